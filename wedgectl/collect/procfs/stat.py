"""One process as /proc shows it: its stat line, resident memory, bytes read, owner, start time and open
files, and the host's boot time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from wedgectl.collect._failures import failure_from_oserror
from wedgectl.collect.procfs._files import CLK_TCK, COLLECTOR, PAGE_SIZE, PROC, read_text, readlinks
from wedgectl.collect.procfs.parse import parse_io, parse_stat
from wedgectl.model.types import CollectorFailure, FailureKind

PF_EXITING = 0x4  # include/linux/sched.h: set as do_exit() begins


def fd_links(pid: int, proc_root: Path = PROC) -> list[str]:
    """What each open file descriptor of `pid` points to (readlink /proc/PID/fd/*): 'socket:[N]',
    '/dev/nvidia0', a path. An fd closed meanwhile is skipped; OSError (PermissionError without
    CAP_SYS_PTRACE over it) when the fd directory is unreadable. str paths: a vLLM Worker holds
    hundreds of fds, and a sample reads them all."""
    return readlinks(f"{proc_root}/{pid}/fd/")


def _status(pid: int, proc_root: Path) -> bytes | None:
    """/proc/PID/status, its first 16 KiB (it is about 1.5 KiB); None when gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            return f.read(16 << 10)
    except OSError:
        return None


def owner_uids(pid: int, proc_root: Path = PROC) -> tuple[int, int] | None:
    """The process's real and effective uid, from its status file (not /proc/PID's owner, which a
    process that makes itself non-dumpable turns to root); None when gone or unreadable."""
    text = _status(pid, proc_root)
    if text is None:
        return None
    for line in text.split(b"\n"):
        if line.startswith(b"Uid:"):
            fields = line.split()[1:3]
            if len(fields) == 2 and all(x.isdigit() for x in fields):
                return int(fields[0]), int(fields[1])
            return None
    return None


def innermost_pid(pid: int, proc_root: Path = PROC) -> int | None:
    """The pid the process knows itself by: the last of its status's NSpid (its own pid namespace's,
    a container's); the pid itself outside one; None when gone or unreadable."""
    text = _status(pid, proc_root)
    for line in (text or b"").split(b"\n"):
        if line.startswith(b"NSpid:"):
            fields = line.split()[1:]
            return int(fields[-1]) if fields and fields[-1].isdigit() else None
    return None if text is None else pid


SIGKILL_BIT = 1 << (9 - 1)  # signal 9 in the SigPnd/ShdPnd masks of /proc/PID/status


def kill_pending(pid: int, proc_root: Path = PROC) -> bool:
    """Whether a SIGKILL waits for the process (its status's SigPnd or ShdPnd): killed, but not yet on a
    CPU to act on it, so its stat shows no PF_EXITING. The kernel adds SIGKILL to every thread's pending
    set at once; each thread that runs then exits. Seen: a deployment killed whole on a loaded 2-core
    host, its EngineCore's main thread in state R, 1 of its 2 threads gone and no PF_EXITING 3 s on.
    False when gone or unreadable."""
    text = _status(pid, proc_root)
    for line in (text or b"").split(b"\n"):
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            fields = line.split()
            try:
                if len(fields) == 2 and int(fields[1], 16) & SIGKILL_BIT:
                    return True
            except ValueError:
                return False
    return False


def start_ticks(pid: int, proc_root: Path = PROC) -> int | None:
    """When the process started (clock ticks after boot, /proc/PID/stat field 22); None if gone.

    With the pid, it names one process for good: a reused pid starts later.
    """
    try:
        return parse_stat(read_text(proc_root / str(pid) / "stat")).starttime_ticks
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ProcessStat:
    """Process-wide figures from /proc/PID/stat, in seconds."""

    pid: int
    comm: str
    state: str
    ppid: int
    utime_s: float
    stime_s: float
    num_threads: int
    starttime_ticks: int
    processor: int | None = None  # the CPU it last ran on
    flags: int = 0  # the kernel's PF_* flags

    @property
    def cpu_s(self) -> float:
        return self.utime_s + self.stime_s

    @property
    def exiting(self) -> bool:
        """In its exit, not yet a zombie: PF_EXITING set (killed, or returned from main; its threads,
        memory and files being torn down). It reads as R, D or S meanwhile: for as long as a loaded
        host takes to run that (measured: 0.69 s for 2 GiB on 2 busy CPUs), or for good where the
        kernel cannot finish it (a driver's release stuck in state D). Nothing of Python runs there."""
        return bool(self.flags & PF_EXITING) and self.state not in ("Z", "X")

    def started(self, proc_root: Path = PROC) -> float | None:
        """When it started, in unix seconds, as psutil's create_time() computes it (boot time plus
        the start time's ticks); None where the boot time is unreadable."""
        boot = boot_time(proc_root)
        return None if boot is None else boot + self.starttime_ticks / CLK_TCK


def read_process_stat(
    pid: int, proc_root: Path = PROC
) -> tuple[ProcessStat | None, tuple[CollectorFailure, ...]]:
    """State, ppid, CPU times and thread count of one process."""
    try:
        st = parse_stat(read_text(proc_root / str(pid) / "stat"))
    except OSError as exc:
        return None, (failure_from_oserror(COLLECTOR, exc, str(pid), f"/proc/{pid}/stat", pid),)
    except (ValueError, IndexError) as exc:
        return None, (CollectorFailure(COLLECTOR, FailureKind.BAD_DATA, f"/proc/{pid}/stat: {exc}", str(pid)),)
    return (
        ProcessStat(
            pid=st.pid,
            comm=st.comm,
            state=st.state,
            ppid=st.ppid,
            utime_s=st.utime_ticks / CLK_TCK,
            stime_s=st.stime_ticks / CLK_TCK,
            num_threads=st.num_threads,
            starttime_ticks=st.starttime_ticks,
            processor=st.processor,
            flags=st.flags,
        ),
        (),
    )


def read_rss(pid: int, proc_root: Path = PROC) -> int | None:
    """Resident bytes, from /proc/PID/statm's second field as psutil's memory_info().rss reads it
    (stat's rss field is counted another way and differs by a few pages); None where unreadable."""
    try:
        fields = read_text(proc_root / str(pid) / "statm").split()
        return int(fields[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def read_io(pid: int, proc_root: Path = PROC) -> tuple[int, int] | None:
    """(rchar, read_bytes): the bytes `pid` has read through read(2) and its kin, and those it had fetched
    from storage (/proc/PID/io, one small read). The kernel lets a reader see it only with ptrace access
    (PTRACE_MODE_READ: the process's own user, which Yama's ptrace_scope does not restrict, or
    CAP_SYS_PTRACE); otherwise, or once the process is gone, None: never an error, since whoever could
    not read it still has the rest of the sample. The read waits only for an execve under way in the
    target (its exec_update_lock), as the thread syscall reads do."""
    try:
        return parse_io(read_text(f"{proc_root}/{pid}/io"))
    except OSError:
        return None


_BOOT: dict[str, tuple[float, float]] = {}  # proc root -> (monotonic time read, btime)
BOOT_TTL_S = 1.0


def boot_time(proc_root: Path = PROC) -> float | None:
    """The host's boot time in unix seconds (/proc/stat's btime), read again at most once a second
    per proc root. The kernel gives it as the wall clock less the time since boot, so it moves
    when the wall clock is stepped (NTP, a VM's clock sync): a value kept for good put process
    start times seconds away from psutil's, which reads it at every call. None where unreadable."""
    key = str(proc_root)
    now = time.monotonic()
    kept = _BOOT.get(key)
    if kept is None or now - kept[0] >= BOOT_TTL_S:
        try:
            text = read_text(proc_root / "stat")
        except OSError:
            return None
        at = text.find("\nbtime ")
        if at < 0:
            return None
        try:
            _BOOT[key] = kept = (now, float(text[at + 7:text.index("\n", at + 1)]))
        except ValueError:
            return None
    return kept[1]
