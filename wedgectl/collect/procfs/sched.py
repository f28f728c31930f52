"""The scheduler's view of a thread: each thread at the edges of a probe window (ThreadSched), a
main thread's quiet and run delay (main_thread_sched), and run delays from schedstat."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from wedgectl.collect.procfs._files import COLLECTOR, PROC, read_or_none, read_text
from wedgectl.collect.procfs.clock import CLOCK, SchedClock
from wedgectl.collect.procfs.parse import parse_exec_start, parse_schedstat, parse_stat
from wedgectl.collect.procfs.threads import read_threads
from wedgectl.model.types import CollectorFailure, FailureKind, ThreadSample


def own_run_delay_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (the second field of
    /proc/thread-self/schedstat, the scheduler's run delay); None where unreadable."""
    try:
        sched = parse_schedstat(read_text(PROC / "thread-self" / "schedstat"))
    except OSError:
        return None
    return sched[1] / 1e9 if sched else None


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
            sched = parse_schedstat(read_text(f"{task_dir}/{tid}/schedstat"))
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
            stat = read_or_none(tdir / "stat")
            if stat is None:
                continue  # exited since
            try:
                out[t.tid] = sched_from_texts(pid, t, stat, read_or_none(tdir / "sched"),
                                              read_or_none(tdir / "schedstat"))
            except (ValueError, IndexError) as exc:
                failures.append(CollectorFailure(COLLECTOR, FailureKind.BAD_DATA, f"{tdir}: {exc}", str(t.tid)))
    return out, tuple(failures)


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
    not run between the reads, and the CPU stat names is the one that stamped it. Where it changed,
    the thread ran (or was woken) while it was read: it has been quiet for less than the read took,
    which is what quiet_s says (a thread that naps 1 ms per loop, as vLLM's EngineCore between
    empty steps, read as unknown one time in nine). A migration zeroes exec_start, which reads as
    unknown. quiet_s is a lower bound on a VM: the CPU's task clock stops while the hypervisor
    steals it, so the steal since the thread last ran is not counted (the conservative side for
    a deadlock rule). Either figure is None where it cannot be read (no
    CONFIG_SCHED_DEBUG or schedstat, a CPU out of reach, the process gone)."""
    base = proc_root / str(pid)
    began = time.monotonic()
    first = read_or_none(base / "sched")
    stat_text = read_or_none(base / "stat")
    schedstat = read_or_none(base / "schedstat")
    second = read_or_none(base / "sched")
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
    es, es_after = parse_exec_start(first), parse_exec_start(second)
    if es and es_after and es_after != es:  # it ran between the reads
        since = time.monotonic() - began
    elif es and es == es_after and st.processor is not None:
        offset = (clock or CLOCK).offset(st.processor)
        if offset is not None:
            since = max(0.0, time.monotonic() - (es + offset))
    if runnable:
        # Running (exec_start a tick old at most) or queued for a CPU since it last ran.
        return 0.0, (delay + since if delay is not None and since is not None else None)
    return since, delay
