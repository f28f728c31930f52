"""Read per-thread state from /proc (stat, wchan, syscall, status) without ever stopping the target.

Parsing is kept apart from reading: the ``parse_*`` functions take the text of
one /proc file, so unit tests feed recorded text, and the readers take a
``proc_root`` so tests can point them at a recorded tree.
"""

from __future__ import annotations

import os
import platform
import resource
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from wedgectl.collect._failures import failure_from_oserror, permission_hint
from wedgectl.model.types import CollectorFailure, CpuLimit, FailureKind, ThreadSample

COLLECTOR = "procfs"
PROC = Path("/proc")

try:
    CLK_TCK = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    CLK_TCK = 100
PF_EXITING = 0x4  # include/linux/sched.h: set as do_exit() begins

try:
    PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    PAGE_SIZE = 4096

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


# ---------------------------------------------------------------------------
# pure parsers


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


# ---------------------------------------------------------------------------
# readers


def own_run_delay_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (the second field of
    /proc/thread-self/schedstat, the scheduler's run delay); None where unreadable."""
    try:
        sched = parse_schedstat(_read_text(PROC / "thread-self" / "schedstat"))
    except OSError:
        return None
    return sched[1] / 1e9 if sched else None


def _read_text(path: Path | str) -> str:
    # One read() of a small /proc file is atomic for the kernel's seq_file. os.open/os.read, not
    # open(): `top` reads three files of every thread that ran each refresh, and a file object costs more
    # than the read.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode("utf-8", "replace")
    finally:
        os.close(fd)


def fd_links(pid: int, proc_root: Path = PROC) -> list[str]:
    """What each open file descriptor of `pid` points to (readlink /proc/PID/fd/*): 'socket:[N]',
    '/dev/nvidia0', a path. An fd closed meanwhile is skipped; OSError (PermissionError without
    CAP_SYS_PTRACE over it) when the fd directory is unreadable. str paths: a vLLM Worker holds
    hundreds of fds, and a sample reads them all."""
    return _readlinks(f"{proc_root}/{pid}/fd/")


def _readlinks(fd_dir: str, skip: frozenset[int] | set[int] = frozenset()) -> list[str]:
    links = []
    for fd in os.listdir(fd_dir):
        if skip and int(fd) in skip:
            continue
        try:
            links.append(os.readlink(fd_dir + fd))
        except FileNotFoundError:
            continue
    return links


def owner_uids(pid: int, proc_root: Path = PROC) -> tuple[int, int] | None:
    """The process's real and effective uid, from its status file (not /proc/PID's owner, which a
    process that makes itself non-dumpable turns to root); None when gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            text = f.read(16 << 10)
    except OSError:
        return None
    for line in text.split(b"\n"):
        if line.startswith(b"Uid:"):
            fields = line.split()[1:3]
            if len(fields) == 2 and all(x.isdigit() for x in fields):
                return int(fields[0]), int(fields[1])
            return None
    return None


def start_ticks(pid: int, proc_root: Path = PROC) -> int | None:
    """When the process started (clock ticks after boot, /proc/PID/stat field 22); None if gone.

    With the pid, it names one process for good: a reused pid starts later.
    """
    try:
        return parse_stat(_read_text(proc_root / str(pid) / "stat")).starttime_ticks
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
        st = parse_stat(_read_text(proc_root / str(pid) / "stat"))
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
        fields = _read_text(proc_root / str(pid) / "statm").split()
        return int(fields[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
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
            text = _read_text(proc_root / "stat")
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


class ThreadMemo:
    """Each thread's last sample, keyed by its schedstat at that read (see read_threads), and the
    thread files held open between reads.

    A file of /proc/PID/task/TID read again through a descriptor kept open (pread at offset 0:
    the kernel makes the text afresh at each read) costs a sixth of an open, read and close
    (0.9 against 6 us, measured on a vLLM Worker), and `top` reads every thread's schedstat and
    the three files of each that ran, every second. The descriptor names the thread, not the
    number: once the thread has exited a read fails (ESRCH) and the path is opened again, so a
    reused tid is read as the new thread. At most `max_fds` are held (half the soft limit on
    open files, at most 4096); past that a file is opened for each read, as without a memo.
    They are closed as their threads leave the memo, at close(), or when the memo is collected."""

    def __init__(self, max_fds: int | None = None) -> None:
        self._by: dict[int, dict[int, tuple[str, ThreadSample]]] = {}
        self._fds: dict[int, dict[int, dict[str, int]]] = {}  # pid -> tid -> file path -> descriptor held open
        self._held = 0
        self.max_fds = _fd_budget() if max_fds is None else max_fds
        self.hits = 0
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)

    def get(self, pid: int, tid: int, sched: str | None) -> ThreadSample | None:
        got = self._by.get(pid, {}).get(tid)
        if sched is None or got is None or got[0] != sched:
            return None
        self.hits += 1
        return got[1]

    def put(self, pid: int, tid: int, sched: str, sample: ThreadSample) -> None:
        self._by.setdefault(pid, {})[tid] = (sched, sample)

    def read(self, pid: int, tid: int, path: str) -> str:
        """A thread file's text, through a descriptor held open where there is one (or room for
        one). Raises as _read_text does: FileNotFoundError or ProcessLookupError once it is gone."""
        held = self._fds.get(pid, {}).get(tid)
        fd = held.get(path) if held is not None else None
        if held is not None and fd is not None:
            try:
                return os.pread(fd, 65536, 0).decode("utf-8", "replace")
            except OSError:  # the thread exited (or the tid was reused): open the path afresh
                del held[path]
                self._held -= 1
                _HELD_FDS.discard(fd)
                os.close(fd)
        if self._held >= self.max_fds:
            return _read_text(path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.pread(fd, 65536, 0).decode("utf-8", "replace")
        except BaseException:
            os.close(fd)
            raise
        self._fds.setdefault(pid, {}).setdefault(tid, {})[path] = fd
        _HELD_FDS.add(fd)  # after the open, before any close: never a number another file has
        self._held += 1
        return text

    @property
    def held(self) -> int:
        return self._held

    def keep(self, pid: int, tids: Sequence[int]) -> None:
        """Forget the threads of pid that are gone."""
        live = set(tids)
        mine = self._by.get(pid, {})
        for tid in [t for t in mine if t not in live]:
            del mine[tid]
        held = self._fds.get(pid, {})
        for tid in [t for t in held if t not in live]:
            self._close(held.pop(tid))

    def forget_others(self, pids: Iterable[int]) -> None:
        keep = set(pids)
        for pid in [p for p in self._by if p not in keep]:
            del self._by[pid]
        for pid in [p for p in self._fds if p not in keep]:
            for held in self._fds.pop(pid).values():
                self._close(held)

    def _close(self, held: dict[str, int]) -> None:
        for fd in held.values():
            _HELD_FDS.discard(fd)
            os.close(fd)
            self._held -= 1

    def close(self) -> None:
        """Close every descriptor held; the memo still works, opening files afresh. Not while a
        read through it is under way in another thread: a number freed and reused meanwhile could
        be read, or closed, as the memo's (top's collector thread is its one user, and never calls
        it; the finalizer runs once nothing refers to the memo)."""
        _close_fds(self._fds)
        self._held = 0


def _close_fds(fds: dict[int, dict[int, dict[str, int]]]) -> None:
    for threads in fds.values():
        for held in threads.values():
            for fd in held.values():
                _HELD_FDS.discard(fd)
                try:
                    os.close(fd)
                except OSError:
                    pass
    fds.clear()


# Every descriptor the ThreadMemos of this process hold open on thread files: own_fd_links leaves
# them out (none is a socket, and top holds hundreds).
_HELD_FDS: set[int] = set()


def own_fd_links() -> list[str]:
    """fd_links of this process, less the thread files ThreadMemos hold open: wedgectl reads its
    own socket fds twice at each sample of sockets (sockets.own_tcp_addresses), and a readlink
    apiece of the held files would cost more than every other read of it."""
    return _readlinks(f"{PROC}/{os.getpid()}/fd/", _HELD_FDS)


def _fd_budget() -> int:
    """Half the soft limit on open files, at most 4096: the rest is left to scrapes, py-spy's pipes
    and whatever else the process opens."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(0, min(4096, soft // 2))


def read_threads(
    pid: int,
    proc_root: Path = PROC,
    *,
    timeout: float = 2.0,
    machine: str | None = None,
    unchanged: ThreadMemo | None = None,
    switches: bool = True,
) -> tuple[tuple[ThreadSample, ...], tuple[CollectorFailure, ...]]:
    """Every thread of ``pid`` from /proc/PID/task/*/{stat,wchan,syscall,status}.

    `switches`: read status for the context-switch counts. It is the dearest of the four files
    (12 us a thread against 6-8 for the others, measured on a vLLM Worker) and no verdict reads
    the counts; `top`, which reads every thread that ran each second, passes False and leaves
    them None. A diagnose keeps them in its bundle.

    With `unchanged` (top's memo across refreshes), a thread whose schedstat (time on a CPU,
    time waiting for one, times scheduled) is what it was at the last read has not run since:
    its last sample is reused, one read instead of three. One that was woken and still waits
    for a CPU reads as it was until it runs.

    comm is taken from stat (the same 16-byte task->comm the comm file shows),
    saving one read per thread. A thread that exits mid-read is dropped and
    reported once as GONE; unreadable wchan/syscall (ptrace access refused)
    leave those fields empty and are reported once as PERMISSION. Stops after
    ``timeout`` seconds and reports the threads it skipped as TIMEOUT.
    """
    task_dir = proc_root / str(pid) / "task"
    try:
        tids = sorted(int(name) for name in os.listdir(task_dir) if name.isdigit())
    except OSError as exc:
        return (), (failure_from_oserror(COLLECTOR, exc, str(pid), f"/proc/{pid}/task", pid),)

    names = ("stat", "wchan", "syscall", "status") if switches else ("stat", "wchan", "syscall")
    deadline = time.monotonic() + timeout
    threads: list[ThreadSample] = []
    failures: list[CollectorFailure] = []
    gone: list[int] = []
    denied: dict[str, list[int]] = {}
    for i, tid in enumerate(tids):
        if time.monotonic() > deadline:
            failures.append(
                CollectorFailure(
                    COLLECTOR,
                    FailureKind.TIMEOUT,
                    f"read {i} of {len(tids)} threads in {timeout:.1f}s; skipped tids {tids[i:][:20]}",
                    str(pid),
                )
            )
            break
        tdir = f"{task_dir}/{tid}/"  # a str: pathlib's joins cost more than the reads
        texts: dict[str, str | None] = {}
        sched: str | None = None
        if unchanged is not None:
            try:
                sched = unchanged.read(pid, tid, tdir + "schedstat")
            except OSError:
                sched = None  # no schedstat (or gone): read it whole below
            hit = unchanged.get(pid, tid, sched)
            if hit is not None:
                threads.append(hit)
                continue
        try:
            for name in names:
                try:
                    texts[name] = _read_text(tdir + name) if unchanged is None else unchanged.read(pid, tid,
                                                                                                   tdir + name)
                except PermissionError:
                    if name == "stat":
                        raise
                    texts[name] = None
                    denied.setdefault(name, []).append(tid)
            threads.append(
                thread_from_texts(
                    tid, texts["stat"] or "", texts["wchan"], texts["syscall"], texts.get("status"), machine
                )
            )
            if unchanged is not None and sched is not None and not any(v is None for v in texts.values()):
                unchanged.put(pid, tid, sched, threads[-1])
        except (FileNotFoundError, ProcessLookupError):
            gone.append(tid)
        except OSError as exc:
            failures.append(failure_from_oserror(COLLECTOR, exc, str(tid), f"/proc/{pid}/task/{tid}", pid))
        except (ValueError, IndexError) as exc:
            failures.append(
                CollectorFailure(COLLECTOR, FailureKind.BAD_DATA, f"/proc/{pid}/task/{tid}: {exc}", str(tid))
            )

    if unchanged is not None:  # a thread that exited mid-read is gone too: its held files close now
        unchanged.keep(pid, [t for t in tids if t not in gone] if gone else tids)
    if gone:
        what = "process exited mid-read" if not threads else f"{len(gone)} thread(s) exited mid-read: {gone[:20]}"
        failures.append(CollectorFailure(COLLECTOR, FailureKind.GONE, what, str(pid)))
    for name, denied_tids in denied.items():
        failures.append(
            CollectorFailure(
                COLLECTOR,
                FailureKind.PERMISSION,
                f"/proc/{pid}/task/*/{name} unreadable for {len(denied_tids)} thread(s); {permission_hint(pid)}",
                str(pid),
            )
        )
    return tuple(threads), tuple(failures)


# ---------------------------------------------------------------------------
# the scheduler's view of a thread, at the edges of a probe window
#
# /proc/PID/task/TID/sched's `se.exec_start` is the scheduler-clock time the
# thread last ran; for a thread asleep in futex(2) that is when its wait began
# (a thread parked since before a probe attached fires no tracepoint in the
# window). schedstat gives exact on-CPU and run-queue nanoseconds.


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


def thread_schedstats(pid: int, proc_root: Path = PROC) -> dict[int, tuple[int, int, int]]:
    """Each live thread of pid's schedstat (parse_schedstat's triple), by tid; a thread gone or
    unreadable mid-read is left out, and a pid gone gives {}."""
    task_dir = f"{proc_root}/{pid}/task"
    try:
        tids = [name for name in os.listdir(task_dir) if name.isdigit()]
    except OSError:
        return {}
    out: dict[int, tuple[int, int, int]] = {}
    for tid in tids:
        try:
            sched = parse_schedstat(_read_text(f"{task_dir}/{tid}/schedstat"))
        except OSError:
            continue
        if sched:
            out[int(tid)] = sched
    return out


@dataclass(frozen=True)
class ThreadSched:
    """One thread at one edge of a probe window: its ThreadSample and the scheduler's view of it."""

    pid: int
    thread: ThreadSample
    cpu: int | None  # the CPU it last ran on (stat field 39)
    exec_start_s: float | None  # se.exec_start: last ran at, on that CPU's scheduler clock
    oncpu_ns: int | None  # schedstat: time on a CPU
    runq_ns: int | None  # schedstat: time runnable, waiting for a CPU

    @property
    def tid(self) -> int:
        return self.thread.tid

    @property
    def comm(self) -> str:
        return self.thread.comm

    @property
    def futex_addr(self) -> int | None:
        return self.thread.futex_addr

    @property
    def in_futex_wait(self) -> bool:
        return self.thread.in_futex_wait


def sched_from_texts(pid: int, thread: ThreadSample, stat: str | None, sched: str | None,
                     schedstat: str | None) -> ThreadSched:
    """Build a ThreadSched from a ThreadSample and the texts of stat, sched and schedstat (None: unreadable)."""
    ss = parse_schedstat(schedstat) if schedstat else None
    return ThreadSched(
        pid=pid,
        thread=thread,
        cpu=parse_stat(stat).processor if stat else None,
        exec_start_s=parse_exec_start(sched) if sched else None,
        oncpu_ns=ss[0] if ss else None,
        runq_ns=ss[1] if ss else None,
    )


def _read_or_none(path: Path) -> str | None:
    try:
        return _read_text(path)
    except OSError:
        return None


def read_thread_scheds(
    pids: Iterable[int], proc_root: Path = PROC, timeout: float = 3.0
) -> tuple[dict[int, ThreadSched], tuple[CollectorFailure, ...]]:
    """tid -> ThreadSched for every thread of the pids, within ``timeout`` seconds in all.

    A thread that exits between its reads is left out, as read_threads does.
    """
    deadline = time.monotonic() + timeout
    out: dict[int, ThreadSched] = {}
    failures: list[CollectorFailure] = []
    for pid in pids:
        left = deadline - time.monotonic()
        if left <= 0:
            failures.append(CollectorFailure(COLLECTOR, FailureKind.TIMEOUT,
                                             f"read threads for {timeout:.0f} s; the rest skipped", str(pid)))
            break
        threads, fails = read_threads(pid, proc_root, timeout=left)
        failures += fails
        for t in threads:
            tdir = proc_root / str(pid) / "task" / str(t.tid)
            stat = _read_or_none(tdir / "stat")
            if stat is None:
                continue  # exited since
            try:
                out[t.tid] = sched_from_texts(pid, t, stat, _read_or_none(tdir / "sched"),
                                              _read_or_none(tdir / "schedstat"))
            except (ValueError, IndexError) as exc:
                failures.append(CollectorFailure(COLLECTOR, FailureKind.BAD_DATA, f"{tdir}: {exc}", str(t.tid)))
    return out, tuple(failures)


CLOCK_READS = 5  # tries per CPU at a read no preemption stretched
CLOCK_READ_TIGHT_S = 0.002  # a bracket this narrow ends the tries
CLOCK_SLEEP_S = 0.0005


def offset_from_reads(reads: Iterable[tuple[float, float | None, float]],
                      slept: float = CLOCK_SLEEP_S) -> float | None:
    """The offset (CLOCK_MONOTONIC minus the task clock) from timed reads of a thread's own exec_start.

    Each read is (monotonic before the sleep, exec_start read, monotonic after the read). The
    wake-up stamped exec_start at least `slept` after `before`, and a preemption between the wake
    and the read stamps it again on resuming, never later than `after`: the true offset lies in
    [before + slept - es, after - es] whichever happened. The narrowest bracket's middle is
    taken, so a read our own thread waited for a CPU to finish (a loaded host) cannot skew it by
    the wait: a single read timed at the wake alone read as much as that wait off."""
    best: tuple[float, float] | None = None
    for before, es, after in reads:
        if es is None:
            continue
        lo, hi = before + slept - es, after - es
        width = max(0.0, hi - lo)  # none where a read ends within the sleep (a clock stood still): the read's end
        if best is None or width < best[0]:
            best = (width, (lo + hi) / 2 if hi > lo else hi)
    return None if best is None else best[1]


def sched_clock_offsets(cpus: Iterable[int], proc_root: Path = PROC) -> dict[int, float]:
    """CLOCK_MONOTONIC minus each CPU's scheduler task clock, in seconds.

    That clock (rq_clock_task) runs behind CLOCK_MONOTONIC by the IRQ and
    steal time each CPU has accounted. A helper thread pins itself to the CPU,
    sleeps a moment (the wake-up stamps its exec_start with that CPU's clock,
    now) and reads its own sched file, timed on both sides (offset_from_reads);
    up to CLOCK_READS tries, until one is bracketed within CLOCK_READ_TIGHT_S.
    CPUs it may not run on get the median.
    """
    out: dict[int, float] = {}

    def measure(cpu: int) -> None:
        reads: list[tuple[float, float | None, float]] = []
        try:
            os.sched_setaffinity(0, {cpu})
            for _ in range(CLOCK_READS):
                before = time.monotonic()
                time.sleep(CLOCK_SLEEP_S)
                es = parse_exec_start(_read_or_none(proc_root / "thread-self" / "sched") or "")
                after = time.monotonic()
                reads.append((before, es, after))
                if es is None or after - before - CLOCK_SLEEP_S <= CLOCK_READ_TIGHT_S:
                    break
        except OSError:
            return
        offset = offset_from_reads(reads)
        if offset is not None:
            out[cpu] = offset

    wanted = sorted(set(cpus))
    for cpu in wanted:
        t = threading.Thread(target=measure, args=(cpu,), name=f"wedgectl-clock-{cpu}", daemon=True)
        t.start()
        t.join(timeout=2.0)
    if out:
        median = sorted(out.values())[len(out) // 2]
        for cpu in wanted:
            out.setdefault(cpu, median)
    return out


def cpu_steal_s(proc_root: Path = PROC) -> dict[int, float]:
    """Each CPU's steal time since boot, in seconds, from /proc/stat (clock ticks: 10 ms steps):
    the time the hypervisor ran something else while this CPU had work. {} where unreadable."""
    text = _read_or_none(proc_root / "stat")
    out: dict[int, float] = {}
    for line in (text or "").splitlines():
        if not (line.startswith("cpu") and line[3:4].isdigit()):
            continue
        f = line.split()
        try:
            out[int(f[0][3:])] = int(f[8]) / CLK_TCK
        except (ValueError, IndexError):
            continue
    return out


class SchedClock:
    """sched_clock_offsets, measured once per CPU and kept for REFRESH_S, then carried forward by
    the CPU's steal time.

    A CPU's task clock stops while the hypervisor steals the CPU (CONFIG_PARAVIRT_TIME_ACCOUNTING),
    so its offset grows by exactly the steal /proc/stat counts for it: a few ms a second on a quiet
    VM, a tenth of every second on a crowded host. A kept offset is therefore moved on by the
    steal counted since it was measured (one read of /proc/stat, about 20 us, against a thread
    pinned to each CPU). Without that, a minute-old offset would make a thread that ran a moment
    ago read as off its CPU for as long as the host had stolen in that minute."""

    REFRESH_S = 60.0

    def __init__(self, proc_root: Path = PROC) -> None:
        self.proc_root = proc_root
        self._offsets: dict[int, tuple[float, float, float | None]] = {}  # cpu -> (offset, measured at, steal then)
        self._lock = threading.Lock()

    def offset(self, cpu: int) -> float | None:
        with self._lock:
            steal = cpu_steal_s(self.proc_root).get(cpu)
            got = self._offsets.get(cpu)
            if got is None or time.monotonic() - got[1] > self.REFRESH_S:
                measured = sched_clock_offsets([cpu], self.proc_root)
                if cpu not in measured:
                    return None  # a CPU this process may not run on (a cpuset): no clock to read it by
                self._offsets[cpu] = (measured[cpu], time.monotonic(), steal)  # steal read just before: 10 ms ticks
                return measured[cpu]
            offset, _, steal_then = got
            if steal is not None and steal_then is not None:
                offset += max(0.0, steal - steal_then)
            return offset


CLOCK = SchedClock()


def main_thread_quiet_s(pid: int, proc_root: Path = PROC, clock: SchedClock | None = None) -> float | None:
    """How long a process's main thread has gone without a CPU, now: 0 while it runs or waits
    for one, None where it cannot be read (no CONFIG_SCHED_DEBUG, a CPU out of reach)."""
    return main_thread_sched(pid, proc_root, clock)[0]


def main_thread_sched(pid: int, proc_root: Path = PROC,
                      clock: SchedClock | None = None) -> tuple[float | None, float | None]:
    """(quiet_s, runq_s) of a process's main thread, now.

    quiet_s: how long it has gone without a CPU; 0 while it runs or waits for one.
    runq_s: how long, since it started, it has been runnable but waiting for a CPU: schedstat's
    run delay (waits that ended) plus, while it is runnable (state R), the wait under way since it
    last ran. Its growth between two samples tells a thread that wanted a CPU and got none (a
    host too busy to run it) from one parked on purpose (its run delay stands still). The run
    delay alone would miss a thread that has not run at all since: the kernel adds a wait to it
    only when the wait ends.

    se.exec_start is stamped on the clock of the CPU the thread ran on; stat names that CPU. The
    sched file is read on both sides of stat and must not change in between: then the thread did
    not run between the reads, and the CPU stat names is the one that stamped it. A migration
    zeroes exec_start, which reads as unknown. quiet_s is a lower bound on a VM: the CPU's task clock
    stops while the hypervisor steals it, so the steal since the thread last ran is not counted
    (the conservative side for a deadlock rule). Either figure is None where it cannot be read (no
    CONFIG_SCHED_DEBUG or schedstat, a CPU out of reach, the process gone)."""
    base = proc_root / str(pid)
    first = _read_or_none(base / "sched")
    stat_text = _read_or_none(base / "stat")
    schedstat = _read_or_none(base / "schedstat")
    second = _read_or_none(base / "sched")
    if stat_text is None:
        return None, None
    try:
        st = parse_stat(stat_text)
    except (ValueError, IndexError):
        return None, None
    counted = parse_schedstat(schedstat) if schedstat else None
    delay = counted[1] / 1e9 if counted else None
    runnable = st.state == "R"
    if first is None or second is None:
        return None, None if runnable else delay
    since: float | None = None  # seconds since it last ran
    es = parse_exec_start(first)
    if es and es == parse_exec_start(second) and st.processor is not None:
        offset = (clock or CLOCK).offset(st.processor)
        if offset is not None:
            since = max(0.0, time.monotonic() - (es + offset))
    if runnable:
        # Running (exec_start a tick old at most) or queued for a CPU since it last ran.
        return 0.0, (delay + since if delay is not None and since is not None else None)
    return since, delay


# ---------------------------------------------------------------------------
# scheduling groups (sampler.raise_priority)


def _cgroup_lines(text: str) -> tuple[str | None, str | None]:
    """(v1 cpu controller's path, v2 path) in a /proc/PID/cgroup text."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


def cpu_cgroup(text: str) -> str | None:
    """The cpu controller's cgroup path in a /proc/PID/cgroup text: the v1 line naming `cpu`
    among its controllers, else the v2 line (`0::PATH`); None when neither is there."""
    v1, v2 = _cgroup_lines(text)
    return v1 if v1 is not None else v2


CGROUP_ROOT = Path("/sys/fs/cgroup")


def _stat_counts(text: str) -> tuple[int, int] | None:
    """(nr_periods, nr_throttled) from a cpu.stat text."""
    got = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("nr_periods", "nr_throttled"):
            got[key] = int(value)
    return (got["nr_periods"], got["nr_throttled"]) if len(got) == 2 else None


def read_cpu_limit(pid: int, proc_root: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> CpuLimit | None:
    """The CPU limit of pid's cgroup and how often it was throttled (CpuLimit); None with no limit
    set on it, or where its cgroup is not to be read (another cgroup namespace's path, no cpu
    controller mounted). v1's controller mounts as cpu or cpu,cpuacct; v2's files sit in the
    unified tree. Read from the process's own cgroup: a limit set only on a parent is not seen."""
    text = _read_or_none(proc_root / str(pid) / "cgroup")
    if text is None:
        return None
    v1, v2 = _cgroup_lines(text)
    try:
        if v1 is not None:
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                d = f"{cgroup_root}/{mount}/{v1.strip('/')}".rstrip("/")
                stat = _read_or_none(Path(d + "/cpu.stat"))
                if stat is None:
                    continue
                quota = int(_read_text(d + "/cpu.cfs_quota_us"))
                period = int(_read_text(d + "/cpu.cfs_period_us"))
                counts = _stat_counts(stat)
                return CpuLimit(quota, period, *counts) if quota > 0 and period > 0 and counts else None
        if v2 is not None:
            d = f"{cgroup_root}/{v2.strip('/')}".rstrip("/")
            limit, stat = _read_or_none(Path(d + "/cpu.max")), _read_or_none(Path(d + "/cpu.stat"))
            if limit is None or stat is None:
                return None
            quota_text, period_text = (limit.split() + ["100000"])[:2]
            counts = _stat_counts(stat)
            if quota_text == "max" or counts is None:
                return None
            return CpuLimit(int(quota_text), int(period_text), *counts)
    except (OSError, ValueError):
        return None
    return None


def autogroup_applies(proc_root: Path = PROC) -> bool:
    """Whether the kernel groups this process by session (autogroup): it is on
    (kernel.sched_autogroup_enabled) and the process is in the root cpu cgroup, the only
    place autogroup acts. Then CPU is shared between sessions by their autogroup's nice, and
    a task's nice ranks it only inside its session."""
    try:
        if _read_text(proc_root / "sys" / "kernel" / "sched_autogroup_enabled").strip() != "1":
            return False
        return cpu_cgroup(_read_text(proc_root / "self" / "cgroup")) == "/"
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
