"""The classifier: a pure function from an evidence bundle to a verdict with its reasons.

`classify(bundle)` derives the `Facts` once (parsed log, metric series, process CPU rates,
stacks; facts.py) and tries the rules in order. Each rule (rule.py) is a named predicate
over the facts whose docstring says which hang it recognises and which vLLM behaviour it
relies on, paired with the builder of its verdict: evidence (evidence.py), advice, and a
confidence named in confidence.py. The first that holds gives the verdict. Live evidence
(processes, stacks, metric deltas; live.py) is stronger than a log (log.py), so live rules
come first.
"""

from __future__ import annotations

from wedgectl.classify import confidence as C
from wedgectl.classify.enginerules import stale_evidence, unread_evidence
from wedgectl.classify.evidence import (engine_cpu_evidence, engine_stack_evidence, fmt_duration, metrics_evidence,
                                        present)
from wedgectl.classify.facts import MIN_FROZEN_S, STATS_INTERVAL_S, Facts, unix_to_logtime
from wedgectl.classify.series import Series, slope_per_s
from wedgectl.classify.live import LIVE_RULES
from wedgectl.classify.log import LOG_RULES, REQUESTS_HELD, stop_seen_s, too_short_to_tell
from wedgectl.classify.rule import Rule
from wedgectl.classify.startup import starting
from wedgectl.model.types import Bundle, Evidence, Verdict, VerdictKind

# A verdict this sure needs no note of what could not be read (capture.policy.CERTAIN: the capture stops on it).
CERTAIN = 0.9


def classify(bundle: Bundle) -> Verdict:
    """The verdict for a bundle: the first live rule that holds, else the first log rule."""
    return classify_facts(Facts(bundle))


def classify_facts(facts: Facts) -> Verdict:
    """classify, for a caller that reads the same Facts too (their cached values are shared)."""
    if facts.is_live:
        for rule in LIVE_RULES:
            verdict = rule(facts)
            if verdict is not None:
                return _with_caveats(facts, verdict)
    if facts.log is not None:
        for rule in _log_rules(facts):
            verdict = rule(facts)
            if verdict is not None:
                return _with_caveats(facts, verdict)
    return _inconclusive(facts)


def _log_rules(f: Facts) -> tuple[Rule, ...]:
    """The log rules that may decide: all of them, except that a live server whose /metrics now shows no
    request running or waiting holds none, whatever its log's last stats lines say of requests held (a
    wedge or a deadlock that ended, a restart of watch after one): those lines are its past."""
    if f.is_live and f.last_metrics is not None and f.running == 0 and f.waiting == 0:
        return tuple(r for r in LOG_RULES if r.holds not in REQUESTS_HELD)
    return LOG_RULES


def _with_caveats(f: Facts, verdict: Verdict) -> Verdict:
    """Say what the evidence lacked, so a reader knows how far to trust it."""
    notes = []
    if f.exited:
        notes.append("the deployment exited during the capture; the evidence ends there")
    if f.is_live and not f.saw_processes and not verdict.verdict.is_healthy:
        notes.append("metrics-only evidence (no process access)")
    if f.is_live and f.saw_processes and not f.stacks:
        notes.append("no Python stacks (py-spy failed or was not run)")
    more = tuple(Evidence("wedgectl", n) for n in notes)
    if not verdict.verdict.is_healthy:  # a report gone stale: no Python runs there (evidence, never the decider)
        more += tuple(e for e in stale_evidence(f) if e not in verdict.evidence)
    if verdict.confidence < CERTAIN or not verdict.verdict.is_healthy:
        more += present(unread_evidence(f))  # neither ptrace nor the engine's report: say what would decide
    if not more:
        return verdict
    return Verdict(
        verdict.verdict, verdict.confidence, verdict.summary, verdict.rule,
        verdict.evidence + more, verdict.advice, verdict.facts,
    )


def _inconclusive(f: Facts) -> Verdict:
    ev: list[Evidence] = []
    advice: list[str] = []
    summary = "The evidence does not decide between the hang classes."
    still_starting = starting(f)
    if still_starting is not None:  # a start-up short of its bound: say where it is, not "check the URL"
        summary, ev_start, advice_start = still_starting
        ev += ev_start
        advice += advice_start
    elif f.is_live:
        if not f.scrapes:
            ev.append(Evidence("metrics", f"no /metrics scrape parsed ({f.failed_scrapes} failed)"))
            advice.append("Check the metrics URL (--url) and that the API server is up.")
        elif f.window_s < MIN_FROZEN_S:
            advice.append("Sample longer (--window 10) so counter deltas mean something.")
        if f.scrapes:
            ev.append(metrics_evidence(f, f"{f.running:.0f} running, {f.waiting:.0f} waiting"))
        ev += present(engine_cpu_evidence(f), engine_stack_evidence(f))
        if f.engine_awaits_input and f.waiting >= 1 and f.running < 1:
            ev.append(Evidence("stack", f"the EngineCore waits for requests at every sample while {f.waiting:.0f} "
                               "wait: its scheduler holds nothing it can step (paused streaming-input sessions "
                               "waiting on their clients, or requests lost between the API server and the engine)",
                               values={"waiting": f.waiting}))
            advice.append("Check the waiting requests' clients (paused streaming sessions); if none holds them, "
                          "`wedgectl diagnose --pid PID --window 15` again: a count that never drains is a leak.")
        ev += stale_evidence(f)
        ev += present(unread_evidence(f))
    if f.log is not None:
        span = (f.log.last_t - f.log.first_t) if f.log.first_t is not None and f.log.last_t is not None else None
        ev.append(Evidence("log",
                           f"{f.log.n_lines} lines, {len(f.stats)} stats lines, {len(f.log.access)} access lines, "
                           + (f"covering {fmt_duration(span)}" if span is not None else "with no stamps to time them"),
                           values={"span_s": None if span is None else round(span, 1)}))
        seen = stop_seen_s(f)
        if too_short_to_tell(f) and seen is not None and f.last_stats is not None:
            s = f.last_stats
            ev.append(Evidence("log", f"the last stats line: {s.running} running at 0 tokens/s, and the log shows "
                               f"that for {fmt_duration(seen)}: less than one stats interval "
                               f"({STATS_INTERVAL_S:.0f} s), too short to tell a stop from a pause",
                               values={"line": s.lineno, "seen_s": round(seen, 1)}))
            summary = (f"{s.running} request(s) ran with no tokens for only {fmt_duration(seen)} in this log: "
                       "too short to tell a hang from a pause.")
        if not f.stats:
            ev.append(Evidence("log",
                               "no stats lines: vLLM logs them only while tokens flow, so idle and stuck look alike"))
        if still_starting is None:
            advice.append("Capture the live process: `wedgectl diagnose --pid PID --save-bundle hang.tar.gz`.")
    if not advice:
        advice.append("Capture more: `wedgectl diagnose --pid PID --window 15`.")
    return Verdict(VerdictKind.INCONCLUSIVE, C.INCONCLUSIVE, summary, "inconclusive", tuple(ev), tuple(advice))


__all__ = ["Facts", "Rule", "Series", "classify", "classify_facts", "LIVE_RULES", "LOG_RULES", "slope_per_s",
           "unix_to_logtime"]
