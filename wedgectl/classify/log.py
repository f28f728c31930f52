"""The log rules: predicates over a vLLM server's log alone (stats, access, shutdown, failure lines), with their
verdicts."""

from __future__ import annotations

from collections.abc import Callable

from wedgectl.classify import confidence as C
from wedgectl.classify.collective import STEP_TIMEOUT_RULE
from wedgectl.classify.evidence import (STARVED_ADVICE, failure_evidence, fmt_duration, log_stamp, message,
                                        stats_evidence)
from wedgectl.classify.facts import LOG_SILENCE_S, STATS_INTERVAL_S, Facts
from wedgectl.classify.series import slope_per_s
from wedgectl.classify.rule import Rule
from wedgectl.classify.startup import LOG_STARTUP_RULE, phase_lines, startup_state
from wedgectl.read.logparse import StatsLine
from wedgectl.model.types import Evidence, Verdict, VerdictKind

_DEAD_KINDS = ("engine_dead", "engine_core_failed")
_STARVED_LINES = 12  # the stats lines (2 min at vLLM's 10 s interval) a starved queue is judged over

# ----------------------------------------------------------------- engine dead


def log_engine_dead(f: Facts) -> bool:
    """EngineDeadError in the log: the EngineCore died (often after 'No available shared memory
    broadcast block found', vLLM's sign of a worker that stopped answering) and the API server
    now fails every request."""
    return bool(f.failures_of(*_DEAD_KINDS))


def _engine_dead_verdict(f: Facts) -> Verdict:
    ev = [failure_evidence(line) for line in f.failures_of(*_DEAD_KINDS)[:3]]
    shm = f.shm_warnings
    if shm:
        ev.insert(0,
                  Evidence("log",
                           f"{len(shm)} 'No available shared memory broadcast block' warning(s) before: a worker "
                           "stopped answering",
                           t=log_stamp(shm[0].t), values={"line": shm[0].lineno}))
    return Verdict(
        VerdictKind.ENGINE_DEAD, C.ENGINE_DEAD_LOG,
        "The engine died (EngineDeadError); requests fail until the server restarts.",
        "log_engine_dead", tuple(ev),
        ("Read the first traceback before the EngineDeadError: it names the cause.",
         "Restart the server; make the supervisor treat /health 503 as fatal."),
    )


# -------------------------------------------------------------- shutdown hang


def log_shutdown_hang(f: Facts) -> bool:
    """A shutdown began (signal received, '[shutdown]', uvicorn 'Shutting down' / 'Waiting for
    connections to close') and 'Finished server process' never follows. vLLM 0.32's uvicorn waits
    for open client connections with no bound. A live capture that saw the process go saw the
    shutdown finish."""
    return f.shutdown_began is not None and not f.exited


def _shutdown_hang_verdict(f: Facts) -> Verdict:
    began, waiting = f.shutdown_began, f.waiting_connections_line
    assert began is not None
    ev = [Evidence("log", f"shutdown began: {message(began.text)[:120]}", t=log_stamp(began.t),
                   values={"line": began.lineno, "kind": began.kind})]
    if waiting is not None:
        ev.append(Evidence("log", "uvicorn: Waiting for connections to close (no bound)",
                           values={"line": waiting.lineno}))
    ev.append(Evidence("log", "no 'Finished server process' after it",
                       values={"last_line": f.log.n_lines if f.log else None}))
    return Verdict(
        VerdictKind.SHUTDOWN_HANG, C.SHUTDOWN_LOG_WAITING if waiting is not None else C.SHUTDOWN_LOG,
        "Shutdown began and the log never says the server finished exiting.",
        "log_shutdown_hang", tuple(ev),
        ("Check the pid is still alive: `wedgectl diagnose --pid PID` shows the listener and where threads wait.",
         "Clear it with SIGKILL; prevent it with the patched engine (bounded shutdown) or client timeouts."),
    )


# ------------------------------------------------------------ engine deadlock


def _deadlock_silent(f: Facts) -> bool:
    """The stats lines stopped, or a worker stopped answering vLLM's shared-memory broadcast."""
    return f.log_silent or bool(f.shm_warnings)


def log_engine_deadlock(f: Facts) -> bool:
    """Stats lines stop while the API server keeps answering GET /metrics, and the last stats line
    had requests running at 0 tokens/s. vLLM logs the stats line at INFO only while throughput is
    non-zero (then once more at 0.0), so a stop with Running >= 1 means the engine stopped
    producing with work in flight (seed 002). A whole stats interval at 0 tokens/s (prompt and
    generation) with requests running is a stop in itself: a running request emits a token
    every step. Not where a live capture sees the engine runnable but given no CPU (queued behind
    the host's other work, or its cgroup's quota spent) while it uses next to none: the stop is
    the host's, and the live rules say so once the window is long enough (seen: an engine held
    to 1 ms of CPU a second logged a whole interval at 0 tokens/s with 2 running, and the first
    two samples read as a certain deadlock)."""
    s = f.last_stats
    if s is None or s.running < 1:
        return False
    if f.is_live and (f.engine_queued or f.engine_throttled) and f.engine_parked:
        return False
    if too_short_to_tell(f):
        return False
    silence = f.log_silence_s or 0
    stopped = _deadlock_silent(f) and (s.gen_tps == 0 or silence >= LOG_SILENCE_S)
    zero_interval = s.gen_tps == 0 and s.prompt_tps == 0 and len(f.stats) >= 2
    return stopped or zero_interval


def stop_seen_s(f: Facts) -> float | None:
    """How long a log shows requests running with no tokens: the interval the last stats line covers when it
    printed 0 tokens/s (since the line before it), and the silence after it. None: no clock spans it."""
    s = f.last_stats
    if s is None or s.t is None:
        return None
    seen = f.log_silence_s
    if s.gen_tps == 0 and s.prompt_tps == 0 and len(f.stats) >= 2 and f.stats[-2].t is not None:
        covered = s.t - f.stats[-2].t
        seen = covered + (seen or 0.0) if covered > 0 else seen
    return seen


def too_short_to_tell(f: Facts) -> bool:
    """A log alone that shows running requests stopped for less than one stats interval (10 s), by its own clock,
    and no worker that stopped answering: too short to tell a stop from a pause (a five-second log of a server
    between two tokens looks the same). A live capture times the stop itself."""
    if f.is_live or f.shm_warnings:
        return False
    seen = stop_seen_s(f)
    return seen is not None and seen < STATS_INTERVAL_S and f.scrapes_after_last_stats < 6


def _engine_deadlock_verdict(f: Facts) -> Verdict:
    s, silence, n_after, shm = f.last_stats, f.log_silence_s, f.scrapes_after_last_stats, f.shm_warnings
    assert s is not None
    facts: dict[str, object] = {"scrapes_after_last_stats": n_after}
    what = f"stats lines stopped after {s.stamp or 'line %d' % s.lineno} with {s.running} running"
    if silence is not None:
        facts["engine_silent_s"] = round(silence, 1)
        what += f"; silent ~{fmt_duration(silence)}"
    ev = [
        stats_evidence(s, "the last stats line: requests running, generation at %.1f tokens/s" % s.gen_tps),
        Evidence("log", what + (f" while {n_after} GET /metrics were answered 200" if n_after
                                 else "; no GET /metrics answered after it in the log"),
                 values={"scrapes_after": n_after, "scrape_period_s": f.scrape_period_s,
                         "silent_s": facts.get("engine_silent_s")}),
    ]
    if len(f.stats) >= 2:
        prev = f.stats[-2]
        ev.insert(0, stats_evidence(prev, "before it: %.1f tokens/s" % prev.gen_tps))
    if shm:
        ev.append(Evidence("log",
                           f"'No available shared memory broadcast block' x{len(shm)}: a worker stopped answering",
                           values={"line": shm[0].lineno}))
    if not _deadlock_silent(f):
        confidence = C.DEADLOCK_LOG_ZERO_INTERVAL
    else:
        confidence = C.DEADLOCK_LOG_TIMED if silence is not None else C.DEADLOCK_LOG_SILENT
    return Verdict(
        VerdictKind.ENGINE_DEADLOCK, confidence,
        f"The engine stopped with {s.running} request(s) running"
        + (f" and has been silent ~{fmt_duration(silence)}" if silence is not None else "")
        + (" while /metrics kept answering." if n_after else "."),
        "log_engine_deadlock", tuple(ev),
        ("While it hangs, run `wedgectl diagnose --pid PID`: EngineCore CPU and stacks confirm where it is parked.",
         "Restart the server; /health stays 200 in this state, so liveness probes will not."),
        facts,
    )


# ------------------------------------------------------------ admission wedge


def held_queue(stats: tuple[StatsLine, ...]) -> tuple[StatsLine, ...]:
    """The trailing run of stats lines that all say Running: 0 with requests waiting."""
    n = 0
    for x in reversed(stats):
        if x.running != 0 or x.waiting < 1:
            break
        n += 1
    return stats[len(stats) - n:] if n else ()


def log_admission_wedge(f: Facts) -> bool:
    """The last stats line shows requests waiting, none running and no throughput, then the stats
    stop (or repeat unchanged): the scheduler never admits the waiting request although nothing
    holds the engine. Seed 003's shape (waiting=1, KV 0 %). Without the stop, the line itself
    covers a whole interval (10 s) in which a request waited while nothing ran and nothing was
    computed, when it follows another: with an idle engine, vLLM admits a waiting request at once.
    Queue state held over two lines or more outweighs the throughput they print: that figure is an
    interval average (the last tokens before the wedge), vLLM may print it a line late, and no
    request generates while none runs (a real 0.32 wedge printed 8.2 tokens/s with Running: 0)."""
    s = f.last_stats
    if s is None or s.running != 0 or s.waiting < 1:
        return False
    if len(held_queue(f.stats)) >= 2:
        return True
    if s.gen_tps > 0 or s.prompt_tps > 0:
        return False
    return f.log_silent or len(f.stats) >= 2


def _admission_wedge_verdict(f: Facts) -> Verdict:
    s, silence, n_after = f.last_stats, f.log_silence_s, f.scrapes_after_last_stats
    assert s is not None
    held = held_queue(f.stats)
    reason = "deferred" if (s.deferred or 0) >= 1 else "capacity"
    deferred = f", {s.deferred} deferred holding slots" if reason == "deferred" else ""
    ev = [stats_evidence(s, f"the last stats line: 0 running, {s.waiting} waiting{deferred}, KV {s.kv_usage_pct:.1f}%"),
          Evidence("log", "no stats line since"
                   + (f", while {n_after} GET /metrics were answered 200" if n_after else "")
                   + (f" (~{fmt_duration(silence)})" if silence is not None else ""),
                   values={"scrapes_after": n_after, "silent_s": silence})]
    if len(held) >= 2:
        first, printed = held[0], max(x.gen_tps for x in held)
        span = f" over {fmt_duration(s.t - first.t)}" if s.t is not None and first.t is not None else ""
        ev.insert(0, stats_evidence(first, f"{len(held)} stats lines in a row{span}: 0 running, requests waiting"
                                    + (f"; the {printed:.1f} tokens/s printed is an interval average: nothing runs"
                                       if printed > 0 else "")))
    advice = (("Confirm live: `wedgectl diagnose --pid PID` (waiting by reason deferred: paused sessions hold the "
               "slots).",
               "End the idle sessions or raise --max-num-seqs above the sessions held open.") if reason == "deferred"
              else
              ("Confirm live: `wedgectl diagnose --pid PID` (EngineCore spinning, waiting by reason capacity).",
               "Size the KV pool above max_model_len, or run the patched engine, which fails such requests at once."))
    return Verdict(
        VerdictKind.ADMISSION_WEDGE, C.WEDGE_LOG_SILENT if f.log_silent else C.WEDGE_LOG_INTERVAL,
        f"{s.waiting} request(s) waiting (reason: {reason}), none running, no tokens: the scheduler never admits them"
        + (f" (~{fmt_duration(silence)})." if silence is not None else "."),
        "log_admission_wedge", tuple(ev), advice,
        {"engine_silent_s": silence, "reason": reason, "held_lines": len(held)},
    )


# -------------------------------------------------------------------- starved


def log_starved(f: Facts) -> bool:
    """Tokens flow but the queue does not drain: generation > 0, waiting >= 1 and not falling,
    prompt throughput 0 (nothing admitted), KV usage climbing. The seed-000 shape: one long
    request grows its KV share until the pool is full; the waiting ones cannot fit."""
    window = f.stats[-_STARVED_LINES:]
    if len(window) < 3:
        return False
    s = window[-1]
    if s.waiting < 1 or any(x.gen_tps <= 0 for x in window) or s.waiting < window[0].waiting:
        return False
    return not any(x.prompt_tps > 0 for x in window[1:])


def _starved_verdict(f: Facts) -> Verdict:
    window = f.stats[-_STARVED_LINES:]
    s = window[-1]
    timed = [(x.t, x.kv_usage_pct) for x in f.stats if x.t is not None and x.waiting >= 1]
    kv_rate = slope_per_s(timed)  # percent per second
    facts: dict[str, object] = {
        "waiting": s.waiting,
        "running": s.running,
        "tokens_per_s": s.gen_tps,
        "kv_usage_pct": s.kv_usage_pct,
    }
    first: StatsLine = next((x for x in f.stats if x.waiting >= 1), window[0])
    ev = [
        stats_evidence(first, f"{first.waiting} waiting behind {first.running} running"),
        stats_evidence(s, f"still {s.waiting} waiting; generation {s.gen_tps:.1f} tokens/s; no prompt tokens admitted"),
    ]
    to_full: float | None = None
    if kv_rate is not None:
        per_min = kv_rate * 60
        facts["kv_growth_pct_per_min"] = round(per_min, 2)
        if kv_rate > 0:
            to_full = facts["seconds_to_kv_full"] = round((100 - s.kv_usage_pct) / kv_rate, 0)
        span = timed[-1][0] - timed[0][0]
        ev.append(Evidence("log", f"KV cache {timed[0][1]:.1f}% -> {s.kv_usage_pct:.1f}% over {fmt_duration(span)}: "
                           f"+{per_min:.2f} %/min"
                           + (f", full in ~{fmt_duration(to_full)}" if to_full is not None else ""),
                           values={"kv_growth_pct_per_min": round(per_min, 2),
                                   "seconds_to_kv_full": facts.get("seconds_to_kv_full")}))
    return Verdict(
        VerdictKind.STARVED, C.STARVED_LOG,
        f"Not a hang: {s.running} request(s) generate {s.gen_tps:.1f} tokens/s while {s.waiting} wait for KV capacity"
        + (f"; KV full in ~{fmt_duration(to_full)}." if to_full is not None else "."),
        "log_starved", tuple(ev), STARVED_ADVICE, facts,
    )


# --------------------------------------------------------- progressing, idle


def log_progressing(f: Facts) -> bool:
    """Stats lines report generation throughput and the queue drains or is empty; a log silent
    past LOG_SILENCE_S after a line with requests running is not serving any more."""
    s = f.last_stats
    if s is None or s.gen_tps <= 0:
        return False
    silence = f.log_silence_s
    return not (silence is not None and silence >= LOG_SILENCE_S and s.running >= 1)


def _progressing_verdict(f: Facts) -> Verdict:
    s = f.last_stats
    assert s is not None
    return Verdict(
        VerdictKind.PROGRESSING, C.PROGRESSING_LOG,
        f"Serving at the last stats line: {s.gen_tps:.1f} tokens/s, {s.running} running, {s.waiting} waiting.",
        "log_progressing", (stats_evidence(s, "the last stats line"),),
    )


def log_idle(f: Facts) -> bool:
    """The last stats line shows nothing running or waiting. vLLM logs a line at INFO only while
    tokens flow (then one all-zero line), so an idle server's log ends on that line. A log with
    no stats line at all does not decide: a wedge that began before the first 10 s interval
    looks the same."""
    s = f.last_stats
    return s is not None and not s.running and not s.waiting


def _idle_verdict(f: Facts) -> Verdict:
    s = f.last_stats
    assert s is not None
    return Verdict(VerdictKind.IDLE, C.IDLE_LOG, "Idle: nothing running or waiting at the end of the log.", "log_idle",
                   (stats_evidence(s, "the last stats line: nothing running or waiting"),))


# Access paths that ask the server nothing: liveness, readiness and metrics probes, model listing.
_PROBE_PATHS = ("/health", "/metrics", "/ping", "/v1/models", "/version", "/load", "/is_sleeping")


def log_never_asked(f: Facts) -> bool:
    """The server finished starting and was never asked anything: no stats line, no failure, no
    pending shutdown, and every access line a probe (/health, /metrics). vLLM logs a stats line at INFO
    within one interval (10 s) of a request's first tokens, and uvicorn an access line when it
    answers one. A request refused at the queue's head from the start (never a token) stays
    silent too, but on 0.32 one that can never fit is refused with 400 at the API (an access line),
    so silence past two intervals is an unused server; the confidence says how long it was quiet."""
    log = f.log
    if log is None or f.stats or log.failures or f.shutdown_began is not None or not startup_state(f).serving:
        return False  # a shutdown that finished ends the quiet; one pending is the shutdown rule's
    if f.running + f.waiting >= 1:
        return False  # a live scrape shows requests in flight: uvicorn logs a request when it answers it
    return all(a.path.split("?", 1)[0] in _PROBE_PATHS and a.method in ("GET", "HEAD") for a in log.access)


def never_asked_quiet_s(f: Facts) -> float | None:
    """How long the log has been quiet since the server said it started: to the capture's end when
    live, else to the log's last stamped line; None when no clock spans it."""
    stamped = [p.t for p in phase_lines(f.bundle.log_lines) if p.t is not None]
    since = stamped[-1] if stamped else None  # uvicorn's 'Application startup complete' has no stamp
    if since is None or f.log is None:
        return None
    try:
        end = f.now_logtime if f.now_logtime is not None else f.log.last_t
    except (ValueError, OverflowError, OSError):  # a hostile bundle's capture time no calendar holds
        end = f.log.last_t
    if f.log.shutdown and f.log.shutdown[0].t is not None:
        end = f.log.shutdown[0].t  # quiet until it was stopped
    return end - since if end is not None and end > since else None


def _never_asked_verdict(f: Facts) -> Verdict:
    assert f.log is not None
    quiet = never_asked_quiet_s(f)
    probes = len(f.log.access)
    timed = quiet is not None and quiet >= 2 * STATS_INTERVAL_S
    ev = [Evidence("log", "started, then no stats line and no inference request"
                   + (f": quiet {fmt_duration(quiet)}" if quiet is not None
                      else ": how long, the log's stamps cannot say"),
                   values={"quiet_s": None if quiet is None else round(quiet, 1), "probes_answered": probes}),
          Evidence("log", f"{probes} probe(s) answered since (GET /health, /metrics): the server is up",
                   values={"probes": probes})]
    return Verdict(
        VerdictKind.IDLE, C.IDLE_LOG_QUIET if timed else C.IDLE_LOG_QUIET_SHORT,
        "Idle: started and never asked anything" + (f" (quiet {fmt_duration(quiet)})." if quiet is not None else "."),
        "log_never_asked", tuple(ev),
        () if timed else ("Read the log again later, or `wedgectl diagnose --pid PID`: a longer quiet decides it.",),
        {"quiet_s": None if quiet is None else round(quiet, 1), "probes": probes},
    )


# The log rules that say the server holds requests now (stuck, or queued): a live capture whose /metrics shows
# none running or waiting overrules them (classify._log_rules).
REQUESTS_HELD: tuple[Callable[[Facts], bool], ...] = (log_engine_deadlock, log_admission_wedge, log_starved)

LOG_RULES: tuple[Rule, ...] = (
    STEP_TIMEOUT_RULE,
    Rule(log_engine_dead, _engine_dead_verdict),
    LOG_STARTUP_RULE,
    Rule(log_shutdown_hang, _shutdown_hang_verdict),
    Rule(log_engine_deadlock, _engine_deadlock_verdict),
    Rule(log_admission_wedge, _admission_wedge_verdict),
    Rule(log_starved, _starved_verdict),
    Rule(log_progressing, _progressing_verdict),
    Rule(log_idle, _idle_verdict),
    Rule(log_never_asked, _never_asked_verdict),
)
