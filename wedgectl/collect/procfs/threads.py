"""Every thread of a process from /proc/PID/task (read_threads), and top's memo across refreshes
(ThreadMemo): the last sample of a thread that has not run, and its files held open."""

from __future__ import annotations

import os
import resource
import time
import weakref
from pathlib import Path
from typing import Iterable, Sequence

from wedgectl.collect._failures import failure_from_oserror, permission_hint
from wedgectl.collect.procfs._files import COLLECTOR, PROC, read_text, readlinks
from wedgectl.collect.procfs.parse import thread_from_texts
from wedgectl.model.types import CollectorFailure, FailureKind, ThreadSample


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
        one). Raises as read_text does: FileNotFoundError or ProcessLookupError once it is gone."""
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
            return read_text(path)
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
    return readlinks(f"{PROC}/{os.getpid()}/fd/", _HELD_FDS)


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
                    texts[name] = read_text(tdir + name) if unchanged is None else unchanged.read(pid, tid,
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
