"""Python stacks of one process via `py-spy dump --json`, non-blocking by default (the target is never paused)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from wedgectl.collect._failures import permission_hint
from wedgectl.collect.control import run_bounded
from wedgectl.read.stacks import frame_names  # noqa: F401 - re-exported: one reading of py-spy frames
from wedgectl.model.types import CollectorFailure, FailureKind, StackDump

COLLECTOR = "pyspy"
NATIVE_TIMEOUT_S = 20.0
log = logging.getLogger(__name__)

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def find_pyspy() -> str | None:
    """py-spy next to the running interpreter (pip installs it there), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def build_command(exe: str, pid: int, native: bool = False, nonblocking: bool = True) -> list[str]:
    """The py-spy argv. --nonblocking cannot be combined with --native (py-spy refuses)."""
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if native:
        cmd.append("--native")
    elif nonblocking:
        cmd.append("--nonblocking")
    return cmd


def _error(kind: FailureKind, message: str) -> str:
    # StackDump has no failure-kind field: the kind leads the message, and
    # stack_failure() reads it back.
    return f"{kind.value}: {message}"


def stack_failure(dump: StackDump) -> CollectorFailure | None:
    """The CollectorFailure a failed dump stands for, or None if it succeeded."""
    if dump.error is None:
        return None
    head, _, rest = dump.error.partition(": ")
    try:
        kind = FailureKind(head)
    except ValueError:
        kind, rest = FailureKind.ERROR, dump.error
    return CollectorFailure(COLLECTOR, kind, rest, str(dump.pid))


def parse_dump_json(text: str) -> tuple[dict[str, Any], ...]:
    """py-spy's JSON: a top-level list of thread objects. Raises ValueError otherwise."""
    data = json.loads(text)
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise ValueError(f"expected a JSON list of threads, got {type(data).__name__}")
    return tuple(data)


def _first_lines(stderr: str, limit: int = 3) -> str:
    lines = []
    for line in stderr.splitlines():
        if line.startswith("Stack backtrace:"):
            break
        if line.strip():
            lines.append(line.strip())
    return " | ".join(lines[:limit]) or "no output"


def _classify(pid: int, rc: int, stderr: str) -> tuple[FailureKind, str]:
    low = stderr.lower()
    detail = _first_lines(stderr)
    if not os.path.exists(f"/proc/{pid}"):
        return FailureKind.GONE, f"process {pid} is gone ({detail})"
    if "permission denied" in low or "operation not permitted" in low or "os error 13" in low:
        return FailureKind.PERMISSION, f"py-spy was refused ptrace access: {permission_hint(pid)} ({detail})"
    if "failed to find python version" in low or "failed to find a python interpreter" in low:
        return FailureKind.ERROR, f"not a Python process ({detail})"
    return FailureKind.ERROR, f"py-spy exited {rc}: {detail}"


def dump_stacks(
    pid: int,
    native: bool = False,
    nonblocking: bool = True,
    timeout: float = 5.0,
    runner: Runner = run_bounded,
) -> StackDump:
    """One `py-spy dump --json` of ``pid`` (only that process: --subprocesses --json prints
    just the parent, so callers dump each pid of the tree).

    --nonblocking reads the target's memory while it runs. ``native=True`` needs
    the target stopped, so --nonblocking is dropped (and a warning logged): the
    target stays stopped while py-spy unwinds it (0.3 s for a vLLM Worker on 2 idle
    cores, measured; seconds on a loaded host). Never raises; a failure is a
    StackDump whose ``error`` starts with the FailureKind value.
    """
    if native:
        # Native unwinding reads every library's debug info first: 6-10 s measured on a loaded
        # 2-core host for a vLLM worker (torch, the CPU kernels), far past a Python-only dump.
        timeout = max(timeout, NATIVE_TIMEOUT_S)
    t0 = time.time()
    exe = find_pyspy()
    if exe is None:
        return StackDump(
            pid, t0, native, error=_error(FailureKind.MISSING_TOOL, "py-spy not found beside python or on PATH")
        )
    if native and nonblocking:
        log.warning("py-spy --native cannot be non-blocking: pid %d will be paused for the dump", pid)
    cmd = build_command(exe, pid, native, nonblocking)
    env = {**os.environ, "RUST_BACKTRACE": "0"}  # keep stderr to the error itself
    try:
        proc = runner(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return StackDump(pid, time.time(), native,
                         error=_error(FailureKind.TIMEOUT, f"py-spy gave no dump in {timeout:.1f}s"))
    except FileNotFoundError:
        return StackDump(pid, time.time(), native, error=_error(FailureKind.MISSING_TOOL, f"cannot execute {exe}"))
    except PermissionError as exc:
        return StackDump(pid, time.time(), native, error=_error(FailureKind.PERMISSION, f"cannot execute {exe}: {exc}"))
    except OSError as exc:
        return StackDump(pid, time.time(), native, error=_error(FailureKind.ERROR, f"running py-spy: {exc!r}"))
    t = time.time()
    if proc.returncode != 0:
        kind, message = _classify(pid, proc.returncode, proc.stderr or "")
        return StackDump(pid, t, native, error=_error(kind, message))
    try:
        threads = parse_dump_json(proc.stdout)
    except ValueError as exc:
        return StackDump(pid, t, native, error=_error(FailureKind.BAD_DATA, f"unreadable py-spy JSON: {exc}"))
    return StackDump(pid, t, native, threads=threads)


def thread_for_tid(dump: StackDump, tid: int) -> dict[str, Any] | None:
    """The thread of ``dump`` whose OS thread id is ``tid``."""
    for t in dump.threads:
        if t.get("os_thread_id") == tid:
            return t
    return None
