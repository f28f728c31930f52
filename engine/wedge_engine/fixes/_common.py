"""What several fixes share: reversible method patches, the status record's lifecycle, the API server's AsyncLLM.

Nothing here patches anything on import; the fix modules call in.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from wedge_engine import status
from wedge_engine.capability import Needs, holds

logger = logging.getLogger("vllm.wedge_engine")

_MARK = "__wedge_engine_fix__"
# (owner, attribute, original) for every patch, so tests can undo them.
_patches: list[tuple[Any, str, Any]] = []
_lock = threading.Lock()

# Marks an engine-side failure message that the API server turns into an HTTP error.
ERROR_MARKER = "wedge_engine:"

# The vLLM names the helpers below rely on; a fix that calls one lists its Needs in its REQUIRES.
STEP_RECORDER = Needs("vllm.v1.engine.core", "EngineCoreProc._process_engine_step", ("self",),
                      "step recorder (install_step_recorder)")
ASYNC_LLM_INIT = Needs("vllm.v1.engine.async_llm", "AsyncLLM.__init__", None,
                       "finds the API server's AsyncLLM (on_async_llm)")
# Optional: before vLLM 0.29 there is no GracefulHTTPError, and http_error_class falls back to what those
# releases' AsyncLLM.generate passes through (a ValueError: HTTP 400 with the message) or wraps
# (anything else: EngineGenerateError, HTTP 500 with vLLM's generic message).
HTTP_ERROR = Needs("vllm.exceptions", "GracefulHTTPError.__init__", ("self", "message", "http_status"),
                   "HTTP errors with their own status (else 400 with the message, or a generic 500)")
ABORT = Needs("vllm.v1.engine.async_llm", "AsyncLLM.abort", ("self", "request_id", "internal"),
              "aborts failed requests (fail_requests)")


def patch_method(owner: Any, name: str, make: Callable[[Any], Any], tag: str | None = None) -> bool:
    """Replace owner.name with make(original); False (and nothing done) if our wrapper is already there.

    With `tag`, only a wrapper of the same tag counts as already there: a fix that observes (the report)
    wraps methods other fixes wrap too, on top of theirs, and never stops one applied after it.
    """
    mark = _MARK if tag is None else f"{_MARK}{tag}"
    with _lock:
        original = getattr(owner, name)
        if getattr(original, mark, False):
            return False
        wrapper = make(original)
        if not isinstance(wrapper, (staticmethod, classmethod)):
            functools.update_wrapper(wrapper, original)
            setattr(wrapper, mark, True)
        _patches.append((owner, name, owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else original))
        setattr(owner, name, wrapper)
        return True


_ABSENT = object()


def unpatch_all() -> None:
    """Undo every patch, newest first (tests)."""
    with _lock:
        while _patches:
            owner, name, original = _patches.pop()
            if original is _ABSENT:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)


# ------------------------------------------------------------------ status record


def ensure_status_file(role: str, environ: dict[str, str] | None = None) -> str | None:
    """The status record's path; the API server creates it (and names it in the env) if nobody has.

    The env variable is set before vLLM spawns the EngineCore and workers, so
    they inherit it. Only the process that created the file removes it.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(status.STATUS_FILE_ENV)
    if path or role != "api":
        return path or None
    path = status.default_path(os.getpid())  # a private 0700 directory, not the shared $TMPDIR
    status.create(path)
    environ[status.STATUS_FILE_ENV] = path
    atexit.register(status.remove, path)
    return path


_writer: status.StatusWriter | None = None
_writer_failed = False


def status_writer() -> status.StatusWriter | None:
    """This process's writer of the status record, opened once; None (logged once) when unavailable."""
    global _writer, _writer_failed
    if _writer is not None or _writer_failed:
        return _writer
    path = os.environ.get(status.STATUS_FILE_ENV)
    try:
        if not path:
            raise status.StatusFileError(f"{status.STATUS_FILE_ENV} is not set")
        _writer = status.StatusWriter(path)
        _writer.attach_engine(os.getpid())
    except OSError as exc:
        _writer_failed = True
        logger.warning("wedge_engine: no engine status record (%s); heartbeat and watchdog are blind", exc)
    return _writer


_reader: status.StatusReader | None = None


def status_reader() -> status.StatusReader | None:
    global _reader
    if _reader is None:
        path = os.environ.get(status.STATUS_FILE_ENV)
        if path:
            try:
                _reader = status.StatusReader(path)
            except OSError as exc:
                logger.warning("wedge_engine: cannot read the engine status record %s: %s", path, exc)
    return _reader


def install_step_recorder() -> bool:
    """Record every EngineCore busy-loop step in the status record (EngineCoreProc._process_engine_step).

    ``_process_engine_step`` returns whether the step ran the model
    (``total_num_scheduled_tokens > 0``), so a spinning engine moves ``steps``
    and not ``model_steps``, and a blocked one moves neither.
    """
    from vllm.v1.engine.core import EngineCoreProc

    def make(original):
        def _process_engine_step(self):
            executed = original(self)
            writer = _writer if _writer is not None else status_writer()
            if writer is not None:
                writer.record_step(bool(executed))
            return executed

        return _process_engine_step

    return patch_method(EngineCoreProc, "_process_engine_step", make)


# ------------------------------------------------------------------ the API server's AsyncLLM


_llms: weakref.WeakSet = weakref.WeakSet()
_llm_callbacks: list[Callable[[Any], None]] = []


def on_async_llm(callback: Callable[[Any], None]) -> None:
    """Call callback(async_llm) for every AsyncLLM this process builds (and those already built)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _llms.add(self)
            for cb in list(_llm_callbacks):
                try:
                    cb(self)
                except Exception:
                    logger.exception("wedge_engine: AsyncLLM hook %s failed", getattr(cb, "__name__", cb))

        return __init__

    patch_method(AsyncLLM, "__init__", make)
    _llm_callbacks.append(callback)
    for llm in list(_llms):
        callback(llm)


def async_llms() -> list[Any]:
    return list(_llms)


def http_error_class(name: str, status_code: int) -> type:
    """An exception vLLM's handlers answer with `status_code` and the message as the body: a GracefulHTTPError
    subclass where the release has it (0.29 on). Before that, a 4xx is a ValueError, which AsyncLLM.generate
    passes through and the server answers 400 with the message; a 5xx is a GenerationError that is also a
    ValueError where the release has one (its status and message answered), else a RuntimeError, which
    AsyncLLM.generate wraps in EngineGenerateError and the server answers 500 (the message stays in its log)."""
    from http import HTTPStatus

    if holds(HTTP_ERROR):
        from vllm.exceptions import GracefulHTTPError

        def __init__(self, message: str) -> None:
            GracefulHTTPError.__init__(self, message, HTTPStatus(status_code))

        return type(name, (GracefulHTTPError,), {"__init__": __init__, "__module__": __name__})
    generation_error = _generation_error() if status_code >= 500 else None
    if generation_error is not None:
        # A ValueError passes AsyncLLM.generate unwrapped, and the OpenAI handlers catch GenerationError
        # (before ValueError) and answer its status_code with its message: 503 with the reason, not a bare 500
        # (nor, on 0.15, an error body the completions route sends with HTTP 200).
        def __init__(self, message: str) -> None:
            generation_error.__init__(self, message)
            self.status_code = HTTPStatus(status_code)

        return type(name, (generation_error, ValueError), {"__init__": __init__, "__module__": __name__})
    base = ValueError if status_code < 500 else RuntimeError
    return type(name, (base,), {"__module__": __name__, "status_code": HTTPStatus(status_code)})


# Where releases before GracefulHTTPError (0.29) keep the OpenAI handlers' GenerationError.
_GENERATION_ERROR_MODULES = ("vllm.entrypoints.openai.engine.protocol", "vllm.entrypoints.openai.engine.serving")


def _generation_error() -> type | None:
    import importlib

    for module in _GENERATION_ERROR_MODULES:
        try:
            cls = getattr(importlib.import_module(module), "GenerationError", None)
        except Exception:
            continue
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls
    return None


def fail_requests(llm: Any, make_error: Callable[[], BaseException], loop: Any = None) -> list[str]:
    """Fail every request the API server is waiting on with make_error(); return their ids.

    Must run on the event loop thread. Each request's output queue gets the
    exception, which ``AsyncLLM.generate`` raises to the handler (vLLM answers
    a GracefulHTTPError with its status and message); then the requests are
    aborted in OutputProcessor and, best effort, in the EngineCore.
    """
    import asyncio

    states = getattr(llm.output_processor, "request_states", {})
    ids = list(states)
    for rid in ids:
        state = states.get(rid)
        queue = getattr(state, "queue", None)
        if queue is not None:
            queue.put(make_error())
    if ids:
        task = (loop or asyncio.get_running_loop()).create_task(llm.abort(ids, internal=True))
        _background.add(task)
        task.add_done_callback(_background.discard)
    return ids


_background: set = set()
