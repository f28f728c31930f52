"""Progress watchdog: prevents a stuck engine from holding requests forever behind a /health that says 200.

The hangs it ends: the spinning wedge (the EngineCore keeps stepping, no step
runs the model; vLLM's own ``--watchdog-config`` and SGLang's watchdog are fed
by every step, so they never fire) and the blocked deadlock (model execution
never returns, seed 002; ``WEDGE_ENGINE_FAULT=model-stall``). In both, vLLM
keeps /health at 200 and the clients wait until their own timeouts.

A daemon thread in the API server checks, every min(1 s, T/4), whether the
server is waiting on requests (``OutputProcessor.get_num_unfinished_requests``)
and how long ago the EngineCore last ran the model (the status record, which
it reads without the engine's help). When requests have been in flight or
waiting for ``WEDGE_ENGINE_WATCHDOG_S`` = T seconds (default 60) with no model
step, it trips, once:

1. logs one ERROR line (spinning or blocked, counters, ages) and sends
   SIGUSR2 to every EngineCore and worker that registered in the status
   record's pid list: each dumps the Python stacks of all its threads to its
   stderr, the server log (``faulthandler.register``, which runs in C and so
   works while the process's main thread is stuck);
2. on the event loop, fails every request the API server is waiting on with
   HTTP 503 and a message that says why, and aborts them in the engine;
3. from then on ``AsyncLLM.check_health`` raises EngineDeadError, so /health
   answers 503 and a supervisor restarts the server, and ``AsyncLLM.add_request``
   refuses new requests with 503 instead of queueing them behind the hang.

Hooks: ``AsyncLLM.__init__`` (start the thread), ``AsyncLLM.add_request``
(remember the event loop; refuse once tripped), ``AsyncLLM.check_health``
(API server); ``faulthandler`` and the pid list (EngineCore, workers); the
step recorder ``EngineCoreProc._process_engine_step`` (EngineCore).

Cost when nothing is wrong: a thread that wakes once a second and reads 128
bytes; one attribute test per request.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from wedge_engine import status
from wedge_engine.fixes import _common
from wedge_engine.fixes._common import patch_method

logger = logging.getLogger("vllm.wedge_engine")

DUMP_SIGNAL = signal.SIGUSR2

_active: set[str] = set()
EngineStalled: type | None = None


@dataclass
class WatchState:
    """What the watchdog thread knows between polls."""

    limit_s: float
    busy_since_ns: int | None = None
    tripped: bool = False
    message: str = ""
    loop: Any = None


_state = WatchState(limit_s=60.0)


def stalled_for_s(now_ns: int, busy_since_ns: int, snap: status.StatusSnapshot) -> float:
    """Seconds with requests waiting and no model step: counted from the later of the two."""
    return max(0.0, (now_ns - max(busy_since_ns, snap.last_model_step_ns)) / 1e9)


def describe_stall(snap: status.StatusSnapshot, stalled_s: float, in_flight: int, poll_s: float,
                   now_ns: int | None = None) -> str:
    """The sentence clients and the log get when the watchdog trips."""
    now = snap.read_ns if now_ns is None else now_ns
    step_age = max(0.0, (now - snap.last_step_ns) / 1e9)
    model_age = max(0.0, (now - snap.last_model_step_ns) / 1e9)
    if step_age <= max(2 * poll_s, 1.0):
        how = f"spinning: the engine keeps stepping ({snap.steps} steps) but none has run the model for {model_age:.1f} s"
    else:
        how = f"blocked: no engine step at all for {step_age:.1f} s (last model step {model_age:.1f} s ago)"
    return (f"engine stalled: {in_flight} request(s) in flight or waiting and no model step for "
            f"{stalled_s:.1f} s (watchdog limit {_state.limit_s:g} s); {how}. The wedge_engine watchdog failed "
            f"the requests and turned /health to 503; the server needs a restart")


def check_once(llm: Any, reader: status.StatusReader, poll_s: float, now_ns: int | None = None) -> bool:
    """One watchdog poll; True when it tripped now."""
    if _state.tripped:
        return False
    in_flight = llm.output_processor.get_num_unfinished_requests()
    now = time.monotonic_ns() if now_ns is None else now_ns
    if in_flight == 0:
        _state.busy_since_ns = None
        return False
    if _state.busy_since_ns is None:
        _state.busy_since_ns = now
    snap = reader.read()
    stalled = stalled_for_s(now, _state.busy_since_ns, snap)
    if stalled < _state.limit_s:
        return False
    trip(llm, describe_stall(snap, stalled, in_flight, poll_s, now))
    return True


def trip(llm: Any, message: str) -> None:
    _state.tripped = True
    _state.message = message
    targets = stack_dump_targets()
    logger.error("wedge_engine watchdog: %s; the stacks of pids %s follow in the log",
                 message, ", ".join(str(pid) for pid, _role in targets) or "(none registered)")
    dump_engine_stacks(targets)
    loop = _state.loop
    if loop is None or loop.is_closed():
        logger.error("wedge_engine watchdog: no event loop seen yet; cannot fail the requests")
        return
    error_class = EngineStalled

    def fail() -> None:
        ids = _common.fail_requests(llm, lambda: error_class(message), loop)
        logger.error("wedge_engine watchdog: failed %d request(s) with HTTP 503", len(ids))

    loop.call_soon_threadsafe(fail)


def stack_dump_targets() -> list[tuple[int, str]]:
    """The registered engine/worker (pid, role) pairs that are still this server's processes."""
    path = os.environ.get(status.STATUS_FILE_ENV)
    ours = _descendants()
    # A pid not among our descendants is gone and maybe reused: SIGUSR2 would kill a stranger.
    return [(pid, role) for pid, role in (status.read_pids(path) if path else ()) if ours is None or pid in ours]


def dump_engine_stacks(targets: list[tuple[int, str]] | None = None) -> list[int]:
    """Make every registered engine/worker process dump its stacks to its stderr; the pids reached."""
    done = []
    for pid, _role in stack_dump_targets() if targets is None else targets:
        if pid == os.getpid():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            done.append(pid)
            continue
        try:
            os.kill(pid, DUMP_SIGNAL)
            done.append(pid)
        except OSError:
            pass
    return done


def _descendants() -> set[int] | None:
    """This process and its live descendants; None when psutil (a vLLM dependency) is missing."""
    try:
        import psutil

        me = psutil.Process()
        return {me.pid, *(p.pid for p in me.children(recursive=True))}
    except Exception:
        return None


def _run(llm_ref, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        try:
            llm = llm_ref()
            reader = _common.status_reader()
            if llm is None:
                return
            if reader is not None:
                check_once(llm, reader, poll_s)
        except Exception:  # never let the watchdog die of a surprise; say it once a poll at most
            logger.exception("wedge_engine watchdog: poll failed")


def _start(llm: Any) -> None:
    import weakref

    poll_s = min(1.0, _state.limit_s / 4)
    thread = threading.Thread(target=_run, args=(weakref.ref(llm), poll_s), name="wedge-engine-watchdog", daemon=True)
    thread.start()


def _patch_api() -> list[str]:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    global EngineStalled
    if EngineStalled is None:
        EngineStalled = _common.http_error_class("EngineStalled", 503)
    error_class = EngineStalled
    done = []

    def make_add(original):
        async def add_request(self, *args, **kwargs):
            if _state.loop is None:
                _state.loop = asyncio.get_running_loop()
            if _state.tripped:
                raise error_class(_state.message)
            return await original(self, *args, **kwargs)

        return add_request

    def make_health(original):
        async def check_health(self):
            if _state.tripped:
                raise EngineDeadError()
            return await original(self)

        return check_health

    if patch_method(AsyncLLM, "add_request", make_add):
        done.append("AsyncLLM.add_request")
    if patch_method(AsyncLLM, "check_health", make_health):
        done.append("AsyncLLM.check_health")
    _common.on_async_llm(_start)
    done.append("watchdog thread")
    return done


def _arm_stack_dump(role: str) -> bool:
    path = os.environ.get(status.STATUS_FILE_ENV)
    if not path:
        return False
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    status.register_pid(path, os.getpid(), role)
    return True


def activate(settings: Any, role: str) -> str | None:
    if _active:
        return None
    _state.limit_s = float(settings.watchdog_s)
    done = []
    _common.ensure_status_file(role)
    if role in ("api", "engine") and _common.install_step_recorder():
        done.append("EngineCoreProc._process_engine_step records steps")
    if role in ("engine", "worker") and _arm_stack_dump(role):
        done.append(f"stack dump on {DUMP_SIGNAL.name}")
    if role == "api":
        done += _patch_api()
        done.append(f"limit {settings.watchdog_s:g} s")
    _active.update(done)
    return ", ".join(done) if done else None


def is_active() -> bool:
    return bool(_active)


def reset() -> None:
    """Forget a trip (tests)."""
    _state.busy_since_ns = None
    _state.tripped = False
    _state.message = ""
    _state.loop = None
