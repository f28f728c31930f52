"""Running the real CLI in tests: `python -m wedgectl ...` as a subprocess, bounded, killed with all it
started when it outlives its bound; and the one line an error prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 120  # most runs take about a second; the margin is for a loaded 2-core host


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every descendant it has (a repro's server runs in a session of its own)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    for pid in [proc.pid, *(k.pid for k in kids)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)
    psutil.wait_procs(kids, timeout=5)


def stop_gracefully(proc: subprocess.Popen, timeout: float = 20) -> int | None:
    """SIGTERM `proc` and wait for it: its exit code, or None (then SIGKILLed) when it outlived `timeout`."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
        return None


def kill_group(pid: int, wait_s: float = 10.0) -> None:
    """SIGKILL the process group a repro's server leads (started in a session of its own, it holds the
    EngineCore, the Workers and the resource tracker), reap the leader if it is ours, and wait until the group
    is gone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except (ChildProcessError, OSError):
        pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)


def run_cli(*args: str, prefix: tuple[str, ...] = (), python: str = sys.executable, env: dict[str, str] | None = None,
            cwd: str | Path = REPO, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`python -m wedgectl ARGS` (after `prefix`: setpriv), killed with all it started if it outlives `timeout`."""
    proc = subprocess.Popen([*prefix, python, "-m", "wedgectl", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(stderr: str) -> str:
    """The single line an error prints on stderr: asserts there is exactly one, and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def gone_pid() -> int:
    """The pid of a child of ours that has exited and been reaped (and not been reused since)."""
    import pytest

    for _ in range(20):
        child = subprocess.Popen(["true"])
        child.wait(timeout=30)
        if not os.path.exists(f"/proc/{child.pid}"):
            return child.pid
    pytest.fail("every pid of an exited child was reused at once")
