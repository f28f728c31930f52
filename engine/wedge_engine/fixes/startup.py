"""Start-up deadline: prevents the startup hang, an API server that waits forever for its engine core.

The hang: vLLM 0.32's API server waits for the engine core's READY in
``wait_for_engine_startup`` (``vllm/v1/engine/utils.py``), polling every 10 s
with no deadline and logging only at DEBUG; the EngineCore itself waits for its
workers (``WorkerProc.wait_for_ready``) and for profiling and warm-up
(``collective_rpc``, timeout None) with none either. A worker stuck in weight
loading, graph capture or a collective leaves a server that never listens and
says nothing.

With this fix, in the API server, ``wait_for_engine_startup`` gets a deadline
(``WEDGE_ENGINE_STARTUP_S``, default 1200 s: a large model loaded from network
storage and compiled takes minutes, never twenty). When it passes, the wait is
interrupted and raises ``RuntimeError("wedge_engine: start-up did not finish
within N s ...")`` (raised into the waiting thread, see ``raise_in``);
vLLM's own failure path then stops the engine processes
and the server exits non-zero, so a supervisor restarts it or pages.

Cost when nothing is wrong: one timer thread during start-up.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

from wedge_engine.capability import Needs
from wedge_engine.fixes._common import patch_method

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.engine.utils", "wait_for_engine_startup", None, "the API server's wait for READY, bounded"),
)
OPTIONAL: tuple[Needs, ...] = ()

_active: set[str] = set()


class StartupDeadlineExceeded(RuntimeError):
    """Raised into the waiting thread when the deadline passes (then replaced by the clear error)."""


def raise_in(thread_id: int) -> Callable[[], None]:
    """An interrupt that raises StartupDeadlineExceeded in thread `thread_id` at its next bytecode.

    Not a signal: the API server waits inside its event loop, whose SIGINT handler (asyncio's
    Runner) only schedules a cancel the blocked loop would never run. The wait returns to Python
    at least every 10 s (vLLM polls with that timeout), where the exception lands."""

    def interrupt() -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(StartupDeadlineExceeded))

    return interrupt


class StartupDeadline:
    """One start-up wait with a bound: `expire` (run by a timer) interrupts the waiting thread."""

    def __init__(self, bound_s: float, interrupt: Callable[[], None]) -> None:
        self.bound_s = bound_s
        self.expired = False
        self._interrupt = interrupt

    def expire(self) -> None:
        self.expired = True
        logger.error("wedge_engine: start-up did not finish within %g s; failing it", self.bound_s)
        self._interrupt()

    def error(self) -> RuntimeError:
        return RuntimeError(
            f"wedge_engine: start-up did not finish within {self.bound_s:g} s: the engine core never reported "
            "ready (vLLM waits for it with no deadline). The last EngineCore/Worker lines above name the phase "
            "it stuck in (weight loading, KV cache profiling, graph capture / warm-up); "
            "raise WEDGE_ENGINE_STARTUP_S if start-up is just slow."
        )


def with_deadline(original: Any, bound_s: float, interrupt: Callable[[], None] | None = None):
    """`original` (a blocking start-up wait) failing with a clear RuntimeError after `bound_s` seconds."""

    def wait_for_engine_startup(*args: Any, **kwargs: Any) -> Any:
        deadline = StartupDeadline(bound_s, interrupt or raise_in(threading.get_ident()))
        timer = threading.Timer(bound_s, deadline.expire)
        timer.daemon = True
        timer.start()
        try:
            return original(*args, **kwargs)
        except (StartupDeadlineExceeded, KeyboardInterrupt):
            if deadline.expired:
                raise deadline.error() from None
            raise
        finally:
            timer.cancel()

    return wait_for_engine_startup


def activate(settings: Any, role: str) -> str | None:
    if role != "api" or _active:
        return None
    from vllm.v1.engine import utils

    bound = float(settings.startup_s)
    if patch_method(utils, "wait_for_engine_startup", lambda original: with_deadline(original, bound)):
        _active.add("startup")
    return f"wait_for_engine_startup fails after {bound:g} s"


def is_active() -> bool:
    return bool(_active)
