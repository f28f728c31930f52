"""What each Worker rank's own report says of itself (its steps, its last collective), as the lines the
collective-hang verdict cites. No I/O.

The plugin wraps vLLM's GroupCoordinator collectives in each Worker and counts its execute_model calls
(engine/wedge_engine/collectives.py): a rank's report names the last collective it entered or left, the
rank's own number of it, since when, and whether it is inside it still. In a tensor-parallel group every
rank runs the same collectives in the same order, so a rank inside #41 beside one whose last is #40,
returned, is a rank that never arrived: the report names it as the stacks do. A collective inside a
compiled or captured graph runs no Python and is never recorded; where every rank's report agrees (the
same step, the same collective returned) the one they wait in is such a one, and the stacks decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wedgectl.classify import enginefacts as ef
from wedgectl.classify.evidence import fmt_duration
from wedgectl.model.engine import EngineReading, RankCollective
from wedgectl.model.types import Evidence, Sample

SOURCE = "engine"


@dataclass(frozen=True)
class RankReport:
    """One Worker rank's latest report: its label (as the stacks name it), steps and last collective."""

    label: str
    reading: EngineReading
    steps: int | None
    collective: RankCollective | None

    @property
    def pid(self) -> int:
        return self.reading.pid

    @property
    def collective_age_s(self) -> float | None:
        """Seconds in the collective (inside) or since it returned, at the read: the report's own clock from
        the collective's change to its write, plus the report's age."""
        rep, c = self.reading.report, self.collective
        if rep is None or c is None or c.since_mono_ns is None or c.since_mono_ns > rep.written_mono_ns:
            return None
        return (rep.written_mono_ns - c.since_mono_ns) / 1e9 + (self.reading.age_s or 0.0)

    @property
    def inside(self) -> bool:
        return self.collective is not None and self.collective.inside is True


def rank_reports(samples: Sequence[Sample], ranks: Sequence[tuple[int, str]]) -> tuple[RankReport, ...]:
    """The latest report of each (pid, label) rank that holds a rank part, in the order given."""
    latest = ef.latest_readings(samples)
    out = []
    for pid, label in ranks:
        r = latest.get(pid)
        rank = r.report.rank if r is not None and r.report is not None else None
        if r is not None and rank is not None:
            out.append(RankReport(label, r, rank.steps, rank.collective))
    return tuple(out)


def _collective_text(c: RankCollective) -> str:
    return (f"{c.op}" + (f" #{c.seq}" if c.seq is not None else "") + (f" on {c.group}" if c.group else ""))


def _line(rr: RankReport) -> Evidence:
    """'rank TP1 (Worker pid N): 4 steps; last collective all_reduce #40 on tp, inside it for 12 s'."""
    c, age = rr.collective, rr.collective_age_s
    steps = f"{rr.steps} step{'s' if rr.steps != 1 else ''}" if rr.steps is not None else "steps not counted"
    if c is None:
        where = "no collective recorded"
    elif c.inside:
        where = f"inside {_collective_text(c)}" + (f" for {fmt_duration(age)}" if age is not None else "")
    else:
        where = (f"last collective {_collective_text(c)}, returned"
                 + (f" {fmt_duration(age)} ago" if age is not None else ""))
    r = rr.reading
    stale = " (report stale: no Python ran there lately)" if r.stale else ""
    return Evidence(SOURCE, f"rank {rr.label} (Worker pid {r.pid}) by its own report: {steps}; {where}{stale}",
                    values={"pid": r.pid, "rank": rr.label, "steps": rr.steps,
                            "collective": None if c is None else c.op, "group": None if c is None else c.group,
                            "seq": None if c is None else c.seq, "inside": None if c is None else c.inside,
                            "collective_s": None if age is None else round(age, 1),
                            "report_age_s": None if r.age_s is None else round(r.age_s, 2)})


def _labels(rrs: Sequence[RankReport]) -> str:
    return ", ".join(rr.label for rr in rrs)


def _reading(rrs: Sequence[RankReport]) -> Evidence | None:
    """What the ranks' reports say together: who waits inside which collective and who never entered it, who
    is a step behind, or, where they all agree, that the collective is out of the report's sight."""
    seen = [rr for rr in rrs if rr.collective is not None]
    inside = [rr for rr in seen if rr.inside]
    if inside and len(inside) < len(seen):
        waited = max(inside, key=lambda rr: rr.collective.seq if rr.collective and rr.collective.seq else 0)
        c = waited.collective
        assert c is not None
        behind = [rr for rr in seen if not rr.inside and rr.collective is not None and c.seq is not None
                  and rr.collective.seq is not None and rr.collective.seq < c.seq
                  and rr.collective.group == c.group]
        if behind:
            lasts = "; ".join(f"{rr.label}'s last, {_collective_text(rr.collective)}, returned" for rr in behind
                              if rr.collective is not None)
            return Evidence(SOURCE, f"the ranks' reports: {_labels(inside)} wait(s) inside {_collective_text(c)}; "
                            f"{_labels(behind)} never entered it ({lasts}): the rank that never arrived",
                            values={"waiting": [rr.label for rr in inside],
                                    "never_entered": [rr.label for rr in behind],
                                    "collective": c.op, "group": c.group, "seq": c.seq})
    steps = {rr.steps for rr in rrs if rr.steps is not None}
    if len(steps) > 1:
        most = max(steps)
        behind = [rr for rr in rrs if rr.steps is not None and rr.steps < most]
        return Evidence(SOURCE, f"the ranks' reports: {_labels(behind)} behind in its steps "
                        f"({', '.join(f'{rr.label} {rr.steps}' for rr in rrs if rr.steps is not None)}): it never "
                        "began the step the others are in", values={"behind": [rr.label for rr in behind],
                                                                     "steps": {rr.label: rr.steps for rr in rrs}})
    distinct = {(c.op, c.group, c.seq, c.inside) for rr in rrs if (c := rr.collective) is not None}
    if len(rrs) > 1 and len(seen) == len(rrs) and len(distinct) == 1 and not inside:
        c = seen[0].collective
        assert c is not None
        return Evidence(SOURCE, f"the ranks' reports agree: every rank in the same step, its last collective "
                        f"{_collective_text(c)} returned; the one they wait in runs inside a compiled or captured "
                        "graph, out of the reports' sight (the stacks, or the ranks' CPU, decide which rank never "
                        "arrived)",
                        values={"collective": c.op, "group": c.group, "seq": c.seq, "agree": True})
    return None


def rank_report_evidence(samples: Sequence[Sample], ranks: Sequence[tuple[int, str]]) -> tuple[Evidence, ...]:
    """One line per rank whose report carries its rank part, then what they say together (where it says
    anything): nothing for a capture without reports, or reports from a writer without collectives."""
    rrs = rank_reports(samples, ranks)
    if not any(rr.steps is not None or rr.collective is not None for rr in rrs):
        return ()
    lines = [_line(rr) for rr in rrs]
    together = _reading(rrs)
    return (*lines, *([together] if together is not None else []))
