"""Leaked-request reaper: aborts a request once its client is gone, and counts it.

The hang it prevents (leaked capacity, "ghost requests"): a request whose
client disconnected stays in the engine, counted as running or waiting and
holding KV blocks, until it reaches max_tokens or forever. vLLM 0.32's
``AsyncLLM.generate`` aborts on disconnect only ``if q is not None``: a
cancellation that lands while ``q = await self.add_request(...)`` is still
awaiting (the request already registered in the OutputProcessor and queued to
the EngineCore) sends no abort (``WEDGE_ENGINE_FAULT=lost-abort`` makes every
disconnect take that path).

The fix (API server): ``AsyncLLM.generate`` is wrapped. When the generator
ends for any reason other than its request finishing (the handler task
cancelled by a disconnect, the generator closed or collected, an error) and the
OutputProcessor still tracks the request's id, the request is aborted in the
OutputProcessor and the EngineCore (``AsyncLLM.abort``, from its own task, so
it runs even while the disconnect unwinds), counted in
``wedge_engine:reaped_requests_total`` on /metrics and logged. When vLLM's own
abort already ran, the id is gone and nothing is counted.

Cost when nothing is wrong: one dict lookup when a request's generator ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from wedge_engine.fixes import _common
from wedge_engine.capability import Needs
from wedge_engine.fixes._common import patch_method

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps and calls in vLLM (capability.py). generate's parameters are checked because
# request_id_of reads the request id as its third positional argument.
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.engine.async_llm", "AsyncLLM.generate", ("self", "prompt", "sampling_params", "request_id"),
          "sees a request's generator end"),
    Needs("vllm.v1.engine.async_llm", "AsyncLLM.abort", ("self", "request_id"), "aborts the leaked request"),
)
OPTIONAL: tuple[Needs, ...] = ()

COUNTER_NAME = "wedge_engine:reaped_requests"

_active: set[str] = set()
_counter: Any = None
reaped: list[str] = []  # ids reaped in this process (tests; the counter is what /metrics shows)


def request_id_of(args: tuple, kwargs: dict) -> str | None:
    """The request id generate() was called with: generate(prompt, sampling_params, request_id, ...)."""
    rid = kwargs.get("request_id", args[2] if len(args) > 2 else None)
    return rid if isinstance(rid, str) else None


def still_tracked(llm: Any, request_id: str) -> bool:
    """Whether the OutputProcessor still tracks this external request id (nobody aborted or finished it)."""
    ids = getattr(getattr(llm, "output_processor", None), "external_req_ids", None)
    return bool(ids.get(request_id)) if ids is not None else False


def reap(llm: Any, request_id: str) -> bool:
    """Abort `request_id` if it is still tracked; count and log it. False when there was nothing to do."""
    if not still_tracked(llm, request_id):
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False  # collected outside the loop: no task can be run from here
    task = loop.create_task(llm.abort(request_id))
    _common._background.add(task)
    task.add_done_callback(_common._background.discard)
    reaped.append(request_id)
    if _counter is not None:
        _counter.inc()
    logger.warning("wedge_engine: reaper: client of request %s is gone; aborted it (%d reaped)", request_id,
                   len(reaped))
    return True


def around_generate(original, started=None, ended=None):
    """A wrapper of AsyncLLM.generate (an async generator of a request's outputs): `started(self, request_id)`
    before it runs, `ended(self, request_id, finished)` however it ends (finished: its request's last output
    was yielded; False when its handler was cancelled by a disconnect, the generator closed, or an error)."""
    async def generate(self, *args, **kwargs):
        request_id = request_id_of(args, kwargs)
        if request_id is not None and started is not None:
            started(self, request_id)
        done = False
        try:
            async for out in original(self, *args, **kwargs):
                done = done or bool(getattr(out, "finished", False))
                yield out
            done = True
        finally:
            if request_id is not None and ended is not None:
                ended(self, request_id, done)

    return generate


def _patch_generate() -> bool:
    from vllm.v1.engine.async_llm import AsyncLLM

    def on_end(llm: Any, request_id: str, finished: bool) -> None:
        if not finished:
            reap(llm, request_id)

    return patch_method(AsyncLLM, "generate", lambda original: around_generate(original, ended=on_end))


def _publish_counter() -> bool:
    global _counter
    if _counter is not None:
        return False
    from prometheus_client import Counter

    _counter = Counter(COUNTER_NAME, "Requests the wedge_engine reaper aborted because their client was gone.")
    return True


def activate(settings: Any, role: str) -> str | None:
    """Patch the API server's AsyncLLM.generate; nothing runs in the EngineCore or Workers."""
    if role != "api":
        return None
    done = []
    if _patch_generate():
        done.append("AsyncLLM.generate aborts a request whose client is gone")
    if _publish_counter():
        done.append(f"{COUNTER_NAME}_total on /metrics")
    _active.update(done)
    return ", ".join(done) if done else None


def is_active() -> bool:
    return bool(_active)
