"""The rules that read the engine's own report, and the lines other verdicts cite from it. No I/O.

An engine report (model/engine.py) says where the EngineCore is (its stage, since when), what its
scheduler holds and how many steps it took, from a thread that runs beside the busy loop. It decides
where ptrace cannot (py-spy refused, no CAP_SYS_PTRACE): a fresh report stuck in one stage of a step is
a deadlock; a waiting request that needs more KV blocks than the pool holds, while the steps rise and
nothing runs, is an admission wedge. Its evidence is tagged `engine`, so a reader sees which source
decided. A stale report (no Python ran in its process for three periods) is evidence, never a verdict.
"""

from __future__ import annotations

from wedgectl.classify import confidence as C
from wedgectl.classify import enginefacts as ef
from wedgectl.classify.evidence import (counter_evidence, deadlock_process_evidence, engine_cpu_evidence, fmt_duration,
                                        listening_evidence, metrics_evidence, present)
from wedgectl.classify.facts import CERTAIN_FROZEN_S, MIN_FROZEN_S, Facts
from wedgectl.classify.rule import Rule
from wedgectl.classify.verdictfacts import deadlock_facts, wedge_facts
from wedgectl.model import engine as E
from wedgectl.model.engine import EngineReading, EngineReport, RequestSample
from wedgectl.model.types import Evidence, Role, Verdict, VerdictKind

SOURCE = "engine"
# A process whose report has said shutting_down this long supports a shutdown hang: vLLM's own shutdown
# (EngineCore.shutdown, uvicorn's lifespan) ends in a few seconds when nothing holds it.
SHUTDOWN_LONG_S = CERTAIN_FROZEN_S
MOST_IDS = 5  # request ids an evidence line names


def _who(f: Facts, r: EngineReading) -> str:
    role = ef.role_of(r, ef.process_roles(f.samples))
    return f"{ef.ROLE_LABELS[role]} pid {r.pid}"


def _running(f: Facts, rep: EngineReport) -> float:
    """Requests running: the report's count, else /metrics'."""
    return float(rep.running) if rep.running is not None else f.running


def stage_evidence(f: Facts, r: EngineReading) -> Evidence | None:
    """'stage execute_model_wait for 12 s, running 1 (EngineCore pid N, report 0.4 s old)'."""
    rep = r.report
    if rep is None or rep.stage is None:
        return None
    sched = rep.scheduler
    running = sched.running if sched is not None else None
    what = (f"stage {rep.stage.name}" + (f" ({rep.stage.phase})" if rep.stage.phase else "")
            + (f" for {fmt_duration(r.stage_age_s)}" if r.stage_age_s is not None else "")
            + (f", running {running}" if running is not None else "")
            + f" ({_who(f, r)}, report {r.age_s if r.age_s is not None else 0:.1f} s old)")
    return Evidence(SOURCE, what, values={
        "pid": r.pid, "stage": rep.stage.name, "stage_s": None if r.stage_age_s is None else round(r.stage_age_s, 1),
        "running": running, "waiting": sched.waiting if sched is not None else None, "steps": rep.steps,
        "report_age_s": None if r.age_s is None else round(r.age_s, 2), "seq": rep.seq})


def ids_text(requests: tuple[RequestSample, ...]) -> str:
    shown = ", ".join(r.id for r in requests[:MOST_IDS])
    return shown + (f" and {len(requests) - MOST_IDS} more" if len(requests) > MOST_IDS else "")


def requests_evidence(rep: EngineReport) -> Evidence | None:
    """The requests held in the step, by id (running first): what an operator aborts."""
    held = rep.requests_in("running") or rep.requests
    if not held:
        return None
    total = rep.requests_total
    return Evidence(SOURCE, f"requests frozen in the step: {ids_text(held)}"
                    + (f" (the scheduler holds {total})" if total is not None else ""),
                    values={"ids": [r.id for r in held[:MOST_IDS]], "requests_total": total})


def report_stack_evidence(rep: EngineReport) -> Evidence | None:
    """The main thread's innermost frame in the stacks the writer took for an overdue stage."""
    stacks = rep.stacks
    thread = next((t for t in stacks.threads if t.name == "MainThread"), None) if stacks is not None else None
    if stacks is None or thread is None or not thread.frames:
        return None
    frames = [f"{fr.function} ({fr.file}:{fr.line})" for fr in thread.frames[:5]]
    return Evidence(SOURCE, f"main thread at {frames[0]}" + (f" ({stacks.reason})" if stacks.reason else ""),
                    values={"frames": frames})


def stale_evidence(f: Facts) -> tuple[Evidence, ...]:
    """A report its process stopped rewriting: the writer is a Python thread, so no Python runs there."""
    out = []
    for r in ef.stale_readings(f.samples):
        rep = r.report
        assert rep is not None and r.age_s is not None
        why, reason = _why_silent(f, r.pid)
        out.append(Evidence(SOURCE, f"{_who(f, r)}'s report not rewritten for {fmt_duration(r.age_s)} (every "
                            f"{rep.period_s:g} s) while the process lives: its threads are not running Python "
                            f"({why})", values={"pid": r.pid, "report_age_s": round(r.age_s, 1),
                                                "stage": rep.stage_name, "why": reason}))
    return tuple(out)


SILENT_SPINS_CORES = 0.5  # a silent process using this much CPU runs native code with the GIL held
SILENT_QUEUED_SHARE = 0.5  # its main thread runnable off a CPU this share of the window: it is given no CPU


def _why_silent(f: Facts, pid: int) -> tuple[str, str]:
    """Why no Python runs in a process, where its samples say: (the words, a key). Stopped (state T or t:
    SIGSTOP, or a tracer holding it), running native code with the GIL held (it uses CPU), queued for a CPU
    it is not given (schedstat's run delay), or in uninterruptible sleep; else the three it may be."""
    seen = [(s.t, p) for s in f.samples for p in s.processes if p.pid == pid]
    if not seen:
        return "the GIL held in native code, the process stopped, or no CPU", "unknown"
    (t0, first), (t1, last) = seen[0], seen[-1]
    span = t1 - t0
    cores = (last.cpu_s - first.cpu_s) / span if span > 0 else None
    if last.state[:1] in ("T", "t"):
        return f"the process is stopped, state {last.state[:1]}: a SIGSTOP or a tracer holds it", "stopped"
    if cores is not None and cores >= SILENT_SPINS_CORES:
        return f"it runs native code with the GIL held: {cores:.2f} cores over the window", "native"
    if span > 0 and first.main_runq_s is not None and last.main_runq_s is not None and \
            (last.main_runq_s - first.main_runq_s) >= SILENT_QUEUED_SHARE * span:
        return (f"its main thread waited for a CPU {last.main_runq_s - first.main_runq_s:.1f} s of "
                f"{span:.1f} s: it is given no CPU"), "no_cpu"
    if last.threads and all(th.state[:1] == "D" for th in last.threads):
        return "all its threads in uninterruptible sleep (state D)", "uninterruptible"
    used = "" if cores is None else f"{cores:.2f} cores; "
    return f"{used}the GIL held by a thread blocked in native code, or the process given no CPU", "blocked"


def unread_evidence(f: Facts) -> Evidence | None:
    """What could not be read, where neither ptrace (py-spy refused) nor an engine report gave the engine's
    side, and what would decide it."""
    refused = ef.ptrace_refused(f.samples)
    missing = ef.missing_readings(f.samples)
    if not refused or not missing:
        return None
    return Evidence("wedgectl", f"could not read the engine's side: py-spy was refused ptrace access to pid "
                    f"{', '.join(refused[:4])}, and no engine report was read ({ef.reason_summary(missing)}); the "
                    "patched engine's report (WEDGE_ENGINE_REPORT=1 in the server's environment) or CAP_SYS_PTRACE "
                    "for wedgectl would decide it",
                    values={"pyspy_refused": list(refused[:8]),
                            "reports": list(dict.fromkeys(r.error for r in missing))[:4]})


# -------------------------------------------------------------- engine deadlock


def live_engine_report_deadlock(f: Facts) -> bool:
    """The engine's own report, fresh, has the EngineCore in a step's model stage (execute_model_wait,
    execute_model, sample_tokens) for MIN_FROZEN_S or more with a request running. vLLM's busy loop
    dispatches a step to the executor and blocks on the future's result(); the report's thread runs
    beside it, so a report rewritten on time that keeps naming one stage means the main thread never
    came back. Not while tokens advance or the report's steps rise (the engine steps), nor while the host
    starves the engine of CPU (live_engine_waits_for_cpu, before this rule, says so). Not with several
    Worker ranks either: there the same stage is also a collective that one rank never reached, which only
    the ranks' own stacks tell apart (the collective rule, and the metrics' deadlock after it, decide)."""
    stage, r = f.engine_stage, f.engine_report
    if stage is None or r is None or r.report is None or not f.engine_report_fresh or len(f.workers) > 1:
        return False
    name, age = stage
    if name not in E.MODEL_STAGES or age is None or age < MIN_FROZEN_S or _running(f, r.report) < 1:
        return False
    # Its report's history counts only from the stage's start: steps before it are the ones that led here.
    since = r.report.stage.since_mono_ns if r.report.stage is not None else None
    steps = ef.steps_over_window(f.samples, r.pid, history_since_ns=since)
    return not (steps is not None and steps[1] > steps[0]) and not f.tokens_advance and not f.engine_waits_for_cpu


def _deadlock_verdict(f: Facts) -> Verdict:
    r, stage = f.engine_report, f.engine_stage
    assert r is not None and r.report is not None and stage is not None
    rep, (name, age) = r.report, stage
    running = _running(f, rep)
    ev = list(present(stage_evidence(f, r), requests_evidence(rep), report_stack_evidence(rep)))
    if f.scrapes:
        ev += [metrics_evidence(f, f"{f.running:.0f} running, {f.waiting:.0f} waiting"), counter_evidence(f)]
    ev += deadlock_process_evidence(f)  # the stacks, where ptrace gave them: beside the report, not instead
    ev += stale_evidence(f)
    ev += present(listening_evidence(f))
    held = rep.requests_in("running") or rep.requests
    advice: tuple[str, ...] = () if f.native_captured else (
        "Capture native stacks of the EngineCore and Workers (`wedgectl diagnose --pid PID --native`): the "
        "innermost frame names the kernel, collective or lock the step waits on.",)
    advice += ("Restart the server: the step will not return. /health stays 200, so point liveness probes at "
               "the patched engine's heartbeat."
               + (f" The requests it held ({ids_text(held)}) fail with it." if held else ""),)
    return Verdict(
        VerdictKind.ENGINE_DEADLOCK,
        C.DEADLOCK_ENGINE_REPORT_CERTAIN if (age or 0.0) >= CERTAIN_FROZEN_S else C.DEADLOCK_ENGINE_REPORT,
        f"The engine stopped inside a step: its own report has the EngineCore in {name} for "
        f"{fmt_duration(age or 0.0)} with {running:.0f} request(s) running.",
        "live_engine_report_deadlock", tuple(ev), advice,
        {**deadlock_facts(f), "source": SOURCE, "stage": name, "stage_s": round(age or 0.0, 1), "running": running,
         "waiting": f.waiting, "report_age_s": None if r.age_s is None else round(r.age_s, 2),
         "request_ids": [q.id for q in held[:MOST_IDS]]},
    )


# -------------------------------------------------------------- admission wedge


def never_fitting(f: Facts) -> RequestSample | None:
    """The first waiting request of the EngineCore's report that needs more KV blocks than the pool holds."""
    sched = f.engine_scheduler
    kv = sched.kv_blocks if sched is not None else None
    return next((q for q in f.engine_requests if q.state == "waiting" and q.never_fits(kv)), None)


def live_engine_report_wedge(f: Facts) -> bool:
    """The engine's own report, fresh, shows its busy loop stepping (its step count rose over the window, or
    over the last writes the report carries: one sample can decide) with nothing running while a waiting
    request needs more KV blocks than the pool holds in all (blocks_needed > kv_blocks.total). vLLM's
    scheduler tries it at every step; allocate_slots() returns None for it and the waiting loop breaks, so
    nothing behind it is admitted either: a wedge that no freeing of blocks can end."""
    sched, steps = f.engine_scheduler, f.engine_report_steps
    if not f.engine_report_fresh or sched is None or steps is None or steps[1] <= steps[0]:
        return False
    running = sched.running if sched.running is not None else f.running
    return running < 1 and never_fitting(f) is not None


def stepping_idle(f: Facts) -> bool:
    """The EngineCore's fresh report shows its busy loop stepping (steps rose over the window or its history) with
    nothing running and a request waiting: the scheduler is asked at every step and admits nothing."""
    sched, steps = f.engine_scheduler, f.engine_report_steps
    if not f.engine_report_fresh or sched is None or steps is None or steps[1] <= steps[0]:
        return False
    return (sched.running if sched.running is not None else f.running) < 1 and (sched.waiting or 0) >= 1


def stepping_evidence(f: Facts, what: str = "each step admits nothing") -> Evidence | None:
    """'the engine stepped 812 times in 2.0 s with nothing running and 3 waiting (capacity 1, deferred 2): ...'."""
    sched, steps, r = f.engine_scheduler, f.engine_report_steps, f.engine_report
    if not stepping_idle(f) or sched is None or steps is None or r is None:
        return None
    first, last, span = steps
    reasons = ", ".join(f"{k} {v}" for k, v in sched.waiting_by_reason.items() if v)
    waiting = [q.id for q in f.engine_requests if q.state == "waiting"]
    return Evidence(SOURCE, f"the engine stepped {last - first} times in {span:.1f} s with nothing running and "
                    f"{sched.waiting if sched.waiting is not None else '?'} waiting"
                    + (f" ({reasons})" if reasons else "") + f": {what} ({_who(f, r)}'s report)"
                    + (f"; waiting: {', '.join(waiting[:MOST_IDS])}" if waiting else ""),
                    values={"steps_first": first, "steps_last": last, "span_s": round(span, 2), "running": 0,
                            "waiting": sched.waiting, "waiting_by_reason": sched.waiting_by_reason or None,
                            "waiting_ids": waiting[:MOST_IDS]})


def never_fits_evidence(f: Facts) -> tuple[Evidence, str] | None:
    """The request of the EngineCore's report that can never be admitted, as an evidence line and the advice
    that names it (what to run to abort it); None without a report that names one. The metrics' wedge
    verdict cites it too, where it decides first."""
    req, sched = never_fitting(f), f.engine_scheduler
    kv = sched.kv_blocks if sched is not None else None
    if req is None or kv is None or kv.total is None or req.blocks_needed is None:
        return None
    ev = Evidence(SOURCE, f"request {req.id} needs {req.blocks_needed} KV blocks; the pool holds {kv.total} in "
                  f"all, {kv.total - 1} for requests (one is vLLM's null block)"
                  + (f", {kv.free} free" if kv.free is not None else ""),
                  values={"request": req.id, "blocks_needed": req.blocks_needed, "kv_total": kv.total,
                          "kv_free": kv.free, "block_size": kv.block_size, "prompt_tokens": req.prompt_tokens,
                          "waiting_s": None if req.age_s is None else round(req.age_s, 1)})
    size = f" blocks of {kv.block_size} tokens" if kv.block_size else ""
    api = f.api_server
    how = (f"`wedgectl remedy --pid {api.pid} --yes` ends its client's connection, and vLLM aborts a request "
           "whose client is gone" if api is not None else "end its client's connection (vLLM aborts a request "
           "whose client is gone), or restart")
    advice = (f"Abort request {req.id}: {how}. It needs {req.blocks_needed} KV blocks and the pool gives a request "
              f"at most {kv.total - 1}{size}, so it waits for ever and holds every request behind it. Then size the "
              "pool: raise --gpu-memory-utilization / --num-gpu-blocks-override, or lower --max-model-len below "
              "what the pool can hold.")
    return ev, advice


def _wedge_verdict(f: Facts) -> Verdict:
    req, sched, steps, r = never_fitting(f), f.engine_scheduler, f.engine_report_steps, f.engine_report
    named = never_fits_evidence(f)
    assert req is not None and sched is not None and steps is not None and r is not None and named is not None
    kv = sched.kv_blocks
    assert kv is not None and kv.total is not None
    stepped = stepping_evidence(f, "each step refuses it")
    assert stepped is not None
    ev = [named[0], stepped]
    if f.scrapes:
        ev += [metrics_evidence(f, f"{f.waiting:.0f} waiting, {f.running:.0f} running"), counter_evidence(f)]
    ev += present(engine_cpu_evidence(f))
    waiting = sched.waiting if sched.waiting is not None else f"{f.waiting:.0f}"
    m = f.last_metrics  # before 0.20 no waiting_by_reason: capacity is what the report's blocks show
    inferred = "" if m is not None and (m.waiting_capacity is not None or m.waiting_deferred is not None) else (
        ", inferred from the blocks")
    advice = (
        named[1],
        "Run the patched engine: its admission guard fails such requests at once with the blocks needed and "
        "available.",
    )
    return Verdict(
        VerdictKind.ADMISSION_WEDGE,
        C.WEDGE_ENGINE_REPORT_CORROBORATED if f.tokens_frozen else C.WEDGE_ENGINE_REPORT,
        f"{waiting} request(s) waiting (reason: capacity{inferred}) that the scheduler never admits: {req.id} needs "
        f"{req.blocks_needed} KV blocks, more than the {kv.total - 1} the pool gives a request; nothing runs, "
        "engine stepping.",
        "live_engine_report_wedge", tuple(ev), advice,
        {**wedge_facts(f), "source": SOURCE, "request": req.id, "blocks_needed": req.blocks_needed,
         "kv_total": kv.total,
         "kv_free": kv.free, "waiting": sched.waiting, "reason": "capacity"},
    )


# -------------------------------------------------------------- starved


def runaway(f: Facts) -> RequestSample | None:
    """The running request of the EngineCore's report holding the most KV blocks (the runaway a starved pool
    waits behind); None without a report that says what its requests hold."""
    running = [q for q in f.engine_requests if q.state == "running" and q.blocks_held]
    return max(running, key=lambda q: q.blocks_held or 0) if running else None


def runaway_evidence(f: Facts) -> Evidence | None:
    """'request X holds 40 of the pool's 96 KV blocks, 300 tokens out, running for 40 s (EngineCore's report)'."""
    hog, sched = runaway(f), f.engine_scheduler
    if hog is None:
        return None
    kv = sched.kv_blocks if sched is not None else None
    of = f" of the pool's {kv.total}" if kv is not None and kv.total else ""
    return Evidence(SOURCE, f"request {hog.id} holds {hog.blocks_held}{of} KV blocks"
                    + (f", {hog.output_tokens} tokens out" if hog.output_tokens is not None else "")
                    + (f", running for {fmt_duration(hog.age_s)}" if hog.age_s is not None else "")
                    + " (the EngineCore's report): what the waiting requests wait behind",
                    values={"request": hog.id, "blocks_held": hog.blocks_held,
                            "kv_total": kv.total if kv is not None else None, "output_tokens": hog.output_tokens})


# -------------------------------------------------------- shutdown and start-up


def shutting_down(f: Facts) -> EngineReading | None:
    """The reading whose report has said shutting_down longest, once that is SHUTDOWN_LONG_S or more."""
    long = [r for r in f.engine_readings.values() if r.report is not None and r.report.stage_name == E.SHUTTING_DOWN
            and r.stage_age_s is not None and r.stage_age_s >= SHUTDOWN_LONG_S]
    return max(long, key=lambda r: r.stage_age_s or 0.0) if long else None


def api_shutting_down(f: Facts) -> EngineReading | None:
    """The API server's own reading, fresh, saying shutting_down: uvicorn's shutdown() began and has not returned
    (the process would exit when it does), for SHUTDOWN_LONG_S or more; or for MIN_FROZEN_S while it still
    tracks a request and no EngineCore is left to finish it (vLLM's SIGTERM ends the engine at once, and uvicorn
    waits for that request's connection to close, with no deadline: a drain that cannot end)."""
    api = f.api_server
    r = f.engine_readings.get(api.pid) if api is not None else None
    if r is None or r.report is None or r.report.stage_name != E.SHUTTING_DOWN or r.stage_age_s is None:
        return None
    if not r.fresh:
        return None
    undrainable = f.engine_core is None and (r.report.requests_total or 0) >= 1 and r.stage_age_s >= MIN_FROZEN_S
    return r if r.stage_age_s >= SHUTDOWN_LONG_S or undrainable else None


def undrainable_evidence(f: Facts) -> Evidence | None:
    """'the API server still tracks 1 request (1 client connected) and no EngineCore is left to finish it'."""
    r = api_shutting_down(f)
    rep = r.report if r is not None else None
    if rep is None or f.engine_core is not None or not rep.requests_total:
        return None
    held = ids_text(rep.requests)
    clients = f", {rep.clients_connected} client(s) connected" if rep.clients_connected else ""
    return Evidence(SOURCE, f"the API server still tracks {rep.requests_total} request(s){clients} and no EngineCore "
                    f"is left to finish them: {held}; uvicorn waits for their connections to close",
                    values={"requests_total": rep.requests_total, "clients_connected": rep.clients_connected,
                            "ids": [q.id for q in rep.requests[:MOST_IDS]]})


def shutdown_evidence(f: Facts) -> Evidence | None:
    r = shutting_down(f)
    return None if r is None else stage_evidence(f, r)


def starting_phase(f: Facts) -> EngineReading | None:
    """The reading of a process whose report says it is starting and names the phase: a Worker's first
    (it does the loading), then the EngineCore's."""
    roles = ef.process_roles(f.samples)
    order = {Role.WORKER: 0, Role.ENGINE_CORE: 1, Role.API_SERVER: 2}
    found = [r for r in f.engine_readings.values() if r.report is not None and r.report.stage is not None
             and r.report.stage.name == E.STARTING and r.report.stage.phase]
    return min(found, key=lambda r: (order.get(ef.role_of(r, roles), 3), r.pid)) if found else None


DEADLOCK_RULE = Rule(live_engine_report_deadlock, _deadlock_verdict)
WEDGE_RULE = Rule(live_engine_report_wedge, _wedge_verdict)
