"""Fault stream-sessions: the first requests become streaming-input sessions, to reproduce the deferred-admission wedge.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=stream-sessions``, optional
``WEDGE_ENGINE_FAULT_SESSIONS=N``, default 2); never run it in a deployment.

The hang (stock vLLM 0.32 scheduler): a streaming-input session (a resumable
request; ``AsyncLLM._add_streaming_input_request``, used by the realtime API)
that ends a turn with no next input queued is parked in
``RequestStatus.WAITING_FOR_STREAMING_REQ`` (``Scheduler._handle_stopped_request``).
It sits in the waiting queue and in ``Scheduler.deferred_waiting``, so
/metrics shows it as ``vllm:num_requests_waiting_by_reason{reason="deferred"}``,
and it keeps a model-runner slot: the waiting loop of ``Scheduler.schedule``
stops admitting once ``len(self.running) + self.num_waiting_for_streaming_input
>= self.max_num_active_reqs`` (``max_num_seqs``). With max_num_seqs paused
sessions nothing is admitted, ever: running 0, deferred = max_num_seqs, new
requests waiting for "capacity", KV almost free, tokens frozen, /health 200,
the EngineCore stepping empty (the waiting request counts as unfinished work).

What the fault supplies: over HTTP only the realtime (audio) route opens such
sessions, which a text model cannot serve. ``Scheduler.add_request`` (EngineCore)
is wrapped so the first N requests it sees are marked ``resumable`` before
vLLM's own add_request, as ``_add_streaming_input_request`` marks them; from
there every line that parks, counts and refuses is vLLM's. The API server does
not know they are sessions, so each client gets its first turn's answer and
goes: the parked session also has no client behind it, as a realtime session
whose client vanished without closing its input stream.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from wedge_engine._env import int_at_least
from wedge_engine.capability import Needs
from wedge_engine.faults._patch import MethodPatch, is_fault

SESSIONS_ENV = "WEDGE_ENGINE_FAULT_SESSIONS"
DEFAULT_SESSIONS = 2

# What it wraps in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ("self", "request"),
          "marks the first requests resumable"),
)
OPTIONAL: tuple[Needs, ...] = ()

_patch = MethodPatch()
_state = {"left": 0}


def sessions_from(environ: Mapping[str, str]) -> int:
    """N from WEDGE_ENGINE_FAULT_SESSIONS (default 2); FaultConfigError unless an integer >= 1."""
    from wedge_engine.faults import FaultConfigError

    return int_at_least(environ, SESSIONS_ENV, DEFAULT_SESSIONS, 1, FaultConfigError)


def _scheduler_class():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def activate(environ: Mapping[str, str]) -> str:
    """Wrap Scheduler.add_request so the first N new requests are resumable sessions."""
    n = sessions_from(environ)
    cls = _scheduler_class()
    original = cls.add_request
    if is_fault(original):
        return "already active"
    _state["left"] = n

    @functools.wraps(original)
    def add_request(self, request):
        if _state["left"] > 0 and request.request_id not in self.requests:
            _state["left"] -= 1
            request.resumable = True
        return original(self, request)

    _patch.install(cls, "add_request", original, add_request)
    return f"Scheduler.add_request makes the first {n} request(s) streaming-input sessions"


def is_active() -> bool:
    return _patch.active


def deactivate() -> None:
    """Put the original back (tests)."""
    _patch.restore()
    _state["left"] = 0
