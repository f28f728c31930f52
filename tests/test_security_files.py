"""Files wedgectl reads and writes beside other users (issue 33, findings 4, 5 and 8).

Other users are played by nobody (uid 65534) through setpriv; the tests run as root, as wedgectl
does beside production servers. Real processes, real files and a real bind mount in nobody's own
user and mount namespace, no mocks.

4. A server log found through a process is read through the process's descriptor, or by its path
   only where device and inode match: never the root-only file its path names in our namespace.
5. Bundles go only into new files, and into directories of our own: nothing someone else made
   (a file, a link, a directory) is written into or followed.
8. Rotation deletes only regular files of ours with the names wedgectl writes, in a directory of ours.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wedgectl.model import exitcodes
from wedgectl.store.bundle import read_bundle, write_bundle
from wedgectl.collect import processes
from wedgectl.model.errors import UnreadableInput, UnwritableOutput
from wedgectl.store.sources import bundle_from_log, read_log_lines
from wedgectl.tui.source import save_bundle
from wedgectl.watch.recorder import Rotation, bundle_name, recorded, rotate, save_onset

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]  # the checkout whose wedgectl `-m wedgectl` runs
TARGETS = Path(__file__).resolve().parent / "targets"
LOGS = Path(__file__).resolve().parent / "fixtures" / "logs"
SECRET = "root:$6$rt-secret-hash$do-not-leak:19000:0:99999:7:::"
TARGET_LINE = "INFO 01-01 00:00:00 [loggers.py:1] the target's own log line 7f3a"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="plays other users with setpriv, as root")


def as_nobody(*argv: str | os.PathLike[str]) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *map(str, argv)]


def _nobody_python(*wrapper: str) -> str:
    """An interpreter nobody may run, inside wrapper too (the venv's may lead into /root)."""
    for python in ("/usr/bin/python3", sys.executable):
        if subprocess.run(as_nobody(*wrapper, python, "-c", "import ctypes, multiprocessing"), capture_output=True,
                          timeout=60).returncode == 0:
            return python
    pytest.skip("no Python interpreter nobody may run")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory under /tmp that nobody can reach (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="wedgectl-sec-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _nobody_dir(parent: Path, name: str = "nobody") -> Path:
    d = parent / name
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    return d


def _root_secret(parent: Path) -> Path:
    """A root-only file (0600 root), as /etc/shadow or /etc/rt-secret.txt is."""
    d = parent / "etc"
    d.mkdir(mode=0o755)
    secret = d / "rt-secret.txt"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (SECRET + "\n").encode())
    os.close(fd)
    return secret


def _runs_as_nobody(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return any(line.split()[1:] == [str(NOBODY)] * 4 for line in status.splitlines() if line.startswith("Uid:"))


def _nobody_log(d: Path) -> Path:
    log = d / "server.log"
    log.write_text(TARGET_LINE + "\n")
    os.chown(log, NOBODY, NOBODY)
    log.chmod(0o644)
    return log


def _read_ready(fifo: Path, proc: subprocess.Popen, timeout_s: float = 90.0) -> dict:
    """The target's 'ready {json}' line, through the FIFO it was given (bounded: a test never hangs)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    buf = b""
    deadline = time.monotonic() + timeout_s
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise AssertionError(f"the target never announced itself (rc {proc.poll()}): {buf!r}")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                buf += os.read(fd, 4096)
    finally:
        os.close(fd)
    word, _, info = buf.split(b"\n")[0].decode().partition(" ")
    assert word == "ready", buf
    return json.loads(info)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _start_fake(shared: Path, shell: str, *args: str | os.PathLike[str]) -> tuple[subprocess.Popen, dict]:
    """fake_vllm_serve.py as nobody, its stdout and stderr set up by `shell` (sh -c, "$@" = args)."""
    fifo = shared / "ready.fifo"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    proc = subprocess.Popen(as_nobody("sh", "-c", shell, "sh", *args), stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return proc, _read_ready(fifo, proc)
    except BaseException:
        _stop(proc)
        raise


def _wedgectl(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "WEDGECTL_NO_MOUNT_TRACEFS": "1"})


# ------------------------------------------------------------------ 4. the log read through the process


def test_a_log_bind_mounted_over_a_root_file_is_read_through_the_target(shared, tmp_path):
    """nobody, root in a user and mount namespace of its own, bind-mounts its log over a root-only
    file and writes to it: /proc/PID/fd/1 then reads as the root-only file's path. diagnose's bundle
    holds the target's own lines, never the root-only file."""
    secret = _root_secret(shared)
    home = _nobody_dir(shared)
    log = _nobody_log(home)
    if subprocess.run(as_nobody("unshare", "-Urm", "sh", "-c", 'mount --bind "$0" "$1"', log, secret),
                      capture_output=True, timeout=60).returncode != 0:
        pytest.skip("unprivileged user and mount namespaces are not allowed here")
    python = _nobody_python("unshare", "-Urm")
    proc, ready = _start_fake(
        shared, 'exec unshare -Urm sh -c \'mount --bind "$0" "$1" && exec "$2" "$3" serve "$4" >>"$1" 2>&1\' "$@"',
        log, secret, python, TARGETS / "fake_vllm_serve.py", shared / "ready.fifo")
    try:
        assert os.readlink(f"/proc/{ready['api']}/fd/1") == str(secret)  # the path names the root-only file here
        out = tmp_path / "b.tar.gz"
        r = _wedgectl("diagnose", "--pid", str(ready["api"]), "--window", "2", "--no-stacks", "--ebpf", "off",
                      "--save-bundle", str(out))
        assert "Traceback" not in r.stderr, r.stderr
        text = "\n".join(read_bundle(out).log_lines)
        assert "rt-secret-hash" not in text
        assert TARGET_LINE in text
    finally:
        _stop(proc)
    assert secret.read_text() == SECRET + "\n"


def test_a_log_replaced_after_discovery_is_read_through_the_fd_then_refused(shared):
    """top and watch find the log once and read it for hours. The target's file is renamed away and
    a root-only file put at its path: the reads go through the descriptor (the target's lines); once
    the target is gone the path leads to another inode, and nothing is read."""
    home = _nobody_dir(shared)
    log = _nobody_log(home)
    with open(log, "ab") as out:  # as a shell's >> would: the target writes, wedgectl reads
        proc = subprocess.Popen(as_nobody(_nobody_python(), "-c", "import time; print('second line', flush=True); "
                                          "time.sleep(120)"),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "second line" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        held = processes.log_path_of(proc.pid)
        assert held is not None and str(held) == str(log)
        log.rename(home / "server.log.1")
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # root's now, at the path found
        os.write(fd, (SECRET + "\n").encode())
        os.close(fd)
        lines = read_log_lines(held)[0]
        assert lines == (TARGET_LINE, "second line")
    finally:
        _stop(proc)
    with pytest.raises(UnreadableInput, match="no longer the file"):
        read_log_lines(held)


def test_a_log_the_target_could_not_read_itself_is_not_read(shared):
    """Its stdout is a root-only file root opened for it: the target may only write it, so wedgectl
    does not read it on the target's behalf (an operator's --log still can)."""
    secret = _root_secret(shared)
    with open(secret, "ab") as out:
        proc = subprocess.Popen(as_nobody(_nobody_python(), "-c", "import time; time.sleep(120)"),
                                stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _runs_as_nobody(proc.pid) and time.monotonic() < deadline:  # setpriv has switched
            time.sleep(0.05)
        held = processes.log_path_of(proc.pid)
        assert held is not None and str(held) == str(secret)
        with pytest.raises(UnreadableInput, match="could not read this file itself"):
            read_log_lines(held)
    finally:
        _stop(proc)


# ------------------------------------------------------------------ 5. bundles only into new files of ours


def _one_line_refusal(r: subprocess.CompletedProcess, code: int = exitcodes.UNWRITABLE_OUTPUT) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr


def _as_nobody_can_read(path: Path) -> bool:
    return subprocess.run(as_nobody("cat", path), capture_output=True, timeout=60).returncode == 0


def test_save_bundle_never_writes_into_a_file_nobody_made(shared):
    home = _nobody_dir(shared)
    planted = home / "b.tar.gz"
    subprocess.run(as_nobody("sh", "-c", 'umask 0; echo planted > "$0"', planted), check=True, timeout=60)
    r = _wedgectl("diagnose", "--log", str(LOGS / "seed000_starved.log"), "--save-bundle", str(planted))
    _one_line_refusal(r)
    assert "exists" in r.stderr
    st = planted.stat()
    assert planted.read_text() == "planted\n" and st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o666


def test_save_bundle_never_follows_a_link_nobody_planted(shared):
    secret = _root_secret(shared)
    home = _nobody_dir(shared)
    link = home / "b.tar.gz"
    subprocess.run(as_nobody("ln", "-s", secret, link), check=True, timeout=60)
    r = _wedgectl("diagnose", "--log", str(LOGS / "seed000_starved.log"), "--save-bundle", str(link))
    _one_line_refusal(r)
    assert secret.read_text() == SECRET + "\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    dir_link = home / "bundle-dir"
    subprocess.run(as_nobody("ln", "-s", home, dir_link), check=True, timeout=60)
    r = _wedgectl("diagnose", "--log", str(LOGS / "seed000_starved.log"), "--save-bundle", str(dir_link))
    _one_line_refusal(r)
    assert sorted(p.name for p in home.iterdir()) == ["b.tar.gz", "bundle-dir"]  # nothing written through it


def test_save_bundle_never_writes_into_a_directory_nobody_made(shared):
    home = _nobody_dir(shared)
    target = _nobody_dir(home, "b")
    r = _wedgectl("diagnose", "--log", str(LOGS / "seed000_starved.log"), "--save-bundle", str(target))
    _one_line_refusal(r)
    assert list(target.iterdir()) == [] and target.stat().st_uid == NOBODY


def test_a_new_bundle_is_ours_alone(shared):
    """What root writes to a new path nobody cannot read, in a directory nobody may reach into."""
    for name in ("b", "b.tar.gz"):
        path = write_bundle(bundle_from_log(LOGS / "seed000_starved.log"), shared / "new" / name)
        files = [path, *path.iterdir()] if path.is_dir() else [path]
        for f in files:
            st = f.lstat()
            assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == (0o700 if f.is_dir() else 0o600), f
        assert not any(_as_nobody_can_read(f) for f in files if f.is_file())


def test_top_saves_only_into_a_directory_of_its_own(shared):
    b = bundle_from_log(LOGS / "seed000_starved.log")
    home = _nobody_dir(shared)
    with pytest.raises(UnwritableOutput, match="owned by uid 65534"):
        save_bundle(b, home)
    wide = shared / "wide"
    wide.mkdir()
    wide.chmod(0o1777)  # root's, but anyone may plant there
    with pytest.raises(UnwritableOutput, match="writable by other users"):
        save_bundle(b, wide)
    subprocess.run(as_nobody("ln", "-s", shared, home / "saves"), check=True, timeout=60)
    with pytest.raises(UnwritableOutput, match="symbolic link"):
        save_bundle(b, home / "saves")
    assert list(home.iterdir()) == [home / "saves"] and list(wide.iterdir()) == []
    # a directory it makes is 0700 and its own; the next save reuses it, under a new name
    mine = shared / "mine" / "saves"
    first, second = save_bundle(b, mine), save_bundle(b, mine)
    assert first != second and first.parent == second.parent == mine
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert read_bundle(second).log_lines == b.log_lines


def test_watch_refuses_a_bundle_dir_nobody_owns(shared):
    home = _nobody_dir(shared)
    for bad in (home, shared / "wide"):
        if bad.name == "wide":
            bad.mkdir()
            bad.chmod(0o1777)
        t0 = time.monotonic()
        r = _wedgectl("watch", "--url", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--bundle-dir", str(bad),
                      "--max-seconds", "30", timeout=120)
        _one_line_refusal(r)
        assert str(bad) in r.stderr and time.monotonic() - t0 < 60
        assert list(bad.iterdir()) == []


# ------------------------------------------------------------------ 8. rotation deletes only its own files


def _onset_files(d: Path, n: int, t0: int = 1_700_000_000) -> list[Path]:
    paths = []
    for i in range(n):
        p = d / bundle_name("n:8000/tiny", "admission_wedge", t0 + i)
        p.write_bytes(b"z" * 1000)
        os.utime(p, (t0 + i, t0 + i))
        paths.append(p)
    return paths


def test_rotation_never_counts_or_deletes_planted_links_or_foreign_files(shared, tmp_path):
    """Links named as onset bundles, leading to a big file of someone else's and to other files, and a
    nobody-owned file of that name: before, they counted (stat followed them) and pushed the real
    bundles out. Now only our regular files count, and only they are deleted."""
    bundles = tmp_path / "bundles"
    bundles.mkdir(mode=0o700)
    real = _onset_files(bundles, 3)
    victims = []
    for i, size in enumerate((64 << 20, 10, 10)):
        v = shared / f"victim-{i}"
        with open(v, "wb") as fh:
            fh.truncate(size)
        victims.append(v)
        link = bundles / bundle_name("planted", "admission_wedge", 1_800_000_000 + i)
        link.symlink_to(v)
    foreign = bundles / bundle_name("planted", "engine_dead", 1_800_000_100)
    foreign.write_bytes(b"f" * 100)
    os.chown(foreign, NOBODY, NOBODY)
    assert rotate(bundles, Rotation(keep=3, max_bytes=1 << 20)) == []
    assert recorded(bundles) == real
    assert all(p.exists() for p in real + victims) and foreign.exists()
    assert rotate(bundles, Rotation(keep=1, max_bytes=1 << 20)) == real[:2]
    planted = [p for p in bundles.iterdir() if p.name.startswith("wedgectl-watch-planted-admission")]
    assert len(planted) == 3 and all(p.is_symlink() for p in planted)
    assert all(v.exists() for v in victims) and foreign.exists() and recorded(bundles) == real[2:]


def test_rotation_and_saves_never_happen_in_a_directory_nobody_owns(shared):
    home = _nobody_dir(shared)
    theirs = _onset_files(home, 3)
    for p in theirs:
        os.chown(p, 0, 0)  # even files that look like ours are not deleted from a directory that is not
    assert rotate(home, Rotation(keep=1, max_bytes=1)) == [] and all(p.exists() for p in theirs)
    with pytest.raises(UnwritableOutput, match="owned by uid 65534"):
        save_onset(bundle_from_log(LOGS / "seed000_starved.log"), home, "n:8000/tiny", "admission_wedge",
                   Rotation(keep=1))
    assert sorted(home.iterdir()) == sorted(theirs)


def test_repro_replaces_only_its_own_bundle(shared, tmp_path):
    """repro writes out_dir/bundle.tar.gz on every run: a file of ours there is replaced; one that
    nobody made, or a link, is refused and left as it was."""
    b = bundle_from_log(LOGS / "seed000_starved.log")
    ours = tmp_path / "bundle.tar.gz"
    ours.write_bytes(b"an earlier run's")
    write_bundle(b, ours, replace_own=True)
    assert read_bundle(ours).log_lines == b.log_lines and stat.S_IMODE(ours.stat().st_mode) == 0o600
    home = _nobody_dir(shared)
    planted = home / "bundle.tar.gz"
    subprocess.run(as_nobody("sh", "-c", 'echo planted > "$0"', planted), check=True, timeout=60)
    with pytest.raises(UnwritableOutput, match="already exists"):
        write_bundle(b, planted, replace_own=True)
    assert planted.read_text() == "planted\n" and planted.stat().st_uid == NOBODY
