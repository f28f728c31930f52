"""Pure parsers of /proc text: stat, wchan, syscall (with futex(2)'s numbers and ops), status, sched,
schedstat and io. Each takes the text of one file, so unit tests feed recorded text."""

from __future__ import annotations

import platform
from dataclasses import dataclass

from wedgectl.collect.procfs._files import CLK_TCK
from wedgectl.model import bounds
from wedgectl.model.types import ThreadSample

# (futex, restart_syscall) numbers per architecture, from the kernel's syscall tables.
_SYSCALL_NUMBERS: dict[str, tuple[int, int]] = {
    "x86_64": (202, 219),
    "amd64": (202, 219),
    "aarch64": (98, 128),
    "arm64": (98, 128),
}

# futex(2) commands (op & FUTEX_CMD_MASK)
FUTEX_PRIVATE_FLAG = 128
FUTEX_CLOCK_REALTIME = 256
_FUTEX_CMDS = {
    0: "FUTEX_WAIT",
    1: "FUTEX_WAKE",
    2: "FUTEX_FD",
    3: "FUTEX_REQUEUE",
    4: "FUTEX_CMP_REQUEUE",
    5: "FUTEX_WAKE_OP",
    6: "FUTEX_LOCK_PI",
    7: "FUTEX_UNLOCK_PI",
    8: "FUTEX_TRYLOCK_PI",
    9: "FUTEX_WAIT_BITSET",
    10: "FUTEX_WAKE_BITSET",
    11: "FUTEX_WAIT_REQUEUE_PI",
    12: "FUTEX_CMP_REQUEUE_PI",
    13: "FUTEX_LOCK_PI2",
}
# commands that park the caller until someone wakes it: the ones a "waiter" is in
FUTEX_WAIT_CMDS = frozenset({0, 6, 9, 11, 13})


def futex_syscall_numbers(machine: str | None = None) -> tuple[int, int] | None:
    """(futex, restart_syscall) for this CPU architecture, or None where we do not know them."""
    return _SYSCALL_NUMBERS.get((machine or platform.machine()).lower())


def decode_futex_op(op: int) -> str:
    """0x189 -> 'FUTEX_WAIT_BITSET_PRIVATE|FUTEX_CLOCK_REALTIME', 0x80 -> 'FUTEX_WAIT_PRIVATE'."""
    cmd = op & ~(FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME)
    name = _FUTEX_CMDS.get(cmd)
    if name is None:
        name = f"FUTEX_OP_{cmd:#x}"
    if op & FUTEX_PRIVATE_FLAG:
        name += "_PRIVATE"
    if op & FUTEX_CLOCK_REALTIME:
        name += "|FUTEX_CLOCK_REALTIME"
    return name


def is_futex_wait_op(op: int | None) -> bool:
    """True for ops that block the caller (WAIT, WAIT_BITSET, LOCK_PI, ...); unknown (None) counts."""
    if op is None:
        return True
    return (op & ~(FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME)) in FUTEX_WAIT_CMDS


@dataclass(frozen=True)
class StatFields:
    """The fields of /proc/PID[/task/TID]/stat that wedgectl uses (times in clock ticks)."""

    pid: int
    comm: str
    state: str
    ppid: int
    utime_ticks: int
    stime_ticks: int
    num_threads: int
    starttime_ticks: int
    processor: int | None = None  # field 39: the CPU it last ran on
    flags: int = 0  # field 9: the kernel's PF_* flags


def parse_stat(text: str) -> StatFields:
    """Parse one stat line. comm may hold spaces and parentheses, so split at the LAST ')'."""
    open_ = text.index("(")
    close = text.rindex(")")
    pid = int(text[:open_].strip())
    comm = text[open_ + 1 : close]
    rest = text[close + 2 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3]
    return StatFields(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        utime_ticks=int(rest[11]),
        stime_ticks=int(rest[12]),
        num_threads=int(rest[17]),
        starttime_ticks=int(rest[19]),
        processor=int(rest[36]) if len(rest) > 36 else None,
        flags=int(rest[6]),
    )


def parse_wchan(text: str) -> str:
    """The kernel function a thread sleeps in; '0' (running, or not permitted) becomes ''."""
    text = text.strip()
    return "" if text in ("", "0") else text


def parse_syscall(text: str) -> tuple[int | None, tuple[int, ...]]:
    """Parse /proc/.../syscall: 'nr a1 a2 a3 a4 a5 a6 sp pc'.

    Returns (None, ()) for 'running' (on a CPU, in user or kernel space), and
    (-1, ()) for '-1 sp pc' (blocked, but not in a system call: e.g. a page
    fault or a stop). Otherwise (nr, (a1..a6)).
    """
    fields = text.split()
    if not fields or fields[0] == "running":
        return None, ()
    nr = int(fields[0])
    if nr < 0:
        return nr, ()
    return nr, tuple(int(f, 0) for f in fields[1:7])


def futex_from_syscall(
    nr: int | None, args: tuple[int, ...], wchan: str = "", machine: str | None = None
) -> tuple[int | None, int | None, bool | None]:
    """(futex_addr, futex_op, futex_timed) when the thread is in futex(2), else (None, None, None).

    restart_syscall counts as futex: after a ptrace attach (a blocking
    py-spy dump) an interrupted *timed* futex wait resumes through
    restart_syscall, and /proc still shows the original argument registers.
    restart_syscall can also resume nanosleep/poll, so when wchan names a
    non-futex function the thread is not counted as a futex waiter.
    """
    numbers = futex_syscall_numbers(machine)
    if numbers is None or nr is None or len(args) < 4:
        return None, None, None
    futex_nr, restart_nr = numbers
    if nr == restart_nr and wchan and "futex" not in wchan:
        return None, None, None
    if nr not in (futex_nr, restart_nr):
        return None, None, None
    return args[0], args[1], args[3] != 0


def parse_ctxt_switches(status_text: str) -> tuple[int | None, int | None]:
    """(voluntary, nonvoluntary) context switches from a status file."""
    def field(key: str) -> int | None:  # the file's last lines; find, not a split of all ~55
        at = status_text.find("\n" + key)
        if at < 0 and not status_text.startswith(key):
            return None
        start = at + 1 + len(key) if at >= 0 else len(key)
        end = status_text.find("\n", start)
        return int(status_text[start:end if end >= 0 else None])

    return field("voluntary_ctxt_switches:"), field("nonvoluntary_ctxt_switches:")


def thread_from_texts(
    tid: int,
    stat: str,
    wchan: str | None = None,
    syscall: str | None = None,
    status: str | None = None,
    machine: str | None = None,
    clk_tck: int = CLK_TCK,
) -> ThreadSample:
    """Build one ThreadSample from the texts of its /proc files (None: unreadable)."""
    st = parse_stat(stat)
    wchan_name = parse_wchan(wchan) if wchan is not None else ""
    nr, args = parse_syscall(syscall) if syscall is not None else (None, ())
    addr, op, timed = futex_from_syscall(nr, args, wchan_name, machine)
    vol, nonvol = parse_ctxt_switches(status) if status is not None else (None, None)
    return ThreadSample(
        tid=tid,
        comm=st.comm,
        state=st.state,
        wchan=wchan_name,
        syscall_nr=nr,
        syscall_args=args,
        futex_addr=addr,
        futex_op=op,
        futex_timed=timed,
        utime_s=st.utime_ticks / clk_tck,
        stime_s=st.stime_ticks / clk_tck,
        voluntary_switches=vol,
        nonvoluntary_switches=nonvol,
    )


# /proc/PID/task/TID/sched's `se.exec_start` is the scheduler-clock time the thread last ran; for a
# thread asleep in futex(2) that is when its wait began (a thread parked since before a probe attached
# fires no tracepoint in the window). schedstat gives exact on-CPU and run-queue nanoseconds.


def parse_exec_start(text: str) -> float | None:
    """se.exec_start from a sched file, in seconds (the file prints milliseconds); None without CONFIG_SCHED_DEBUG."""
    for line in text.splitlines():
        if line.startswith("se.exec_start"):
            try:
                return float(line.split(":", 1)[1]) / 1000.0
            except (ValueError, IndexError):
                return None
    return None


def parse_schedstat(text: str) -> tuple[int, int, int] | None:
    """(ns on CPU, ns waiting on a run queue, timeslices) from a schedstat file."""
    try:
        a, b, c = text.split()[:3]
        return int(a), int(b), int(c)
    except ValueError:
        return None


def parse_io(text: str) -> tuple[int, int] | None:
    """(rchar, read_bytes) from a /proc/PID/io file: bytes read through read(2) and its kin, and bytes
    fetched from storage. None when either is missing, not a decimal or past bounds.MAX_IO_BYTES."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("rchar", "read_bytes"):
            value = value.strip()
            if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > bounds.MAX_IO_BYTES:
                return None
            found[key] = int(value)
    if len(found) != 2:
        return None
    return found["rchar"], found["read_bytes"]
