"""The startup-hang rules: a server that never finished starting, the phase it is stuck in, and for how long."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from wedgectl.model import bounds
from wedgectl.read import stacks as stk
from wedgectl.classify import confidence as C
from wedgectl.classify.enginerules import stage_evidence, starting_phase
from wedgectl.classify.evidence import fmt_duration, log_stamp, message
from wedgectl.classify.facts import PARKED_CORES, Facts, unix_to_logtime
from wedgectl.classify.ioprogress import EngineReads, engine_reads, reads_evidence, unknown_reason
from wedgectl.classify.rule import Rule
from wedgectl.read.logparse import parse_stamp
from wedgectl.model.engine import STARTING, EngineReading
from wedgectl.model.types import Evidence, ProcessSample, Role, Verdict, VerdictKind

# The deadlines, and why.
# A parked engine (EngineCore + Workers <= PARKED_CORES) that has logged nothing for STARTUP_QUIET_S
# is not loading, compiling or capturing: those burn CPU, and vLLM logs each step of start-up
# (engine config, device init, "Starting to load model", "Loading weights took", "KV cache size",
# "init engine ... took", "Starting vLLM server on"). Measured on vLLM 0.32 (2 CPU cores, tiny
# model): the longest quiet gap of a healthy start was 5 s idle, 48 s at load 20+, both while the
# EngineCore was spawned and importing (busy, or not there yet: the long deadline).
STARTUP_QUIET_S = 60.0
# The bound an operator may set instead (diagnose --startup-quiet, recorded in the bundle's manifest):
# a bundle that records one outside these is judged with the default.
STARTUP_QUIET_RANGE = (bounds.STARTUP_QUIET_MIN_S, bounds.STARTUP_QUIET_MAX_S)
# Phases that may legitimately be quiet and slow whatever the CPU shows: weight loading from slow
# or network storage (the CPU idles in reads), torch.compile and autotuning of a large model
# (minutes of busy CPU, one line at the end). Past 10 min of silence even those are stuck.
STARTUP_DEADLINE_S = 600.0
# ... unless the engine is seen making no progress at all: parked, and reading no bytes (/proc/PID/io's
# rchar and read_bytes unchanged in the EngineCore and every Worker, each read at two samples or more)
# for NO_READS_MIN_S or more. A load reads and a compile burns CPU; an engine doing neither, its log quiet
# past the quiet bound, is hung in those phases too, and the quiet bound decides there as elsewhere.
# 3 s: a load submits reads back to back (readahead), each done in milliseconds from a disk and well
# under a second from a network mount that answers, so 3 s with neither counter moving is a read that
# does not come back, or none asked for; and diagnose's 6 s window at 1 s samples sees 3 s of it.
# Where /proc/PID/io is unreadable (another user's server, without CAP_SYS_PTRACE) or bytes are still
# being read, STARTUP_DEADLINE_S stays, and a start short of it says what it could not tell.
NO_READS_MIN_S = 3.0

WEIGHT_LOADING = "weight loading"
TORCH_COMPILE = "torch compile"
WARM_UP = "graph capture / warm-up"
KV_PROFILING = "KV cache profiling"
DEVICE_INIT = "device and distributed init"
ENGINE_INIT = "engine core init"
WAIT_WORKERS = "EngineCore waiting for its workers to report ready"
WAIT_ENGINE = "API server waiting for the engine core to report ready"
API_STARTUP = "API server start-up (engine ready)"
SERVING = "serving"
UNKNOWN_PHASE = "unknown (no start-up line yet)"
SLOW_PHASES = (WEIGHT_LOADING, TORCH_COMPILE)

# A start-up line and the phase the server is in once it is printed (vLLM 0.32 wording; later
# lines win). "KV cache size" ends profiling: what follows is compile_or_warm_up_model.
PHASE_LINES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), ph) for p, ph in (
    (r"Initializing a V1 LLM engine", ENGINE_INIT),
    (r"world_size=\d+ rank=\d+ .*backend=|init_distributed_environment", DEVICE_INIT),
    (r"Starting to load model", WEIGHT_LOADING),
    (r"Loading weights took|Model loading took", KV_PROFILING),
    (r"Memory profiling takes|Available KV cache memory", KV_PROFILING),
    (r"(?:GPU|CPU|XPU|TPU) KV cache size:", WARM_UP),
    (r"torch\.compile|Compiling a graph|Dynamo bytecode transform", TORCH_COMPILE),
    (r"Capturing (?:CUDA|cuda)? ?graphs?|Graph capturing", WARM_UP),
    (r"init engine \(profile, create kv cache, warmup model\) took", API_STARTUP),
    (r"Starting vLLM (?:API )?server|Application startup complete", SERVING),
))
_STAMP = re.compile(r"\b(\d{2}-\d{2} \d{2}:\d{2}:\d{2})\b")
# Printed once a minute by an EngineCore whose workers do not answer (shm_broadcast.py): a wait, not progress.
_WAITING_LINE = "No available shared memory broadcast block"

# The phases the engine's own report names (its stage "starting", the plugin's wording), as named here.
_REPORT_PHASES = {"weight loading": WEIGHT_LOADING, "kv cache / profiling": KV_PROFILING,
                  "graph capture / warm-up": WARM_UP, "torch compile": TORCH_COMPILE}

# Frames (innermost first) that name the phase a process is in; a Worker's stack says most.
_PHASE_FRAMES: dict[str, str] = {
    "load_model": WEIGHT_LOADING, "load_weights": WEIGHT_LOADING, "download_weights_from_hf": WEIGHT_LOADING,
    "safetensors_weights_iterator": WEIGHT_LOADING,
    "compile_or_warm_up_model": WARM_UP, "capture_model": WARM_UP, "_warmup_and_capture": WARM_UP,
    "_dummy_run": WARM_UP, "warming_up_model": WARM_UP,
    "determine_available_memory": KV_PROFILING, "profile_run": KV_PROFILING,
    "init_device": DEVICE_INIT, "init_distributed_environment": DEVICE_INIT, "init_process_group": DEVICE_INIT,
    "initialize_model_parallel": DEVICE_INIT,
    "wait_for_ready": WAIT_WORKERS,
    "wait_for_engine_startup": WAIT_ENGINE,
}


@dataclass(frozen=True)
class PhaseLine:
    """A start-up line of the log and the phase the server is in after it."""

    lineno: int
    t: float | None  # seconds since 2000-01-01, the log's clock
    phase: str
    text: str


# Cached: the sampler classifies after every sample over the same (up to 4 MiB) log tail.
@lru_cache(maxsize=4)
def last_progress_t(lines: tuple[str, ...]) -> float | None:
    """The stamp of the log's last line that is not vLLM's once-a-minute 'still waiting' warning."""
    for line in reversed(lines):
        m = _STAMP.search(line)
        if m and _WAITING_LINE not in line:
            return parse_stamp(m.group(1))
    return None


@lru_cache(maxsize=4)
def phase_lines(lines: tuple[str, ...]) -> tuple[PhaseLine, ...]:
    """Every start-up line, in log order."""
    out = []
    for lineno, line in enumerate(lines, start=1):
        for pattern, phase in PHASE_LINES:
            if pattern.search(line):
                m = _STAMP.search(line)
                out.append(PhaseLine(lineno, parse_stamp(m.group(1)) if m else None, phase, line[:300]))
                break
    return tuple(out)


@dataclass(frozen=True)
class StackPhase:
    pid: int
    role: Role
    phase: str
    frame: str


def stack_phase(f: Facts) -> StackPhase | None:
    """The phase the stacks name: a Worker's first, then the EngineCore's, then the API server's. Where py-spy's
    name none, or only a wait on another process, the stacks the engine's own report took of itself once its
    start-up stage was overdue say where the Worker or EngineCore is."""
    order = {Role.WORKER: 0, Role.ENGINE_CORE: 1, Role.API_SERVER: 2}
    ordered = sorted(f.last_processes, key=lambda p: order.get(p.role, 3))
    found = _pyspy_phase(f, ordered)
    if found is None or found.phase in (WAIT_ENGINE, WAIT_WORKERS):
        return _reported_phase(f, [p for p in ordered if p.role is not Role.API_SERVER]) or found
    return found


def _pyspy_phase(f: Facts, ordered: list[ProcessSample]) -> StackPhase | None:
    for p in ordered:
        dump = f.stacks.get(p.pid)
        if dump is None:
            continue
        for thread in dump.threads:
            for frame, name in zip(stk.frame_names(thread),
                                   (stk.base_name(x.get("name")) for x in thread.get("frames") or ())):
                if name in _PHASE_FRAMES:
                    return StackPhase(p.pid, p.role, _PHASE_FRAMES[name], frame)
                if "torch/_dynamo" in frame or "torch/_inductor" in frame:
                    return StackPhase(p.pid, p.role, TORCH_COMPILE, frame)
    return None


def _reported_phase(f: Facts, engine: list[ProcessSample]) -> StackPhase | None:
    """The phase a Worker's or EngineCore's report stacks name (frames innermost first), where py-spy gave none."""
    readings = f.engine_readings
    for p in engine:
        r = readings.get(p.pid)
        stacks = r.report.stacks if r is not None and r.report is not None else None
        for thread in stacks.threads if stacks is not None else ():
            for fr in thread.frames:
                if fr.function in _PHASE_FRAMES:
                    return StackPhase(p.pid, p.role, _PHASE_FRAMES[fr.function],
                                      f"{fr.function} ({fr.file}:{fr.line}, the engine's own report)")
    return None


@dataclass(frozen=True)
class StartupState:
    """Where a start-up stands: its phase, since when, and how sure the clock is."""

    phase: str
    last_line: PhaseLine | None
    quiet_s: float | None  # since the log's last stamped line
    age_s: float | None  # the API server's age
    stack: StackPhase | None
    serving: bool  # the log says the server started (after its last engine init)
    report: EngineReading | None = None  # a process whose engine report says it is starting, in a named phase

    @property
    def stuck_s(self) -> float | None:
        """How long it has been in this phase: the log's silence, else (a log unread: another user's server)
        the time the engine's fresh report has been in its stage, else the process's age."""
        if self.quiet_s is not None:
            return self.quiet_s
        if self.report is not None and self.report.fresh and self.report.stage_age_s is not None:
            return self.report.stage_age_s
        return self.age_s

    @property
    def slow_phase(self) -> bool:
        return self.phase in SLOW_PHASES


def _now_logtime(f: Facts) -> float | None:
    """The capture's end (else the bundle's creation) on the log's clock; None for a time no calendar holds."""
    try:
        if f.now_logtime is not None:
            return f.now_logtime
        created = f.bundle.manifest.created
        return unix_to_logtime(created) if created else None
    except (ValueError, OverflowError, OSError):  # a hostile bundle's year 10000
        return None


def startup_state(f: Facts) -> StartupState:
    lines = phase_lines(tuple(f.bundle.log_lines))
    last = lines[-1] if lines else None
    serving = last is not None and last.phase == SERVING
    now = _now_logtime(f)
    last_t = last_progress_t(tuple(f.bundle.log_lines))
    quiet = now - last_t if now is not None and last_t is not None and now >= last_t else None
    api = f.api_server
    age = None
    if api is not None and api.started is not None and f.samples:
        age = max(0.0, f.samples[-1].t - api.started)
    sp = stack_phase(f)
    phase = sp.phase if sp is not None else last.phase if last is not None else UNKNOWN_PHASE
    if sp is not None and sp.phase in (WAIT_ENGINE, WAIT_WORKERS) and last is not None and last.phase != SERVING:
        phase = last.phase  # the waiter names no phase; the log says what the engine was doing
    told = starting_phase(f)
    stage = told.report.stage if told is not None and told.report is not None else None
    if stage is not None and stage.phase and (sp is None or sp.phase in (WAIT_ENGINE, WAIT_WORKERS)):
        phase = _REPORT_PHASES.get(stage.phase.lower(), stage.phase)  # the engine's own word, newer than the log's
    return StartupState(phase, last, quiet, age, sp, serving, told)


def quiet_bound(f: Facts) -> float:
    """The start-up quiet bound this evidence is judged with: the manifest's (diagnose --startup-quiet) when
    it is a number within STARTUP_QUIET_RANGE, else STARTUP_QUIET_S. A slow phase's deadline is never
    shorter than it."""
    value = f.bundle.manifest.startup_quiet_s
    low, high = STARTUP_QUIET_RANGE
    if isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high:
        return float(value)
    return STARTUP_QUIET_S


def slow_deadline(f: Facts) -> float:
    """STARTUP_DEADLINE_S, or the quiet bound where an operator set it longer."""
    return max(STARTUP_DEADLINE_S, quiet_bound(f))


def idle_reads(f: Facts) -> EngineReads | None:
    """The engine's reads where they show no progress: the engine parked, and every engine process read
    no byte over NO_READS_MIN_S or more of the window; None otherwise."""
    if not f.engine_parked:
        return None
    reads = engine_reads(f.samples)
    return reads if reads.none_read and reads.span_s >= NO_READS_MIN_S else None


def _deadline(f: Facts, s: StartupState) -> float:
    """The quiet bound for a parked engine in a phase that burns CPU, or in a slow phase while it reads
    nothing (idle_reads); the slow deadline otherwise."""
    if f.engine_parked and (not s.slow_phase or idle_reads(f) is not None):
        return quiet_bound(f)
    return slow_deadline(f)


def _progress_unknown(f: Facts, s: StartupState) -> tuple[str, str] | None:
    """Where a parked engine in a slow phase gets the slow deadline because its reads could not decide:
    (what could not be told, what to check). None where the reads or the CPU decide."""
    if not s.slow_phase or not f.engine_parked or idle_reads(f) is not None:
        return None
    reads = engine_reads(f.samples)
    pid = reads.loader
    grep = f"`grep -E '^(rchar|read_bytes)' /proc/{pid if pid is not None else 'PID'}/io`"
    if reads.reading:
        most = max(reads.rchar, reads.read_bytes)  # a load through mmap moves read_bytes alone
        return (f"the engine still reads ({most / 1e6:.1f} MB over {fmt_duration(reads.span_s)})",
                f"Check the load is moving: {grep} a minute apart; "
                "counters that stop with the engine parked are a hung start-up.")
    if reads.none_read:
        return (f"no bytes read, but over only {fmt_duration(reads.span_s)} (it takes "
                f"{NO_READS_MIN_S:g} s)",
                "Diagnose with a longer window (--window 10): no bytes read and no CPU for "
                f"{NO_READS_MIN_S:g} s decides it at the quiet bound.")
    return (unknown_reason(reads),
            f"Check whether it still reads: {grep} twice, seconds apart, as the "
            "server's user or root (rising: the load goes on; unchanged with the engine parked: hung); or "
            "diagnose as that user, or with CAP_SYS_PTRACE, where no bytes read decides it at the quiet bound.")


def _reads_line(f: Facts, s: StartupState) -> Evidence | None:
    """What the engine read over the window, where it was read or where the phase hangs on it."""
    reads = engine_reads(f.samples)
    if not s.slow_phase and len(reads.never_readable) == len(reads.pids):
        return None  # a phase the CPU decides, with nothing read (an older bundle): no line
    return reads_evidence(reads, f.engine_cores)


# ------------------------------------------------------------------ live


def reported_starting(f: Facts) -> EngineReading | None:
    """A fresh report of this deployment's EngineCore (else a Worker's) in stage starting. vLLM's API server
    listens only once the EngineCore has reported READY (its handshake ends after the model is loaded,
    profiled and warmed up), so while one says it is starting, the API server has not served: what its
    sockets would say where they cannot be read (no CAP_SYS_PTRACE over another user's server)."""
    alive = {p.pid: p.role for p in f.last_processes}
    order = {Role.ENGINE_CORE: 0, Role.WORKER: 1}
    found = [r for r in f.engine_readings.values() if r.fresh and r.report is not None
             and r.report.stage_name == STARTING and alive.get(r.pid) in order]
    return min(found, key=lambda r: (order[alive[r.pid]], r.pid)) if found else None


def _still_starting(f: Facts) -> StartupState | None:
    """The start-up state of a live API server that never listened nor answered /metrics, with no shutdown
    begun and a start-up phase to name; None for any other target. Its sockets unreadable (no
    CAP_SYS_PTRACE), a fresh engine report in stage starting stands for 'never listened'."""
    api = f.api_server
    if not f.is_live or api is None or f.scrapes or not f.api_never_listened:
        return None
    if api.connections is None and reported_starting(f) is None:
        return None
    if f.shutdown_began is not None or f.api_shutdown_frames:
        return None
    s = startup_state(f)
    if s.serving and s.stack is None:
        return None
    return s


def starting(f: Facts) -> tuple[str, tuple[Evidence, ...], tuple[str, ...]] | None:
    """For a verdict that cannot call it: a server still starting, not (yet) past its bound. The summary
    names the phase and how long it has lasted, the evidence what was seen, the advice what to check."""
    s = _still_starting(f)
    if s is None or s.stuck_s is None:
        return None
    bound = _deadline(f, s)
    unknown = _progress_unknown(f, s)
    summary = (f"Starting: in {s.phase} for {fmt_duration(s.stuck_s)}, short of the {fmt_duration(bound)} "
               "after which this phase counts as hung" + (f"; {unknown[0]}" if unknown else "")
               + "; not a verdict yet.")
    ev = _never_listened_evidence(f, "still starting")
    if s.last_line is not None:
        ev.append(Evidence("log", f"last start-up line: {message(s.last_line.text)[:120]}",
                           t=log_stamp(s.last_line.t), values={"line": s.last_line.lineno}))
    if f.engine_cores is not None:
        ev.append(Evidence("proc", f"engine used {f.engine_cores:.2f} cores over the window"
                           + (" (parked)" if f.engine_parked else " (busy: loading, compiling or capturing)"),
                           values={"cores": round(f.engine_cores, 3)}))
    if (reads := _reads_line(f, s)) is not None:
        ev.append(reads)
    _add_report(ev, f, s)
    left = fmt_duration(float(math.ceil(max(0.0, bound - s.stuck_s))))
    advice = (
        f"Diagnose again once {left} more have passed: still in {s.phase} "
        "with no log line and the engine parked then is a hung start-up.",
        *((unknown[1],) if unknown else ()),
        f"Set the bound with --startup-quiet SECONDS (default {fmt_duration(STARTUP_QUIET_S)}; weight loading "
        f"and torch.compile get {fmt_duration(STARTUP_DEADLINE_S)} unless the engine is parked and reads no bytes).",
        _PHASE_ADVICE.get(s.phase, "Read the log's last start-up lines for the step it is on."),
    )
    return summary, tuple(ev), advice


def _never_listened_evidence(f: Facts, then: str = "") -> list[Evidence]:
    """The API server's line (never listening, /metrics never answered, then `then`); where its sockets are
    unreadable, the engine report that stands for them, and that report's stage line."""
    api = f.api_server
    pid = api.pid if api is not None else "?"
    told = reported_starting(f) if api is not None and api.connections is None else None
    end = f": {then}" if then else ""
    if told is None:
        return [Evidence("proc", f"API server pid {pid} alive, never listening, /metrics never answered{end}")]
    return [Evidence("proc", f"API server pid {pid} alive, /metrics never answered, its sockets unreadable (no "
                             "CAP_SYS_PTRACE); the engine's report says it is starting, and vLLM's API server "
                             f"listens only once the engine reports ready{end}", values={"report_pid": told.pid}),
            *((line,) if (line := stage_evidence(f, told)) is not None else ())]


def _add_report(ev: list[Evidence], f: Facts, s: StartupState) -> None:
    """The report line naming the phase (s.report), unless the same line is already cited."""
    if s.report is not None and (reported := stage_evidence(f, s.report)) is not None and reported not in ev:
        ev.append(reported)


def live_startup_hang(f: Facts) -> bool:
    """The API server lives but never listened nor answered /metrics, no shutdown began, and it
    has been in one start-up phase past the deadline (the quiet bound, STARTUP_QUIET_S unless
    diagnose --startup-quiet set another, with the engine parked; STARTUP_DEADLINE_S otherwise).
    vLLM 0.32 waits with no deadline for the engine core's READY (wait_for_engine_startup polls
    forever, logging only at DEBUG) and the EngineCore waits for its workers
    (WorkerProc.wait_for_ready: multiprocessing.connection.wait, no timeout); the collective_rpc
    of profiling and warm-up has none either. In weight loading and torch compile the quiet bound
    decides only while the engine reads no bytes (idle_reads). Unreadable sockets (no CAP_SYS_PTRACE)
    leave "never listened" unknown, unless a fresh engine report says the engine is starting
    (reported_starting): no verdict without one."""
    s = _still_starting(f)
    if s is None:
        return False
    stuck = s.stuck_s
    return stuck is not None and stuck >= _deadline(f, s) and (s.age_s is None or s.age_s >= _deadline(f, s))


def _process_line(p: ProcessSample, f: Facts) -> str:
    cores = f.cpu_by_pid(p.role).get(p.pid)
    age = f" up {fmt_duration(f.samples[-1].t - p.started)}" if p.started is not None else ""
    return f"{p.role.value} pid {p.pid}{age}, state {p.state}" + (f", {cores:.2f} cores" if cores is not None else "")


def _startup_verdict(f: Facts, live: bool) -> Verdict:
    s = startup_state(f)
    stuck = s.stuck_s or 0.0
    ev: list[Evidence] = []
    api = f.api_server
    if live and api is not None:
        first, *more = _never_listened_evidence(f)
        ev.append(Evidence("proc", first.what + (f"; up {fmt_duration(s.age_s)}" if s.age_s is not None else ""),
                           values={**first.values, "pid": api.pid,
                                   "age_s": None if s.age_s is None else round(s.age_s, 1)}))
        ev += more
        ev += [Evidence("proc", _process_line(p, f), values={"pid": p.pid, "role": p.role.value})
               for p in f.last_processes if p.role in (Role.ENGINE_CORE, Role.WORKER)]
        if f.engine_cores is not None:
            ev.append(Evidence("proc", f"engine used {f.engine_cores:.2f} cores over the window"
                               + (" (parked: not loading, compiling or capturing)" if f.engine_parked else ""),
                               values={"cores": round(f.engine_cores, 3), "parked_below": PARKED_CORES}))
        if (reads := _reads_line(f, s)) is not None:
            ev.append(reads)
    if s.last_line is not None:
        ev.append(Evidence("log", f"last start-up line: {message(s.last_line.text)[:120]}",
                           t=log_stamp(s.last_line.t),
                           values={"line": s.last_line.lineno, "phase_after": s.last_line.phase}))
    deadline = _deadline(f, s) if live else (slow_deadline(f) if s.slow_phase else quiet_bound(f))
    if s.quiet_s is not None:
        set_by = "" if quiet_bound(f) == STARTUP_QUIET_S else f", not the default {fmt_duration(STARTUP_QUIET_S)}"
        ev.append(Evidence("log", f"no start-up progress in the log for {fmt_duration(s.quiet_s)} "
                                  f"(bound {fmt_duration(deadline)}{set_by})",
                           values={"quiet_s": round(s.quiet_s, 1), "deadline_s": deadline}))
    if f.shm_warnings:
        ev.append(Evidence("log",
                           f"vLLM's own 'No available shared memory broadcast block found' x{len(f.shm_warnings)}: "
                           "the EngineCore waits on a worker that does not answer",
                           t=log_stamp(f.shm_warnings[-1].t), values={"count": len(f.shm_warnings)}))
    if s.stack is not None:
        name = s.stack.role.value
        ev.append(Evidence("stack", f"{name} pid {s.stack.pid} in {s.stack.phase}: {s.stack.frame}",
                           values={"pid": s.stack.pid, "phase": s.stack.phase}))
    _add_report(ev, f, s)
    # Two sources naming the phase: the stacks (py-spy's, or those the engine's report took of itself) and the
    # log's last start-up line, or the engine's own report of its stage (its word, with since when, where the log
    # is unreadable: no ptrace, no /proc/PID/fd).
    corroborated = s.stack is not None and (s.last_line is not None or s.report is not None)
    if not live:
        confidence = C.STARTUP_LOG
    elif stuck >= slow_deadline(f) and not f.engine_parked:
        confidence = C.STARTUP_PAST_DEADLINE
    elif s.slow_phase and stuck < slow_deadline(f):  # decided by the bytes it did not read (idle_reads)
        confidence = C.STARTUP_PARKED_CORROBORATED if corroborated else C.STARTUP_NO_READS
    else:
        confidence = C.STARTUP_PARKED_CORROBORATED if corroborated else C.STARTUP_PARKED
    pids = " ".join(str(p.pid) for p in f.last_processes)
    advice = [
        "It will not finish by itself: vLLM waits for this with no deadline. Stop the whole tree "
        f"({pids or 'the API server and its engine processes'}), "
        "not only the API server, or its engine processes live on as orphans holding memory and the device.",
        _PHASE_ADVICE.get(s.phase,
                          "The innermost frames above name what it waits on." if f.native_captured else
                          "Capture native stacks (`wedgectl diagnose --pid PID --native`): the innermost frame names "
                          "what it waits on."),
        "Bound start-up: the patched engine fails it with a clear error after WEDGE_ENGINE_STARTUP_S; "
        "in Kubernetes a startupProbe on /health does the same from outside.",
    ]
    return Verdict(
        VerdictKind.STARTUP_HANG, confidence,
        f"Start-up stuck in {s.phase} for {fmt_duration(stuck)}: the server never became healthy.",
        "live_startup_hang" if live else "log_startup_hang", tuple(ev), tuple(advice),
        {"phase": s.phase, "stuck_s": round(stuck, 1), "deadline_s": deadline,
         "age_s": None if s.age_s is None else round(s.age_s, 1),
         "quiet_s": None if s.quiet_s is None else round(s.quiet_s, 1)},
    )


_PHASE_ADVICE = {
    WEIGHT_LOADING: "Weight loading: check the checkpoint's storage (a hung network mount shows the Worker in state "
                    "D); "
                    "copy the weights to local disk.",
    TORCH_COMPILE: "torch.compile: try --enforce-eager (or -cc.mode=none) to confirm, then check VLLM_CACHE_ROOT's "
                   "compile cache.",
    WARM_UP: "Graph capture / warm-up: retry with --enforce-eager; with several GPUs set NCCL_DEBUG=INFO, a peer that "
             "never "
             "joins a collective holds every rank here.",
    KV_PROFILING: "KV cache profiling: another process may hold the device (`wedgectl diagnose` on an orphaned "
                  "engine); "
                  "lower --gpu-memory-utilization or set --num-gpu-blocks-override.",
    DEVICE_INIT: "Device / distributed init: a rank that never joins (wrong MASTER_ADDR, a firewall, a dead peer) "
                 "holds the others.",
    ENGINE_INIT: "The engine core never reported ready: read the EngineCore and Worker lines of the log, then their "
                 "stacks.",
}


def live_startup_verdict(f: Facts) -> Verdict:
    return _startup_verdict(f, live=True)


# ------------------------------------------------------------------ log


def log_startup_hang(f: Facts) -> bool:
    """The log holds start-up lines and then nothing: no 'Starting vLLM server', no request, no stats
    line, no failure, no shutdown, and it has been quiet past the deadline by the time it was read
    (the quiet bound, or STARTUP_DEADLINE_S in weight loading or torch compile). A log alone cannot
    tell a hung start-up from a killed one: the verdict says to check the pid lives. A live capture
    that saw the processes is the live rule's to decide (they may have listened, or be busy)."""
    log = f.log
    if log is None or f.stats or log.access or log.shutdown or (f.is_live and f.saw_processes):
        return False
    if any(x.kind != "shm_broadcast_timeout" for x in log.failures):
        return False
    s = startup_state(f)
    if s.last_line is None or s.serving:
        return False
    deadline = slow_deadline(f) if s.slow_phase else quiet_bound(f)
    return s.quiet_s is not None and s.quiet_s >= deadline


def log_startup_verdict(f: Facts) -> Verdict:
    v = _startup_verdict(f, live=False)
    return Verdict(v.verdict, v.confidence, v.summary, v.rule, v.evidence,
                   ("Check the server's pid still lives, then `wedgectl diagnose --pid PID`: stacks name the phase for "
                    "sure.",
                    *v.advice), v.facts)


LIVE_STARTUP_RULE = Rule(live_startup_hang, live_startup_verdict)
LOG_STARTUP_RULE = Rule(log_startup_hang, log_startup_verdict)

__all__ = ["LIVE_STARTUP_RULE", "LOG_STARTUP_RULE", "NO_READS_MIN_S", "STARTUP_DEADLINE_S", "STARTUP_QUIET_RANGE",
           "STARTUP_QUIET_S", "idle_reads", "phase_lines", "quiet_bound", "reported_starting", "starting",
           "startup_state"]
