"""Engine report: every vLLM process says, in a small JSON file, what it is doing now and what its scheduler holds.

The hang it helps tell apart: a stuck server shows the same /metrics whether
its engine is blocked in the model, spinning in the scheduler, or idle with
nothing to do; a reader outside sees only stacks it must sample itself. With
this on, each process keeps ``/tmp/wedge-engine-reports-<uid>/wedge-engine-<pid>.report.json``
fresh once a second (``wedge_engine/report.py``; the contract is schema 1 of
issue 37), and wedgectl reads it by pid.

It is on whenever any fix is on (it is part of "all"), and alone with
``WEDGE_ENGINE_REPORT=1``; ``WEDGE_ENGINE_REPORT=0`` or ``-report`` turns it off.

What each process reports, and the hooks that keep its stage:

* EngineCore: "starting" (phase "weight loading" in ``Executor.__init__``,
  "KV cache / profiling" in ``determine_available_memory``, "graph capture /
  warm-up" in ``compile_or_warm_up_model``, or ``initialize_from_config``
  before 0.32 where that runs the warm-up), "idle"
  (``EngineCoreProc._process_input_queue``), "scheduling"
  (``Scheduler.schedule``), "execute_model" (the executor's own class's
  ``execute_model``), "execute_model_wait" (``result()`` of the future it
  returns), "sample_tokens" (``sample_tokens``), "update_output"
  (``Scheduler.update_from_output``), "shutting_down" (``EngineCore.shutdown``);
  the scheduler's queues and KV pool, read from the report thread (list copies,
  no lock); steps and model steps from the status record's writer.
* Worker: "starting" (phases from ``WorkerWrapperBase``'s start-up calls),
  "execute_model" (``WorkerWrapperBase.execute_model``, and ``sample_tokens``),
  "idle" between them, "shutting_down"; its tp/pp/dp rank, its own step count
  (``execute_model`` calls) and the last collective it entered or left
  (``GroupCoordinator``'s collectives, ``wedge_engine/collectives.py``).
* API server: "serving", then "shutting_down" (the uvicorn server's ``shutdown``,
  as the shutdown fix hooks it); the requests its OutputProcessor tracks (the
  engine's ids), each with whether its client is still connected: a request's
  ``AsyncLLM.generate`` runs while its client waits (vLLM cancels the handler on a
  disconnect), so a tracked request whose generator ended before it finished has
  no client (``client_connected`` false, ``disconnected_s`` since when): a ghost
  the engine still runs. Its report starts when ``AsyncLLM.__init__`` runs (before
  the engine is launched): vLLM's helper subprocesses load the plugin as an API
  server too, and must not report.

Its wrappers are tagged (``patch_method(..., tag="report")``): they go on top of
the other fixes' wrappers of the same methods and never keep one out.

Cost when nothing is wrong: one clock read and one attribute store per stage
change (five or six per engine step, ~0.1 us each); a thread that wakes once a
second and writes 1-4 KiB.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future
from typing import Any

from wedge_engine import collectives, report
from wedge_engine.capability import AnyOf, Need, Needs, holds
from wedge_engine.fixes import _common
from wedge_engine.fixes._common import patch_method

logger = logging.getLogger("vllm.wedge_engine")

_SCHED = "vllm.v1.core.sched.scheduler"
_CORE = "vllm.v1.engine.core"
_EXEC = "vllm.v1.executor.abstract"
_WORKER = "vllm.v1.worker.worker_base"
TAG = "report"

WARM_UP_CALL = Needs(_EXEC, "Executor.compile_or_warm_up_model", ("self",), "start-up phase graph capture / warm-up")
INIT_FROM_CONFIG = Needs(_EXEC, "Executor.initialize_from_config", ("self", "kv_cache_configs"),
                         "KV cache set-up (and, before 0.32, the warm-up)")
REASONS = Needs("vllm.v1.metrics.stats", "SchedulerStats.num_skipped_waiting_reqs", None,
                "waiting_by_reason (capacity / deferred)")
COLLECTIVES = Needs("vllm.distributed.parallel_state", "GroupCoordinator.all_reduce", ("self",),
                    "worker's last collective (GroupCoordinator's collectives, those it has)")
TRACK_CLIENTS = Needs("vllm.v1.engine.async_llm", "AsyncLLM.generate",
                      ("self", "prompt", "sampling_params", "request_id"),
                      "API server requests and whether each one's client is connected")
# What it wraps in vLLM (capability.py).
REQUIRES: tuple[Need, ...] = (
    _common.STEP_RECORDER,
    Needs(_SCHED, "Scheduler.schedule", ("self",), "stage scheduling"),
    Needs(_SCHED, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
          "stage update_output"),
    Needs(_CORE, "EngineCoreProc._process_input_queue", ("self",), "stage idle; finds the engine and its scheduler"),
    Needs(_CORE, "EngineCore.shutdown", ("self",), "stage shutting_down"),
    Needs(_EXEC, "Executor.execute_model", ("self", "scheduler_output"),
          "stages execute_model and execute_model_wait (on the engine's executor class)"),
)
# Parts it runs without: a stage or a field it leaves out where absent.
OPTIONAL: tuple[Need, ...] = (
    Needs(_EXEC, "Executor.sample_tokens", ("self", "grammar_output"), "stage sample_tokens"),
    Needs(_EXEC, "Executor.__init__", ("self", "vllm_config"), "start-up phase weight loading"),
    Needs(_EXEC, "Executor.determine_available_memory", ("self",), "start-up phase KV cache / profiling"),
    AnyOf((WARM_UP_CALL, INIT_FROM_CONFIG), "start-up phase graph capture / warm-up"),
    Needs(_CORE, "EngineCore._initialize_kv_caches", ("self",), "finds the engine before its first wait"),
    REASONS,
    Needs(_WORKER, "WorkerWrapperBase.execute_model", ("self", "scheduler_output"), "worker stage execute_model"),
    Needs(_WORKER, "WorkerWrapperBase.__getattr__", ("self", "attr"),
          "worker start-up phases and sample_tokens (calls the wrapper passes to its worker)"),
    Needs(_WORKER, "WorkerWrapperBase.shutdown", ("self",), "worker stage shutting_down"),
    Needs("vllm.distributed.parallel_state", "_TP", None, "worker rank"),
    COLLECTIVES,
    _common.ASYNC_LLM_INIT,
    TRACK_CLIENTS,
    AnyOf((Needs("vllm.entrypoints.launchers.launcher", "NoSignalServer.shutdown"),
           Needs("vllm.entrypoints.launcher", "serve_http")), "API server stage shutting_down"),
)

WEIGHT_LOADING = "weight loading"
KV_PROFILING = "KV cache / profiling"
WARM_UP = "graph capture / warm-up"
DEVICE_INIT = "device and distributed init"
# Calls a worker's wrapper runs for its EngineCore: (stage, phase) while each runs; "idle" after.
WORKER_CALLS: dict[str, tuple[str, str | None]] = {
    "init_device": ("starting", DEVICE_INIT),
    "load_model": ("starting", WEIGHT_LOADING),
    "determine_available_memory": ("starting", KV_PROFILING),
    "initialize_from_config": ("starting", KV_PROFILING),
    "compile_or_warm_up_model": ("starting", WARM_UP),
    "sample_tokens": ("execute_model", None),
}

stage = report.Stage("starting")
_reporter: report.Reporter | None = None
_writer: report.ReportWriter | None = None
_engine_ref: Any = None  # weakref to the EngineCore, once a hook has seen it
_llm_ref: Any = None  # API server: weakref to the AsyncLLM, once built
# API server: the request generators running (external id -> monotonic start: a client waits on each), and those
# that ended before their request finished (external id -> monotonic end), oldest dropped past MAX_GONE.
_live: dict[str, float] = {}
_gone: dict[str, float] = {}
MAX_GONE = 4096
_reasons_known = False


# ------------------------------------------------------------------ the scheduler, read from the report thread


def copy_items(container: Any, tries: int = 3) -> list:
    """list(container) taken without a lock: retried when the engine thread changed it mid-copy."""
    if container is None:
        return []
    for _ in range(tries):
        try:
            return list(container)
        except RuntimeError:  # "deque mutated during iteration", "dictionary changed size during iteration"
            continue
    return []


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def blocks_held(kv_cache_manager: Any, request_id: str) -> int | None:
    """KV blocks `request_id` holds in its largest KV group (comparable to blocks_needed); None when unknown.

    Reads each group manager's req_to_blocks with .get: a defaultdict, which a plain lookup would grow."""
    managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", None)
    if managers is None:
        return None
    held = [len(m.req_to_blocks.get(request_id) or ()) for m in copy_items(managers)]
    return max(held) if held else 0


def request_sample(request: Any, state: str, now_unix: float, kv_cache_manager: Any,
                   block_size: int | None) -> dict:
    """One request as the report lists it: counts and ages only, never its text."""
    rid = report.clip(getattr(request, "request_id", "?"), report.MAX_ID)
    arrival = getattr(request, "arrival_time", None)
    prompt = _int_or_none(getattr(request, "num_prompt_tokens", None))
    output = _int_or_none(getattr(request, "num_output_tokens", None))
    tokens = _int_or_none(getattr(request, "num_tokens", None))
    if tokens is None and prompt is not None:
        tokens = prompt + (output or 0)
    return {
        "id": rid,
        "state": state,
        "age_s": round(max(0.0, now_unix - arrival), 3) if isinstance(arrival, (int, float)) else None,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "blocks_held": blocks_held(kv_cache_manager, getattr(request, "request_id", "")),
        "blocks_needed": report.blocks_for(tokens, block_size) if tokens is not None else None,
        "client_connected": None,
    }


def _arrival(request: Any) -> float:
    value = getattr(request, "arrival_time", 0.0)
    return value if isinstance(value, (int, float)) else 0.0


def read_scheduler(sched: Any, reasons_known: bool, now_unix: float) -> dict:
    """{"scheduler", "requests_total", "requests"} from a vLLM v1 Scheduler, without taking its locks.

    The waiting queues are ``waiting`` plus ``kv_holding_waiting`` (0.32) or ``skipped_waiting`` (0.19 to
    0.31). Reasons are the release's own: 0.32 counts ``deferred_waiting`` among the queued; 0.2x reports
    the skipped queue as deferred; a release that reports no reasons gets {}.
    """
    running = copy_items(getattr(sched, "running", None))
    queues = [getattr(sched, name, None) for name in ("waiting", "kv_holding_waiting", "skipped_waiting")]
    waiting = [r for q in queues for r in copy_items(q)]
    by_reason: dict[str, int] = {}
    deferred_set = getattr(sched, "deferred_waiting", None)
    skipped = getattr(sched, "skipped_waiting", None)
    if deferred_set is not None:
        deferred = len(deferred_set)
        by_reason = {"capacity": max(0, len(waiting) - deferred), "deferred": deferred}
    elif reasons_known and skipped is not None:
        deferred = len(skipped)
        by_reason = {"capacity": max(0, len(waiting) - deferred), "deferred": deferred}
    pause = getattr(sched, "_pause_state", 0)
    try:
        paused = int(pause) != 0  # PauseState.UNPAUSED is 0
    except (TypeError, ValueError):
        paused = False
    kvm = getattr(sched, "kv_cache_manager", None)
    pool = getattr(kvm, "block_pool", None)
    block_size = _int_or_none(getattr(sched, "block_size", None)) or _int_or_none(
        getattr(getattr(sched, "cache_config", None), "block_size", None))
    kv_blocks = None
    if pool is not None:
        kv_blocks = {"free": _int_or_none(pool.get_num_free_blocks()),
                     "total": _int_or_none(getattr(pool, "num_gpu_blocks", None)), "block_size": block_size}
    running.sort(key=_arrival)
    waiting.sort(key=_arrival)
    sampled = [(r, "running") for r in running] + [(r, "waiting") for r in waiting]
    return {
        "scheduler": {"running": len(running), "waiting": len(waiting), "waiting_by_reason": by_reason,
                      "paused": paused, "kv_blocks": kv_blocks},
        "requests_total": len(running) + len(waiting),
        "requests": [request_sample(r, state, now_unix, kvm, block_size)
                     for r, state in sampled[: report.MAX_REQUESTS]],
    }


def engine_fields() -> dict:
    """The EngineCore's part of the report: counters from the status record's writer, then the scheduler."""
    import time

    out: dict[str, Any] = {}
    writer = _common.status_writer()
    if writer is not None:
        out.update(steps=writer.steps, model_steps=writer.model_steps,
                   last_model_step_mono_ns=writer.last_model_step_ns)
    engine = _engine_ref() if _engine_ref is not None else None
    sched = getattr(engine, "scheduler", None)
    if sched is not None:
        out.update(read_scheduler(sched, _reasons_known, time.time()))
    return out


def client_state(external_id: str, now: float) -> tuple[bool | None, float | None]:
    """(connected, seconds since it went) for a request's client, by its external id: True while its generator
    runs, False once it ended before the request finished, None for a request no generator was seen for."""
    if external_id in _live:
        return True, None
    ended = _gone.get(external_id)
    return (False, round(max(0.0, now - ended), 3)) if ended is not None else (None, None)


def api_fields() -> dict:
    """The API server's part of the report: the requests its OutputProcessor tracks, the ones whose client is gone
    first (then oldest first), each with its engine id, its age and its client's state; and the counts."""
    import time

    llm = _llm_ref() if _llm_ref is not None else None
    states = getattr(getattr(llm, "output_processor", None), "request_states", None)
    if states is None:
        return {}
    now, now_unix = time.monotonic(), time.time()
    samples = []
    gone = connected = 0
    for state in copy_items(getattr(states, "values", lambda: ())()):
        external = getattr(state, "external_req_id", None) or getattr(state, "request_id", "")
        is_connected, since = client_state(external if isinstance(external, str) else "", now)
        gone += is_connected is False
        connected += is_connected is True
        arrival = getattr(getattr(state, "stats", None), "arrival_time", None)
        samples.append({
            "id": report.clip(getattr(state, "request_id", "?"), report.MAX_ID),
            "state": "in_flight",
            "age_s": round(max(0.0, now_unix - arrival), 3) if isinstance(arrival, (int, float)) else None,
            "prompt_tokens": _int_or_none(getattr(state, "prompt_len", None)),
            "output_tokens": None, "blocks_held": None, "blocks_needed": None,
            "client_connected": is_connected, "disconnected_s": since,
        })
    samples.sort(key=lambda q: (q["client_connected"] is not False, -(q["age_s"] or 0.0)))
    return {"requests_total": len(samples), "clients": {"connected": connected, "gone": gone},
            "requests": samples[: report.MAX_REQUESTS]}


def tracking(original):
    """A maker for patch_method on AsyncLLM.generate: while it runs its client waits; one that ends before its
    request finished (the handler cancelled by a disconnect, the generator closed) marks the client gone."""
    import time

    from wedge_engine.fixes.reaper import around_generate

    def started(_llm: Any, rid: str) -> None:
        _live[rid] = time.monotonic()

    def ended(_llm: Any, rid: str, finished: bool) -> None:
        _live.pop(rid, None)
        if not finished:
            while len(_gone) >= MAX_GONE:
                _gone.pop(next(iter(_gone)), None)
            _gone[rid] = time.monotonic()

    return around_generate(original, started, ended)


def _track_generate() -> bool:
    from vllm.v1.engine.async_llm import AsyncLLM

    return patch_method(AsyncLLM, "generate", tracking, TAG)


def read_rank() -> dict | None:
    """The worker's tp/pp/dp rank and world size from vLLM's parallel_state; None before it is set up."""
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:
        return None
    tp, pp, dp, world = (getattr(ps, name, None) for name in ("_TP", "_PP", "_DP", "_WORLD"))
    if tp is None:
        return None

    def rank(group: Any) -> int | None:
        return _int_or_none(getattr(group, "rank_in_group", None)) if group is not None else 0

    return {"tp": rank(tp), "pp": rank(pp), "dp": rank(dp),
            "world_size": _int_or_none(getattr(world, "world_size", None))}


_rank: dict | None = None
# A Worker's own steps and last collective (collectives.py): the wrappers write it, the report thread reads it.
ranks = collectives.RankRecord()


def worker_fields() -> dict:
    global _rank
    if _rank is None:
        _rank = read_rank()
    return {"rank": None if _rank is None else {**_rank, **ranks.snapshot()}}


# ------------------------------------------------------------------ the stage hooks


def stage_on_result(future: Any, name: str = "execute_model_wait") -> None:
    """Enter `name` when the engine calls future.result(); at once where the future takes no attribute.

    The instance's own `result` holds the future only weakly: a strong reference would be a cycle, and every
    step's future (with the model's output in it) would wait for the cyclic collector instead of going at once.
    """
    try:
        ref = weakref.ref(future)
    except TypeError:
        stage.enter(name)
        return

    def waiting_result(*args: Any, **kwargs: Any) -> Any:
        stage.enter(name)
        this = ref()
        return type(this).result(this, *args, **kwargs)

    try:
        future.result = waiting_result
    except (AttributeError, TypeError):
        stage.enter(name)


def _entering(name: str, phase: str | None = None):
    """A maker for patch_method: the stage is `name` while the wrapped call runs (and until the next change)."""

    def make(original):
        def wrapper(self, *args, **kwargs):
            stage.enter(name, phase)
            return original(self, *args, **kwargs)

        return wrapper

    return make


def _dispatching(name: str):
    """execute_model / sample_tokens of the executor: `name` while dispatching, execute_model_wait in result()."""

    def make(original):
        def wrapper(self, *args, **kwargs):
            stage.enter(name)
            out = original(self, *args, **kwargs)
            if isinstance(out, Future):
                stage_on_result(out)
            return out

        return wrapper

    return make


def _found(engine: Any) -> None:
    """Remember the EngineCore (weakly) and hook its executor's own class, once."""
    global _engine_ref
    if _engine_ref is not None:
        return
    _engine_ref = weakref.ref(engine)
    executor = getattr(engine, "model_executor", None)
    if executor is not None:
        cls = type(executor)
        patch_method(cls, "execute_model", _dispatching("execute_model"), TAG)
        if hasattr(cls, "sample_tokens"):
            patch_method(cls, "sample_tokens", _dispatching("sample_tokens"), TAG)


def _install_engine() -> list[str]:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.executor.abstract import Executor

    def make_input(original):
        def _process_input_queue(self, *args, **kwargs):
            stage.enter("idle")
            if _engine_ref is None:
                _found(self)
            return original(self, *args, **kwargs)

        return _process_input_queue

    def make_init_kv(original):
        def _initialize_kv_caches(self, *args, **kwargs):
            _found(self)
            return original(self, *args, **kwargs)

        return _initialize_kv_caches

    done = []
    hooks = [
        (Scheduler, "schedule", _entering("scheduling")),
        (Scheduler, "update_from_output", _entering("update_output")),
        (EngineCoreProc, "_process_input_queue", make_input),
        (EngineCore, "shutdown", _entering("shutting_down")),
        (EngineCore, "_initialize_kv_caches", make_init_kv),
        (Executor, "__init__", _entering("starting", WEIGHT_LOADING)),
        (Executor, "determine_available_memory", _entering("starting", KV_PROFILING)),
        (Executor, "compile_or_warm_up_model", _entering("starting", WARM_UP)),
        # Before 0.32 initialize_from_config also runs the warm-up (there is no compile_or_warm_up_model).
        (Executor, "initialize_from_config",
         _entering("starting", KV_PROFILING if hasattr(Executor, "compile_or_warm_up_model") else WARM_UP)),
    ]
    for owner, name, make in hooks:
        if hasattr(owner, name) and patch_method(owner, name, make, TAG):
            done.append(f"{owner.__name__}.{name}")
    return done


def _then_idle(name: str, phase: str | None):
    """A worker call: the stage is (`name`, `phase`) while it runs, "idle" once it returns."""

    def wrap(fn):
        def staged(*args, **kwargs):
            stage.enter(name, phase)
            try:
                return fn(*args, **kwargs)
            finally:
                stage.enter("idle")

        return staged

    return wrap


def _counting_steps(wrap):
    """execute_model's wrap: as _then_idle, and the rank's own step count goes up as it enters."""

    def counted(fn):
        staged = wrap(fn)

        def step(*args, **kwargs):
            ranks.step()
            return staged(*args, **kwargs)

        return step

    return counted


def _install_collectives() -> list[str]:
    """Record the last collective this Worker entered or left: GroupCoordinator's collective methods, those the
    release has (collectives.OPS)."""
    if not holds(COLLECTIVES):
        return []
    from vllm.distributed.parallel_state import GroupCoordinator

    compiling = collectives.compiling_check()
    wrapped = [name for name, op in collectives.OPS.items() if hasattr(GroupCoordinator, name)
               and patch_method(GroupCoordinator, name, collectives.recording(op, ranks, compiling), TAG)]
    return [f"GroupCoordinator collectives ({len(wrapped)})"] if wrapped else []


def _install_worker() -> list[str]:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    done = []
    own = {"execute_model": ("execute_model", None), **WORKER_CALLS}
    passed_on = {}
    for call, (name, phase) in own.items():
        wrap = _then_idle(name, phase)
        if call == "execute_model":
            wrap = _counting_steps(wrap)
        if hasattr(WorkerWrapperBase, call):  # its own method (or a fault's stand-in for one): wrap it there
            if patch_method(WorkerWrapperBase, call, wrap, TAG):
                done.append(f"WorkerWrapperBase.{call}")
        else:  # passed on to the worker by WorkerWrapperBase.__getattr__
            passed_on[call] = wrap
    if passed_on and hasattr(WorkerWrapperBase, "__getattr__"):
        def make_getattr(original):
            def __getattr__(self, attr):
                value = original(self, attr)
                wrap = passed_on.get(attr)
                return value if wrap is None or not callable(value) else wrap(value)

            return __getattr__

        if patch_method(WorkerWrapperBase, "__getattr__", make_getattr, TAG):
            done.append(f"WorkerWrapperBase.__getattr__ ({', '.join(passed_on)})")
    if hasattr(WorkerWrapperBase, "shutdown") and patch_method(
            WorkerWrapperBase, "shutdown", _entering("shutting_down"), TAG):
        done.append("WorkerWrapperBase.shutdown")
    return done + _install_collectives()


def _install_api() -> list[str]:
    from wedge_engine.fixes import shutdown

    if holds(shutdown.NO_SIGNAL_SERVER):
        from vllm.entrypoints.launchers.launcher import NoSignalServer as server
    else:
        import uvicorn

        server = uvicorn.Server

    def make(original):
        async def shutdown_(self, *args, **kwargs):
            stage.enter("shutting_down")
            return await original(self, *args, **kwargs)

        return shutdown_

    if patch_method(server, "shutdown", make, TAG):
        return [f"{server.__name__}.shutdown"]
    return []


def _vllm_version() -> str | None:
    try:
        from vllm import __version__
    except Exception:
        return None
    return str(__version__)


def _start_writer() -> report.ReportWriter | None:
    global _writer
    if _writer is None and _reporter is not None:
        _writer = report.start_writer(_reporter)
    return _writer


def _start_with_async_llm() -> bool:
    """API server: start the report when the AsyncLLM is built (it launches the engine), not at plugin load:
    vLLM's helper subprocesses (the model registry's inspection) load the plugin as "api" too, and build none."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(original):
        def __init__(self, *args, **kwargs):
            global _llm_ref
            try:
                _start_writer()
            except Exception:
                logger.exception("wedge_engine report: could not start the report thread")
            result = original(self, *args, **kwargs)
            _llm_ref = weakref.ref(self)
            return result

        return __init__

    return patch_method(AsyncLLM, "__init__", make, TAG)


def activate(settings: Any, role: str) -> str | None:
    global _reporter, _reasons_known
    if _reporter is not None:
        return None
    done: list[str] = []
    if role in ("api", "engine"):
        # steps and model_steps come from the status record the heartbeat keeps; kept here too when the
        # report is on alone (an engine running in the API server's process steps there)
        _common.ensure_status_file(role)
        if _common.install_step_recorder():
            done.append("EngineCoreProc._process_engine_step records steps")
    collect = None
    if role == "api":
        stage.enter("serving")
        done += _install_api()
        if holds(TRACK_CLIENTS) and _track_generate():
            done.append("AsyncLLM.generate (clients)")
        collect = api_fields
    elif role == "engine":
        _common.status_writer()  # opened here, on the engine's thread, before the report thread reads it
        _reasons_known = holds(REASONS)
        done += _install_engine()
        collect = engine_fields
    else:
        done += _install_worker()
        collect = worker_fields
    _reporter = report.Reporter(role, _vllm_version(), stage, collect)
    hooks = f"stage from {', '.join(done) or 'start-up'}"
    if role == "api" and holds(_common.ASYNC_LLM_INIT) and _start_with_async_llm():
        return f"{report.report_path(report.default_dir(), _reporter.pid)} once the AsyncLLM is built; {hooks}"
    if _start_writer() is None:
        return None
    return f"{_writer.path} every {report.REPORT_INTERVAL_S:g} s; {hooks}"


def is_active() -> bool:
    return _reporter is not None


def deactivate() -> None:
    """Stop the thread and remove the report (tests)."""
    global _writer, _reporter, _engine_ref, _rank, _llm_ref
    if _writer is not None:
        _writer.close()
    _writer = _reporter = None
    _engine_ref = None
    _llm_ref = None
    _live.clear()
    _gone.clear()
    _rank = None
    ranks.reset()
    stage.enter("starting")


__all__ = ["activate", "engine_fields", "is_active", "read_scheduler", "stage", "stage_on_result"]
