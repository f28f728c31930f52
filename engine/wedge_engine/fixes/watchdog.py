"""Progress watchdog: prevents a stuck engine from holding requests forever behind a /health that says 200.

The hangs it ends: the spinning wedge (the EngineCore keeps stepping, no step
runs the model; vLLM's own ``--watchdog-config`` and SGLang's watchdog are fed
by every step, so they never fire) and the blocked deadlock (model execution
never returns, seed 002; ``WEDGE_ENGINE_FAULT=model-stall``). In both, vLLM
keeps /health at 200 and the clients wait until their own timeouts.

A daemon thread in the API server checks, every min(1 s, T/4), whether the
server is waiting on requests (``OutputProcessor.get_num_unfinished_requests``)
and whether the engine is getting work done: progress is the status record's
count of model steps and of tokens completed (``Scheduler.update_from_output``),
read without the engine's help, not the wall time since a step started. When
requests have been in flight or waiting for ``WEDGE_ENGINE_WATCHDOG_S`` = T
seconds (default 60) and neither count has moved, it trips:

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

It does not trip where no progress is expected:

- a paused engine (``AsyncLLM.pause_generation``, vLLM's ``/pause``; the
  scheduler's ``set_pause_state``, which sleep uses too) or a sleeping one
  (``/sleep``, ``AsyncLLM.sleep``; what ``vllm:engine_sleep_state`` reports):
  the EngineCore sets the PAUSED / SLEEPING flags of the status record and the
  API server remembers its own pause and sleep calls; the clock starts again
  when the engine resumes;
- a step that is long for this server: the limit stretches to twice the longest
  gap between two moves of progress seen so far while busy (at most 4 T), so a
  server whose prefills habitually take minutes is not cut off each time.

It recovers: once tripped, the first move of progress (the stuck step returned,
tokens were completed) logs one line, /health answers 200 again and new
requests are accepted. A first long step that outlives T trips it and then
recovers this way.

Hooks: ``AsyncLLM.__init__`` (start the thread), ``AsyncLLM.add_request``
(remember the event loop; refuse while tripped), ``AsyncLLM.check_health``,
``pause_generation`` / ``resume_generation`` / ``sleep`` / ``wake_up`` (API
server); ``faulthandler`` and the pid list (EngineCore, workers); the step
recorder ``EngineCoreProc._process_engine_step``, ``Scheduler.update_from_output``
(tokens), ``Scheduler.set_pause_state`` and ``EngineCore.sleep`` / ``wake_up``
(EngineCore).

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
from wedge_engine.capability import Needs
from wedge_engine.fixes._common import patch_method

logger = logging.getLogger("vllm.wedge_engine")

_SCHED = "vllm.v1.core.sched.scheduler"
_CORE = "vllm.v1.engine.core"
_ASYNC = "vllm.v1.engine.async_llm"
# What it wraps and imports in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    _common.STEP_RECORDER,
    Needs(_SCHED, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
          "counts completed tokens"),
    Needs(_CORE, "EngineCore", None, "pause and sleep recorders' class"),
    Needs(_ASYNC, "AsyncLLM.add_request", None, "the event loop; refuses while tripped"),
    Needs(_ASYNC, "AsyncLLM.check_health", ("self",), "/health 503 while tripped"),
    _common.ASYNC_LLM_INIT,
    Needs("vllm.v1.engine.output_processor", "OutputProcessor.get_num_unfinished_requests", ("self",),
          "requests in flight"),
    Needs("vllm.v1.engine.exceptions", "EngineDeadError", None, "what check_health raises"),
    _common.ABORT,
)
# Patched where present (hasattr): without them a paused or sleeping engine may trip it.
OPTIONAL: tuple[Needs, ...] = (
    _common.HTTP_ERROR,
    Needs(_SCHED, "Scheduler.set_pause_state", ("self", "pause_state"), "engine pause flag"),
    Needs(_CORE, "EngineCore.sleep", ("self", "level"), "engine sleep flag"),
    Needs(_CORE, "EngineCore.wake_up", None, "engine sleep flag"),
    Needs(_ASYNC, "AsyncLLM.pause_generation", None, "API server's own pause"),
    Needs(_ASYNC, "AsyncLLM.resume_generation", None, "API server's own pause"),
    Needs(_ASYNC, "AsyncLLM.sleep", None, "API server's own sleep"),
    Needs(_ASYNC, "AsyncLLM.wake_up", None, "API server's own sleep"),
)

DUMP_SIGNAL = signal.SIGUSR2

_active: set[str] = set()
EngineStalled: type | None = None


LONG_STEP_FACTOR = 2.0  # the limit is at least this many times the longest gap between moves of progress
MAX_STRETCH = 4.0  # ... and at most this many times WEDGE_ENGINE_WATCHDOG_S: a deadlock is still caught


@dataclass
class WatchState:
    """What the watchdog thread knows between polls."""

    limit_s: float
    busy_since_ns: int | None = None  # when work arrived, or the engine resumed, with nothing moving since
    progress: tuple[int, int] | None = None  # (model steps, tokens) at the last poll
    progress_ns: int | None = None  # when progress last moved while busy
    longest_gap_s: float = 0.0  # the longest wait between two moves of progress while busy
    api_paused: bool = False  # this API server paused or put the engine to sleep
    tripped: bool = False
    message: str = ""
    loop: Any = None

    @property
    def effective_limit_s(self) -> float:
        """T, stretched for a server whose steps are habitually long."""
        return min(max(self.limit_s, LONG_STEP_FACTOR * self.longest_gap_s), MAX_STRETCH * self.limit_s)


_state = WatchState(limit_s=60.0)


def stalled_for_s(now_ns: int, busy_since_ns: int, progress_ns: int | None) -> float:
    """Seconds with requests waiting and no progress: counted from the later of the two."""
    return max(0.0, (now_ns - max(busy_since_ns, progress_ns or busy_since_ns)) / 1e9)


def expects_no_progress(snap: status.StatusSnapshot) -> bool:
    """A paused or sleeping engine does no work by design: waiting requests are not a stall."""
    return snap.paused or snap.sleeping or _state.api_paused


def describe_stall(snap: status.StatusSnapshot, stalled_s: float, in_flight: int, poll_s: float,
                   now_ns: int | None = None) -> str:
    """The sentence clients and the log get when the watchdog trips."""
    now = snap.read_ns if now_ns is None else now_ns
    step_age = max(0.0, (now - snap.last_step_ns) / 1e9)
    model_age = max(0.0, (now - snap.last_model_step_ns) / 1e9)
    if step_age <= max(2 * poll_s, 1.0):
        how = (f"spinning: the engine keeps stepping ({snap.steps} steps) "
               f"but none has run the model for {model_age:.1f} s")
    else:
        how = f"blocked: no engine step at all for {step_age:.1f} s (last model step {model_age:.1f} s ago)"
    return (f"engine stalled: {in_flight} request(s) in flight or waiting and no model step completed, no token made, "
            f"for {stalled_s:.1f} s (watchdog limit {_state.effective_limit_s:g} s; {snap.model_steps} model steps, "
            f"{snap.tokens} tokens so far); {how}. The wedge_engine watchdog failed the requests and turned "
            f"/health to 503 until the engine makes progress again")


def check_once(llm: Any, reader: status.StatusReader, poll_s: float, now_ns: int | None = None) -> bool:
    """One watchdog poll; True when it tripped now."""
    in_flight = llm.output_processor.get_num_unfinished_requests()
    now = time.monotonic_ns() if now_ns is None else now_ns
    snap = reader.read()
    before, _state.progress = _state.progress, snap.progress
    moved = before is not None and snap.progress != before
    if moved and _state.busy_since_ns is not None:
        since = _state.progress_ns if _state.progress_ns is not None else _state.busy_since_ns
        _state.longest_gap_s = max(_state.longest_gap_s, (now - since) / 1e9)
    if _state.tripped:
        if moved:
            recover(before, snap)
        _state.busy_since_ns = _state.progress_ns = None
        return False
    if in_flight == 0 or expects_no_progress(snap):
        _state.busy_since_ns = _state.progress_ns = None  # the clock starts when work arrives or the engine resumes
        return False
    if _state.busy_since_ns is None:
        _state.busy_since_ns = now
    elif moved:
        _state.progress_ns = now
    stalled = stalled_for_s(now, _state.busy_since_ns, _state.progress_ns)
    if stalled < _state.effective_limit_s:
        return False
    trip(llm, describe_stall(snap, stalled, in_flight, poll_s, now))
    return True


def recover(before: tuple[int, int] | None, snap: status.StatusSnapshot) -> None:
    """Progress after a trip: /health back to 200, requests accepted again, and a line that says so."""
    _state.tripped = False
    _state.message = ""
    logger.warning("wedge_engine watchdog: the engine made progress again (model steps, tokens %s -> %s); "
                   "/health answers 200 and new requests are accepted", before, snap.progress)


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
    if _patch_pause_calls(AsyncLLM):
        done.append("AsyncLLM pause/sleep calls")
    _common.on_async_llm(_start)
    done.append("watchdog thread")
    return done


def _patch_pause_calls(cls: Any) -> bool:
    """Remember that this API server paused the engine or put it to sleep (before the engine says so)."""

    def pausing(original):
        async def wrapper(self, *args, **kwargs):
            _state.api_paused = True
            try:
                return await original(self, *args, **kwargs)
            except BaseException:
                _state.api_paused = False
                raise

        return wrapper

    def resuming(original):
        async def wrapper(self, *args, **kwargs):
            result = await original(self, *args, **kwargs)
            if result is not False:  # wake_up answers False while part of the engine still sleeps
                _state.api_paused = False
            return result

        return wrapper

    done = False
    for name, make in (("pause_generation", pausing), ("sleep", pausing),
                       ("resume_generation", resuming), ("wake_up", resuming)):
        if hasattr(cls, name):
            done = patch_method(cls, name, make) or done
    return done


def install_engine_recorders() -> bool:
    """In the EngineCore: count completed tokens and mirror pause and sleep into the status record."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    def writer() -> status.StatusWriter | None:
        return _common.status_writer()

    def make_update(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            out = original(self, scheduler_output, model_runner_output)
            w = writer()
            if w is not None:
                w.add_tokens(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
            return out

        return update_from_output

    def make_pause(original):
        def set_pause_state(self, pause_state):
            original(self, pause_state)
            w = writer()
            if w is not None:
                w.set_flag(status.PAUSED, int(pause_state) != 0)  # PauseState.UNPAUSED is 0

        return set_pause_state

    def make_sleep(original):
        def sleep(self, level: int = 1, *args, **kwargs):
            w = writer()
            if w is not None and level >= 1:
                w.set_flag(status.SLEEPING, True)  # level 0 only pauses: set_pause_state says so
            return original(self, level, *args, **kwargs)

        return sleep

    def make_wake(original):
        def wake_up(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            w = writer()
            if w is not None:
                w.set_flag(status.SLEEPING, bool(getattr(self.model_executor, "is_sleeping", False)))
            return result

        return wake_up

    done = False
    for owner, name, make in ((Scheduler, "update_from_output", make_update),
                              (Scheduler, "set_pause_state", make_pause),
                              (EngineCore, "sleep", make_sleep), (EngineCore, "wake_up", make_wake)):
        if hasattr(owner, name):  # an older vLLM without pause or sleep: the rest still counts
            # tagged: the admission guard wraps update_from_output too, and an untagged second wrapper
            # would be refused (the tokens then never counted while admission is on)
            done = patch_method(owner, name, make, "watchdog") or done
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
    if role in ("api", "engine") and install_engine_recorders():
        done.append("tokens, pause and sleep recorded")
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
    _state.busy_since_ns = _state.progress = _state.progress_ns = None
    _state.longest_gap_s = 0.0
    _state.api_paused = False
    _state.tripped = False
    _state.message = ""
    _state.loop = None
