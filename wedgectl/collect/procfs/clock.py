"""Each CPU's scheduler clock against CLOCK_MONOTONIC (SchedClock): measured once a minute from a
thread pinned to the CPU, and carried forward between by the CPU's steal time from /proc/stat."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterable

from wedgectl.collect.procfs._files import CLK_TCK, PROC, read_or_none
from wedgectl.collect.procfs.parse import parse_exec_start

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
                es = parse_exec_start(read_or_none(proc_root / "thread-self" / "sched") or "")
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
    text = read_or_none(proc_root / "stat")
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
