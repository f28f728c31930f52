"""What `watch` knows about each target: its verdict over time, its episodes, and when to look closer. No I/O."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from wedgectl.read.metrics import MetricsParseError, MetricsSnapshot, parse_metrics
from wedgectl.model.types import Role, Sample, Verdict, VerdictKind

# Not hangs: the server serves (idle, progressing), serves slowly (starved), or the evidence does
# not decide. Every other verdict, the classes added later included, is a hang for liveness.
NOT_HANGS = frozenset({VerdictKind.IDLE, VerdictKind.PROGRESSING, VerdictKind.STARVED, VerdictKind.INCONCLUSIVE})
HANG_CLASSES = tuple(k for k in VerdictKind if k not in NOT_HANGS)
EPISODE_HISTORY = 50  # episodes kept per target for /v1/targets
CALM_TICKS = 2  # cheap ticks with no trouble before a target drops back from full samples
STACKS_EVERY = 3  # while escalated, py-spy on every third tick (the first included): it costs our CPU


def is_hang(kind: VerdictKind) -> bool:
    return kind not in NOT_HANGS


def iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True)
class Episode:
    """One hang of one target: from the first evaluation in a hang class to the first one out of it."""

    target: str
    verdict: VerdictKind  # the hang class it began as
    start: float
    end: float | None = None
    peak_queue: float = 0.0  # most requests running + waiting seen during it
    bundle: str | None = None  # the evidence saved at its onset
    verdicts: tuple[VerdictKind, ...] = ()  # every hang class it went through, in order

    @property
    def open(self) -> bool:
        return self.end is None

    def duration_s(self, now: float) -> float:
        return (self.end if self.end is not None else now) - self.start

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "target": self.target, "verdict": self.verdict.value, "start": iso(self.start), "end": iso(self.end),
            "duration_s": round(self.duration_s(now), 1), "peak_queue": self.peak_queue, "bundle": self.bundle,
            "verdicts": [v.value for v in self.verdicts],
        }


@dataclass(frozen=True)
class TargetView:
    """One target as the exposition and /v1/targets see it at one instant."""

    name: str
    url: str | None
    pid: int | None
    verdict: Verdict | None
    since: float | None  # when the current verdict began
    last_evaluation: float | None
    escalated: bool
    episodes: tuple[Episode, ...]
    episodes_total: dict[VerdictKind, int] = field(default_factory=dict)
    stale: bool = False  # its last tick was skipped: the evaluation before still ran, or no worker was free
    kept_bytes: int = 0  # what its kept samples take (estimated), within its budget
    budget_exceeded: int = 0  # times its kept samples went over its byte budget and were trimmed

    @property
    def hang_since(self) -> float | None:
        """When the open episode began, if the target is in one."""
        return self.episodes[-1].start if self.episodes and self.episodes[-1].open else None

    def failing_liveness(self, now: float, grace_s: float) -> bool:
        """In a hang class for longer than the grace."""
        return self.hang_since is not None and now - self.hang_since > grace_s

    def state_seconds(self, now: float) -> float:
        return max(0.0, now - self.since) if self.since is not None else 0.0

    def to_json(self, now: float, grace_s: float) -> dict[str, Any]:
        from wedgectl.store.bundle import to_jsonable
        from wedgectl.read.redact import redact_obj

        v = self.verdict
        return redact_obj({  # served to anyone who can reach --listen: no secret goes out
            "target": self.name, "url": self.url, "pid": self.pid,
            "verdict": v.verdict.value if v else None, "confidence": v.confidence if v else None,
            "summary": v.summary if v else None, "rule": v.rule if v else None,
            "evidence": to_jsonable(v.evidence) if v else [],
            "since": iso(self.since), "state_seconds": round(self.state_seconds(now), 1),
            "last_evaluation": iso(self.last_evaluation), "escalated": self.escalated,
            "live": not self.failing_liveness(now, grace_s), "stale": self.stale,
            "kept_bytes": self.kept_bytes, "budget_exceeded": self.budget_exceeded,
            "episodes": [e.to_json(now) for e in self.episodes],
        })


class Tracker:
    """The verdicts of one target over time, folded into episodes. observe() returns the episode
    that began or ended at this evaluation (None when nothing changed)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.verdict: Verdict | None = None
        self.since: float | None = None
        self.last_evaluation: float | None = None
        self.episodes: deque[Episode] = deque(maxlen=EPISODE_HISTORY)
        self.totals: Counter[VerdictKind] = Counter()
        self.stale = False  # a tick was skipped since the last evaluation
        self.skips = 0  # ticks skipped, all told

    def skipped(self) -> None:
        """A tick passed this target by (its last evaluation still ran, or no worker was free)."""
        self.stale = True
        self.skips += 1

    @property
    def current(self) -> Episode | None:
        return self.episodes[-1] if self.episodes and self.episodes[-1].open else None

    def observe(self, verdict: Verdict, now: float, queue: float | None = None) -> Episode | None:
        if self.verdict is None or verdict.verdict is not self.verdict.verdict:
            self.since = now
        self.verdict, self.last_evaluation, self.stale = verdict, now, False
        kind, ep = verdict.verdict, self.current
        if ep is None:
            if not is_hang(kind):
                return None
            ep = Episode(self.name, kind, now, peak_queue=queue or 0.0, verdicts=(kind,))
            self.episodes.append(ep)
            self.totals[kind] += 1
            return ep
        if is_hang(kind):
            seen = ep.verdicts if kind in ep.verdicts else (*ep.verdicts, kind)
            self.episodes[-1] = replace(ep, peak_queue=max(ep.peak_queue, queue or 0.0), verdicts=seen)
            return None
        if kind is VerdictKind.INCONCLUSIVE:
            return None  # a look that decides nothing does not end a hang
        self.episodes[-1] = replace(ep, end=now)
        return self.episodes[-1]

    def close(self, now: float) -> Episode | None:
        """The target went away: its open episode ends now."""
        ep = self.current
        if ep is None:
            return None
        self.episodes[-1] = replace(ep, end=now)
        return self.episodes[-1]

    def attach_bundle(self, episode: Episode, path: str) -> None:
        for i, e in enumerate(self.episodes):
            if e.start == episode.start and e.target == episode.target:
                self.episodes[i] = replace(e, bundle=path)

    def view(self, url: str | None, pid: int | None, escalated: bool, kept_bytes: int = 0,
             budget_exceeded: int = 0) -> TargetView:
        return TargetView(self.name, url, pid, self.verdict, self.since, self.last_evaluation, escalated,
                          tuple(self.episodes), dict(self.totals), self.stale, kept_bytes, budget_exceeded)


# ---------------------------------------------------------------- escalation
# Cheap ticks read /metrics, /health and process CPU only. Each predicate below names a sign of
# trouble in that data; while any holds (or the verdict is not healthy), ticks take full samples:
# every thread, Python stacks, and the probes.


def _snapshots(samples: Sequence[Sample]) -> list[MetricsSnapshot]:
    out = []
    for s in samples:
        if s.metrics is not None and s.metrics.ok:
            try:
                out.append(parse_metrics(s.metrics.text or ""))
            except MetricsParseError:
                continue
    return out


def queue_of(samples: Sequence[Sample]) -> float | None:
    """Requests running + waiting at the last scrape that answered (a loaded server misses some)."""
    for s in reversed(samples):
        snaps = _snapshots([s])
        if snaps:
            return (snaps[0].running or 0) + (snaps[0].waiting or 0)
    return None


def frozen_with_work(samples: Sequence[Sample]) -> bool:
    """Requests in flight and the generation counter did not move between the last two scrapes:
    a stepping vLLM engine publishes tokens every few milliseconds."""
    snaps = _snapshots(samples[-2:])
    if len(snaps) < 2:
        return False
    a, b = snaps
    return (b.running or 0) + (b.waiting or 0) >= 1 and a.generation_tokens == b.generation_tokens


def waiting_not_draining(samples: Sequence[Sample]) -> bool:
    """Requests wait and nothing was admitted (waiting did not fall, prompt tokens flat)."""
    snaps = _snapshots(samples[-2:])
    if len(snaps) < 2:
        return False
    a, b = snaps
    return (b.waiting or 0) >= 1 and (b.waiting or 0) >= (a.waiting or 0) and a.prompt_tokens == b.prompt_tokens


def health_failing(samples: Sequence[Sample]) -> bool:
    """/health did not answer 200, or /metrics did not: vLLM answers 503 once its engine died."""
    if not samples:
        return False
    last = samples[-1]
    scrape_failed = last.metrics is not None and not last.metrics.ok
    return (last.health_status is not None
            and last.health_status != 200) or last.health_error is not None or scrape_failed


def process_gone(samples: Sequence[Sample]) -> bool:
    """A process of the deployment exited since the last look."""
    if len(samples) < 2 or not samples[-2].processes:
        return False
    return bool({p.pid for p in samples[-2].processes} - {p.pid for p in samples[-1].processes})


def not_listening(samples: Sequence[Sample]) -> bool:
    """The API server lives with no listening socket: a shutdown under way (or a start-up not done).
    Unreadable sockets (no CAP_SYS_PTRACE, connections None) say nothing."""
    if not samples:
        return False
    return any(p.role is Role.API_SERVER and not p.listening
               and p.connections is not None for p in samples[-1].processes)


TROUBLE_SIGNS = (frozen_with_work, waiting_not_draining, health_failing, process_gone, not_listening)


def trouble(samples: Sequence[Sample]) -> tuple[str, ...]:
    """The names of the signs of trouble the latest samples show."""
    return tuple(sign.__name__ for sign in TROUBLE_SIGNS if sign(samples))


class Escalation:
    """Whether the next tick takes a full sample: at once on trouble or an unhealthy verdict, and
    back to cheap ticks after CALM_TICKS ticks without either."""

    def __init__(self) -> None:
        self.full = False
        self.calm = 0
        self.ticks = 0  # full ticks taken since the escalation
        self.reasons: tuple[str, ...] = ()

    @property
    def stacks_due(self) -> bool:
        """The next tick dumps stacks: the first full tick, then every STACKS_EVERY-th."""
        return self.full and self.ticks % STACKS_EVERY == 0

    def update(self, samples: Sequence[Sample], verdict: VerdictKind | None) -> bool:
        """Fold in the tick just taken; whether the next one is full."""
        if self.full:
            self.ticks += 1
        signs = trouble(samples)
        unhealthy = verdict is not None and verdict not in (VerdictKind.IDLE, VerdictKind.PROGRESSING)
        if signs or unhealthy:
            if not self.full:
                self.ticks = 0
            self.full, self.calm = True, 0
            self.reasons = signs + ((f"verdict {verdict.value}",) if unhealthy and verdict else ())
        elif self.full:
            self.calm += 1
            if self.calm >= CALM_TICKS:
                self.full, self.reasons = False, ()
        return self.full
