"""Reading py-spy thread dumps: where a vLLM process's threads are, as named heuristics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wedgectl.types import StackDump

Thread = dict[str, Any]

IN_MODEL = "in model execution"  # execute_model / collective_rpc / waiting on the workers
IN_SCHEDULER = "in the scheduler"  # schedule(): admission, block allocation
WAITING_INPUT = "waiting for requests"  # the busy loop's blocking input_queue.get(): idle
IN_STEP = "stepping"  # elsewhere in EngineCore.step / the busy loop
IN_SHUTDOWN = "in shutdown"
UNKNOWN = "unknown"

# Frame names that mean "the engine handed work to the model and waits for it".
_MODEL_FRAMES = {
    "execute_model",
    "sample_tokens",
    "collective_rpc",
    "execute_dummy_batch",
    "_model_forward",
    "get_response",
    "acquire_read",
    "dequeue",
    "synchronize",
}
_SHUTDOWN_FRAMES = {
    "shutdown",
    "_wait_tasks_to_complete",
    "_shutdown",
    "_exitfunc",
    "join",
    "_wait_for_tstate_lock",
    "terminate",
}


def frame_names(thread: Thread) -> list[str]:
    """'function (file:line)' for each frame, innermost first (py-spy's order)."""
    out = []
    for f in thread.get("frames") or ():
        filename = f.get("short_filename") or f.get("filename") or "?"
        line = f.get("line")
        where = f"{filename}:{line}" if line else filename
        out.append(f"{f.get('name', '?')} ({where})")
    return out


def base_name(name: object) -> str:
    """py-spy 0.4 names methods 'Class.method'; rules match on the method."""
    return str(name or "").rsplit(".", 1)[-1]


def _names(thread: Thread) -> list[str]:
    return [base_name(f.get("name")) for f in thread.get("frames") or ()]


def engine_main_thread(dump: StackDump | None) -> Thread | None:
    """The EngineCore thread that runs the busy loop (run_busy_loop / run_engine_core)."""
    if dump is None:
        return None
    for t in dump.threads:
        names = _names(t)
        if "run_busy_loop" in names or "run_engine_core" in names:
            return t
    for t in dump.threads:
        if t.get("thread_name") == "MainThread":
            return t
    return dump.threads[0] if dump.threads else None


# A Worker's main thread: running the model, or waiting in its busy loop for the next step.
WORKER_IN_MODEL = "in model execution"
WORKER_WAITING = "waiting for a step"
_WORKER_MODEL_FRAMES = {"execute_model", "sample_tokens", "_model_forward", "forward", "execute_dummy_batch"}


def classify_worker_thread(thread: Thread | None) -> str:
    """Whether a Worker is inside execute_model (a real step, or stuck in one) or idle in its
    busy loop's dequeue. vLLM 0.32 broadcasts even no-op steps, so one snapshot proves little;
    the share of snapshots over a burst of dumps is what the classifier reads."""
    if thread is None:
        return UNKNOWN
    names = _names(thread)
    # _execute_worker_rpc: the busy loop handed the step's RPC (execute_model) to the worker;
    # whatever runs below it (a kernel, a collective, a lock) is part of the step.
    if any(n in _WORKER_MODEL_FRAMES for n in names) or "_execute_worker_rpc" in names:
        return WORKER_IN_MODEL
    if "worker_busy_loop" in names or "dequeue" in names:
        return WORKER_WAITING
    return UNKNOWN


def profile(dumps: list[StackDump], where: Callable[[Thread | None], str]) -> dict[str, int]:
    """How many of a burst of dumps put the main thread in each place."""
    out: dict[str, int] = {}
    for d in dumps:
        key = where(main_thread(d) or engine_main_thread(d))
        out[key] = out.get(key, 0) + 1
    return out


def classify_engine_thread(thread: Thread | None) -> str:
    """Where an EngineCore main thread is, by the innermost frame that says something."""
    if thread is None:
        return UNKNOWN
    for f in thread.get("frames") or ():
        name = base_name(f.get("name"))
        file = str(f.get("filename", ""))
        if name in _MODEL_FRAMES:
            return IN_MODEL
        if name == "schedule" and "sched" in file:
            return IN_SCHEDULER
        if name == "_process_input_queue":
            return WAITING_INPUT
        if name in ("step", "step_with_batch_queue", "_process_engine_step"):
            return IN_STEP
        if name in ("shutdown", "_wait_tasks_to_complete"):
            return IN_SHUTDOWN
    return UNKNOWN


def shutdown_frames(dump: StackDump | None) -> list[str]:
    """Frames of any thread that is in a shutdown or exit path (uvicorn shutdown, thread join at exit)."""
    if dump is None:
        return []
    out = []
    for t in dump.threads:
        names = _names(t)
        if any(n in _SHUTDOWN_FRAMES for n in names):
            out += [n for n in frame_names(t) if base_name(n.split(" ")[0]) in _SHUTDOWN_FRAMES]
    return out


def main_thread(dump: StackDump) -> Thread | None:
    """The thread that runs the process's loop: vLLM's busy loops, else MainThread."""
    loops = ("run_busy_loop", "run_engine_core", "worker_busy_loop", "worker_main")
    for t in dump.threads:
        if any(n in loops for n in _names(t)):
            return t
    return next((t for t in dump.threads if t.get("thread_name") == "MainThread"), None)


def innermost_interesting(dump: StackDump) -> str | None:
    """The innermost frame of the main thread (else any thread) that is not interpreter plumbing."""
    main = main_thread(dump)
    for t in ([main] if main else []) + [t for t in dump.threads if t is not main]:
        names = frame_names(t)
        if not names:
            continue
        for n in names:
            fn = base_name(n.split(" ")[0])
            if fn in ("wait", "select", "poll", "_recv", "recv", "get", "run", "_bootstrap", "_bootstrap_inner"):
                continue
            return n
    return None
