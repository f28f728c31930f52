"""The engine report in deploy/kubernetes/sidecar-example.yaml's layout: a shared volume (an emptyDir: root's,
mode 0777), the server's own report directory inside it, and a sidecar of another uid with no ptrace that is
told the directory by its own WEDGE_ENGINE_REPORT_DIR (the server's environ is unreadable to it)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_reports import report_bytes
from wedgectl.collect import procfs
from wedgectl.collect.enginereport import REPORT_DIR_ENV, read_engine_report
from wedgectl.model.engine import NOT_FOUND

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine import report  # noqa: E402

ME = os.getpid()
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays the sidecar's user (nobody) from root")


@pytest.fixture
def volume() -> Iterator[Path]:
    """An emptyDir as the kubelet makes it: root's, mode 0777."""
    base = Path(tempfile.mkdtemp(prefix="wedgectl-emptydir-", dir="/tmp"))
    try:
        base.chmod(0o777)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def read_as_nobody(environ: dict[str, str], tmp: str) -> tuple[str | None, str | None, int | None]:
    """This process's report read by a forked child that dropped to nobody with no capabilities:
    (path, error, the report's pid)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)  # from root to another uid: every capability goes
            r = read_engine_report(ME, environ=environ, tmp=tmp)
            os.write(write, json.dumps([r.path, r.error, r.report.pid if r.report else None]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        got = json.loads(fh.read() or b"[null, null, null]")
    os.waitpid(child, 0)
    return got[0], got[1], got[2]


def test_the_volume_itself_is_refused_and_a_directory_of_the_servers_own_inside_it_is_read(volume):
    # pointed at the volume itself, the writer refuses: others may write there
    with pytest.raises(report.ReportDirError, match="writable by others"):
        report.report_dir({report.REPORT_DIR_ENV: str(volume)})
    # the example's layout: a directory inside it, which the first vLLM process makes its own, 0711
    shared = str(volume / "reports")
    made = report.report_dir({report.REPORT_DIR_ENV: shared})
    st = os.stat(made)
    assert made == shared and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o711
    report.write_atomic(report.report_path(made, ME), report_bytes(
        pid=ME, proc_start_ticks=procfs.start_ticks(ME), written_mono_ns=time.monotonic_ns()))

    path, error, pid = read_as_nobody({REPORT_DIR_ENV: shared}, tmp=str(volume))
    assert (error, pid) == (None, ME) and path == report.report_path(made, ME)
    # without its own WEDGE_ENGINE_REPORT_DIR the sidecar cannot learn the server's (its environ is
    # unreadable across users) and looks only where the writer's default would be
    path, error, pid = read_as_nobody({}, tmp=str(volume))
    assert pid is None and error is not None and error.startswith(NOT_FOUND) and shared not in error, error
