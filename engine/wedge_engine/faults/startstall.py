"""Fault startup-stall: a Worker's start-up step never returns, so the server never becomes healthy.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=startup-stall``, optional
``WEDGE_ENGINE_FAULT_PHASE=warm-up|profile|load``, default warm-up); never run
it in a deployment.

The hang: a server stuck in start-up, with no error and no deadline. The Worker
blocks (on a ``threading.Event`` that is never set) in one of the three
start-up steps it runs for its EngineCore, as a hung collective during graph
capture, a hung profile run or a read from a dead network mount would:

* ``warm-up``: ``compile_or_warm_up_model`` (graph capture / warm-up; the
  EngineCore calls it through ``collective_rpc`` from ``_initialize_kv_caches``
  after logging the KV cache size);
* ``profile``: ``determine_available_memory`` (the KV cache profiling run);
* ``load``: ``load_model`` (weight loading, in ``WorkerProc.__init__``, before
  the Worker reports READY).

What it models are vLLM 0.32's own waits without a deadline, which stay as they
are: the EngineCore's ``WorkerProc.wait_for_ready``
(``vllm/v1/executor/multiproc_executor.py``: ``multiprocessing.connection.wait``
with no timeout) and ``collective_rpc`` for profiling and warm-up (timeout
None), and the API server's ``wait_for_engine_startup``
(``vllm/v1/engine/utils.py``: polls every 10 s forever, logging only at DEBUG).
The patch sits on ``WorkerWrapperBase`` (``vllm/v1/worker/worker_base.py``),
through which every worker of the multiproc and uniproc executors receives
those calls; the stalled frame keeps the method's name so stacks name the phase.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from wedge_engine.capability import Needs

PHASE_ENV = "WEDGE_ENGINE_FAULT_PHASE"
PHASES: dict[str, str] = {
    "warm-up": "compile_or_warm_up_model",
    "profile": "determine_available_memory",
    "load": "load_model",
}
DEFAULT_PHASE = "warm-up"

logger = logging.getLogger("vllm.wedge_engine")

# What it patches in vLLM (capability.py): the phase methods are set on the class whether or not
# it defines them (it passes the rest to its worker), so only the class itself is needed.
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.worker.worker_base", "WorkerWrapperBase", None, "start-up calls reach the worker through it"),
)
OPTIONAL: tuple[Needs, ...] = ()

_original: dict[str, Any] = {}
# Never set in a real run; tests set it to let a parked thread go.
_never = threading.Event()


def phase_from(environ: Mapping[str, str]) -> str:
    """The phase WEDGE_ENGINE_FAULT_PHASE names (default warm-up); FaultConfigError for another."""
    from wedge_engine.faults import FaultConfigError

    raw = environ.get(PHASE_ENV, "").strip().lower() or DEFAULT_PHASE
    if raw not in PHASES:
        raise FaultConfigError(f"{PHASE_ENV}={raw!r} is not one of {', '.join(PHASES)}")
    return raw


def _worker_wrapper_class():
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    return WorkerWrapperBase


def _stall_named(method: str):
    """A method that logs once and blocks forever, its code named `method` (what py-spy shows)."""

    def stall(self, *args, **kwargs):
        logger.warning("wedge_engine: startup-stall: %s blocks forever now (start-up never finishes)", method)
        _never.wait()
        return _original["fallback"](self, *args, **kwargs)

    stall.__code__ = stall.__code__.replace(co_name=method, co_qualname=f"WorkerWrapperBase.{method}")
    stall.__name__ = method
    return stall


def activate(environ: Mapping[str, str], cls: type | None = None) -> str:
    """Make `cls`.<phase method> (default WorkerWrapperBase) block forever; return what was patched."""
    phase = phase_from(environ)
    method = PHASES[phase]
    cls = cls if cls is not None else _worker_wrapper_class()
    if _original:
        return "already active"
    had_own = method in cls.__dict__
    _original.update(cls=cls, method=method, had_own=had_own, own=cls.__dict__.get(method),
                     fallback=cls.__dict__[method] if had_own
                     else (lambda self, *a, **k: getattr(self.worker, method)(*a, **k)))
    # WorkerWrapperBase passes most calls to its worker through __getattr__; a class attribute
    # of the same name is found first.
    setattr(cls, method, _stall_named(method))
    return f"{cls.__name__}.{method} blocks forever ({phase}): start-up never finishes"


def is_active() -> bool:
    return bool(_original)


def deactivate() -> None:
    """Put the class back (tests). A call already parked stays parked until _never is set."""
    if not _original:
        return
    cls, method = _original["cls"], _original["method"]
    if _original["had_own"]:
        setattr(cls, method, _original["own"])
    else:
        delattr(cls, method)
    _original.clear()
