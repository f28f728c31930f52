"""Bounded shutdown: prevents the shutdown hang, an API server that never exits after SIGTERM.

The hang (measured on vLLM 0.32): on SIGTERM vLLM stops its engine, then
uvicorn's ``Server.shutdown`` logs "Waiting for connections to close" and
waits, with no bound, for every connection whose request is still in its
cycle: a generation that will never finish, a client that announced a body
and stopped sending it. vLLM's ``NoSignalServer`` installs no signal handlers
of uvicorn's, so a second SIGTERM or SIGINT does nothing either, and
``--shutdown-timeout`` does not reach this wait.

With this fix, in the API server, from the first SIGTERM or SIGINT:

1. every request the server is waiting on is failed at once with HTTP 503
   ("server shutting down") and aborted in the engine;
2. after a short grace (min(1 s, bound/10)) for those responses to go out,
   every client connection still open is closed, and again every 0.5 s
   (a half-sent upload can no longer hold the server);
3. uvicorn's graceful wait is capped at what is left of the bound;
4. a daemon thread hard-exits the process when ``WEDGE_ENGINE_SHUTDOWN_S``
   (default 10 s) has passed since the signal, whatever the engine, the event
   loop or interpreter teardown are doing: it SIGKILLs the server's descendant
   processes (EngineCore, workers), then ``os._exit(1)``. A second signal
   hard-exits at once.

Hooks: ``add_signal_handler`` of uvloop's ``Loop`` and asyncio's unix
selector loop (vLLM's ``serve_http`` registers its SIGTERM/SIGINT handler
through it; ours runs first, then vLLM's, which shuts the engine down as
before); ``NoSignalServer.__init__`` and ``NoSignalServer.shutdown``
(``vllm/entrypoints/launchers/launcher.py``).

Cost when nothing is wrong: none (nothing runs until a signal).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from wedge_engine.fixes import _common
from wedge_engine.capability import AnyOf, Need, Needs, holds
from wedge_engine.fixes._common import patch_method

logger = logging.getLogger("vllm.wedge_engine")

_LAUNCHER = "vllm.entrypoints.launchers.launcher"
# What it wraps in vLLM (capability.py); the signal hooks are uvloop's and asyncio's, not vLLM's
# (uvloop is optional: without it only asyncio's loop is hooked).
# The uvicorn server vLLM runs: its own NoSignalServer (0.29 on; __init__ and shutdown come from
# uvicorn.Server up to 0.31), or before it a plain uvicorn.Server made by serve_http in
# vllm/entrypoints/launcher.py, whose signal handlers go through loop.add_signal_handler as well.
NO_SIGNAL_SERVER = Needs(_LAUNCHER, "NoSignalServer", None, "the uvicorn server vLLM runs (0.29 on)")
SERVER = AnyOf((NO_SIGNAL_SERVER, Needs("vllm.entrypoints.launcher", "serve_http", None,
                                        "serves a plain uvicorn.Server (before 0.29)")),
               "tracks the uvicorn server and caps its graceful wait")
REQUIRES: tuple[Need, ...] = (
    SERVER,
    _common.ASYNC_LLM_INIT,
    _common.ABORT,
)
OPTIONAL: tuple[Needs, ...] = (_common.HTTP_ERROR,)

CLOSE_EVERY_S = 0.5
HARD_EXIT_CODE = 1

_active: set[str] = set()
ServerShuttingDown: type | None = None


@dataclass
class ShutdownState:
    bound_s: float = 10.0
    started: float | None = None  # time.monotonic() of the first signal
    signal_name: str = ""
    servers: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    closed: int = 0

    @property
    def deadline(self) -> float | None:
        return None if self.started is None else self.started + self.bound_s

    @property
    def grace_s(self) -> float:
        return min(1.0, self.bound_s / 10)


_state = ShutdownState()


def on_signal(signum: int) -> None:
    """Our part of the API server's SIGTERM/SIGINT handler; runs on the event loop before vLLM's."""
    name = signal.Signals(signum).name
    if _state.started is not None:
        hard_exit(f"second signal ({name}) during shutdown")
        return
    begin(name)


def begin(reason: str) -> None:
    """Start the bounded shutdown: fail requests, schedule the connection closer, arm the hard exit."""
    if _state.started is not None:
        return
    _state.started = time.monotonic()
    _state.signal_name = reason
    threading.Thread(target=_hard_exit_at, args=(_state.deadline,), name="wedge-engine-shutdown-bound",
                     daemon=True).start()
    message = (f"server shutting down ({reason}): the request was aborted by the wedge_engine bounded shutdown; "
               f"retry on another instance")
    error_class = ServerShuttingDown
    failed = 0
    for llm in _common.async_llms():
        try:
            failed += len(_common.fail_requests(llm, lambda: error_class(message)))
        except Exception:
            logger.exception("wedge_engine shutdown: could not fail the in-flight requests")
    logger.warning(
        "[shutdown] wedge_engine: %s; failed %d in-flight request(s) with HTTP 503, closing client connections "
        "in %.1f s, exiting within %g s (hard exit then)", reason, failed, _state.grace_s, _state.bound_s,
    )
    try:
        asyncio.get_running_loop().call_later(_state.grace_s, _close_connections)
    except RuntimeError:  # not on a loop thread: the capped uvicorn shutdown and the hard exit remain
        pass


def _close_connections() -> None:
    n = 0
    for server in list(_state.servers):
        state = getattr(server, "server_state", None)
        for conn in list(getattr(state, "connections", ())):
            transport = getattr(conn, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.close()
                n += 1
    if n:
        _state.closed += n
        logger.warning("[shutdown] wedge_engine: closed %d client connection(s) still open", n)
    try:
        asyncio.get_running_loop().call_later(CLOSE_EVERY_S, _close_connections)
    except RuntimeError:
        pass


def _hard_exit_at(deadline: float) -> None:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(left, 0.25))
    hard_exit(f"still running {_state.bound_s:g} s after {_state.signal_name}")


def hard_exit(why: str) -> None:
    """Kill the server's descendants and exit now."""
    killed = _kill_descendants()
    try:
        logger.error("[shutdown] wedge_engine: %s; hard exit (SIGKILLed %d engine process(es))", why, killed)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except Exception:  # logging may already be torn down; exit anyway
        pass
    os._exit(HARD_EXIT_CODE)


def _kill_descendants() -> int:
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:
        return 0
    n = 0
    for child in children:
        try:
            child.kill()
            n += 1
        except Exception:
            pass
    return n


def remaining_s() -> float | None:
    deadline = _state.deadline
    return None if deadline is None else deadline - time.monotonic()


# ------------------------------------------------------------------ hooks


def chain_signal_callback(signum: int, callback: Any) -> Any:
    """callback preceded by on_signal for SIGTERM/SIGINT; other signals unchanged."""
    if signum not in (signal.SIGTERM, signal.SIGINT) or getattr(callback, "__wedge_engine_fix__", False):
        return callback

    def chained(*args):
        try:
            on_signal(signum)
        except Exception:
            logger.exception("wedge_engine shutdown: signal hook failed")
        return callback(*args)

    chained.__wedge_engine_fix__ = True
    return chained


def _patch_loops() -> list[str]:
    done = []

    def make(original):
        def add_signal_handler(self, sig, callback, *args):
            return original(self, sig, chain_signal_callback(sig, callback), *args)

        return add_signal_handler

    try:
        import uvloop

        if patch_method(uvloop.Loop, "add_signal_handler", make):
            done.append("uvloop.Loop.add_signal_handler")
    except ImportError:
        pass
    from asyncio import unix_events

    if patch_method(unix_events._UnixSelectorEventLoop, "add_signal_handler", make):
        done.append("asyncio unix loop add_signal_handler")
    return done


def _server_class() -> tuple[type, str]:
    """The server class to patch and its name for the log line."""
    if holds(NO_SIGNAL_SERVER):
        from vllm.entrypoints.launchers.launcher import NoSignalServer

        return NoSignalServer, "NoSignalServer"
    import uvicorn

    return uvicorn.Server, "uvicorn.Server"


def _patch_server() -> list[str]:
    server, label = _server_class()

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _state.servers.add(self)

        return __init__

    def make_shutdown(original):
        async def shutdown(self, sockets=None):
            if _state.started is None:  # shutdown reached without a signal we saw: bound it all the same
                begin("server shutdown")
            left = remaining_s() or _state.bound_s
            cap = max(0.1, left - 1.0)
            current = self.config.timeout_graceful_shutdown
            self.config.timeout_graceful_shutdown = cap if current is None else min(current, cap)
            return await original(self, sockets)

        return shutdown

    done = []
    if patch_method(server, "__init__", make_init):
        done.append(f"{label}.__init__")
    if patch_method(server, "shutdown", make_shutdown):
        done.append(f"{label}.shutdown")
    return done


def activate(settings: Any, role: str) -> str | None:
    if role != "api":
        return None
    global ServerShuttingDown
    if ServerShuttingDown is None:
        ServerShuttingDown = _common.http_error_class("ServerShuttingDown", 503)
    _state.bound_s = float(settings.shutdown_s)
    done = _patch_loops() + _patch_server()
    _common.on_async_llm(lambda _llm: None)  # track AsyncLLMs so the signal can fail their requests
    done.append(f"bound {settings.shutdown_s:g} s")
    _active.update(done)
    return ", ".join(done)


def is_active() -> bool:
    return bool(_active)


def reset() -> None:
    """Forget a shutdown in progress (tests)."""
    _state.started = None
    _state.signal_name = ""
    _state.closed = 0
