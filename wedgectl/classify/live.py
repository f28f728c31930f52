"""The live rules: predicates over a captured window (processes, stacks, metric deltas), with their verdicts."""

from __future__ import annotations

from wedgectl.read import stacks as stk
from wedgectl.classify import confidence as C
from wedgectl.classify.collective import COLLECTIVE_RULE
from wedgectl.classify.evidence import (
    STARVED_ADVICE,
    counter_evidence,
    cpu_wait_evidence,
    engine_cpu_evidence,
    engine_stack_evidence,
    failure_evidence,
    fmt_duration,
    deadlock_process_evidence,
    futex_evidence,
    listening_evidence,
    heartbeat_evidence,
    log_stamp,
    message,
    metrics_evidence,
    present,
    profile_evidence,
    stepless_evidence,
)
from wedgectl.classify.corroboration import starved_for_capacity, wedge_refused_for_capacity
from wedgectl.classify.deferred import DEFERRED, DEFERRED_ADVICE, reason_text, waiting_reason
from wedgectl.classify.enginerules import (DEADLOCK_RULE, WEDGE_RULE, api_shutting_down, never_fits_evidence, runaway,
                                           runaway_evidence, stepping_evidence, stepping_idle, undrainable_evidence,
                                           shutdown_evidence, shutting_down, stage_evidence, stale_evidence)
from wedgectl.classify.verdictfacts import deadlock_facts, wedge_facts
from wedgectl.classify.facts import CERTAIN_FROZEN_S, STEAL_SHARE, Facts, mostly_queued, mostly_throttled
from wedgectl.classify.series import slope_per_s
from wedgectl.classify.leak import ENGINE_LEAK_RULE, LEAK_RULE
from wedgectl.classify.orphan import ORPHAN_RULE
from wedgectl.classify.rule import Rule
from wedgectl.classify.startup import LIVE_STARTUP_RULE
from wedgectl.model.types import Evidence, Verdict, VerdictKind

_METRICS_ONLY_ADVICE = "Metrics only: run `wedgectl diagnose --pid PID` to {}."

# ------------------------------------------------------------------ engine dead


def live_engine_dead(f: Facts) -> bool:
    """The engine is gone: EngineDeadError in the log, /health 503, or no EngineCore beside a
    listening API server. vLLM turns /health to 503 only after EngineDeadError; the API server
    stays up and fails every request."""
    api = f.api_server
    if not f.is_live or api is None:
        return False
    return f.last_health == 503 or (f.engine_core is None and bool(api.listening)
                                    and bool(f.failures_of("engine_dead")))


def _engine_dead_verdict(f: Facts) -> Verdict:
    api, engine = f.api_server, f.engine_core
    assert api is not None
    ev = [Evidence("proc", f"API server pid {api.pid} alive, listening on {', '.join(api.listening) or 'nothing'}; "
                   f"{'no EngineCore process' if engine is None else 'EngineCore pid %d' % engine.pid}")]
    if f.last_health == 503:
        ev.append(Evidence("metrics", "GET /health answered 503"))
    ev += [failure_evidence(line) for line in f.failures_of("engine_dead")[:2]]
    return Verdict(
        VerdictKind.ENGINE_DEAD, C.ENGINE_DEAD_LIVE,
        "The engine process died; the API server answers but every request fails.",
        "live_engine_dead", tuple(ev),
        ("Read the first traceback in the EngineCore log: it names the cause.",
         "Restart the server; a supervisor should treat /health 503 as fatal."),
    )


# ---------------------------------------------------------------- shutdown hang


def live_shutdown_hang(f: Facts) -> bool:
    """Shutdown began and the API server never exits: the listener is closed (no LISTEN socket,
    /metrics refused) while the process lives. Measured on vLLM 0.32: SIGTERM kills the EngineCore
    and Worker at once, then uvicorn waits for open client connections forever ("Waiting for
    connections to close"); a second SIGTERM does nothing. An API server that exited during the
    capture finished its shutdown; one whose sockets were unreadable (no CAP_SYS_PTRACE) leaves
    "no listener" unknown. The engine's own report saying shutting_down for SHUTDOWN_LONG_S is a third
    sign that a shutdown began (enginerules.shutting_down). Where the sockets are unreadable, the API
    server's own report decides: uvicorn's shutdown() began SHUTDOWN_LONG_S ago or more and the process
    lives, with no /metrics answered in the window (its listener is the first thing shutdown closes)."""
    api = f.api_server
    if not f.is_live or api is None or api.listening or f.exited:
        return False
    if api.connections is None:
        return api_shutting_down(f) is not None and not f.scrapes
    began = f.shutdown_began is not None or bool(f.api_shutdown_frames) or shutting_down(f) is not None
    return began and f.api_never_listened


def _shutdown_hang_verdict(f: Facts) -> Verdict:
    api, began, frames = f.api_server, f.shutdown_began, f.api_shutdown_frames
    assert api is not None
    sockets = ("with no listening socket" if api.connections is not None else
               "(its sockets unreadable without ptrace; /metrics never answered)")
    ev = [
        Evidence(
            "proc",
            f"API server pid {api.pid} alive ({api.state}, {api.num_threads} threads) {sockets}",
            values={"pid": api.pid, "state": api.state, "threads": api.num_threads, "connections": api.connections},
        )
    ]
    facts: dict[str, object] = {}
    if api.connections:
        ev.append(Evidence("proc",
                           f"{api.connections} client connection(s) still open: uvicorn waits for them to close",
                           values={"connections": api.connections}))
    if f.engine_core is None:
        ev.append(Evidence("proc", "EngineCore and Worker already exited"))
    ev += present(futex_evidence(api))
    if began is not None:
        ago = None
        if began.t is not None and f.now_logtime is not None and f.now_logtime >= began.t:
            ago = f.now_logtime - began.t
            facts["shutdown_age_s"] = round(ago, 1)
        ev.append(Evidence("log",
                           f"shutdown began: {message(began.text)[:120]}"
                           + (f" ({fmt_duration(ago)} ago)" if ago is not None else ""),
                           t=log_stamp(began.t), values={"line": began.lineno, "kind": began.kind}))
        if f.waiting_connections_line is not None:
            ev.append(Evidence("log", "uvicorn: Waiting for connections to close",
                               values={"line": f.waiting_connections_line.lineno}))
    if frames:
        ev.append(Evidence("stack", f"API server stack in shutdown: {frames[0]}", values={"frames": list(frames[:6])}))
    reported = shutdown_evidence(f)  # the engine's own report: stage shutting_down for long
    api_reported = api_shutting_down(f)
    if reported is None and api_reported is not None:
        reported = stage_evidence(f, api_reported)
    if api_reported is not None:  # the API server's own word, with its stage's age: one sample decides
        facts["source"] = "engine"
    ev += present(reported, undrainable_evidence(f))
    ev += f.probe_evidence
    # The API server's own report of its shutdown, for SHUTDOWN_LONG_S, while it lives, is as sure as a log line
    # with the connections uvicorn waits for: it is the shutdown's own word, not an inference.
    corroborated = (began is not None and (api.connections or frames)) or (
        reported is not None and (began is not None or frames or api.connections)) or api_shutting_down(f) is not None
    return Verdict(
        VerdictKind.SHUTDOWN_HANG, C.SHUTDOWN_CORROBORATED if corroborated else C.SHUTDOWN_NO_LISTENER,
        "Shutdown began but the API server never exits: listener closed, process alive"
        + (f", {api.connections} client connection(s) held open." if api.connections else "."),
        "live_shutdown_hang", tuple(ev),
        (
            "Only SIGKILL clears it now: kill -9 %d (the supervisor should escalate after a bound)." % api.pid,
            "Prevent it: run the patched engine (bounded shutdown) or give clients a timeout.",
        ),
        facts,
    )


# ------------------------------------------------------------- admission wedge


def live_admission_wedge(f: Facts) -> bool:
    """Work is waiting that the scheduler never admits, and nothing executes: waiting >= 1, running
    0 (a self-preempted request sits in waiting too), token counters frozen, and the EngineCore
    spinning (vLLM's busy loop calls schedule() ~1000 times/s, each refusing the request: the
    waiting loop's allocate_slots() returns None and breaks). KV usage ~0 shows it is not pressure
    from other requests: the request cannot fit even in an empty pool. A blocked engine with
    stale gauges (parked, no heartbeat) is left to the deadlock rule."""
    if f.waiting < 1 or f.running > 0 or not (f.tokens_frozen or wedge_refused_for_capacity(f)):
        return False
    return not (f.engine_parked and not f.heartbeat_spinning and not f.engine_stepping and not stepping_idle(f))


def _admission_wedge_verdict(f: Facts) -> Verdict:
    m = f.last_metrics
    assert m is not None
    # the engine's own report counting steps that admit nothing is as good as its CPU or its main thread's quiet:
    # on a busy host those read short of a spin (a slice of a core; a nap that straddles each read)
    spinning = f.engine_spinning or f.heartbeat_spinning or f.engine_stepping or stepping_idle(f)
    if not spinning:
        confidence = C.WEDGE_METRICS_ONLY
    elif f.heartbeat_spinning or f.tokens_frozen_s >= CERTAIN_FROZEN_S:
        confidence = C.WEDGE_CERTAIN
    elif wedge_refused_for_capacity(f):
        confidence = C.WEDGE_REFUSED_EMPTY_POOL
    elif stepping_idle(f):  # the engine's own report: its loop steps, admitting nothing (no stacks needed)
        confidence = C.WEDGE_ENGINE_REPORT
    else:
        confidence = C.WEDGE_SPINNING
    by_reason = m.waiting_capacity is not None or m.waiting_deferred is not None
    ev = [
        metrics_evidence(f, f"{f.waiting:.0f} waiting" + reason_text(m, f.api_server)
                         + f", 0 running, KV cache {((m.kv_usage or 0) * 100):.1f}% used"),
        counter_evidence(f),
    ]
    if not by_reason:  # vLLM before 0.20 publishes no reason: capacity is what is left once nothing runs
        ev.append(Evidence("metrics", "no vllm:num_requests_waiting_by_reason on this server (vLLM before 0.20): "
                                      "the reason is inferred from 0 running and a frozen counter"))
    ev += present(engine_cpu_evidence(f), heartbeat_evidence(f))
    ev += profile_evidence(f) or list(present(engine_stack_evidence(f)))
    ev += f.probe_evidence
    named = never_fits_evidence(f)  # the engine's own report, where it has one: the request, by id
    if named is not None:
        ev.append(named[0])
    ev += present(stepping_evidence(f), stage_evidence(f, f.engine_report) if f.engine_report is not None else None)
    reason = waiting_reason(m)
    advice = list(DEFERRED_ADVICE) if reason == DEFERRED else [
        named[1] if named is not None else
        "The request needs more KV blocks than the pool can ever free: it will wait forever. "
        "Abort it (or restart), then size the pool: raise --gpu-memory-utilization / "
        "--num-gpu-blocks-override, or lower --max-model-len below the servable context.",
        "Run the patched engine: it fails such requests at once with the blocks needed and available.",
    ]
    if not f.saw_processes:
        advice.append(_METRICS_ONLY_ADVICE.format("confirm the EngineCore is spinning"))
    return Verdict(
        VerdictKind.ADMISSION_WEDGE, confidence,
        f"{f.waiting:.0f} request(s) waiting (reason: {reason}{'' if by_reason else ', inferred'}) that the "
        "scheduler never admits; nothing runs, "
        f"tokens frozen {fmt_duration(f.tokens_frozen_s)}"
        + ((", engine spinning." if f.engine_spinning or f.heartbeat_spinning else ", engine stepping.")
           if spinning else "."),
        "live_admission_wedge", tuple(ev), tuple(advice), wedge_facts(f),
    )


# ------------------------------------------------------- an engine the host starves


def live_engine_waits_for_cpu(f: Facts) -> bool:
    """What would read as an engine deadlock, but the engine was never given a CPU to step on: an
    EngineCore or Worker main thread runnable yet off a CPU for most of the window (schedstat's
    run delay grew), the engine using next to no CPU. A blocked engine parks, and its run delay
    stands still; this one queues behind the host's other work (seen on a 2-core host at load ~9:
    the EngineCore runnable with 0.00 cores for 3 s while 8 streams were being served). Frozen
    counters then say nothing about a hang, so no hang is named; the capture goes on. The same
    holds when the engine's last published gauges say nothing is in flight: an engine stopped by
    the host before it could publish the request it was handed reads as idle, counters frozen.
    Not where tokens came within the window, though: those are steps the engine took, and with
    nothing in flight since, that is progress however queued (seen: `watch` of a lightly loaded
    server held to 0.05 cores, a completion every 2 s, its last scrape between two requests, read
    as waiting for a CPU with 8 tokens just made)."""
    return f.engine_waits_for_cpu and (live_engine_deadlock(f) or (_nothing_in_flight(f) and not f.tokens_advance))


def _waits_for_cpu_verdict(f: Facts) -> Verdict:
    w = f.engine_cpu_wait
    _, waited, span = w or (None, 0.0, 0.0)
    t = f.engine_throttling
    throttled = mostly_throttled(t)
    steal = f.host_steal
    stolen = steal is not None and steal[2] >= STEAL_SHARE
    ev = [metrics_evidence(f, f"{f.running:.0f} running, {f.waiting:.0f} waiting, all gauges frozen"),
          counter_evidence(f)]
    ev += present(cpu_wait_evidence(f), engine_cpu_evidence(f))
    return Verdict(
        VerdictKind.INCONCLUSIVE, C.INCONCLUSIVE,
        (f"The engine is waiting for a CPU, not stopped: its counters are frozen because the host gave it "
         f"none for {fmt_duration(waited)}. A hang cannot be told from that."
         if w is None or mostly_queued(w) or t is None else
         f"The engine is waiting for a CPU, not stopped: its counters are frozen because its cgroup's CPU limit "
         f"ran out in {t[1]} of {t[2]} periods while it was runnable. A hang cannot be told from that."),
        "live_engine_waits_for_cpu", tuple(ev),
        (("Raise the engine's CPU limit (the container's resources.limits.cpu): its cgroup ran out of quota "
          "in most periods of the window." if throttled else
          f"The hypervisor took {steal[2]:.0%} of this VM's CPU time (steal, `top`'s st): its host is "
          "oversubscribed. Move the server to a dedicated or larger instance, and find what else holds "
          "the CPUs here (`top -o %CPU`)." if stolen and steal is not None else
          "Find what holds the CPUs: the host's other work (`top -o %CPU`), or a CPU limit on a parent "
          "cgroup of the engine's."),
         "Diagnose again once the engine gets CPU: a blocked engine parks and waits for no CPU, so this "
         "capture shows no hang yet. A longer window (--window 20) may see its counters move, or it park."),
        {"runq_s": round(waited, 2), "span_s": round(span, 2), "engine_cores": f.engine_cores,
         "running": f.running, "waiting": f.waiting},
    )


# -------------------------------------------------------------- engine deadlock


def live_engine_deadlock(f: Facts) -> bool:
    """The engine stopped stepping with work in flight while the API process answers /metrics:
    running >= 1 (or waiting) and every counter frozen, the EngineCore parked (no CPU; main
    thread in execute_model / collective_rpc / a shared-memory dequeue / a device sync). In a
    blocked vLLM engine nothing is published, so every gauge holds its last value. A spinning
    engine is stepping (unless its heartbeat froze or its stack sits in the model): not a
    deadlock; with only waiting requests the engine must be seen asleep. Deferred requests are not
    work it owes a step: vLLM 0.32 leaves paused sessions out of its unfinished count and sleeps.
    Releases without the waiting-by-reason gauge (before 0.20) say so by the stack alone: with none
    running, an engine whose main thread waits on its input queue at every sample has nothing it could
    step (its busy loop blocks there only then), whatever the waiting gauge says (vLLM 0.15 counts
    paused streaming sessions as waiting and serves a new request beside them)."""
    deferred = (f.last_metrics.waiting_deferred or 0) if f.last_metrics is not None else 0
    if f.running + f.waiting - deferred < 1 or not f.tokens_frozen:
        return False
    if f.running < 1 and f.engine_awaits_input:
        return False
    asleep = (f.engine_parked and not f.engine_stepping) or f.heartbeat_frozen
    if f.running < 1 and not asleep:
        return False
    return not (f.engine_spinning and not f.heartbeat_frozen and f.engine_where != stk.IN_MODEL)


def _deadlock_confidence(f: Facts) -> float:
    if f.engine_parked or f.heartbeat_frozen:
        share = f.worker_model_share
        certain = (f.tokens_frozen_s >= CERTAIN_FROZEN_S
                   or (share is not None and share >= C.DEADLOCK_WORKER_SHARE)  # every Worker inside execute_model
                   or f.main_thread_parked)  # a main thread parked the whole window on one futex, never woken
        return C.DEADLOCK_CERTAIN if certain else C.DEADLOCK_PARKED
    if f.engine_where == stk.IN_MODEL:
        return C.DEADLOCK_IN_MODEL
    return C.DEADLOCK_METRICS_ONLY if f.running >= 1 else C.DEADLOCK_WAITING_ONLY


def _engine_deadlock_verdict(f: Facts) -> Verdict:
    running, waiting = f.running, f.waiting
    ev = [metrics_evidence(f, f"{running:.0f} running, {waiting:.0f} waiting, all gauges frozen"), counter_evidence(f)]
    ev += present(stepless_evidence(f))
    ev += deadlock_process_evidence(f)
    if f.engine_report is not None:  # the engine's own report, where it has one: its stage, or that it went stale
        ev += present(stage_evidence(f, f.engine_report))
    ev += stale_evidence(f)
    ev += present(listening_evidence(f))
    advice: tuple[str, ...] = () if f.native_captured else (
        "Capture native stacks of the EngineCore and Workers (`wedgectl diagnose --pid PID --native`): "
        "the innermost frame names the kernel, collective or lock it waits on.",)
    advice += ("Restart the server; /health stays 200, so point liveness probes at the patched engine's heartbeat.",)
    if not f.saw_processes:
        advice += (_METRICS_ONLY_ADVICE.format("see where the engine is parked"),)
    return Verdict(
        VerdictKind.ENGINE_DEADLOCK, _deadlock_confidence(f),
        f"The engine stopped with {running:.0f} running / {waiting:.0f} waiting; counters frozen "
        f"{fmt_duration(f.tokens_frozen_s)}" + (", EngineCore parked." if f.engine_parked else "."),
        "live_engine_deadlock", tuple(ev), advice, deadlock_facts(f),
    )


# ---------------------------------------------------------------------- starved


def live_starved(f: Facts) -> bool:
    """Live but the queue does not drain: tokens advance while requests wait for capacity and none
    is admitted (prompt tokens flat, waiting not falling). The seed-000 shape: one runaway request
    holding most of the KV pool; vLLM admits nothing until blocks free up. Prompt tokens that rose
    in the window mean something was admitted: a busy queue, not a starved one."""
    if f.waiting < 1 or not f.tokens_advance:
        return False
    w = f.waiting_series
    draining = w.first is not None and w.last is not None and w.last < w.first
    return not draining and not (f.prompt_tokens.delta or 0) > 0


def _starved_verdict(f: Facts) -> Verdict:
    running, waiting, g = f.running, f.waiting, f.gen_tokens
    kv_rate = slope_per_s(f.kv.points)
    facts: dict[str, object] = {"tokens_per_s": round(g.rate or 0, 2), "waiting": waiting, "running": running}
    kv_last = f.kv.last
    ev = [
        metrics_evidence(f, f"{waiting:.0f} waiting behind {running:.0f} running; nothing admitted in the window"),
        counter_evidence(f),
    ]
    if kv_last is not None:
        facts["kv_usage_pct"] = round(kv_last * 100, 1)
    if kv_rate is not None and kv_last is not None:
        per_min = kv_rate * 100 * 60
        facts["kv_growth_pct_per_min"] = round(per_min, 2)
        to_full: float | None = None
        if kv_rate > 0:
            to_full = facts["seconds_to_kv_full"] = round((1 - kv_last) / kv_rate, 1)
        ev.append(Evidence("metrics", f"KV cache {kv_last * 100:.1f}% used, growing {per_min:.2f} %/min"
                           + (f"; full in ~{fmt_duration(to_full)}" if to_full is not None else ""),
                           values={"kv_usage_pct": round(kv_last * 100, 1), "pct_per_min": round(per_min, 2)}))
    ev += present(engine_cpu_evidence(f), runaway_evidence(f),
                  stage_evidence(f, f.engine_report) if f.engine_report is not None else None)
    hog = runaway(f)
    if hog is not None:
        facts["request_ids"] = [hog.id]
    return Verdict(
        VerdictKind.STARVED, C.STARVED_CAPACITY if starved_for_capacity(f) else C.STARVED_LIVE,
        f"Not a hang: tokens advance at {g.rate or 0:.1f}/s but {waiting:.0f} request(s) wait for KV capacity behind "
        f"{running:.0f} running.",
        "live_starved", tuple(ev), STARVED_ADVICE, facts,
    )


# ------------------------------------------------------------------ progressing, idle


def live_progressing(f: Facts) -> bool:
    """Tokens advance between scrapes: the engine is live and serving. vLLM counts a generated
    token only once a step produced it, so a rising vllm:generation_tokens_total is a stepping engine."""
    return f.tokens_advance


def _progressing_verdict(f: Facts) -> Verdict:
    g = f.gen_tokens
    return Verdict(
        VerdictKind.PROGRESSING, C.PROGRESSING_LIVE,
        f"Serving: {g.rate or 0:.1f} tokens/s, {f.running:.0f} running, {f.waiting:.0f} waiting.",
        "live_progressing",
        present(counter_evidence(f), metrics_evidence(f, "gauges at the last scrape"), engine_cpu_evidence(f),
                cpu_wait_evidence(f)),
        (), {"tokens_per_s": round(g.rate or 0, 2)},
    )


def _nothing_in_flight(f: Facts) -> bool:
    return len(f.scrapes) >= 2 and not f.running and not f.waiting


def live_idle(f: Facts) -> bool:
    """Nothing in flight and nothing waiting over two scrapes or more; the engine is not stuck, just
    unused. Not while an engine main thread is queued for a CPU (Facts.engine_queued): an idle
    engine sleeps, and one the host holds back may not have published the work it was handed."""
    return _nothing_in_flight(f) and not f.engine_queued


def _idle_verdict(f: Facts) -> Verdict:
    return Verdict(
        VerdictKind.IDLE,
        C.IDLE_ENGINE_BUSY if f.engine_spinning else C.IDLE_ENGINE_HELD if f.engine_runnable else C.IDLE_LIVE,
        "Idle: no request running or waiting.",
        "live_idle", present(metrics_evidence(f, "0 running, 0 waiting"), engine_cpu_evidence(f)),
    )


LIVE_RULES: tuple[Rule, ...] = (
    Rule(live_engine_dead, _engine_dead_verdict),
    ORPHAN_RULE,
    LIVE_STARTUP_RULE,
    Rule(live_shutdown_hang, _shutdown_hang_verdict),
    COLLECTIVE_RULE,
    WEDGE_RULE,  # the engine's report names the request that never fits: before the metrics' reading of it
    Rule(live_admission_wedge, _admission_wedge_verdict),
    Rule(live_engine_waits_for_cpu, _waits_for_cpu_verdict),
    DEADLOCK_RULE,  # the engine's report has its step stuck in one stage: before the metrics' reading of it
    Rule(live_engine_deadlock, _engine_deadlock_verdict),
    ENGINE_LEAK_RULE,  # the API server's report names the requests whose client went
    LEAK_RULE,
    Rule(live_starved, _starved_verdict),
    Rule(live_progressing, _progressing_verdict),
    Rule(live_idle, _idle_verdict),
)
