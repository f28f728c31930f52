"""The facts the classifier's rules read: derived once from a bundle, frozen, facts as properties."""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from wedgectl.read import stacks as stk
from wedgectl.classify import enginefacts as ef
from wedgectl.classify.probefacts import parked_threads, probe_evidence  # pure readers of Sample.probes
from wedgectl.read.logparse import FailureLine, ParsedLog, ShutdownLine, StatsLine, parse_log
from wedgectl.read.metrics import MetricsParseError, MetricsSnapshot, parse_metrics
from wedgectl.model.engine import EngineReading, RequestSample, SchedulerSummary
from wedgectl.model.types import Bundle, Evidence, ProcessSample, Role, Sample, StackDump
from wedgectl.classify.series import Series, main_runq, most_grown, stepless_of

# Thresholds, with the reason for each.
SPINNING_CORES = 0.5  # engine (EngineCore + Workers) in a wedge: ~1.2 cores here; a parked one ~0
PARKED_CORES = 0.2  # a blocked engine sleeps in zmq poll: measured 0.01 cores
# A busy loop that steps keeps its main thread on a CPU every few ms (vLLM sleeps 1 ms after a step that
# scheduled nothing); a blocked one has not run since it blocked. Generous for a loaded host's run queue.
STEPPING_QUIET_S = 0.5
MIN_FROZEN_S = 2.0  # ~2 ms per token here: a live engine moves the counter many times in 2 s
CERTAIN_FROZEN_S = 10.0  # frozen this long with work in flight is past any sane step time
SHORT_SPAN_S = 0.8  # two scrapes about a second apart: a window that other evidence may extend or decide
LOG_SILENCE_S = 25.0  # vLLM logs stats every 10 s at INFO while tokens flow; two missed lines
STATS_INTERVAL_S = 10.0  # VLLM_LOG_STATS_INTERVAL's default
# An engine main thread runnable but off a CPU for at least this share of the window is starved by
# the host: a blocked engine parks (its run delay stands still), a starved one queues for a CPU.
# Measured on a 2-core host at load ~9: the EngineCore runnable, 0.00 cores, for 3 s of 3 s.
CPU_WAIT_SHARE = 0.5
QUEUED_MIN_SPAN_S = 0.2  # the shortest span over which a queued engine is told from an idle one
# The hypervisor took at least this share of the host's CPU time over the capture (steal): worth
# naming. A quiet 2-vCPU VM under three CPU hogs lost 0.3 %; a crowded one, about 9 % of a CPU
# over a 7 s probe window.
STEAL_SHARE = 0.10


def unix_to_logtime(t: float) -> float:
    """A unix time on the log's clock: local time, seconds since 2000-01-01 (see logparse)."""
    local = _dt.datetime.fromtimestamp(t)
    same_day_2000 = local.replace(year=2000) if not (local.month == 2 and local.day == 29) else local
    return (same_day_2000 - _dt.datetime(2000, 1, 1)).total_seconds()


def is_finish(line: ShutdownLine) -> bool:
    """uvicorn's last words on a clean exit: vLLM 0.32 ends with 'Application shutdown complete.'
    (its own serve loop never prints 'Finished server process')."""
    return line.kind == "finished" or (line.kind == "application_shutdown" and "complete" in line.text)


def _metric_series(snapshot_property: str) -> cached_property:
    """A fact: one MetricsSnapshot property over the window's scrapes (a Series)."""

    def read(facts: Facts) -> Series:
        return facts.series(lambda m: getattr(m, snapshot_property))

    read.__doc__ = f"MetricsSnapshot.{snapshot_property} over the window."
    return cached_property(read)


def mostly_queued(w: tuple[ProcessSample, float, float] | None) -> bool:
    """A most_grown run-delay reading (process, seconds queued, span) queued CPU_WAIT_SHARE of its span or more."""
    return w is not None and w[1] >= CPU_WAIT_SHARE * w[2]


def mostly_throttled(t: tuple[ProcessSample, int, int] | None) -> bool:
    """A Facts.engine_throttling reading (process, throttled periods, periods) out of quota in half the periods or
    more."""
    return t is not None and t[2] > 0 and t[1] >= t[2] / 2


@dataclass(frozen=True)
class Facts:
    """Facts derived from a bundle; rules read only this.

    Each fact is a cached property: the rules, their evidence builders and the caveats read
    the same facts many times, and a live sampler or `top` classifies after every sample."""

    bundle: Bundle

    # --- the window and its scrapes ----------------------------------------

    @cached_property
    def log(self) -> ParsedLog | None:
        return parse_log(self.bundle.log_lines) if self.bundle.log_lines else None

    @property
    def samples(self) -> tuple[Sample, ...]:
        return self.bundle.samples

    @property
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
    def running(self) -> float:
        """Requests running at the last scrape (0 without one)."""
        m = self.last_metrics
        return (m.running or 0.0) if m else 0.0

    @cached_property
    def waiting(self) -> float:
        """Requests waiting at the last scrape (0 without one)."""
        m = self.last_metrics
        return (m.waiting or 0.0) if m else 0.0

    gen_tokens = _metric_series("generation_tokens")
    prompt_tokens = _metric_series("prompt_tokens")
    kv = _metric_series("kv_usage")
    waiting_series = _metric_series("waiting")
    heartbeat_steps = _metric_series("heartbeat_steps")
    heartbeat_model_steps = _metric_series("heartbeat_model_steps")

    @cached_property
    def window_s(self) -> float:
        return 0.0 if len(self.samples) < 2 else self.samples[-1].t - self.samples[0].t

    @cached_property
    def tokens_advance(self) -> bool:
        """The generation counter rose over the window's scrapes."""
        g = self.gen_tokens
        return bool(self.scrapes) and g.delta is not None and g.delta > 0

    @cached_property
    def tokens_frozen_s(self) -> float:
        """How long the generation counter has not moved: its frozen span over the scrapes, or, once
        it held over two scrapes (SHORT_SPAN_S), as long as the engine has taken no step
        (stepless_s): a token is counted only when a step produced it, so the kernel's record of
        the stepping threads reaches back before the first scrape."""
        g = self.gen_tokens
        if g.delta != 0 or g.span_s < SHORT_SPAN_S:
            return g.frozen_s
        return max(g.frozen_s, self.stepless_s or 0.0)

    @cached_property
    def tokens_frozen(self) -> bool:
        """The generation counter held still for at least MIN_FROZEN_S (tokens_frozen_s)."""
        return bool(self.scrapes) and self.gen_tokens.delta == 0 and self.tokens_frozen_s >= MIN_FROZEN_S

    @cached_property
    def heartbeat_spinning(self) -> bool:
        """The plugin's heartbeat counts steps but no model step: the busy loop runs empty."""
        steps, model = self.heartbeat_steps, self.heartbeat_model_steps
        return steps.delta is not None and steps.delta > 0 and (model.delta or 0) == 0

    @cached_property
    def heartbeat_frozen(self) -> bool:
        """The plugin's step counter held still for at least MIN_FROZEN_S: the busy loop stopped."""
        steps = self.heartbeat_steps
        return steps.delta == 0 and steps.span_s >= MIN_FROZEN_S

    # --- processes -----------------------------------------------------------

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
    def engine_core_cores(self) -> float | None:
        """Mean cores the EngineCore used over the window (None with fewer than two samples of it)."""
        return self.cpu_cores(Role.ENGINE_CORE)

    @cached_property
    def worker_cores(self) -> float | None:
        """Mean cores all Workers used together over the window."""
        return self.cpu_cores(Role.WORKER)

    @cached_property
    def engine_cores(self) -> float | None:
        """Cores the engine burns: EngineCore plus its Workers. In a wedge on vLLM 0.32 the
        EngineCore sleeps 1 ms after each no-op step (~0.25 core) while every empty step is
        still broadcast to the Workers, which spin on the shared-memory queue (~1 core); in a
        blocked engine both sleep."""
        core, workers = self.engine_core_cores, self.worker_cores
        if core is None and workers is None:
            return None
        return (core or 0.0) + (workers or 0.0)

    @cached_property
    def stepless_s(self) -> float | None:
        """How long, at the last sample, no engine can have taken a step: a step needs the EngineCore's
        main thread (it schedules the step and collects its output) and every one of its Workers'
        (each runs its shard of the model), so one of them off a CPU for q seconds means no step for
        q seconds. Per EngineCore the longest such quiet; across data-parallel EngineCores, which step
        on their own, the shortest. None where a main thread's quiet was not read."""
        return stepless_of(self.last_processes)

    @cached_property
    def stepless_processes(self) -> tuple[ProcessSample, ...]:
        """The engine processes whose main threads' quiet makes stepless_s, longest first."""
        if not self.stepless_s:
            return ()
        procs = [p for p in self.last_processes if p.main_quiet_s is not None and p.main_quiet_s >= self.stepless_s]
        return tuple(sorted(procs, key=lambda p: -(p.main_quiet_s or 0.0)))

    @cached_property
    def engine_spinning(self) -> bool:
        """The engine burns at least SPINNING_CORES: its busy loop keeps stepping."""
        return self.engine_cores is not None and self.engine_cores >= SPINNING_CORES

    @cached_property
    def engine_cpu_wait(self) -> tuple[ProcessSample, float, float] | None:
        """The EngineCore or Worker whose main thread waited longest for a CPU over the window, as a
        share of the time between its first and last reading: (its last sample, seconds runnable
        but off a CPU, seconds between the readings), from schedstat's run delay
        (ProcessSample.main_runq_s). None with fewer than two readings SHORT_SPAN_S apart."""
        return most_grown(self.samples, main_runq, SHORT_SPAN_S)

    @cached_property
    def engine_throttling(self) -> tuple[ProcessSample, int, int] | None:
        """The EngineCore or Worker whose cgroup's CPU limit throttled it most over the window: (its
        last sample, periods in which it ran out of quota, periods elapsed), from cpu.stat's counters
        at its first and last reading (ProcessSample.cpu_limit). None where no limit was read twice."""
        got = most_grown(self.samples, lambda s, p: None if p.cpu_limit is None else
                         (p.cpu_limit.periods, p.cpu_limit.throttled), 1)
        return None if got is None else (got[0], int(got[1]), int(got[2]))

    @cached_property
    def host_steal(self) -> tuple[float, float, float] | None:
        """The hypervisor's steal over the capture, from the bundle's host facts (sources.steal_facts):
        (CPU seconds stolen, seconds, share of the host's CPU time). None where not recorded or not sane."""
        host = self.bundle.manifest.host
        try:
            stolen, span, cpus = float(host["steal_s"]), float(host["steal_span_s"]), int(host["steal_cpus"])
        except (KeyError, TypeError, ValueError):
            return None
        if not (math.isfinite(stolen) and math.isfinite(span)) or stolen < 0 or span <= 0 or cpus <= 0:
            return None
        return stolen, span, min(1.0, stolen / (span * cpus))

    @cached_property
    def engine_queued(self) -> bool:
        """An EngineCore or Worker main thread runnable but off a CPU for CPU_WAIT_SHARE of the time
        between its first and last reading, however short (QUEUED_MIN_SPAN_S: the quick look's
        0.3 s will do). An idle engine's main threads sleep on their queues, so their run delay
        stands still: one queued for a CPU has work it cannot get to, whatever its last published
        gauges say (seen: 0 running, 0 waiting, published before a CPU limit stopped the engine,
        while a request it had been handed waited; its run delay grew 0.40 s in 0.41 s)."""
        return mostly_queued(most_grown(self.samples, main_runq, QUEUED_MIN_SPAN_S))

    @cached_property
    def engine_waits_for_cpu(self) -> bool:
        """The host, not the engine, stopped the steps: an engine main thread was runnable but off a
        CPU for CPU_WAIT_SHARE of the window, while the engine got at most PARKED_CORES. A frozen
        counter then says nothing about a hang: the engine was never given the CPU to step."""
        return (mostly_queued(self.engine_cpu_wait) or self.engine_throttled) and self.engine_parked

    @cached_property
    def engine_throttled(self) -> bool:
        """An EngineCore or Worker whose cgroup ran out of CPU quota in half the periods of the window
        or more (Facts.engine_throttling), with a thread of the engine runnable (state R) at its last
        reading (Facts.engine_runnable): its CPU limit holds it back. A blocked engine sleeps (state
        S) and spends no quota. The run delay alone can understate this: seen on an overloaded host,
        an engine held to 1 ms of CPU a second, throttled in 5 of 5 periods, queued only 4.3 s of
        12.9 s between readings."""
        return mostly_throttled(self.engine_throttling) and self.engine_runnable

    @cached_property
    def engine_runnable(self) -> bool:
        """A thread of an EngineCore or Worker under a CPU limit was runnable (state R) at the last
        reading. Not only the main threads: a main thread asleep on a queue that a sibling thread
        feeds waits for that sibling, and under a spent quota the sibling queues. Seen: an engine
        held to 1 ms of CPU a second, both main threads asleep for 4 s while the Worker's ZMQ I/O
        thread sat runnable; read as an engine deadlock (0.85) on that alone. A blocked engine's
        threads sleep on their queues and sockets (S), as every recorded deadlock shows."""
        return any(p.state == "R" or any(t.state == "R" for t in p.threads)
                   for p in self.last_processes
                   if p.cpu_limit is not None and p.role in (Role.ENGINE_CORE, Role.WORKER))

    @cached_property
    def engine_stepping(self) -> bool:
        """The engine's busy loop kept stepping however little CPU it burnt: at every reading (two at
        least) the main threads had run within STEPPING_QUIET_S (Facts.stepless_s), and the EngineCore
        is not inside the model. vLLM from 0.19 to 0.28 runs the model in the EngineCore process on one
        rank and sleeps 1 ms after each step that scheduled nothing, so an admission wedge there burns
        ~0.2 cores, which reads as parked by CPU alone (seen on 0.19.1: 0.20 cores, main thread quiet
        for at most 4 ms at each of 4 readings); a blocked engine's quiet grows with the window."""
        quiet = [q for q in (stepless_of(s.processes) for s in self.samples if s.processes) if q is not None]
        return len(quiet) >= 2 and max(quiet) <= STEPPING_QUIET_S and self.engine_where != stk.IN_MODEL

    @cached_property
    def engine_parked(self) -> bool:
        """The engine burns at most PARKED_CORES: it sleeps."""
        return self.engine_cores is not None and self.engine_cores <= PARKED_CORES

    @cached_property
    def last_processes(self) -> tuple[ProcessSample, ...]:
        for s in reversed(self.samples):
            if s.processes:
                return s.processes
        return ()

    def last_of_role(self, role: Role) -> ProcessSample | None:
        return next((p for p in self.last_processes if p.role == role), None)

    @cached_property
    def api_server(self) -> ProcessSample | None:
        """The API server (uvicorn, /metrics, /health) at the last sample that saw processes."""
        return self.last_of_role(Role.API_SERVER)

    @cached_property
    def engine_core(self) -> ProcessSample | None:
        """The EngineCore (scheduler and busy loop) at the last sample that saw processes."""
        return self.last_of_role(Role.ENGINE_CORE)

    @cached_property
    def workers(self) -> tuple[ProcessSample, ...]:
        """The Workers (model execution) at the last sample that saw processes."""
        return tuple(p for p in self.last_processes if p.role == Role.WORKER)

    @cached_property
    def saw_processes(self) -> bool:
        return bool(self.last_processes)

    @cached_property
    def exited(self) -> bool:
        """The deployment was seen and then was gone by the last sample."""
        return bool(self.samples) and self.saw_processes and not self.samples[-1].processes

    @cached_property
    def api_never_listened(self) -> bool:
        """No sample of the window saw the API server listening."""
        return all(not p.listening for _, p in self.processes_with_role(Role.API_SERVER))

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

    # --- stacks and probes -------------------------------------------------

    @cached_property
    def stacks(self) -> dict[int, StackDump]:
        """The latest good stack dump of each pid."""
        out: dict[int, StackDump] = {}
        for s in self.samples:
            for d in s.stacks:
                if d.error is None and d.threads:
                    out[d.pid] = d
        return out

    @cached_property
    def native_captured(self) -> bool:
        """The stacks were taken with native frames (--native): advice must not ask for them again."""
        return any(stk.has_native(d) for d in self.stacks.values())

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
    def engine_where(self) -> str | None:
        """Where the EngineCore main thread is in its latest dump (stacks.IN_MODEL, ...); None without one."""
        stack = self.stack_of_role(Role.ENGINE_CORE)
        return stk.classify_engine_thread(stk.engine_main_thread(stack)) if stack else None

    @cached_property
    def engine_awaits_input(self) -> bool:
        """The EngineCore main thread blocks on its input queue in its latest dump and in every dump of its burst:
        vLLM's busy loop blocks there only when its scheduler holds nothing it could step."""
        engine = self.engine_core
        if engine is None or self.engine_where != stk.WAITING_INPUT:
            return False
        return all(stk.classify_engine_thread(stk.engine_main_thread(d)) == stk.WAITING_INPUT
                   for d in self.stack_burst(engine.pid))

    @cached_property
    def api_shutdown_frames(self) -> tuple[str, ...]:
        """Frames of API server threads in a shutdown or exit path, from its latest dump."""
        stack = self.stack_of_role(Role.API_SERVER)
        return tuple(stk.shutdown_frames(stack)) if stack else ()

    @cached_property
    def worker_model_share(self) -> float | None:
        """The share of Worker stack samples inside execute_model (None without a burst)."""
        total = inside = 0
        for p in self.workers:
            prof = stk.profile(self.stack_burst(p.pid), stk.classify_worker_thread)
            total += sum(prof.values())
            inside += prof.get(stk.WORKER_IN_MODEL, 0)
        return inside / total if total >= 2 else None

    @cached_property
    def main_thread_parked(self) -> bool:
        """The probes saw a main thread parked the whole window on one futex, never woken."""
        return bool(parked_threads(self.samples))

    @cached_property
    def probe_evidence(self) -> tuple[Evidence, ...]:
        """The probes' own evidence lines (parked and spinning main threads, the back-end)."""
        return tuple(probe_evidence(self.samples))

    # --- engine reports: the plugin's own word (classify/enginefacts.py) -------

    @cached_property
    def engine_readings(self) -> dict[int, EngineReading]:
        """Each process's latest engine-report reading over the window (a report, or why none)."""
        return ef.latest_readings(self.samples)

    @cached_property
    def engine_report(self) -> EngineReading | None:
        """The EngineCore's latest reading that holds a report."""
        return ef.engine_core_reading(self.samples)

    @cached_property
    def engine_report_fresh(self) -> bool:
        """The EngineCore's report was rewritten within 3 of its intervals (the writer's thread runs)."""
        return self.engine_report is not None and self.engine_report.fresh

    @cached_property
    def engine_stage(self) -> tuple[str, float | None] | None:
        """(the EngineCore's stage by its report, seconds in it at the read); None without one."""
        r = self.engine_report
        stage = r.report.stage if r is not None and r.report is not None else None
        return None if r is None or stage is None else (stage.name, r.stage_age_s)

    @cached_property
    def engine_scheduler(self) -> SchedulerSummary | None:
        """The EngineCore's scheduler summary by its report."""
        r = self.engine_report
        return r.report.scheduler if r is not None and r.report is not None else None

    @cached_property
    def engine_requests(self) -> tuple[RequestSample, ...]:
        """The request samples of the EngineCore's report: running first, then waiting, oldest first."""
        r = self.engine_report
        return r.report.requests if r is not None and r.report is not None else ()

    @cached_property
    def engine_report_steps(self) -> tuple[int, int, float] | None:
        """(first, last, seconds) of the EngineCore's step count: its fresh reports, or its report's history."""
        r = self.engine_report
        return None if r is None else ef.steps_over_window(self.samples, r.pid)

    # --- log -----------------------------------------------------------------

    @cached_property
    def stats(self) -> tuple[StatsLine, ...]:
        return self.log.stats if self.log else ()

    @cached_property
    def last_stats(self) -> StatsLine | None:
        return self.stats[-1] if self.stats else None

    def failures_of(self, *kinds: str) -> tuple[FailureLine, ...]:
        """The log's engine-failure lines of these kinds, in log order."""
        return tuple(f for f in (self.log.failures if self.log else ()) if f.kind in kinds)

    @cached_property
    def shm_warnings(self) -> tuple[FailureLine, ...]:
        """'No available shared memory broadcast block': vLLM's sign of a worker that stopped answering."""
        return self.failures_of("shm_broadcast_timeout")

    @cached_property
    def shutdown_lines(self) -> tuple[ShutdownLine, ...]:
        return self.log.shutdown if self.log else ()

    @cached_property
    def shutdown_began(self) -> ShutdownLine | None:
        """The first shutdown line that is not followed by 'Finished server process'."""
        lines = self.shutdown_lines
        finished = [s for s in lines if is_finish(s)]
        began = [s for s in lines if not is_finish(s)]
        if not began:
            return None
        last_finished = finished[-1].lineno if finished else -1
        pending = [s for s in began if s.lineno > last_finished]
        return pending[0] if pending else None

    @cached_property
    def waiting_connections_line(self) -> ShutdownLine | None:
        """uvicorn's 'Waiting for connections to close' at or after the pending shutdown."""
        began = self.shutdown_began
        if began is None:
            return None
        return next((s for s in self.shutdown_lines if s.kind == "waiting_connections" and s.lineno >= began.lineno),
                    None)

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
        if not n or first.t is None or last.t is None:  # a run's ends always carry a stamp
            return None
        return (last.t - first.t) / n

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

    @cached_property
    def log_silent(self) -> bool:
        """The stats lines stopped: silent LOG_SILENCE_S by the clock, or six answered scrapes since."""
        silence = self.log_silence_s
        return (silence is not None and silence >= LOG_SILENCE_S) or self.scrapes_after_last_stats >= 6


def _all_timed(log: ParsedLog | None):
    if log is None:
        return []
    return [*log.stats, *log.shutdown, *log.failures, *log.startup]


def _longest_contiguous_run(stats: Sequence[StatsLine]) -> tuple[StatsLine, StatsLine] | None:
    best: tuple[StatsLine, StatsLine] | None = None
    best_s = 0.0
    start = 0
    for i in range(1, len(stats) + 1):
        t, t_before = (stats[i].t, stats[i - 1].t) if i < len(stats) else (None, None)
        broken = t is None or t_before is None or t - t_before > 3 * STATS_INTERVAL_S
        if broken:
            a, b = stats[start], stats[i - 1]
            if b.t is not None and a.t is not None and b.t > a.t:
                if best is None or (b.t - a.t) > best_s:
                    best, best_s = (a, b), b.t - a.t
            start = i
    return best
