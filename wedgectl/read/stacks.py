"""Reading py-spy thread dumps: where a vLLM process's threads are, as named heuristics."""

from __future__ import annotations

import re

from collections.abc import Callable
from typing import Any

from wedgectl.model.types import StackDump

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


_PLUMBING = {"wait", "select", "poll", "_recv", "recv", "get", "run", "_bootstrap", "_bootstrap_inner"}
_NATIVE_PLUMBING = _PLUMBING | {"read", "epoll_wait", "epoll_pwait", "futex", "syscall", "__libc_recv",
                                "pthread_cond_wait", "pthread_cond_timedwait", "sem_wait", "sem_timedwait"}
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_NATIVE_FILE = re.compile(r"\.so(?:\.[0-9]+)*$|\.(?:c|cc|cpp|cxx|h|hpp)$")


def _unwound_native(f: dict[str, Any]) -> bool:
    """A frame py-spy --native unwound from machine code: a shared object's or a C/C++ source's, or a bare address
    (not a .py file, nor the pseudo-files of generated Python code, which is_native_frame also counts)."""
    file = str(f.get("filename") or "")
    return bool(_NATIVE_FILE.search(file)) or bool(_ADDRESS.fullmatch(str(f.get("name") or "")))


def _frame_text(f: dict[str, Any]) -> str:
    filename = f.get("short_filename") or f.get("filename") or "?"
    line = f.get("line")
    return f"{f.get('name', '?')} ({filename}:{line})" if line else f"{f.get('name', '?')} ({filename})"


def innermost_interesting(dump: StackDump) -> str | None:
    """The innermost frame of the main thread (else any thread) that is not interpreter plumbing.

    With native frames (--native), the Python frame stays the subject, and the innermost named native frame
    above it is added ("X (file.py:N), in native Y (lib)"): a bare address in libc says nothing on its own."""
    main = main_thread(dump)
    for t in ([main] if main else []) + [t for t in dump.threads if t is not main]:
        frames = [f for f in t.get("frames") or () if isinstance(f, dict)]
        if not frames:
            continue
        natives: list[dict[str, Any]] = []
        for f in frames:
            if _unwound_native(f):
                natives.append(f)
                continue
            if base_name(f.get("name")) in _PLUMBING:
                continue
            return _with_native(_frame_text(f), natives)
        if natives:  # a thread with no telling Python frame: its innermost named native one
            named = [f for f in natives if not _ADDRESS.fullmatch(str(f.get("name") or ""))]
            telling = [f for f in named if base_name(f.get("name")) not in _NATIVE_PLUMBING]
            return _frame_text((telling or named or natives)[0])
    return None


def _with_native(python: str, natives: list[dict[str, Any]]) -> str:
    named = [f for f in natives if not _ADDRESS.fullmatch(str(f.get("name") or ""))]
    telling = [f for f in named if base_name(f.get("name")) not in _NATIVE_PLUMBING]
    if not (telling or named):
        return python
    return f"{python}, in native {_frame_text((telling or named)[0])}"


def has_native(dump: StackDump) -> bool:
    """Whether the dump was taken with native frames (--native)."""
    return any(_unwound_native(f) for t in dump.threads for f in t.get("frames") or () if isinstance(f, dict))


# --- collectives: where a rank of a parallel group is, relative to the collective its step needs.
# A rank's main thread is inside a collective (it arrived and waits for the others), before one
# (model code, a device synchronise, host code: it has not arrived), or elsewhere (between steps).
INSIDE = "inside a collective"
BEFORE = "before the collective"
ELSEWHERE = "elsewhere"

# What the innermost telling frame is, within those groups.
KIND_COLLECTIVE = "collective"
KIND_COMPILED = "compiled graph"  # a generated file: compute, or a collective inlined by torch.compile
KIND_DEVICE_SYNC = "device synchronise"
KIND_MODEL = "model or host code"
KIND_IDLE = "waiting for a step"
KIND_UNKNOWN = "unknown"

# Python frames of vLLM's and torch's collectives (GroupCoordinator, the device communicators,
# torch.distributed, the shared-memory broadcast queue used inside a step).
_COLLECTIVE_FRAMES = {
    "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather", "broadcast",
    "broadcast_object", "broadcast_object_list", "broadcast_tensor_dict", "barrier", "all_to_all",
    "all_to_all_single", "send_tensor_dict", "recv_tensor_dict", "send_object", "recv_object",
    "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather", "_all_reduce_out_place",
    "all_reduce_impl", "monitored_barrier", "wait_tensor",
}
# Native frames of a rank that arrived and waits: vLLM's CPU shared-memory collectives
# (csrc/cpu/shm.cpp: shm_allreduce, shm_gather, shm_all_gather spin with no timeout), gloo,
# and the NCCL / RCCL host-side waits. Not "barrier": libgomp's gomp_barrier_wait ends every
# OpenMP region of plain CPU compute.
_SHM_ENTRY = ("shm_allreduce", "shm_all_gather", "shm_gather", "shm_send", "shm_recv")
_NATIVE_COLLECTIVE = (*_SHM_ENTRY, "gloo::", "processgroupgloo", "processgroupnccl", "nccl", "rccl",
                      "c10d::", "allreduce", "allgather", "all_reduce", "all_gather")
# Native frames of a host thread waiting for its device: a kernel still running (or never ending).
_DEVICE_SYNC = ("cudastreamsynchronize", "custreamsynchronize", "cudaeventsynchronize", "cueventsynchronize",
                "cudadevicesynchronize", "cuctxsynchronize", "hipstreamsynchronize", "hipeventsynchronize",
                "hipdevicesynchronize", "cudamemcpy", "cumemcpydtoh", "hipmemcpy")
_PY_DEVICE_SYNC = {"synchronize", "current_stream_synchronize"}
# Where torch.compile's generated code lives: inductor's output and vLLM's compile cache.
_GENERATED = ("torchinductor", "torch_compile_cache", "inductor_cache", "<eval_with_key", "__compiled_fn",
              "/tmp/torchinductor")


def is_native_frame(frame: dict[str, Any]) -> bool:
    """A frame py-spy --native read from a shared object (no .py file behind it)."""
    file = str(frame.get("filename") or "")
    return not file.endswith(".py") and not file.startswith("<") and "torchinductor" not in file


def frame_kind(frame: dict[str, Any]) -> str | None:
    """What one frame says about a rank: KIND_COLLECTIVE, KIND_DEVICE_SYNC, KIND_COMPILED, or None."""
    name = str(frame.get("name") or "")
    file = str(frame.get("filename") or frame.get("short_filename") or "")
    low = name.lower()
    if is_native_frame(frame):
        if any(s in low for s in _DEVICE_SYNC):
            return KIND_DEVICE_SYNC
        if any(s in low for s in _NATIVE_COLLECTIVE):
            return KIND_COLLECTIVE
        return None
    base = base_name(name)
    if base in _COLLECTIVE_FRAMES:
        return KIND_COLLECTIVE
    if base in _PY_DEVICE_SYNC:
        return KIND_DEVICE_SYNC
    if any(s in file for s in _GENERATED):
        return KIND_COMPILED
    return None


def frame_label(frame: dict[str, Any]) -> str:
    """'name (file:line)', or 'name (native)' for a frame from a shared object."""
    if is_native_frame(frame):
        return f"{frame.get('name', '?')} (native)"
    filename = frame.get("short_filename") or frame.get("filename") or "?"
    line = frame.get("line")
    return f"{frame.get('name', '?')} ({filename}:{line})" if line else f"{frame.get('name', '?')} ({filename})"


def rank_position(thread: Thread | None) -> tuple[str, str, str]:
    """(group, kind, frame) of a Worker's main thread: INSIDE a collective, BEFORE it (in the
    step, not in one) or ELSEWHERE; the kind of the innermost telling frame, and that frame.
    A compiled graph's frame is BEFORE here: the Python stack cannot tell its compute from an
    inlined collective; native frames or the CPU contrast between ranks decide (classify.collective)."""
    if thread is None:
        return ELSEWHERE, KIND_UNKNOWN, ""
    if classify_worker_thread(thread) != WORKER_IN_MODEL:
        idle = classify_worker_thread(thread) == WORKER_WAITING
        frames = thread.get("frames") or ()
        return ELSEWHERE, KIND_IDLE if idle else KIND_UNKNOWN, frame_label(frames[0]) if frames else ""
    frames = list(thread.get("frames") or ())
    for i, f in enumerate(frames):  # innermost first
        kind = frame_kind(f)
        if kind == KIND_COLLECTIVE:
            return INSIDE, kind, frame_label(_entry_point(frames[i:]))
        if kind is not None:
            return BEFORE, kind, frame_label(f)
    inner = next((f for f in frames if not is_native_frame(f) and base_name(f.get("name")) not in _PLUMBING), None)
    return BEFORE, KIND_MODEL, frame_label(inner) if inner else ""


def _entry_point(frames: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the native frames from the innermost collective one outwards, the named entry point:
    py-spy shows vLLM's CPU all-reduce as spin helpers and C++ templates (and libgomp) inside
    `shm_allreduce`. The innermost collective frame when none is named so."""
    for f in frames:
        if not is_native_frame(f):
            break
        name = str(f.get("name") or "")
        if name.lower().startswith(_SHM_ENTRY) and "<" not in name:
            return f
    return frames[0]


_PLUMBING = {"wait", "_wait", "_call_impl", "_wrapped_call_impl", "__call__", "inner", "wrapper", "_fn"}


def frame_key(thread: Thread | None) -> tuple[Any, ...] | None:
    """The innermost Python frame (name, file, line) of a thread: equal across dumps means it stayed
    put. Native frames are left out: a spin loop's innermost native frame moves while it waits."""
    f = next((f for f in (thread or {}).get("frames") or () if not is_native_frame(f)), None)
    return None if f is None else (f.get("name"), f.get("filename"), f.get("line"))
