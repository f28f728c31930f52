"""A Worker rank's own account of itself: its execute_model steps and the last collective it entered or left.

Pure Python, no vLLM: ``fixes/report.py`` wraps vLLM's ``GroupCoordinator`` methods
(``vllm/distributed/parallel_state.py``) with ``recording`` and counts the wrapper's
``execute_model`` calls into one ``RankRecord``; the report thread reads ``snapshot`` into the
rank part of the report.

What a rank says: the collective's name (``all_reduce``, ``all_gather``, ``broadcast_tensor_dict``,
``send_tensor_dict``, ``barrier``, ...), its group as vLLM names it (``tp``, ``pp``, ``world``: the
coordinator's ``unique_name`` without its ``:N``), the rank's own sequence number of it (every
recorded collective counts, whatever its group), since when (entered, while it is inside; returned,
once it is not) and whether it is inside it still. In a tensor-parallel group every rank runs the same
collectives in the same order, so a rank inside #41 while another's last is #40, returned, names the
rank that never arrived.

What it cannot see: a collective run inside a compiled graph. torch.compile inlines vLLM's
all-reduce where the platform calls it directly (the CPU's ``shm_allreduce``); the wrapper is then
traced, not run, and steps aside while Dynamo traces (``torch.compiler.is_compiling``), so the graph
is the one vLLM would build without it. A CUDA graph's replay runs no Python at all. What runs in
Python each step is still seen: the logits' gather, the pipeline's send and receive, broadcasts,
barriers, and every collective in eager mode and through vLLM's custom ops (``_all_reduce_out_place``
and its kin, which the compiled graph calls back into).

Cost per collective: one call to ``is_compiling``, a few attribute reads, one clock read and one tuple
store on the way in and on the way out; no lock, and nothing it does raises into vLLM. A collective
called inside another (``broadcast_tensor_dict`` sends through ``broadcast_object``, ``all_reduce``
calls ``_all_reduce_out_place``) is the outer one's: only the outermost is recorded. A second thread's
collective while the first is inside one is not recorded either (the record is one per process).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

MAX_NAME = 64  # an op or group name is cut to this

_now_ns = time.monotonic_ns

# GroupCoordinator's methods that run a collective, and the name each is recorded under. The private
# out-of-place ones are what vLLM's custom ops (torch.ops.vllm.all_reduce, ...) call back into, past the
# public method; missing ones (older releases) are left out.
OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "_all_reduce_out_place": "all_reduce",
    "all_gather": "all_gather",
    "_all_gather_out_place": "all_gather",
    "all_gatherv": "all_gatherv",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_out_place": "reduce_scatter",
    "reduce_scatterv": "reduce_scatterv",
    "gather": "gather",
    "broadcast": "broadcast",
    "broadcast_object": "broadcast_object",
    "broadcast_object_list": "broadcast_object_list",
    "broadcast_tensor_dict": "broadcast_tensor_dict",
    "send_object": "send_object",
    "recv_object": "recv_object",
    "isend_object": "isend_object",
    "send_tensor_dict": "send_tensor_dict",
    "recv_tensor_dict": "recv_tensor_dict",
    "isend_tensor_dict": "isend_tensor_dict",
    "irecv_tensor_dict": "irecv_tensor_dict",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
}


def _cut(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    return value[:MAX_NAME]


class RankRecord:
    """One process's steps and last collective. ``last`` is (op, group's unique name, seq, since_mono_ns,
    inside), replaced whole on every change: the report thread reads it once and sees one collective."""

    __slots__ = ("depth", "last", "seq", "steps")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.last: tuple[str, Any, int, int, bool] | None = None
        self.depth = 0
        self.seq = 0
        self.steps = 0

    def enter(self, op: str, group: Any) -> None:
        self.depth = 1
        self.seq = seq = self.seq + 1
        self.last = (op, group, seq, _now_ns(), True)

    def leave(self) -> None:
        last = self.last
        self.depth = 0
        if last is not None:
            self.last = (last[0], last[1], last[2], _now_ns(), False)

    def step(self) -> None:
        self.steps += 1

    def snapshot(self) -> dict[str, Any]:
        """{"steps", "collective"}: the rank part's own fields (collective None before the first)."""
        last = self.last
        collective = None
        if last is not None:
            op, group, seq, since, inside = last
            name = _cut(group)
            collective = {"op": _cut(op), "group": name.partition(":")[0] if name is not None else None,
                          "seq": seq, "since_mono_ns": since, "inside": inside}
        return {"steps": self.steps, "collective": collective}


def compiling_check() -> Callable[[], bool]:
    """torch.compiler.is_compiling (Dynamo folds it to True while it traces), or a False one without torch."""
    try:
        import torch

        check = torch.compiler.is_compiling
    except Exception:
        return _never
    return check if callable(check) else _never


def _never() -> bool:
    return False


def recording(op: str, record: RankRecord, compiling: Callable[[], bool] = _never) -> Callable[[Any], Any]:
    """A maker for patch_method: the wrapped GroupCoordinator method records `op` in `record` while it runs.

    Under Dynamo's trace it only calls through (the first test, so the trace reads nothing of the record);
    a group of one (vLLM returns at once) and a call inside a recorded one are not recorded."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(self: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling() or record.depth:
                return original(self, *args, **kwargs)
            try:
                alone = getattr(self, "world_size", None) == 1
                group = getattr(self, "unique_name", None)
            except Exception:  # a coordinator that raises on reading its own attributes: record nothing
                alone, group = True, None
            if alone:
                return original(self, *args, **kwargs)
            record.enter(op, group)
            try:
                return original(self, *args, **kwargs)
            finally:
                record.leave()

        return collective

    return make


__all__ = ["MAX_NAME", "OPS", "RankRecord", "compiling_check", "recording"]
