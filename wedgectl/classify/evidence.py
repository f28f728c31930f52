"""Evidence lines the rules cite: built from the facts, shared by the live and log rules."""

from __future__ import annotations

import datetime as _dt
import re

from wedgectl.read import stacks as stk
from wedgectl.classify.facts import PARKED_CORES, SPINNING_CORES, STEAL_SHARE, Facts, mostly_queued
from wedgectl.read.logparse import FailureLine, StatsLine, format_stamp
from wedgectl.model.types import Evidence, ProcessSample, Role


def iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def fmt_duration(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def log_stamp(t: float | None) -> str | None:
    return format_stamp(t) if t is not None else None


_LOG_HEADER = re.compile(
    r"^\s*(?:\([\w:.-]+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):?\s+)?"
    r"(?:\d{2}-\d{2} \d{2}:\d{2}:\d{2}\s+)?(?:\[[\w./-]+:\d+\]\s*)?"
)


def message(text: str) -> str:
    """A log line without its '(APIServer pid=N) INFO 12-01 08:24:14 [file.py:N]' header."""
    return _LOG_HEADER.sub("", text, count=1).strip()


def present(*items: Evidence | None) -> tuple[Evidence, ...]:
    return tuple(e for e in items if e is not None)


def failure_evidence(f: FailureLine) -> Evidence:
    """One engine-failure line of the log, quoted without its header."""
    return Evidence("log", message(f.text)[:160], t=log_stamp(f.t), values={"line": f.lineno})


def stats_evidence(s: StatsLine, what: str) -> Evidence:
    return Evidence(
        source="log",
        what=what,
        t=s.stamp,
        values={
            "line": s.lineno,
            "running": s.running,
            "waiting": s.waiting,
            "gen_tokens_per_s": s.gen_tps,
            "prompt_tokens_per_s": s.prompt_tps,
            "kv_usage_pct": s.kv_usage_pct,
        },
    )


def metrics_evidence(f: Facts, what: str) -> Evidence:
    m = f.last_metrics
    values: dict[str, object] = {}
    if m is not None:
        for key, val in (
            ("running", m.running),
            ("waiting", m.waiting),
            ("waiting_capacity", m.waiting_capacity),
            ("kv_usage_pct", None if m.kv_usage is None else round(m.kv_usage * 100, 1)),
            ("generation_tokens_total", m.generation_tokens),
        ):
            if val is not None:
                values[key] = val
    t = iso(f.scrapes[-1][0]) if f.scrapes else None
    return Evidence(source="metrics", what=what, t=t, values=values)


def counter_evidence(f: Facts) -> Evidence:
    g = f.gen_tokens
    return Evidence(
        source="metrics",
        what=(
            "vllm:generation_tokens_total not read" if g.last is None
            else f"vllm:generation_tokens_total at {g.last:.0f} (one reading: no rate yet)" if g.delta is None
            else f"vllm:generation_tokens_total frozen at {g.last:.0f} for {g.frozen_s:.1f} s"
            if g.delta == 0
            else f"vllm:generation_tokens_total rose by {g.delta:.0f} in {g.span_s:.1f} s"
        ),
        t=iso(g.points[-1][0]) if g.points else None,
        values={
            "first": g.first,
            "last": g.last,
            "span_s": round(g.span_s, 2),
            "tokens_per_s": None if g.rate is None else round(g.rate, 1),
        },
    )


# the engine's processes, as evidence names them
_ENGINE_NAMES = {Role.ENGINE_CORE: "EngineCore", Role.WORKER: "Worker"}


def stepless_evidence(f: Facts) -> Evidence | None:
    """The kernel's record that extends a frozen counter back before the first scrape (Facts.stepless_s)."""
    g, q = f.gen_tokens, f.stepless_s
    if g.delta != 0 or not q or f.tokens_frozen_s <= g.frozen_s:
        return None
    who = ", ".join(f"{_ENGINE_NAMES.get(p.role, p.role.value)} pid {p.pid} ({fmt_duration(p.main_quiet_s or 0.0)})"
                    for p in f.stepless_processes)
    return Evidence("proc", f"no engine step for {fmt_duration(q)}: the main thread of {who} has had no CPU "
                    "that long (the scheduler's record), so the counter was frozen before the first scrape too",
                    values={"stepless_s": round(q, 2), "pids": [p.pid for p in f.stepless_processes]})


def cpu_wait_evidence(f: Facts) -> Evidence | None:
    """An engine main thread runnable but off a CPU for CPU_WAIT_SHARE of the window or more
    (Facts.engine_cpu_wait): the host, not the engine, sets the pace."""
    w = f.engine_cpu_wait
    if w is None or not (mostly_queued(w) or f.engine_throttled):
        return None
    p, waited, span = w
    given = ": it was given none" if mostly_queued(w) else ""
    role = _ENGINE_NAMES.get(p.role, p.role.value)
    host = f.bundle.manifest.host
    load = host.get("loadavg", "").split()
    on = f" (load {load[0]} on {host['cpus']} CPUs at the capture's start)" if load and host.get("cpus") else ""
    values = {"pid": p.pid, "runq_s": round(waited, 2), "span_s": round(span, 2),
              "loadavg": host.get("loadavg"), "cpus": host.get("cpus")}
    limited = ""
    t = f.engine_throttling
    if t is not None and t[1] > 0 and t[0].cpu_limit is not None:
        lim = t[0].cpu_limit
        limited = (f"; its cgroup's CPU limit ({lim.cpus:.3g} CPUs: {lim.quota_us} µs of every {lim.period_us} µs) "
                   f"throttled it in {t[1]} of {t[2]} periods")
        values |= {"cpu_limit_cpus": round(lim.cpus, 4), "throttled_periods": t[1], "periods": t[2]}
    stolen = ""
    steal = f.host_steal
    if steal is not None and steal[2] >= STEAL_SHARE:
        stolen = (f"; the hypervisor took {steal[2]:.0%} of this VM's CPU time over the capture "
                  f"(steal: {steal[0]:.1f} CPU s in {steal[1]:.1f} s)")
        values |= {"steal_share": round(steal[2], 3), "steal_s": round(steal[0], 2)}
    return Evidence("proc", f"{role} pid {p.pid}'s main thread was runnable but waited for a CPU {waited:.1f} s "
                    f"of {span:.1f} s{given}{on}{limited}{stolen}", values=values)


def engine_cpu_evidence(f: Facts) -> Evidence | None:
    cores = f.engine_cores
    if cores is None:
        return None
    p = f.engine_core
    core, workers = f.engine_core_cores, f.worker_cores
    state = "spinning" if cores >= SPINNING_CORES else "parked" if cores <= PARKED_CORES else "busy"
    if state == "parked" and f.engine_waits_for_cpu:
        state = "runnable, given no CPU"
    elif state != "spinning" and f.engine_stepping:
        quiet = f.stepless_s or 0.0
        state = (f"stepping all the same: its main thread ran {quiet * 1000:.0f} ms before the last reading "
                 "and within 0.5 s of every one (a step that schedules nothing sleeps 1 ms)")
    split = f"EngineCore {core or 0:.2f}" + (f" + Workers {workers:.2f}" if workers is not None else "")
    return Evidence(
        source="proc",
        what=f"engine used {cores:.2f} cores over the window ({split}): {state}",
        values={"pid": p.pid if p else None, "cores": round(cores, 3),
                "engine_core_cores": None if core is None else round(core, 3),
                "worker_cores": None if workers is None else round(workers, 3), "state": p.state if p else None},
    )


def engine_stack_evidence(f: Facts) -> Evidence | None:
    dump = f.stack_of_role(Role.ENGINE_CORE)
    if dump is None:
        return None
    main = stk.engine_main_thread(dump)
    if main is None:
        return None
    where = stk.classify_engine_thread(main)
    frames = stk.frame_names(main)
    return Evidence(
        source="stack",
        what=f"EngineCore main thread: {where} (innermost: {frames[0] if frames else '?'})",
        values={"pid": dump.pid, "where": where, "frames": frames[:8]},
    )


def profile_evidence(f: Facts) -> list[Evidence]:
    """Where the EngineCore and each Worker spent the end-of-window burst of stack dumps."""
    out = []
    for p in f.last_processes:
        if p.role not in (Role.ENGINE_CORE, Role.WORKER):
            continue
        dumps = f.stack_burst(p.pid)
        if len(dumps) < 2:
            continue
        where = stk.classify_worker_thread if p.role == Role.WORKER else stk.classify_engine_thread
        prof = stk.profile(dumps, where)
        name = "Worker" if p.role == Role.WORKER else "EngineCore"
        parts = ", ".join(f"{n} {k}" for k, n in sorted(prof.items(), key=lambda kv: -kv[1]))
        out.append(Evidence("stack", f"{name} pid {p.pid}, {len(dumps)} stack samples: {parts}",
                            values={"pid": p.pid, "role": p.role.value, "samples": len(dumps), "profile": prof}))
    return out


def heartbeat_evidence(f: Facts) -> Evidence | None:
    m = f.last_metrics
    if m is None or not m.has_heartbeat:
        return None
    return Evidence(
        source="metrics",
        what=(
            f"engine heartbeat: {f.heartbeat_steps.delta or 0:.0f} steps, "
            f"{f.heartbeat_model_steps.delta or 0:.0f} model steps in the window; "
            f"last model step {m.heartbeat_model_step_age or 0:.1f} s ago"
        ),
        values={
            "steps_total": m.heartbeat_steps,
            "model_steps_total": m.heartbeat_model_steps,
            "last_step_age_s": m.heartbeat_step_age,
            "last_model_step_age_s": m.heartbeat_model_step_age,
        },
    )


def futex_evidence(p: ProcessSample, most: int = 3) -> Evidence | None:
    """How many of a process's threads sit in futex waits, and the `most` crowded addresses."""
    waiters = p.futex_waiters
    if not waiters.groups:
        return None
    return Evidence(
        "proc",
        f"{waiters.n_waiting} of {waiters.n_threads} threads of pid {p.pid} parked in futex waits "
        f"on {len(waiters.groups)} address(es)",
        values={"pid": p.pid, "futex_waits": {hex(g.addr): list(g.tids) for g in waiters.groups[:most]}},
    )


STARVED_ADVICE = (
    "A long request holds most of the KV pool; the queue drains only when it finishes or is preempted. "
    "Find it (vllm:request_params_max_tokens, your access log) and cap max_tokens per request.",
    "Limit concurrency per KV (--max-num-seqs, --max-model-len) or add KV capacity.",
)


def deadlock_process_evidence(f: Facts) -> list[Evidence]:
    """What the processes show of a stopped engine, for either deadlock verdict (the metrics' or the engine
    report's): CPU, heartbeat, stacks and where the Workers stopped, probes and futexes."""
    ev = list(present(engine_cpu_evidence(f), heartbeat_evidence(f), engine_stack_evidence(f)))
    ev += profile_evidence(f)
    ev += f.probe_evidence
    if f.engine_core is not None:
        ev += present(futex_evidence(f.engine_core))
    for w in f.workers:
        dump = f.stacks.get(w.pid)
        inner = stk.innermost_interesting(dump) if dump else None
        if inner:
            ev.append(Evidence("stack", f"Worker pid {w.pid} stuck in {inner}", values={"pid": w.pid}))
    return ev


def listening_evidence(f: Facts) -> Evidence | None:
    """The API server still listening (and so answering /metrics) while its engine is stopped."""
    api = f.api_server
    if api is None or not api.listening:
        return None
    return Evidence("proc", f"API server pid {api.pid} still listening on {', '.join(api.listening)} and answering "
                    "/metrics")
