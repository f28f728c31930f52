"""What `watch` knows about each target: its verdict over time, its episodes, and when to look closer. No I/O."""

from __future__ import annotations

import datetime as _dt
import re
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from wedgectl.read.logparse import parse_log
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
class TargetLabels:
    """A target's identity as Prometheus labels: `node` (the pod or host, or the host of a URL elsewhere),
    `port` (its API server's), `model_name` (the served name, as vLLM labels its own series) and `pid`
    (its API server's, only where there is no port). Set once, when the target is named: they stay the
    same while its listener closes."""

    node: str
    port: str = ""
    model_name: str = "unknown"
    pid: str = ""

    NAMES = ("node", "port", "model_name", "pid")

    def values(self) -> list[str]:
        return [self.node, self.port, self.model_name, self.pid]


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
    labels: TargetLabels | None = None
    up: bool = False  # its last look read it: /metrics answered (its processes, where it has no URL)
    remediations: tuple[Any, ...] = ()  # watch --remediate: its acts (remediation.Act), oldest first
    remediation_storm: str | None = None  # why automatic acts on it stopped, once they did

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
            "target": self.name, "url": self.url, "pid": self.pid, "up": self.up,
            "labels": dict(zip(TargetLabels.NAMES, self.labels.values(), strict=True)) if self.labels else None,
            "verdict": v.verdict.value if v else None, "confidence": v.confidence if v else None,
            "summary": v.summary if v else None, "rule": v.rule if v else None,
            "evidence": to_jsonable(v.evidence) if v else [],
            "since": iso(self.since), "state_seconds": round(self.state_seconds(now), 1),
            "last_evaluation": iso(self.last_evaluation), "escalated": self.escalated,
            "live": not self.failing_liveness(now, grace_s), "stale": self.stale,
            "kept_bytes": self.kept_bytes, "budget_exceeded": self.budget_exceeded,
            "episodes": [e.to_json(now) for e in self.episodes],
            "remediations": [a.to_json() for a in self.remediations], "remediation_storm": self.remediation_storm,
        })


class Tracker:
    """The verdicts of one target over time, folded into episodes. observe() returns the episode
    that began or ended at this evaluation (None when nothing changed)."""

    def __init__(self, name: str, labels: TargetLabels | None = None) -> None:
        self.name = name
        self.labels = labels
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

    def observe(self, verdict: Verdict, now: float, queue: float | None = None,
                onset: float | None = None) -> Episode | None:
        """`onset`: when the evidence dates the verdict's condition from (hang_onset), if before now:
        the new state, and the episode it opens, count from it."""
        changed = self.verdict is None or verdict.verdict is not self.verdict.verdict
        if changed:
            self.since = min(now, onset) if onset is not None else now
        self.verdict, self.last_evaluation, self.stale = verdict, now, False
        kind, ep = verdict.verdict, self.current
        if ep is None:
            if not is_hang(kind):
                return None
            start = self.since if changed and self.since is not None else now
            ep = Episode(self.name, kind, start, peak_queue=queue or 0.0, verdicts=(kind,))
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
             budget_exceeded: int = 0, up: bool = False) -> TargetView:
        return TargetView(self.name, url, pid, self.verdict, self.since, self.last_evaluation, escalated,
                          tuple(self.episodes), dict(self.totals), self.stale, kept_bytes, budget_exceeded,
                          self.labels, up)


# ---------------------------------------------------------------- onset
# A watcher that first looks at a server hung for minutes must not say it has been hung for seconds:
# the state counts from when the evidence dates the hang, the earliest of what each source shows.
FROZEN_CLASSES = frozenset({VerdictKind.ADMISSION_WEDGE, VerdictKind.ENGINE_DEADLOCK, VerdictKind.COLLECTIVE_HANG})


def _trailing_start(samples: Sequence[Sample], holds: Any) -> float | None:
    """The time of the first of the newest samples for which `holds(previous, sample)` held each time."""
    start = None
    for i in range(len(samples) - 1, 0, -1):
        if not holds(samples[i - 1], samples[i]):
            break
        start = samples[i - 1].t
    return start


def _frozen_pair(a: Sample, b: Sample) -> bool:
    return frozen_with_work([a, b])


_WALL_STAMP = re.compile(r"(?:(\d{4})-)?(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})")


def wall_time(stamp: str, now: float) -> float | None:
    """A log stamp ("MM-DD HH:MM:SS", vLLM's; or with its year) as Unix time, read in this host's zone: in
    `now`'s year, or the one before when that would put it in the future (a log read just after New Year)."""
    m = _WALL_STAMP.match(stamp.strip())
    if m is None:
        return None
    year = int(m.group(1)) if m.group(1) else _dt.datetime.fromtimestamp(now).year
    for y in (year, year - 1) if not m.group(1) else (year,):
        try:
            mo, d, hh, mm, ss = (int(g) for g in m.groups()[1:])
            t = _dt.datetime(y, mo, d, hh, mm, ss).timestamp()
        except (ValueError, OverflowError, OSError):
            return None
        if t <= now + 60:
            return t
    return None


def _stats_frozen_since(log_lines: Sequence[str], now: float) -> float | None:
    """Since when vLLM's own stats lines have shown no tokens with requests in flight: the run of such lines at
    the log's end (vLLM logs the first zero at INFO, the rest at DEBUG) averages over the interval since the line
    before it, so no token came after that line's stamp; with no line before the run, the run's first stamp."""
    if not log_lines:
        return None
    stats = parse_log(log_lines).stats
    first = None
    for i in range(len(stats) - 1, -1, -1):
        line = stats[i]
        if line.gen_tps > 0 or line.running + line.waiting < 1:
            break
        first = i
    if first is None:
        return None
    since = stats[first - 1] if first > 0 else stats[first]
    return wall_time(since.stamp, now) if since.stamp is not None else None


def hang_onset(kind: VerdictKind, verdict: Verdict, samples: Sequence[Sample], log_lines: Sequence[str],
               now: float) -> float | None:
    """When the evidence dates the hang `kind` from (Unix time), or None when it dates nothing before now:
    - frozen counters with work in flight across the kept samples (admission wedge, deadlock, collective);
    - vLLM's own stats lines: a run of "0.0 tokens/s" with requests in flight at the log's end, from the line
      before it (the interval the first zero averages over);
    - a shutdown: the first of the newest samples with the API server no longer listening;
    - a dead engine: the first of the newest samples with /health or /metrics failing;
    - a start-up: the time the classifier measured in its phase (facts["stuck_s"])."""
    dates: list[float] = []
    if kind in FROZEN_CLASSES:
        if (t := _trailing_start(samples, _frozen_pair)) is not None:
            dates.append(t)
        if (t := _stats_frozen_since(log_lines, now)) is not None:
            dates.append(t)
    elif kind is VerdictKind.SHUTDOWN_HANG:
        if (t := _trailing_start(samples, lambda _a, b: not_listening([b]))) is not None:
            dates.append(t)
    elif kind is VerdictKind.ENGINE_DEAD:
        if (t := _trailing_start(samples, lambda _a, b: health_failing([b]))) is not None:
            dates.append(t)
    stuck = verdict.facts.get("stuck_s")
    if isinstance(stuck, int | float) and not isinstance(stuck, bool) and 0 < stuck < 10 * 365 * 86400:
        dates.append(now - float(stuck))
    # nothing before the server itself: a log appended to across restarts holds the runs before it
    started = [p.started for p in samples[-1].processes if p.role is Role.API_SERVER and p.started] if samples else []
    dates = [t for t in dates if not started or t >= min(started)]
    earliest = min(dates, default=None)
    return earliest if earliest is not None and earliest < now else None


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
