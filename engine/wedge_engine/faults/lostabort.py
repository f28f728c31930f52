"""Fault lost-abort: a client that disconnects leaves its request in the engine, as the add_request race did.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=lost-abort``); never run it in a deployment.

The hang class (leaked capacity, "ghost requests"): requests whose clients are
gone stay counted as running or waiting and keep their KV blocks; the engine
spends its steps on output nobody reads and new clients queue behind them.

The vLLM code it restores: ``AsyncLLM.generate`` (``vllm/v1/engine/async_llm.py``)
aborts a request when its client disconnects, in ``except (asyncio.CancelledError,
GeneratorExit): if q is not None: await self.abort(q.request_id, internal=True)``.
When the cancellation lands while ``q = await self.add_request(...)`` is still
awaiting, after ``OutputProcessor.add_request`` registered the request and the
add was queued to the EngineCore, ``q`` is still None and no abort is sent:
the request runs in the engine to its max_tokens with no client. That window
is a race (microseconds on an idle server); this fault makes every disconnect
land in it, deterministically: ``AsyncLLM.abort`` drops the call that
``generate`` makes while handling the client's CancelledError/GeneratorExit.
Aborts from anywhere else (errors, the patched engine's reaper, the
/abort_requests route) go through.

Patched in the API-server process only (where AsyncLLM lives); inert in the
EngineCore and Workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from collections.abc import Mapping

from wedge_engine.capability import Needs
from wedge_engine.faults._patch import MethodPatch, is_fault

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.engine.async_llm", "AsyncLLM.abort", ("self", "request_id", "internal"),
          "drops generate()'s disconnect abort"),
)
OPTIONAL: tuple[Needs, ...] = ()

_patch = MethodPatch()
dropped: list[str] = []  # request ids whose disconnect abort was dropped (tests, and the log line)


def _async_llm_class():
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def is_disconnect_abort(exc: BaseException | None) -> bool:
    """Whether the exception being handled is a client's disconnect (the task cancelled, or the generator closed)."""
    import asyncio

    return isinstance(exc, (asyncio.CancelledError, GeneratorExit))


def activate(environ: Mapping[str, str]) -> str:
    """Wrap AsyncLLM.abort in the API server; elsewhere patch nothing."""
    if multiprocessing.current_process().name != "MainProcess":
        return "inert outside the API server"
    cls = _async_llm_class()
    original = cls.abort
    if is_fault(original):
        return "already active"

    async def abort(self, request_id, internal: bool = False):
        # Inside generate()'s `except (CancelledError, GeneratorExit)` the handled exception is
        # visible here (same task, exception context chained): that is the disconnect path.
        if is_disconnect_abort(sys.exc_info()[1]):
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            dropped.extend(ids)
            logger.warning("wedge_engine: fault lost-abort: client gone, abort of %s not sent", ",".join(ids))
            return None
        return await original(self, request_id, internal)

    abort.__wrapped__ = original  # type: ignore[attr-defined]
    _patch.install(cls, "abort", original, abort)
    return "AsyncLLM.abort drops the abort generate() sends when its client disconnects"


def is_active() -> bool:
    return _patch.active


def deactivate() -> None:
    """Put the original back (tests)."""
    _patch.restore()
    dropped.clear()
