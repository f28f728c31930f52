"""Readings over a capture's window: a metric as a time series, and per-process counters compared
between their first and last reading. Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from wedgectl.model.types import ProcessSample, Role, Sample


@dataclass(frozen=True)
class Series:
    """One metric over the window: (unix time, value) pairs."""

    points: tuple[tuple[float, float], ...]

    @property
    def first(self) -> float | None:
        return self.points[0][1] if self.points else None

    @property
    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None

    @property
    def delta(self) -> float | None:
        return None if len(self.points) < 2 else self.points[-1][1] - self.points[0][1]

    @property
    def span_s(self) -> float:
        return 0.0 if len(self.points) < 2 else self.points[-1][0] - self.points[0][0]

    @property
    def rate(self) -> float | None:
        """Change per second between the first and last point."""
        return None if self.span_s <= 0 or self.delta is None else self.delta / self.span_s

    @property
    def frozen_s(self) -> float:
        """How long (seconds) the value has not changed, counted back from the last point."""
        if len(self.points) < 2:
            return 0.0
        t_last, v_last = self.points[-1]
        since = t_last
        for t, v in reversed(self.points):
            if v != v_last:
                break
            since = t
        return t_last - since


def slope_per_s(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, v); None with fewer than two distinct times."""
    if len(points) < 2:
        return None
    ts = [p[0] for p in points]
    if max(ts) == min(ts):
        return None
    # statistics.linear_regression's arithmetic, written out: that module (with fractions,
    # decimal and random behind it) was a tenth of the classifier's import time.
    vs = [p[1] for p in points]
    tbar, vbar = math.fsum(ts) / len(ts), math.fsum(vs) / len(vs)
    stv = math.fsum((t - tbar) * (v - vbar) for t, v in zip(ts, vs))
    stt = math.fsum((t - tbar) * (t - tbar) for t in ts)
    return stv / stt if stt else None


def stepless_of(procs: Sequence[ProcessSample]) -> float | None:
    """Facts.stepless_s of one sample's processes: per EngineCore the longest quiet of its main
    thread and its Workers', across EngineCores the shortest; None where one was not read."""
    per_engine = []
    for core in (p for p in procs if p.role == Role.ENGINE_CORE):
        quiet = [p.main_quiet_s for p in procs
                 if p is core or (p.role == Role.WORKER and p.ppid == core.pid)]
        known = [q for q in quiet if q is not None]
        if not known:
            return None
        per_engine.append(max(known))
    return min(per_engine) if per_engine else None


def main_runq(s: Sample, p: ProcessSample) -> tuple[float, float] | None:
    """most_grown's reader of a main thread's run delay (ProcessSample.main_runq_s) against the sample's clock."""
    return None if p.main_runq_s is None else (s.t, p.main_runq_s)


def most_grown(samples: Sequence[Sample], read: Callable[[Sample, ProcessSample], tuple[float, float] | None],
               min_span: float) -> tuple[ProcessSample, float, float] | None:
    """The process whose counter grew most against a clock over the window: read gives (clock,
    counter) for a process in a sample, or None; each process is compared between its first and
    last reading. (its last sample, counter growth, clock span), largest growth per span first;
    None where no process was read twice at least min_span apart."""
    first: dict[int, tuple[float, float]] = {}
    last: dict[int, tuple[tuple[float, float], ProcessSample]] = {}
    for s in samples:
        for p in s.processes:
            got = read(s, p)
            if got is not None:
                first.setdefault(p.pid, got)
                last[p.pid] = (got, p)
    best: tuple[ProcessSample, float, float] | None = None
    for pid, ((x1, y1), p) in last.items():
        x0, y0 = first[pid]
        span = x1 - x0
        if span <= 0 or span < min_span:
            continue
        grown = max(0.0, y1 - y0)
        if best is None or grown / span > best[1] / best[2]:
            best = (p, grown, span)
    return best
