#!/usr/bin/env python3
"""Measure what the probes cost a futex-heavy workload: throughput with and without them, side by side in one run.

The workload is a child process of thread pairs handing a token back and
forth through queue.Queue (each hand-off: a Condition notify and wait, i.e.
FUTEX_WAKE + FUTEX_WAIT, plus the GIL's own futex traffic). It prints its
hand-off counter every 0.25 s. The bench alternates phases on the same
process, untraced and traced (attach, measure, detach), so drift in the host's
load hits both sides alike, and reports each configuration's median rate,
the ratio traced/untraced, and the event rates the probe saw.

    python bench/probe_overhead.py                    # futexwait+offcpu, then +pylockwait, 4 rounds of 3 s
    python bench/probe_overhead.py --rounds 6 --seconds 4 --pairs 4
    python bench/probe_overhead.py --work 2000       # a moderate futex rate, nearer a serving engine's
    python bench/probe_overhead.py --each            # futexwait alone, offcpu alone, then together
    python bench/probe_overhead.py --backend procfs   # the /proc fallback (costs nothing while it waits)

Needs root (or CAP_BPF + CAP_PERFMON) for the eBPF back-ends.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from wedgectl import probes as programs
from wedgectl.collect import ebpf, ebpfhost
from wedgectl.types import ProbeResult, ThreadProbe

WORKLOAD = r"""
import queue, sys, threading, time
pairs, work = int(sys.argv[1]), int(sys.argv[2])
count = [0] * pairs
def ping(i, a, b):
    while True:
        a.put(1); b.get(); count[i] += 1
        for _ in range(work): pass
def pong(a, b):
    while True:
        a.get(); b.put(1)
for i in range(pairs):
    a, b = queue.Queue(1), queue.Queue(1)
    threading.Thread(target=ping, args=(i, a, b), daemon=True).start()
    threading.Thread(target=pong, args=(a, b), daemon=True).start()
while True:
    time.sleep(0.25)
    print(time.monotonic(), sum(count), flush=True)
"""


class Workload:
    def __init__(self, pairs: int, work: int = 0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(pairs), str(work)], stdout=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL)
        self.points: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, n = line.split()
            with self._lock:
                self.points.append((float(t), int(n)))

    def count_at(self, t: float) -> int | None:
        """The counter reading nearest before monotonic time t."""
        with self._lock:
            before = [n for tt, n in self.points if tt <= t]
        return before[-1] if before else None

    def cpu_ns(self) -> int:
        """CPU time of all the workload's threads (schedstat: ns on the CPU), probe programs included:
        a tracepoint's BPF program runs in the context of the thread that hit it."""
        total = 0
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                total += int(Path(f"/proc/{self.proc.pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total

    def rate(self, t0: float, t1: float) -> float:
        """Hand-offs per second between the first and last counter reading inside [t0, t1]."""
        with self._lock:
            inside = [(t, n) for t, n in self.points if t0 <= t <= t1]
        if len(inside) < 2:
            return float("nan")
        (ta, na), (tb, nb) = inside[0], inside[-1]
        return (nb - na) / (tb - ta)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def phase(work: Workload, seconds: float, probes: tuple[str, ...] | None, backend: str) -> dict:
    """One phase: untraced (probes None) or traced; returns its rate and what the probe saw."""
    def measured(fn) -> tuple[float, float, float]:
        # counter points come every 0.25 s: pad the sleep so whole intervals fall inside
        c0, t0 = work.cpu_ns(), time.monotonic()
        time.sleep(0.3)
        fn()
        t1 = time.monotonic()
        c1 = work.cpu_ns()
        time.sleep(0.3)
        n0, n1 = work.count_at(t0), work.count_at(t1)
        us_per_op = (c1 - c0) / 1e3 / (n1 - n0) if n0 is not None and n1 is not None and n1 > n0 else float("nan")
        return work.rate(t0, t1), us_per_op, t1 - t0

    if probes is None:
        rate, us, _ = measured(lambda: time.sleep(seconds))
        return {"rate": rate, "us_per_op": us}
    run = ebpf.start_probes([work.proc.pid], "auto", probes=probes, backend=backend, max_s=seconds + 10)
    assert run is not None
    try:
        rate, us, _ = measured(lambda: time.sleep(seconds))
    finally:
        records, failures = run.stop()
    header = next((r for r in records if isinstance(r, ProbeResult)), None)
    threads = [r for r in records if isinstance(r, ThreadProbe)]
    window = (header.window_s if header else 0.0) or seconds
    waits = sum(t.waits or 0 for t in threads)
    wakes = sum(w.calls for w in header.wakes) if header else 0
    return {"rate": rate, "us_per_op": us, "backend": header.backend if header else None,
            "futex_per_s": (waits + wakes) / window,
            "pylock_per_s": sum(t.pylock_waits or 0 for t in threads) / window,
            "failures": [f.message for f in failures]}


def ctx_switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if "ctxt_switches" in line:
                total += int(line.split(":")[1])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4, help="thread pairs in the workload (default 4)")
    p.add_argument("--work", type=int, default=0,
                   help="empty loop iterations per hand-off: 0 is the worst case, ~2000 a moderate futex rate")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per phase (default 3)")
    p.add_argument("--rounds", type=int, default=4, help="untraced/traced rounds per configuration (default 4)")
    p.add_argument("--backend", default="auto", choices=("auto", "bcc", "bpftrace", "procfs"))
    p.add_argument("--each", action="store_true", help="also each probe alone (futexwait, offcpu)")
    p.add_argument("--no-pylocks", action="store_true", help="skip the pylockwait (uprobe) configuration")
    args = p.parse_args(argv)

    statuses = ebpfhost.detect_backends(programs.ALL_PROBES)
    chosen = ebpfhost.choose_backend([s for s in statuses if args.backend in ("auto", s.name)])
    print(f"back-end: {chosen.name if chosen else 'none'} ({chosen.reason if chosen else ''})")
    configs: list[tuple[str, tuple[str, ...]]] = [("futexwait+offcpu", programs.DEFAULT_PROBES)]
    if args.each:
        configs = [("futexwait", ("futexwait",)), ("offcpu", ("offcpu",)), *configs]
    if not args.no_pylocks and args.backend != "procfs":
        configs.append(("+pylockwait", programs.ALL_PROBES))
    work = Workload(args.pairs, args.work)
    try:
        time.sleep(1.5)  # threads started, rate settled
        s0, t0 = ctx_switches(work.proc.pid), time.monotonic()
        time.sleep(1.0)
        switch_rate = (ctx_switches(work.proc.pid) - s0) / (time.monotonic() - t0)
        rows = []
        for label, probes in configs:
            off, on, seen, cpu_off, cpu_on = [], [], [], [], []
            for _ in range(args.rounds):
                r0 = phase(work, args.seconds, None, args.backend)
                off.append(r0["rate"])
                cpu_off.append(r0["us_per_op"])
                r = phase(work, args.seconds, probes, args.backend)
                on.append(r["rate"])
                cpu_on.append(r["us_per_op"])
                seen.append(r)
                for f in r["failures"]:
                    print(f"  probe: {f}", file=sys.stderr)
            m_off, m_on = statistics.median(off), statistics.median(on)
            rows.append((label, seen[-1].get("backend"), m_off, m_on, m_on / m_off,
                         statistics.median(s["futex_per_s"] for s in seen),
                         statistics.median(s["pylock_per_s"] for s in seen), off, on,
                         statistics.median(cpu_off), statistics.median(cpu_on)))
    finally:
        work.stop()
    print(f"workload: {args.pairs} thread pairs ping-ponging through queue.Queue, {args.work} loop iterations "
          f"per hand-off; "
          f"{switch_rate:,.0f} context switches/s untraced")
    print(f"{args.rounds} rounds x {args.seconds:.0f} s per side, alternating untraced/traced; medians:")
    print("throughput = hand-offs/s; ratio = traced/untraced throughput. cpu = CPU us per hand-off of the")
    print("workload's threads, probe programs included (they run in the traced thread's context): it moves")
    print("less than throughput when other processes load the host.")
    print(f"{'probes':<18} {'backend':<9} {'untraced/s':>10} {'traced/s':>9} {'ratio':>6} {'cpu us':>12} "
          f"{'cpu ratio':>9} {'futex/s':>8} {'pylock/s':>8}")
    for label, backend, m_off, m_on, ratio, fps, pps, off, on, c_off, c_on in rows:
        print(f"{label:<18} {backend or '-':<9} {m_off:>10,.0f} {m_on:>9,.0f} {ratio:>6.3f} "
              f"{c_off:>5.1f}->{c_on:<6.1f} {c_off / c_on:>9.3f} {fps:>8,.0f} {pps:>8,.0f}")
        print(f"{'':<18} rounds untraced {[round(x) for x in off]} traced {[round(x) for x in on]}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
