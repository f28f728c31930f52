"""The log rules: predicates over a vLLM server's log alone (stats, access, shutdown, failure lines), with their verdicts."""

from __future__ import annotations

from wedgectl.classify import confidence as C
from wedgectl.classify.evidence import STARVED_ADVICE, failure_evidence, fmt_duration, log_stamp, message, stats_evidence
from wedgectl.classify.facts import LOG_SILENCE_S, Facts, slope_per_s
from wedgectl.classify.rule import Rule
from wedgectl.logparse import StatsLine
from wedgectl.types import Evidence, Verdict, VerdictKind

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
        ev.insert(0, Evidence("log", f"{len(shm)} 'No available shared memory broadcast block' warning(s) before: a worker stopped answering",
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
        ev.append(Evidence("log", "uvicorn: Waiting for connections to close (no bound)", values={"line": waiting.lineno}))
    ev.append(Evidence("log", "no 'Finished server process' after it", values={"last_line": f.log.n_lines if f.log else None}))
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
    every step."""
    s = f.last_stats
    if s is None or s.running < 1:
        return False
    silence = f.log_silence_s or 0
    stopped = _deadlock_silent(f) and (s.gen_tps == 0 or silence >= LOG_SILENCE_S)
    zero_interval = s.gen_tps == 0 and s.prompt_tps == 0 and len(f.stats) >= 2
    return stopped or zero_interval


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
        Evidence("log", what + f" while {n_after} GET /metrics were answered 200",
                 values={"scrapes_after": n_after, "scrape_period_s": f.scrape_period_s, "silent_s": facts.get("engine_silent_s")}),
    ]
    if len(f.stats) >= 2:
        prev = f.stats[-2]
        ev.insert(0, stats_evidence(prev, "before it: %.1f tokens/s" % prev.gen_tps))
    if shm:
        ev.append(Evidence("log", f"'No available shared memory broadcast block' x{len(shm)}: a worker stopped answering", values={"line": shm[0].lineno}))
    if not _deadlock_silent(f):
        confidence = C.DEADLOCK_LOG_ZERO_INTERVAL
    else:
        confidence = C.DEADLOCK_LOG_TIMED if silence is not None else C.DEADLOCK_LOG_SILENT
    return Verdict(
        VerdictKind.ENGINE_DEADLOCK, confidence,
        f"The engine stopped with {s.running} request(s) running"
        + (f" and has been silent ~{fmt_duration(silence)}" if silence is not None else "")
        + " while /metrics kept answering.",
        "log_engine_deadlock", tuple(ev),
        ("While it hangs, run `wedgectl diagnose --pid PID`: EngineCore CPU and stacks confirm where it is parked.",
         "Restart the server; /health stays 200 in this state, so liveness probes will not."),
        facts,
    )


# ------------------------------------------------------------ admission wedge


def log_admission_wedge(f: Facts) -> bool:
    """The last stats line shows requests waiting, none running and no throughput, then the stats
    stop (or repeat unchanged): the scheduler never admits the waiting request although nothing
    holds the engine. Seed 003's shape (waiting=1, KV 0 %). Without the stop, the line itself
    covers a whole interval (10 s) in which a request waited while nothing ran and nothing was
    computed, when it follows another: with an idle engine, vLLM admits a waiting request at once."""
    s = f.last_stats
    if s is None or s.running != 0 or s.waiting < 1 or s.gen_tps > 0 or s.prompt_tps > 0:
        return False
    return f.log_silent or len(f.stats) >= 2


def _admission_wedge_verdict(f: Facts) -> Verdict:
    s, silence, n_after = f.last_stats, f.log_silence_s, f.scrapes_after_last_stats
    assert s is not None
    return Verdict(
        VerdictKind.ADMISSION_WEDGE, C.WEDGE_LOG_SILENT if f.log_silent else C.WEDGE_LOG_INTERVAL,
        f"{s.waiting} request(s) waiting, none running, no tokens: the scheduler never admits them"
        + (f" (~{fmt_duration(silence)})." if silence is not None else "."),
        "log_admission_wedge",
        (stats_evidence(s, f"the last stats line: 0 running, {s.waiting} waiting, KV {s.kv_usage_pct:.1f}%"),
         Evidence("log", f"no stats line since, while {n_after} GET /metrics were answered 200"
                  + (f" (~{fmt_duration(silence)})" if silence is not None else ""),
                  values={"scrapes_after": n_after, "silent_s": silence})),
        ("Confirm live: `wedgectl diagnose --pid PID` (EngineCore spinning, waiting by reason capacity).",
         "Size the KV pool above max_model_len, or run the patched engine, which fails such requests at once."),
        {"engine_silent_s": silence},
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
    if kv_rate is not None:
        per_min = kv_rate * 60
        facts["kv_growth_pct_per_min"] = round(per_min, 2)
        if kv_rate > 0:
            facts["seconds_to_kv_full"] = round((100 - s.kv_usage_pct) / kv_rate, 0)
        span = timed[-1][0] - timed[0][0]
        ev.append(Evidence("log", f"KV cache {timed[0][1]:.1f}% -> {s.kv_usage_pct:.1f}% over {fmt_duration(span)}: "
                           f"+{per_min:.2f} %/min" + (f", full in ~{fmt_duration(facts['seconds_to_kv_full'])}" if kv_rate > 0 else ""),
                           values={"kv_growth_pct_per_min": round(per_min, 2), "seconds_to_kv_full": facts.get("seconds_to_kv_full")}))
    return Verdict(
        VerdictKind.STARVED, C.STARVED_LOG,
        f"Not a hang: {s.running} request(s) generate {s.gen_tps:.1f} tokens/s while {s.waiting} wait for KV capacity"
        + (f"; KV full in ~{fmt_duration(facts['seconds_to_kv_full'])}." if "seconds_to_kv_full" in facts else "."),
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


LOG_RULES: tuple[Rule, ...] = (
    Rule(log_engine_dead, _engine_dead_verdict),
    Rule(log_shutdown_hang, _shutdown_hang_verdict),
    Rule(log_engine_deadlock, _engine_deadlock_verdict),
    Rule(log_admission_wedge, _admission_wedge_verdict),
    Rule(log_starved, _starved_verdict),
    Rule(log_progressing, _progressing_verdict),
    Rule(log_idle, _idle_verdict),
)
