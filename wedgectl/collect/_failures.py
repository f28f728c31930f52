"""Shared helpers that turn OS errors into CollectorFailure records with actionable help text."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from wedgectl.model.types import CollectorFailure, FailureKind

CAP_SYS_PTRACE = 19  # bit number in /proc/self/status CapEff


def _has_cap(bit: int, proc_root: Path = Path("/proc")) -> bool | None:
    try:
        for line in (proc_root / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _ptrace_scope(proc_root: Path = Path("/proc")) -> int | None:
    try:
        return int((proc_root / "sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None  # no Yama: only uid and capability checks apply


def permission_hint(target_pid: int | None = None) -> str:
    """Say which capability, uid or sysctl stands between us and the target.

    Reading /proc/PID/{syscall,stack} and attaching py-spy need ptrace access:
    same uid *and* the target's capabilities a subset of ours, or CAP_SYS_PTRACE;
    Yama's kernel.yama.ptrace_scope can forbid it further.
    """
    parts: list[str] = []
    cap = _has_cap(CAP_SYS_PTRACE)
    if cap is False:
        parts.append(
            "this process lacks CAP_SYS_PTRACE (containers: add --cap-add=SYS_PTRACE "
            "or securityContext.capabilities.add: [SYS_PTRACE])"
        )
    if os.geteuid() != 0:
        owner = ""
        if target_pid is not None:
            try:
                owner = f" (target uid {os.stat(f'/proc/{target_pid}').st_uid})"
            except OSError:
                pass
        parts.append(f"run as root or as the target's user{owner}")
    scope = _ptrace_scope()
    if scope:
        parts.append(
            f"kernel.yama.ptrace_scope={scope} restricts ptrace; "
            "`sysctl kernel.yama.ptrace_scope=0` (or grant CAP_SYS_PTRACE) allows it"
        )
    if not parts:
        parts.append("ptrace access was refused: CAP_SYS_PTRACE or kernel.yama.ptrace_scope may be missing")
    return "; ".join(parts)


def failure_from_oserror(
    collector: str, exc: BaseException, target: str, what: str, pid: int | None = None
) -> CollectorFailure:
    """Map an OSError (or anything else) to the matching FailureKind."""
    if isinstance(exc, (FileNotFoundError, ProcessLookupError)) or getattr(exc, "errno", None) == errno.ESRCH:
        return CollectorFailure(collector, FailureKind.GONE, f"{what}: no such process or thread (exited)", target)
    if isinstance(exc, PermissionError):
        return CollectorFailure(
            collector, FailureKind.PERMISSION, f"{what}: {exc.strerror or exc}; {permission_hint(pid)}", target
        )
    return CollectorFailure(collector, FailureKind.ERROR, f"{what}: {exc!r}", target)
