"""The escalation policy of a diagnose capture, pure: from the verdict so far to what the next sample takes.

Cheapest decisive evidence first (docs/design.md, "How a capture escalates"): scrapes and /proc,
then a burst of the engine's stacks, then the probes. Each rule is a named predicate.
"""

from __future__ import annotations

from dataclasses import dataclass

from wedgectl.capture.options import SamplerOptions
from wedgectl.classify import Facts
from wedgectl.classify.enginerules import SOURCE as REPORT_SOURCE
from wedgectl.classify.facts import MIN_FROZEN_S, STEPPING_QUIET_S
from wedgectl.classify.series import stepless_of
from wedgectl.model.types import ProcessSample, Verdict, VerdictKind

CERTAIN = 0.9
# Verdicts whose certainty can rest on how long a main thread sat parked: what the probes measure.
PARKED_CLASSES = frozenset({VerdictKind.ENGINE_DEADLOCK, VerdictKind.COLLECTIVE_HANG})
# Verdicts whose evidence reads the engine's stack burst (where its loop spends its time, whether a
# rank's frame stays put): one the window ends on uncertain, before its burst, gets the burst then.
BURST_CLASSES = frozenset({VerdictKind.ADMISSION_WEDGE, *PARKED_CLASSES})
PROBE_MIN_S = 2.0  # attach the probes only with at least this much window left: they need a window to see waits
QUICK_LOOK_S = 0.3  # a serving engine steps every few ms: its counters move many times in this


@dataclass(frozen=True)
class Step:
    """What the next sample takes, decided from the verdict so far (see docs/design.md,
    "How a capture escalates"): stop, or sample on with or without a stack burst and probes."""

    stop: bool
    burst: int = 0  # 0: no stacks; 1: one dump per process; more: a burst of the engine's processes
    probes: bool = False
    why: str = ""


EXTEND_FACTOR = 2.0  # a window whose scrapes are thin runs on to this many times its length, from its first answer
MAX_FACTOR = 4.0  # and never past this many times its length from its start, whatever held the answers back
SUSPECT_STEPLESS_S = 1.0  # one sample whose engine has taken no step this long with work in flight


def starved_live(verdict: Verdict) -> bool:
    """A starved queue read from live counters: tokens advance, so the engine steps; the verdict's
    certainty is how long the queue has waited for capacity (MIN_FROZEN_S), and no stack makes it
    more or less certain or shows in its evidence. It buys no burst, and a capture that stops on it
    takes no dump it left out. (An uncertain "progressing" still buys one: read from the log, it
    is what a hang's first samples can look like.)"""
    return verdict.verdict is VerdictKind.STARVED and not verdict.rule.startswith("log_")


def stacks_cannot_help(verdict: Verdict) -> bool:
    """A verdict no stack dump moves: a live starved queue (starved_live), or an engine the host
    gives no CPU (live_engine_waits_for_cpu: where it waits to run is no evidence of a hang, and
    py-spy would take CPU from a host that has none to spare). It buys no burst and no left-out dump."""
    return starved_live(verdict) or verdict.rule == "live_engine_waits_for_cpu"


def decided_by_the_report(verdict: Verdict) -> bool:
    """A certain verdict that rests on the engine's own report (its source `engine`: enginerules): the report
    carries the time it needs (how long the stage has stood, the steps of its writer's last writes), so one
    sample decides it as well as a window would, and the capture stops there. Any other verdict waits for a
    second sample, as before: one scrape says nothing about movement."""
    return verdict.confidence >= CERTAIN and verdict.facts.get("source") == REPORT_SOURCE


def hang_shaped(f: Facts) -> bool:
    """Whether the first sample already looks like a hang: requests waiting with none running (a
    wedge's gauges; a healthy server admits a waiting request within a step), or work in flight
    while the engine has taken no step for SUSPECT_STEPLESS_S (Facts.stepless_s). Then the stack
    burst goes with the second sample, where a short window needs it to be certain, instead of
    the third; a busy healthy server shows neither and pays for no burst."""
    if f.last_metrics is None:
        return False
    if f.running == 0 and f.waiting >= 1:
        return True
    return f.running + f.waiting >= 1 and (f.stepless_s or 0.0) >= SUSPECT_STEPLESS_S


def quick_look(f: Facts, suspect: bool, options: SamplerOptions) -> bool:
    """Whether the second sample comes QUICK_LOOK_S after the first answer, ahead of the 1 s grid:
    the first scrape answered and does not look like a hang. A serving engine takes a step every
    few milliseconds, so its counters move within QUICK_LOOK_S, and counters that moved are as
    certain on 0.3 s as on 1 s (as is nothing in flight). What a quick look cannot decide, the
    grid goes on to decide as before: a hang class needs MIN_FROZEN_S however many samples it
    gets. A hang-shaped first sample gets none: its burst goes with the sample on the grid."""
    return bool(f.scrapes) and not suspect and options.interval_s > QUICK_LOOK_S


def thin_scrapes(f: Facts) -> bool:
    """The server answers /metrics, but too seldom to measure anything: fewer than two scrapes
    parsed, or spanning less than MIN_FROZEN_S (a saturated API server, or our own threads waiting
    seconds for a CPU on a loaded host). No scrape parsed at all is not thin: that is unreachable."""
    s = f.scrapes
    return bool(s) and (len(s) < 2 or s[-1][0] - s[0][0] < MIN_FROZEN_S)


def next_step(verdict: Verdict, n_samples: int, elapsed_s: float, options: SamplerOptions,
              burst_taken: bool, probes_started: bool, suspect: bool = False, thin: bool = False,
              answered_s: float | None = None) -> Step:
    """The escalation, as a pure function of the verdict so far.

    Cheapest decisive evidence first: two scrapes a second apart, /proc and one dump per
    process decide most states (counters moving, nothing in flight, a closed listener). A
    verdict the classifier is not certain of gets a burst of the EngineCore's and Workers'
    stacks on the next sample (where the engine spends its time); a parked-engine class still
    open after that gets the probes (how long main threads sit parked), with --ebpf auto and
    window left for them to see a wait. The classifier decides certainty; its thresholds
    (MIN_FROZEN_S) keep a slow step, a long prefill or a saturated server from being called
    stuck on a short window. A certain verdict resting on the engine's own report stops the capture at
    its first sample (decided_by_the_report). A first sample that is hang_shaped (`suspect`) buys the
    burst for the second sample at once. A window that ends with `thin` scrapes (thin_scrapes) runs on, up to
    EXTEND_FACTOR times its length counted from the first scrape that answered (`answered_s` ago;
    default: the window's start), and never past MAX_FACTOR times its length: a rate from one scrape
    is no evidence, and a verdict drawn without one (a leak, a starved queue) may name the wrong
    class. Seen on a host at load ~12: wedgectl held off a CPU for 10 s after its first /proc
    reading, its three scrapes then 1 s apart, a leak read as a starved queue."""
    if n_samples < 2:  # one scrape says nothing about movement; the engine's report may (decided_by_the_report)
        if decided_by_the_report(verdict) and elapsed_s >= options.min_window_s:
            return Step(True, why="verdict certain from the engine's own report")
        if suspect and options.stacks:
            return Step(False, burst=options.stack_burst, why="hang-shaped first sample: stack burst")
        return Step(False)
    certain = verdict.confidence >= CERTAIN
    if certain and elapsed_s >= options.min_window_s:
        return Step(True, why="verdict certain")
    if elapsed_s + options.interval_s > options.window_s:
        since = elapsed_s if answered_s is None else min(elapsed_s, answered_s)
        if (thin and since + options.interval_s <= options.window_s * EXTEND_FACTOR
                and elapsed_s + options.interval_s <= options.window_s * MAX_FACTOR):
            return Step(False, why="window extended: too few scrapes answered to measure a rate")
        return Step(True, why="window over")
    if not options.stacks or certain or stacks_cannot_help(verdict):
        return Step(False)
    if not burst_taken:
        return Step(False, burst=options.stack_burst,
                    why=f"{verdict.verdict.value} ({verdict.confidence:.2f}) not certain: stack burst")
    left = options.window_s - elapsed_s
    if (verdict.verdict in PARKED_CLASSES and options.ebpf == "auto" and not probes_started and left >= PROBE_MIN_S):
        return Step(False, probes=True, why=f"{verdict.verdict.value} not certain: probes for the {left:.0f} s left")
    return Step(False)


def engine_stepping(procs: tuple[ProcessSample, ...]) -> bool:
    """Whether /proc alone shows the engine taking steps: every main thread a step needs (the
    EngineCore's and its Workers') on a CPU, or waiting for one, within STEPPING_QUIET_S
    (series.stepless_of). False where that was not read."""
    quiet = stepless_of(procs)
    return quiet is not None and quiet < STEPPING_QUIET_S
