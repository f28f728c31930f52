"""This process's scheduling group (autogroup), for priority.raise_priority: whether the kernel
groups it by session, and the write that sets its session's nice."""

from __future__ import annotations

import os
from pathlib import Path

from wedgectl.collect.procfs._files import PROC, read_text
from wedgectl.collect.procfs.cgroup import cpu_cgroup


def autogroup_applies(proc_root: Path = PROC) -> bool:
    """Whether the kernel groups this process by session (autogroup): it is on
    (kernel.sched_autogroup_enabled) and the process is in the root cpu cgroup, the only
    place autogroup acts. Then CPU is shared between sessions by their autogroup's nice, and
    a task's nice ranks it only inside its session."""
    try:
        if read_text(proc_root / "sys" / "kernel" / "sched_autogroup_enabled").strip() != "1":
            return False
        return cpu_cgroup(read_text(proc_root / "self" / "cgroup")) == "/"
    except OSError:
        return False


def set_own_autogroup_nice(nice: int, proc_root: Path = PROC) -> str | None:
    """Give this process's session (its autogroup) nice `nice`; why it could not, or None.
    A nice below the current one needs CAP_SYS_NICE."""
    try:
        fd = os.open(proc_root / "self" / "autogroup", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(nice).encode())
        finally:
            os.close(fd)
    except OSError as exc:
        return f"/proc/self/autogroup: {exc.strerror or exc}"
    return None
