"""The classifier: a pure function from an evidence bundle to a verdict with its reasons.

`classify(bundle)` builds a `View` (the facts derived from the raw evidence:
parsed log, metric series, process CPU rates, stacks) and tries the rules in
order. Each rule is a named predicate over the view whose docstring says
which hang it recognises and which vLLM behaviour it relies on; the first
that fires gives the verdict. Live evidence (processes, stacks, metric deltas)
is stronger than a log, so live rules come first.
"""

from __future__ import annotations

import datetime as _dt
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from wedgectl import stacks as stk
from wedgectl.collect.ebpf import parked_threads, probe_evidence  # pure readers of Sample.probes
from wedgectl.logparse import ParsedLog, StatsLine, format_stamp, parse_log
from wedgectl.metrics import MetricsParseError, MetricsSnapshot, parse_metrics
from wedgectl.types import (
    Bundle,
    Evidence,
    ProcessSample,
    Role,
    Sample,
    StackDump,
    Verdict,
    VerdictKind,
)

# Thresholds, with the reason for each.
SPINNING_CORES = 0.5  # engine (EngineCore + Workers) in a wedge: ~1.2 cores here; a parked one ~0
PARKED_CORES = 0.2  # a blocked engine sleeps in zmq poll: measured 0.01 cores
MIN_FROZEN_S = 2.0  # ~2 ms per token here: a live engine moves the counter many times in 2 s
CERTAIN_FROZEN_S = 10.0  # frozen this long with work in flight is past any sane step time
LOG_SILENCE_S = 25.0  # vLLM logs stats every 10 s at INFO while tokens flow; two missed lines
STATS_INTERVAL_S = 10.0  # VLLM_LOG_STATS_INTERVAL's default


@dataclass(frozen=True)
class Series:
    """One metric over the window: (unix time, value) pairs."""

    points: tuple[tuple[float, float], ...]

    @property
    def first(self) -> float | None:
        return self.points[0][1] if self.points else None

    @property
    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None

    @property
    def delta(self) -> float | None:
        return None if len(self.points) < 2 else self.points[-1][1] - self.points[0][1]

    @property
    def span_s(self) -> float:
        return 0.0 if len(self.points) < 2 else self.points[-1][0] - self.points[0][0]

    @property
    def rate(self) -> float | None:
        """Change per second between the first and last point."""
        return None if self.span_s <= 0 or self.delta is None else self.delta / self.span_s

    @property
    def frozen_s(self) -> float:
        """How long (seconds) the value has not changed, counted back from the last point."""
        if len(self.points) < 2:
            return 0.0
        t_last, v_last = self.points[-1]
        since = t_last
        for t, v in reversed(self.points):
            if v != v_last:
                break
            since = t
        return t_last - since


def slope_per_s(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, v); None with fewer than two distinct times."""
    if len(points) < 2:
        return None
    ts = [p[0] for p in points]
    if max(ts) == min(ts):
        return None
    slope, _ = statistics.linear_regression(ts, [p[1] for p in points])
    return slope


def iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def unix_to_logtime(t: float) -> float:
    """A unix time on the log's clock: local time, seconds since 2000-01-01 (see logparse)."""
    local = _dt.datetime.fromtimestamp(t)
    same_day_2000 = local.replace(year=2000) if not (local.month == 2 and local.day == 29) else local
    return (same_day_2000 - _dt.datetime(2000, 1, 1)).total_seconds()


def fmt_duration(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@dataclass
class View:
    """Facts derived from a bundle, computed once; rules read only this."""

    bundle: Bundle

    @cached_property
    def log(self) -> ParsedLog | None:
        return parse_log(self.bundle.log_lines) if self.bundle.log_lines else None

    @cached_property
    def samples(self) -> tuple[Sample, ...]:
        return self.bundle.samples

    @cached_property
    def is_live(self) -> bool:
        return bool(self.samples)

    @cached_property
    def scrapes(self) -> tuple[tuple[float, MetricsSnapshot], ...]:
        """Every /metrics scrape that parsed, with its time."""
        out = []
        for s in self.samples:
            if s.metrics is None or not s.metrics.ok:
                continue
            try:
                snap = parse_metrics(s.metrics.text or "")
            except MetricsParseError:
                continue
            out.append((s.metrics.t, snap))
        return tuple(out)

    @cached_property
    def failed_scrapes(self) -> int:
        return sum(1 for s in self.samples if s.metrics is not None and not s.metrics.ok)

    def series(self, getter: Callable[[MetricsSnapshot], float | None]) -> Series:
        return Series(tuple((t, v) for t, snap in self.scrapes if (v := getter(snap)) is not None))

    @cached_property
    def last_metrics(self) -> MetricsSnapshot | None:
        return self.scrapes[-1][1] if self.scrapes else None

    @cached_property
    def gen_tokens(self) -> Series:
        return self.series(lambda m: m.generation_tokens)

    @cached_property
    def prompt_tokens(self) -> Series:
        return self.series(lambda m: m.prompt_tokens)

    @cached_property
    def kv(self) -> Series:
        return self.series(lambda m: m.kv_usage)

    @cached_property
    def waiting(self) -> Series:
        return self.series(lambda m: m.waiting)

    @cached_property
    def running(self) -> Series:
        return self.series(lambda m: m.running)

    @cached_property
    def heartbeat_steps(self) -> Series:
        return self.series(lambda m: m.heartbeat_steps)

    @cached_property
    def heartbeat_model_steps(self) -> Series:
        return self.series(lambda m: m.heartbeat_model_steps)

    @cached_property
    def window_s(self) -> float:
        return 0.0 if len(self.samples) < 2 else self.samples[-1].t - self.samples[0].t

    # --- processes -------------------------------------------------------

    def processes_with_role(self, role: Role) -> list[tuple[float, ProcessSample]]:
        return [(s.t, p) for s in self.samples for p in s.processes if p.role == role]

    def cpu_by_pid(self, role: Role) -> dict[int, float]:
        """Mean cores each process of a role used between its first and last sample."""
        by_pid: dict[int, list[tuple[float, float]]] = {}
        for t, p in self.processes_with_role(role):
            by_pid.setdefault(p.pid, []).append((t, p.cpu_s))
        return {
            pid: (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
            for pid, pts in by_pid.items()
            if len(pts) >= 2 and pts[-1][0] > pts[0][0]
        }

    def cpu_cores(self, role: Role) -> float | None:
        rates = self.cpu_by_pid(role)
        return sum(rates.values()) if rates else None

    @cached_property
    def engine_cores(self) -> float | None:
        """Cores the engine burns: EngineCore plus its Workers. In a wedge on vLLM 0.32 the
        EngineCore sleeps 1 ms after each no-op step (~0.25 core) while every empty step is
        still broadcast to the Workers, which spin on the shared-memory queue (~1 core); in a
        blocked engine both sleep."""
        core, workers = self.cpu_cores(Role.ENGINE_CORE), self.cpu_cores(Role.WORKER)
        if core is None and workers is None:
            return None
        return (core or 0.0) + (workers or 0.0)

    @cached_property
    def last_processes(self) -> tuple[ProcessSample, ...]:
        for s in reversed(self.samples):
            if s.processes:
                return s.processes
        return ()

    def last_of_role(self, role: Role) -> ProcessSample | None:
        return next((p for p in self.last_processes if p.role == role), None)

    @cached_property
    def exited(self) -> bool:
        """The deployment was seen and then was gone by the last sample."""
        return bool(self.samples) and self.saw_processes and not self.samples[-1].processes

    @cached_property
    def saw_processes(self) -> bool:
        return bool(self.last_processes)

    @cached_property
    def stacks(self) -> dict[int, StackDump]:
        """The latest good stack dump of each pid."""
        out: dict[int, StackDump] = {}
        for s in self.samples:
            for d in s.stacks:
                if d.error is None and d.threads:
                    out[d.pid] = d
        return out

    def stack_burst(self, pid: int) -> list[StackDump]:
        """Every good dump of pid from the last sample that has any (the end-of-window burst)."""
        for s in reversed(self.samples):
            dumps = [d for d in s.stacks if d.pid == pid and d.error is None and d.threads]
            if dumps:
                return dumps
        return []

    def stack_of_role(self, role: Role) -> StackDump | None:
        for p in self.last_processes:
            if p.role == role and p.pid in self.stacks:
                return self.stacks[p.pid]
        return None

    @cached_property
    def last_health(self) -> int | None:
        for s in reversed(self.samples):
            if s.health_status is not None or s.health_error is not None:
                return s.health_status
        return None

    @cached_property
    def now_logtime(self) -> float | None:
        """The capture's end on the log's clock, when the capture was live."""
        return unix_to_logtime(self.samples[-1].t) if self.samples else None

    # --- log -------------------------------------------------------------

    @cached_property
    def stats(self) -> tuple[StatsLine, ...]:
        return self.log.stats if self.log else ()

    @cached_property
    def last_stats(self) -> StatsLine | None:
        return self.stats[-1] if self.stats else None

    @cached_property
    def scrapes_after_last_stats(self) -> int:
        """/metrics requests the API server answered after the last stats line."""
        if not self.log or not self.last_stats:
            return 0
        n = self.last_stats.lineno
        return sum(1 for a in self.log.access if a.lineno > n and a.path.startswith("/metrics") and a.status == 200)

    @cached_property
    def scrape_period_s(self) -> float | None:
        """Seconds between /metrics scrapes, from those between the longest run of stats lines
        10 s apart (a gap in the run means the clock of scrapes there is unknown)."""
        if not self.log:
            return None
        run = _longest_contiguous_run(self.stats)
        if run is None:
            return None
        first, last = run
        n = sum(1 for a in self.log.access if first.lineno < a.lineno < last.lineno and a.path.startswith("/metrics"))
        return (last.t - first.t) / n if n else None

    @cached_property
    def log_silence_s(self) -> float | None:
        """How long the stats lines have been silent: by the clock when live, else by scrape count."""
        if not self.last_stats or self.last_stats.t is None:
            return None
        if self.now_logtime is not None and self.now_logtime >= self.last_stats.t:
            return self.now_logtime - self.last_stats.t
        later = [x.t for x in _all_timed(self.log) if x.t is not None and x.lineno > self.last_stats.lineno]
        if later and max(later) > self.last_stats.t:
            return max(later) - self.last_stats.t
        if self.scrape_period_s and self.scrapes_after_last_stats:
            return self.scrapes_after_last_stats * self.scrape_period_s
        return None


def _all_timed(log: ParsedLog | None):
    if log is None:
        return []
    return [*log.stats, *log.shutdown, *log.failures, *log.startup]


def _longest_contiguous_run(stats: Sequence[StatsLine]) -> tuple[StatsLine, StatsLine] | None:
    best: tuple[StatsLine, StatsLine] | None = None
    start = 0
    for i in range(1, len(stats) + 1):
        broken = i == len(stats) or (
            stats[i].t is None or stats[i - 1].t is None or stats[i].t - stats[i - 1].t > 3 * STATS_INTERVAL_S
        )
        if broken:
            a, b = stats[start], stats[i - 1]
            if b.t is not None and a.t is not None and b.t > a.t:
                if best is None or (b.t - a.t) > (best[1].t - best[0].t):
                    best = (a, b)
            start = i
    return best


_LOG_HEADER = re.compile(
    r"^\s*(?:\([\w:.-]+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):?\s+)?"
    r"(?:\d{2}-\d{2} \d{2}:\d{2}:\d{2}\s+)?(?:\[[\w./-]+:\d+\]\s*)?"
)


def _message(text: str) -> str:
    """A log line without its '(APIServer pid=N) INFO 12-01 08:24:14 [file.py:N]' header."""
    return _LOG_HEADER.sub("", text, count=1).strip()


def _stats_evidence(s: StatsLine, what: str) -> Evidence:
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


def _metrics_evidence(v: View, what: str) -> Evidence:
    m = v.last_metrics
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
    t = iso(v.scrapes[-1][0]) if v.scrapes else None
    return Evidence(source="metrics", what=what, t=t, values=values)


def _counter_evidence(v: View) -> Evidence:
    g = v.gen_tokens
    return Evidence(
        source="metrics",
        what=(
            f"vllm:generation_tokens_total frozen at {g.last:.0f} for {g.frozen_s:.1f} s"
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


def _engine_cpu_evidence(v: View) -> Evidence | None:
    cores = v.engine_cores
    if cores is None:
        return None
    p = v.last_of_role(Role.ENGINE_CORE)
    core = v.cpu_cores(Role.ENGINE_CORE)
    workers = v.cpu_cores(Role.WORKER)
    state = "spinning" if cores >= SPINNING_CORES else "parked" if cores <= PARKED_CORES else "busy"
    split = f"EngineCore {core or 0:.2f}" + (f" + Workers {workers:.2f}" if workers is not None else "")
    return Evidence(
        source="proc",
        what=f"engine used {cores:.2f} cores over the window ({split}): {state}",
        values={"pid": p.pid if p else None, "cores": round(cores, 3), "engine_core_cores": None if core is None else round(core, 3),
                "worker_cores": None if workers is None else round(workers, 3), "state": p.state if p else None},
    )


def _engine_stack_evidence(v: View) -> Evidence | None:
    dump = v.stack_of_role(Role.ENGINE_CORE)
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


def _profile_evidence(v: View) -> list[Evidence]:
    """Where the EngineCore and each Worker spent the end-of-window burst of stack dumps."""
    out = []
    for p in v.last_processes:
        if p.role not in (Role.ENGINE_CORE, Role.WORKER):
            continue
        dumps = v.stack_burst(p.pid)
        if len(dumps) < 2:
            continue
        where = stk.classify_worker_thread if p.role == Role.WORKER else stk.classify_engine_thread
        prof = stk.profile(dumps, where)
        name = "Worker" if p.role == Role.WORKER else "EngineCore"
        parts = ", ".join(f"{n} {k}" for k, n in sorted(prof.items(), key=lambda kv: -kv[1]))
        out.append(Evidence("stack", f"{name} pid {p.pid}, {len(dumps)} stack samples: {parts}",
                            values={"pid": p.pid, "role": p.role.value, "samples": len(dumps), "profile": prof}))
    return out


def _worker_model_share(v: View) -> float | None:
    """The share of Worker stack samples inside execute_model (None without a burst)."""
    total = inside = 0
    for p in v.last_processes:
        if p.role == Role.WORKER:
            prof = stk.profile(v.stack_burst(p.pid), stk.classify_worker_thread)
            total += sum(prof.values())
            inside += prof.get(stk.WORKER_IN_MODEL, 0)
    return inside / total if total >= 2 else None


def _heartbeat_evidence(v: View) -> Evidence | None:
    m = v.last_metrics
    if m is None or not m.has_heartbeat:
        return None
    return Evidence(
        source="metrics",
        what=(
            f"engine heartbeat: {v.heartbeat_steps.delta or 0:.0f} steps, "
            f"{v.heartbeat_model_steps.delta or 0:.0f} model steps in the window; "
            f"last model step {m.heartbeat_model_step_age or 0:.1f} s ago"
        ),
        values={
            "steps_total": m.heartbeat_steps,
            "model_steps_total": m.heartbeat_model_steps,
            "last_step_age_s": m.heartbeat_step_age,
            "last_model_step_age_s": m.heartbeat_model_step_age,
        },
    )


def _present(*items: Evidence | None) -> tuple[Evidence, ...]:
    return tuple(e for e in items if e is not None)


def _work_in_flight(v: View) -> tuple[float, float]:
    m = v.last_metrics
    return ((m.running or 0.0) if m else 0.0, (m.waiting or 0.0) if m else 0.0)


def _shutdown_lines(v: View):
    return v.log.shutdown if v.log else ()


def _is_finish(line) -> bool:
    """uvicorn's last words on a clean exit: vLLM 0.32 ends with 'Application shutdown complete.'
    (its own serve loop never prints 'Finished server process')."""
    return line.kind == "finished" or (line.kind == "application_shutdown" and "complete" in line.text)


def _shutdown_began(v: View):
    """The first shutdown line that is not followed by 'Finished server process'."""
    lines = _shutdown_lines(v)
    finished = [s for s in lines if _is_finish(s)]
    began = [s for s in lines if not _is_finish(s)]
    if not began:
        return None
    last_finished = finished[-1].lineno if finished else -1
    pending = [s for s in began if s.lineno > last_finished]
    return pending[0] if pending else None


# ---------------------------------------------------------------- live rules


def live_engine_dead(v: View) -> Verdict | None:
    """The engine is gone: EngineDeadError in the log, /health 503, or no EngineCore beside a
    listening API server. vLLM turns /health to 503 only after EngineDeadError; the API server
    stays up and fails every request."""
    api = v.last_of_role(Role.API_SERVER)
    if not v.is_live or api is None:
        return None
    engine = v.last_of_role(Role.ENGINE_CORE)
    dead_lines = [f for f in (v.log.failures if v.log else ()) if f.kind == "engine_dead"]
    if v.last_health == 503 or (engine is None and api.listening and dead_lines):
        ev = [Evidence("proc", f"API server pid {api.pid} alive, listening on {', '.join(api.listening) or 'nothing'}; "
                       f"{'no EngineCore process' if engine is None else 'EngineCore pid %d' % engine.pid}")]
        if v.last_health == 503:
            ev.append(Evidence("metrics", "GET /health answered 503"))
        ev += [Evidence("log", _message(f.text)[:160], t=format_stamp(f.t) if f.t is not None else None, values={"line": f.lineno}) for f in dead_lines[:2]]
        return Verdict(
            VerdictKind.ENGINE_DEAD, 0.95, "The engine process died; the API server answers but every request fails.",
            "live_engine_dead", tuple(ev),
            ("Read the first traceback in the EngineCore log: it names the cause.", "Restart the server; a supervisor should treat /health 503 as fatal."),
        )
    return None


def live_shutdown_hang(v: View) -> Verdict | None:
    """Shutdown began and the API server never exits: the listener is closed (no LISTEN socket,
    /metrics refused) while the process lives. Measured on vLLM 0.32: SIGTERM kills the EngineCore
    and Worker at once, then uvicorn waits for open client connections forever ("Waiting for
    connections to close"); a second SIGTERM does nothing."""
    api = v.last_of_role(Role.API_SERVER)
    if not v.is_live or api is None or api.listening or v.exited:
        return None  # an API server that exited during the capture finished its shutdown
    if api.connections is None:
        return None  # its sockets were unreadable (no CAP_SYS_PTRACE): "no listener" is unknown
    began = _shutdown_began(v)
    stack = v.stack_of_role(Role.API_SERVER)
    shutdown_frames = stk.shutdown_frames(stack) if stack else []
    engine = v.last_of_role(Role.ENGINE_CORE)
    no_listener_all = all(not p.listening for _, p in v.processes_with_role(Role.API_SERVER))
    if began is None and not shutdown_frames:
        return None
    if not no_listener_all:
        return None
    ev = [
        Evidence(
            "proc",
            f"API server pid {api.pid} alive ({api.state}, {api.num_threads} threads) with no listening socket",
            values={"pid": api.pid, "state": api.state, "threads": api.num_threads, "connections": api.connections},
        )
    ]
    facts: dict[str, object] = {}
    if api.connections:
        ev.append(Evidence("proc", f"{api.connections} client connection(s) still open: uvicorn waits for them to close",
                           values={"connections": api.connections}))
    if engine is None:
        ev.append(Evidence("proc", "EngineCore and Worker already exited"))
    waiters = stk_futex_summary(api)
    if waiters:
        ev.append(waiters)
    if began is not None:
        ago = None
        if began.t is not None and v.now_logtime is not None and v.now_logtime >= began.t:
            ago = v.now_logtime - began.t
            facts["shutdown_age_s"] = round(ago, 1)
        ev.append(Evidence("log", f"shutdown began: {_message(began.text)[:120]}" + (f" ({fmt_duration(ago)} ago)" if ago is not None else ""),
                           t=began.stamp if hasattr(began, "stamp") else (format_stamp(began.t) if began.t is not None else None),
                           values={"line": began.lineno, "kind": began.kind}))
        waiting = [s for s in _shutdown_lines(v) if s.kind == "waiting_connections" and s.lineno >= began.lineno]
        if waiting:
            ev.append(Evidence("log", "uvicorn: Waiting for connections to close", values={"line": waiting[0].lineno}))
    if shutdown_frames:
        ev.append(Evidence("stack", f"API server stack in shutdown: {shutdown_frames[0]}", values={"frames": shutdown_frames[:6]}))
    ev += probe_evidence(v.samples)
    confidence = 0.9 if (began is not None and (api.connections or shutdown_frames)) else 0.8
    return Verdict(
        VerdictKind.SHUTDOWN_HANG, confidence,
        "Shutdown began but the API server never exits: listener closed, process alive"
        + (f", {api.connections} client connection(s) held open." if api.connections else "."),
        "live_shutdown_hang", tuple(ev),
        (
            "Only SIGKILL clears it now: kill -9 %d (the supervisor should escalate after a bound)." % api.pid,
            "Prevent it: run the patched engine (bounded shutdown) or give clients a timeout.",
        ),
        facts,
    )


def stk_futex_summary(p: ProcessSample) -> Evidence | None:
    waits = [t for t in p.threads if t.in_futex_wait]
    if not waits:
        return None
    by_addr: dict[int, list[int]] = {}
    for t in waits:
        by_addr.setdefault(t.futex_addr or 0, []).append(t.tid)
    top = sorted(by_addr.items(), key=lambda kv: -len(kv[1]))[:3]
    return Evidence(
        "proc",
        f"{len(waits)} of {len(p.threads)} threads of pid {p.pid} parked in futex waits on {len(by_addr)} address(es)",
        values={"pid": p.pid, "futex_waits": {hex(a): tids for a, tids in top}},
    )


def live_admission_wedge(v: View) -> Verdict | None:
    """Work is waiting that the scheduler never admits, and nothing executes: waiting >= 1, running
    0 (a self-preempted request sits in waiting too), token counters frozen, and the EngineCore
    spinning (vLLM's busy loop calls schedule() ~1000 times/s, each refusing the request: the
    waiting loop's allocate_slots() returns None and breaks). KV usage ~0 shows it is not pressure
    from other requests: the request cannot fit even in an empty pool."""
    running, waiting = _work_in_flight(v)
    g = v.gen_tokens
    if not v.scrapes or waiting < 1 or running > 0 or g.delta is None or g.delta != 0 or g.span_s < MIN_FROZEN_S:
        return None
    m = v.last_metrics
    assert m is not None
    cores = v.engine_cores
    hb_steps, hb_model = v.heartbeat_steps, v.heartbeat_model_steps
    spinning_hb = hb_steps.delta is not None and hb_steps.delta > 0 and (hb_model.delta or 0) == 0
    spinning_cpu = cores is not None and cores >= SPINNING_CORES
    stack = v.stack_of_role(Role.ENGINE_CORE)
    where = stk.classify_engine_thread(stk.engine_main_thread(stack)) if stack else None
    parked = (cores is not None and cores <= PARKED_CORES) and not spinning_hb
    if parked:
        return None  # a blocked engine with stale gauges: the deadlock rule decides
    if spinning_cpu or spinning_hb:
        confidence = 0.95 if g.frozen_s >= CERTAIN_FROZEN_S or spinning_hb else 0.85
    else:
        confidence = 0.6  # metrics only: gauges alone cannot tell a wedge from a blocked engine
    ev = [
        _metrics_evidence(v, f"{waiting:.0f} waiting"
                          + (f" ({m.waiting_capacity:.0f} for capacity)" if m.waiting_capacity else "")
                          + f", 0 running, KV cache {((m.kv_usage or 0) * 100):.1f}% used"),
        _counter_evidence(v),
    ]
    ev += _present(_engine_cpu_evidence(v), _heartbeat_evidence(v))
    ev += _profile_evidence(v) or list(_present(_engine_stack_evidence(v)))
    ev += probe_evidence(v.samples)
    share = _worker_model_share(v)
    if where == stk.IN_MODEL and not (spinning_cpu or spinning_hb):
        # A parked engine inside execute_model with stale gauges is the deadlock's shape; a
        # spinning one is only broadcasting its no-op steps to the workers.
        confidence = min(confidence, 0.6)
    advice = [
        "The request needs more KV blocks than the pool can ever free: it will wait forever. "
        "Abort it (or restart), then size the pool: raise --gpu-memory-utilization / "
        "--num-gpu-blocks-override, or lower --max-model-len below the servable context.",
        "Run the patched engine: it fails such requests at once with the blocks needed and available.",
    ]
    if not v.saw_processes:
        advice.append("Metrics only: run `wedgectl diagnose --pid PID` to confirm the EngineCore is spinning.")
    return Verdict(
        VerdictKind.ADMISSION_WEDGE, confidence,
        f"{waiting:.0f} request(s) waiting that the scheduler never admits; nothing runs, "
        f"tokens frozen {fmt_duration(g.frozen_s)}" + (", engine spinning." if spinning_cpu or spinning_hb else "."),
        "live_admission_wedge", tuple(ev), tuple(advice),
        {"frozen_s": round(g.frozen_s, 2), "engine_cores": cores, "waiting": waiting,
         "worker_model_share": share, "kv_usage_pct": round((m.kv_usage or 0) * 100, 2),
         "waiting_capacity": m.waiting_capacity},
    )


def live_engine_deadlock(v: View) -> Verdict | None:
    """The engine stopped stepping with work in flight while the API process answers /metrics:
    running >= 1 (or waiting) and every counter frozen, the EngineCore parked (no CPU; main
    thread in execute_model / collective_rpc / a shared-memory dequeue / a device sync). In a
    blocked vLLM engine nothing is published, so every gauge holds its last value."""
    running, waiting = _work_in_flight(v)
    g = v.gen_tokens
    if not v.scrapes or (running + waiting) < 1 or g.delta is None or g.delta != 0 or g.span_s < MIN_FROZEN_S:
        return None
    cores = v.engine_cores
    hb_steps = v.heartbeat_steps
    hb_frozen = hb_steps.delta == 0 and hb_steps.span_s >= MIN_FROZEN_S
    parked = cores is not None and cores <= PARKED_CORES
    stack = v.stack_of_role(Role.ENGINE_CORE)
    where = stk.classify_engine_thread(stk.engine_main_thread(stack)) if stack else None
    if running < 1 and not (parked or hb_frozen):
        return None
    if cores is not None and cores >= SPINNING_CORES and not hb_frozen and where != stk.IN_MODEL:
        return None  # a spinning engine is stepping: not a deadlock
    if parked or hb_frozen:
        confidence = 0.95 if g.frozen_s >= CERTAIN_FROZEN_S else 0.85
    elif where == stk.IN_MODEL:
        confidence = 0.8
    else:
        confidence = 0.55 if running >= 1 else 0.4
    share = _worker_model_share(v)
    if share is not None and share >= 0.9 and confidence < 0.95 and (parked or hb_frozen):
        confidence = 0.95  # every Worker sample inside execute_model, engine asleep: stuck in the step
    ev = [_metrics_evidence(v, f"{running:.0f} running, {waiting:.0f} waiting, all gauges frozen"), _counter_evidence(v)]
    ev += _present(_engine_cpu_evidence(v), _heartbeat_evidence(v), _engine_stack_evidence(v))
    ev += _profile_evidence(v)
    ev += probe_evidence(v.samples)
    if parked_threads(v.samples) and (parked or hb_frozen) and confidence < 0.95:
        confidence = 0.95  # a main thread parked the whole window on one futex, never woken
    engine = v.last_of_role(Role.ENGINE_CORE)
    if engine is not None:
        ev += _present(stk_futex_summary(engine))
    for w in (p for p in v.last_processes if p.role == Role.WORKER):
        dump = v.stacks.get(w.pid)
        if dump:
            inner = stk.innermost_interesting(dump)
            if inner:
                ev.append(Evidence("stack", f"Worker pid {w.pid} stuck in {inner}", values={"pid": w.pid}))
    api = v.last_of_role(Role.API_SERVER)
    if api is not None and api.listening:
        ev.append(Evidence("proc", f"API server pid {api.pid} still listening on {', '.join(api.listening)} and answering /metrics"))
    advice = (
        "Capture native stacks of the EngineCore and Workers (`wedgectl diagnose --pid PID --native`): "
        "the innermost frame names the kernel, collective or lock it waits on.",
        "Restart the server; /health stays 200, so point liveness probes at the patched engine's heartbeat.",
    )
    if not v.saw_processes:
        advice = advice + ("Metrics only: run `wedgectl diagnose --pid PID` to see where the engine is parked.",)
    return Verdict(
        VerdictKind.ENGINE_DEADLOCK, confidence,
        f"The engine stopped with {running:.0f} running / {waiting:.0f} waiting; counters frozen "
        f"{fmt_duration(g.frozen_s)}" + (", EngineCore parked." if parked else "."),
        "live_engine_deadlock", tuple(ev), advice,
        {"frozen_s": round(g.frozen_s, 2), "engine_cores": cores, "running": running, "waiting": waiting,
         "worker_model_share": share},
    )


def live_starved(v: View) -> Verdict | None:
    """Live but the queue does not drain: tokens advance while requests wait for capacity and none
    is admitted (prompt tokens flat, waiting not falling). The seed-000 shape: one runaway request
    holding most of the KV pool; vLLM admits nothing until blocks free up."""
    running, waiting = _work_in_flight(v)
    g, p = v.gen_tokens, v.prompt_tokens
    if not v.scrapes or waiting < 1 or g.delta is None or g.delta <= 0:
        return None
    w = v.waiting
    if w.first is not None and w.last is not None and w.last < w.first:
        return None  # draining
    if (p.delta or 0) > 0:
        return None  # something was admitted in the window: a busy queue, not a starved one
    kv_rate = slope_per_s(v.kv.points)
    facts: dict[str, object] = {"tokens_per_s": round(g.rate or 0, 2), "waiting": waiting, "running": running}
    kv_last = v.kv.last
    ev = [
        _metrics_evidence(v, f"{waiting:.0f} waiting behind {running:.0f} running; nothing admitted in the window"),
        _counter_evidence(v),
    ]
    if kv_last is not None:
        facts["kv_usage_pct"] = round(kv_last * 100, 1)
    if kv_rate is not None and kv_last is not None:
        per_min = kv_rate * 100 * 60
        facts["kv_growth_pct_per_min"] = round(per_min, 2)
        if kv_rate > 0:
            facts["seconds_to_kv_full"] = round((1 - kv_last) / kv_rate, 1)
        ev.append(Evidence("metrics", f"KV cache {kv_last * 100:.1f}% used, growing {per_min:.2f} %/min"
                           + (f"; full in ~{fmt_duration(facts['seconds_to_kv_full'])}" if kv_rate > 0 else ""),
                           values={"kv_usage_pct": round(kv_last * 100, 1), "pct_per_min": round(per_min, 2)}))
    ev += _present(_engine_cpu_evidence(v))
    return Verdict(
        VerdictKind.STARVED, 0.85,
        f"Not a hang: tokens advance at {g.rate or 0:.1f}/s but {waiting:.0f} request(s) wait for KV capacity behind {running:.0f} running.",
        "live_starved", tuple(ev), _STARVED_ADVICE, facts,
    )


_STARVED_ADVICE = (
    "A long request holds most of the KV pool; the queue drains only when it finishes or is preempted. "
    "Find it (vllm:request_params_max_tokens, your access log) and cap max_tokens per request.",
    "Limit concurrency per KV (--max-num-seqs, --max-model-len) or add KV capacity.",
)


def live_progressing(v: View) -> Verdict | None:
    """Tokens advance between scrapes: the engine is live and serving."""
    g = v.gen_tokens
    if not v.scrapes or g.delta is None or g.delta <= 0:
        return None
    running, waiting = _work_in_flight(v)
    return Verdict(
        VerdictKind.PROGRESSING, 0.9,
        f"Serving: {g.rate or 0:.1f} tokens/s, {running:.0f} running, {waiting:.0f} waiting.",
        "live_progressing", _present(_counter_evidence(v), _metrics_evidence(v, "gauges at the last scrape"), _engine_cpu_evidence(v)),
        (), {"tokens_per_s": round(g.rate or 0, 2)},
    )


def live_idle(v: View) -> Verdict | None:
    """Nothing in flight and nothing waiting; the engine is not stuck, just unused."""
    if not v.scrapes or len(v.scrapes) < 2:
        return None
    running, waiting = _work_in_flight(v)
    if running or waiting:
        return None
    cores = v.engine_cores
    return Verdict(
        VerdictKind.IDLE, 0.9 if cores is None or cores < SPINNING_CORES else 0.6,
        "Idle: no request running or waiting.",
        "live_idle", _present(_metrics_evidence(v, "0 running, 0 waiting"), _engine_cpu_evidence(v)),
    )


# ----------------------------------------------------------------- log rules


def log_engine_dead(v: View) -> Verdict | None:
    """EngineDeadError in the log: the EngineCore died (often after 'No available shared memory
    broadcast block found', vLLM's sign of a worker that stopped answering) and the API server
    now fails every request."""
    dead = [f for f in (v.log.failures if v.log else ()) if f.kind in ("engine_dead", "engine_core_failed")]
    if not dead:
        return None
    shm = [f for f in v.log.failures if f.kind == "shm_broadcast_timeout"]
    ev = [Evidence("log", _message(f.text)[:160], t=format_stamp(f.t) if f.t is not None else None, values={"line": f.lineno}) for f in dead[:3]]
    if shm:
        ev.insert(0, Evidence("log", f"{len(shm)} 'No available shared memory broadcast block' warning(s) before: a worker stopped answering",
                              t=format_stamp(shm[0].t) if shm[0].t is not None else None, values={"line": shm[0].lineno}))
    return Verdict(
        VerdictKind.ENGINE_DEAD, 0.9,
        "The engine died (EngineDeadError); requests fail until the server restarts.",
        "log_engine_dead", tuple(ev),
        ("Read the first traceback before the EngineDeadError: it names the cause.",
         "Restart the server; make the supervisor treat /health 503 as fatal."),
    )


def log_shutdown_hang(v: View) -> Verdict | None:
    """A shutdown began (signal received, '[shutdown]', uvicorn 'Shutting down' / 'Waiting for
    connections to close') and 'Finished server process' never follows. vLLM 0.32's uvicorn waits
    for open client connections with no bound."""
    began = _shutdown_began(v)
    if began is None or v.exited:
        return None  # a live capture saw the process go: the shutdown finished
    waiting = [s for s in _shutdown_lines(v) if s.kind == "waiting_connections" and s.lineno >= began.lineno]
    ev = [Evidence("log", f"shutdown began: {_message(began.text)[:120]}", t=format_stamp(began.t) if began.t is not None else None,
                   values={"line": began.lineno, "kind": began.kind})]
    if waiting:
        ev.append(Evidence("log", "uvicorn: Waiting for connections to close (no bound)", values={"line": waiting[0].lineno}))
    ev.append(Evidence("log", "no 'Finished server process' after it", values={"last_line": v.log.n_lines if v.log else None}))
    return Verdict(
        VerdictKind.SHUTDOWN_HANG, 0.75 if waiting else 0.6,
        "Shutdown began and the log never says the server finished exiting.",
        "log_shutdown_hang", tuple(ev),
        ("Check the pid is still alive: `wedgectl diagnose --pid PID` shows the listener and where threads wait.",
         "Clear it with SIGKILL; prevent it with the patched engine (bounded shutdown) or client timeouts."),
    )


def log_engine_deadlock(v: View) -> Verdict | None:
    """Stats lines stop while the API server keeps answering GET /metrics, and the last stats line
    had requests running at 0 tokens/s. vLLM logs the stats line at INFO only while throughput is
    non-zero (then once more at 0.0), so a stop with Running >= 1 means the engine stopped
    producing with work in flight (seed 002)."""
    s = v.last_stats
    if s is None or s.running < 1:
        return None
    shm = [f for f in (v.log.failures if v.log else ()) if f.kind == "shm_broadcast_timeout"]
    silence = v.log_silence_s
    n_after = v.scrapes_after_last_stats
    silent = (silence is not None and silence >= LOG_SILENCE_S) or n_after >= 6 or bool(shm)
    # A whole stats interval at 0 tokens/s (prompt and generation) with requests running is a
    # stop in itself: a running request emits a token every step.
    zero_interval = s.gen_tps == 0 and s.prompt_tps == 0 and len(v.stats) >= 2
    if not (silent and (s.gen_tps == 0 or (silence or 0) >= LOG_SILENCE_S)) and not zero_interval:
        return None
    facts: dict[str, object] = {"scrapes_after_last_stats": n_after}
    what = f"stats lines stopped after {s.stamp or 'line %d' % s.lineno} with {s.running} running"
    if silence is not None:
        facts["engine_silent_s"] = round(silence, 1)
        what += f"; silent ~{fmt_duration(silence)}"
    ev = [
        _stats_evidence(s, "the last stats line: requests running, generation at %.1f tokens/s" % s.gen_tps),
        Evidence("log", what + f" while {n_after} GET /metrics were answered 200",
                 values={"scrapes_after": n_after, "scrape_period_s": v.scrape_period_s, "silent_s": facts.get("engine_silent_s")}),
    ]
    if len(v.stats) >= 2:
        prev = v.stats[-2]
        ev.insert(0, _stats_evidence(prev, "before it: %.1f tokens/s" % prev.gen_tps))
    if shm:
        ev.append(Evidence("log", f"'No available shared memory broadcast block' x{len(shm)}: a worker stopped answering", values={"line": shm[0].lineno}))
    return Verdict(
        VerdictKind.ENGINE_DEADLOCK, (0.8 if silence is not None else 0.7) if silent else 0.6,
        f"The engine stopped with {s.running} request(s) running"
        + (f" and has been silent ~{fmt_duration(silence)}" if silence is not None else "")
        + " while /metrics kept answering.",
        "log_engine_deadlock", tuple(ev),
        ("While it hangs, run `wedgectl diagnose --pid PID`: EngineCore CPU and stacks confirm where it is parked.",
         "Restart the server; /health stays 200 in this state, so liveness probes will not."),
        facts,
    )


def log_admission_wedge(v: View) -> Verdict | None:
    """The last stats line shows requests waiting, none running and no throughput, then the stats
    stop (or repeat unchanged): the scheduler never admits the waiting request although nothing
    holds the engine. Seed 003's shape (waiting=1, KV 0 %)."""
    s = v.last_stats
    if s is None or s.running != 0 or s.waiting < 1 or s.gen_tps > 0 or s.prompt_tps > 0:
        return None
    silence = v.log_silence_s
    silent = (silence is not None and silence >= LOG_SILENCE_S) or v.scrapes_after_last_stats >= 6
    # The line itself covers a whole interval (10 s) in which a request waited while nothing ran
    # and nothing was computed: with an idle engine, vLLM admits a waiting request at once.
    if not silent and len(v.stats) < 2:
        return None
    return Verdict(
        VerdictKind.ADMISSION_WEDGE, 0.75 if silent else 0.65,
        f"{s.waiting} request(s) waiting, none running, no tokens: the scheduler never admits them"
        + (f" (~{fmt_duration(silence)})." if silence is not None else "."),
        "log_admission_wedge",
        (_stats_evidence(s, f"the last stats line: 0 running, {s.waiting} waiting, KV {s.kv_usage_pct:.1f}%"),
         Evidence("log", f"no stats line since, while {v.scrapes_after_last_stats} GET /metrics were answered 200"
                  + (f" (~{fmt_duration(silence)})" if silence is not None else ""),
                  values={"scrapes_after": v.scrapes_after_last_stats, "silent_s": silence})),
        ("Confirm live: `wedgectl diagnose --pid PID` (EngineCore spinning, waiting by reason capacity).",
         "Size the KV pool above max_model_len, or run the patched engine, which fails such requests at once."),
        {"engine_silent_s": silence},
    )


def log_starved(v: View) -> Verdict | None:
    """Tokens flow but the queue does not drain: generation > 0, waiting >= 1 and not falling,
    prompt throughput 0 (nothing admitted), KV usage climbing. The seed-000 shape: one long
    request grows its KV share until the pool is full; the waiting ones cannot fit."""
    window = list(v.stats[-12:])
    if len(window) < 3:
        return None
    s = window[-1]
    if s.waiting < 1 or any(x.gen_tps <= 0 for x in window) or s.waiting < window[0].waiting:
        return None
    if any(x.prompt_tps > 0 for x in window[1:]):
        return None
    timed = [(x.t, x.kv_usage_pct) for x in v.stats if x.t is not None and x.waiting >= 1]
    kv_rate = slope_per_s(timed)  # percent per second
    facts: dict[str, object] = {
        "waiting": s.waiting,
        "running": s.running,
        "tokens_per_s": s.gen_tps,
        "kv_usage_pct": s.kv_usage_pct,
    }
    first = next((x for x in v.stats if x.waiting >= 1), window[0])
    ev = [
        _stats_evidence(first, f"{first.waiting} waiting behind {first.running} running"),
        _stats_evidence(s, f"still {s.waiting} waiting; generation {s.gen_tps:.1f} tokens/s; no prompt tokens admitted"),
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
        VerdictKind.STARVED, 0.8,
        f"Not a hang: {s.running} request(s) generate {s.gen_tps:.1f} tokens/s while {s.waiting} wait for KV capacity"
        + (f"; KV full in ~{fmt_duration(facts['seconds_to_kv_full'])}." if "seconds_to_kv_full" in facts else "."),
        "log_starved", tuple(ev), _STARVED_ADVICE, facts,
    )


def log_progressing(v: View) -> Verdict | None:
    """Stats lines report generation throughput and the queue drains or is empty."""
    s = v.last_stats
    if s is None or s.gen_tps <= 0:
        return None
    silence = v.log_silence_s
    if silence is not None and silence >= LOG_SILENCE_S and s.running >= 1:
        return None
    return Verdict(
        VerdictKind.PROGRESSING, 0.7,
        f"Serving at the last stats line: {s.gen_tps:.1f} tokens/s, {s.running} running, {s.waiting} waiting.",
        "log_progressing", (_stats_evidence(s, "the last stats line"),),
    )


def log_idle(v: View) -> Verdict | None:
    """The last stats line shows nothing running or waiting. vLLM logs a line at INFO only while
    tokens flow (then one all-zero line), so an idle server's log ends on that line. A log with
    no stats line at all does not decide: a wedge that began before the first 10 s interval
    looks the same."""
    s = v.last_stats
    if s is None or s.running or s.waiting:
        return None
    return Verdict(VerdictKind.IDLE, 0.7, "Idle: nothing running or waiting at the end of the log.", "log_idle",
                   (_stats_evidence(s, "the last stats line: nothing running or waiting"),))


LIVE_RULES: tuple[Callable[[View], Verdict | None], ...] = (
    live_engine_dead,
    live_shutdown_hang,
    live_admission_wedge,
    live_engine_deadlock,
    live_starved,
    live_progressing,
    live_idle,
)
LOG_RULES: tuple[Callable[[View], Verdict | None], ...] = (
    log_engine_dead,
    log_shutdown_hang,
    log_engine_deadlock,
    log_admission_wedge,
    log_starved,
    log_progressing,
    log_idle,
)


def classify(bundle: Bundle) -> Verdict:
    """The verdict for a bundle: the first live rule that fires, else the first log rule."""
    v = View(bundle)
    if v.is_live:
        for rule in LIVE_RULES:
            verdict = rule(v)
            if verdict is not None:
                return _with_caveats(v, verdict)
    for rule in LOG_RULES:
        if v.log is None:
            break
        verdict = rule(v)
        if verdict is not None:
            return _with_caveats(v, verdict)
    return _inconclusive(v)


def _with_caveats(v: View, verdict: Verdict) -> Verdict:
    """Say what the evidence lacked, so a reader knows how far to trust it."""
    notes = []
    if v.exited:
        notes.append("the deployment exited during the capture; the evidence ends there")
    if v.is_live and not v.saw_processes and verdict.verdict not in (VerdictKind.IDLE, VerdictKind.PROGRESSING):
        notes.append("metrics-only evidence (no process access)")
    if v.is_live and v.saw_processes and not v.stacks:
        notes.append("no Python stacks (py-spy failed or was not run)")
    if not notes:
        return verdict
    return Verdict(
        verdict.verdict, verdict.confidence, verdict.summary, verdict.rule,
        verdict.evidence + tuple(Evidence("wedgectl", n) for n in notes), verdict.advice, verdict.facts,
    )


def _inconclusive(v: View) -> Verdict:
    ev: list[Evidence] = []
    advice = []
    if v.is_live:
        if not v.scrapes:
            ev.append(Evidence("metrics", f"no /metrics scrape parsed ({v.failed_scrapes} failed)"))
            advice.append("Check the metrics URL (--url) and that the API server is up.")
        elif v.window_s < MIN_FROZEN_S:
            advice.append("Sample longer (--window 10) so counter deltas mean something.")
        running, waiting = _work_in_flight(v)
        if v.scrapes:
            ev.append(_metrics_evidence(v, f"{running:.0f} running, {waiting:.0f} waiting"))
        ev += _present(_engine_cpu_evidence(v), _engine_stack_evidence(v))
    if v.log is not None:
        ev.append(Evidence("log", f"{v.log.n_lines} lines, {len(v.stats)} stats lines, {len(v.log.access)} access lines"))
        if not v.stats:
            ev.append(Evidence("log", "no stats lines: vLLM logs them only while tokens flow, so idle and stuck look alike"))
        advice.append("Capture the live process: `wedgectl diagnose --pid PID --save-bundle hang.tar.gz`.")
    if not advice:
        advice.append("Capture more: `wedgectl diagnose --pid PID --window 15`.")
    return Verdict(VerdictKind.INCONCLUSIVE, 0.0, "The evidence does not decide between the hang classes.",
                   "inconclusive", tuple(ev), tuple(advice))


__all__ = ["View", "Series", "classify", "LIVE_RULES", "LOG_RULES", "slope_per_s", "unix_to_logtime"]
