"""The capture's own scheduling priority: below the server it looks at, back when starved, above it with --urgent.

It changes this process (its nice, its I/O class, its autogroup), so it sits with the collectors.
"""

from __future__ import annotations

import os
import platform

from wedgectl.collect import procfs

# below a default-priority server in our scheduling group (CFS weight 335 against 1024; docs/design.md) while still
# getting a share on a saturated host
NICE = 5


def lower_priority(nice: int = NICE) -> list[str]:
    """Run below the server we look at: nice +`nice` and the idle I/O class (py-spy and bpftrace
    inherit both). What could not be lowered is returned, not raised. The capture gives the nice
    back if the kernel then keeps wedgectl off a CPU too long (restore_priority_if_starved)."""
    global _lowered
    problems = []
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.nice(nice)
        _lowered = (before, procfs.own_run_delay_s())
    except OSError as exc:
        problems.append(f"nice: {exc.strerror or exc}")
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is None:
        return problems + ["ioprio: no syscall number for this machine"]
    import ctypes  # only here: its import costs more than the syscall

    libc = ctypes.CDLL(None, use_errno=True)
    # ioprio_set(IOPRIO_WHO_PROCESS, 0 = this process, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)
    if libc.syscall(nr, 1, 0, 3 << 13) != 0:
        problems.append(f"ioprio: {os.strerror(ctypes.get_errno())}")
    return problems


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30, "ppc64le": 273, "s390x": 282, "riscv64": 30}

# A verdict needs about 0.3 s of wedgectl's CPU. Niced, it can wait far longer than that for a CPU:
# next to a serving vLLM engine (its threads poll their queues, yielding the CPU and taking it back)
# a nice +5 diagnose was measured waiting 9 s of a 10 s run. Once this much waiting has
# piled up, the capture returns to the priority it started at: the server then gives up at most
# those 0.3 s, and the operator gets the verdict.
STARVED_S = 1.0
_lowered: tuple[int, float | None] | None = None  # (the nice before lower_priority, the run delay then)


def restore_priority_if_starved(limit_s: float = STARVED_S) -> str | None:
    """After lower_priority: when the calling (main) thread has waited more than `limit_s` for a CPU
    since, give the nice back (threads and py-spy started later inherit it). What was done, or None."""
    if _lowered is None:
        return None
    before, delay0 = _lowered
    now = procfs.own_run_delay_s()
    if delay0 is None or now is None or now - delay0 <= limit_s:
        return None
    error = restore_priority()
    if error:
        return f"waited {now - delay0:.1f} s for a CPU at low priority; could not return to nice {before}: {error}"
    return f"waited {now - delay0:.1f} s for a CPU at low priority: back at nice {before} for the rest of the capture"


URGENT_NICE = -10  # --urgent: CFS weight 9548 against the server's 1024


def raise_priority(nice: int = URGENT_NICE) -> str:
    """--urgent: rank this capture above the server, to answer fast on a saturated host. It takes
    its ~0.3 CPU s from the server at once instead of waiting for a share. Where autogroup applies
    (procfs.autogroup_applies), the kernel shares the CPUs between sessions and a task's nice
    ranks it only inside its own: the capture goes on in a session of its own
    (control.detach_into_own_session) whose autogroup gets the nice; the operator's session is
    left as it was. Elsewhere (the process in a cgroup: a container, a systemd unit) the task nice
    ranks it against the server when both share the cgroup, and against nothing outside it.
    Says what was done, or why it could not be (then the capture runs at the priority it had)."""
    if procfs.autogroup_applies():
        from wedgectl.collect.control import detach_into_own_session

        detach_into_own_session()
        error = procfs.set_own_autogroup_nice(nice)
        if error:
            return f"--urgent: not raised ({error}); sampling at the priority it started with"
        return f"--urgent: sampling in a session of its own, autogroup nice {nice}"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        return f"--urgent: not raised (nice {nice}: {exc.strerror or exc}); sampling at the priority it started with"
    return f"--urgent: sampling at nice {nice} (this ranks it above the server only in the server's cgroup)"


def restore_priority() -> str | None:
    """Undo lower_priority's nice (the I/O class stays idle); why it could not be, or None."""
    global _lowered
    if _lowered is None:
        return None
    before, _lowered = _lowered[0], None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    except OSError as exc:
        return str(exc.strerror or exc)
    return None
