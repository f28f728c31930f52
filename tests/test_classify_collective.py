"""Ranks and the collective hang on evidence recorded from real TP 2 repros (vLLM 0.32, CPU, compiled mode).

collective-hang.tar.gz: `wedgectl repro collective-hang` (rank 1 held before its forward pass,
rank 0 waiting in the inlined all-reduce); collective-hang-native.tar.gz: `diagnose --native`
of the same hang; healthy-tp2.tar.gz: the control. GPU frame names below are SYNTHETIC (no GPU
was lent to the session that wrote them) and marked so.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.read import stacks as stk
from wedgectl.store.bundle import read_bundle
from wedgectl.classify import Facts, classify
from wedgectl.classify.collective import (
    KERNEL_NEVER_FINISHED,
    NEVER_ARRIVED,
    RankView,
    device_signature,
    live_collective_hang,
    rank_summaries,
    rank_views,
)
from wedgectl.model.types import Bundle, Manifest, ProcessSample, Role, VerdictKind

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


def load(name: str):
    return read_bundle(BUNDLES / f"{name}.tar.gz")


# --- ranks from titles ---------------------------------------------------------------------


@pytest.mark.parametrize("argv0, name, ranks", [
    ("VLLM::Worker_TP1                ", "VLLM::Worker_TP", {"TP": 1}),
    ("VLLM::Worker_DP1_PP0_TP3", "VLLM::Worker_DP", {"DP": 1, "PP": 0, "TP": 3}),
    ("python -c from multiprocessing.spawn import spawn_main", "python", {}),
    ("VLLM::Worker", "VLLM::Worker", {}),  # a world of one: no rank suffix
    ("", "VLLM::Worker_TP", {}),  # comm alone is cut before the digit
])
def test_parallel_rank_from_the_title(argv0, name, ranks):
    p = ProcessSample(pid=1, ppid=0, role=Role.WORKER, name=name, cmdline=(argv0,) if argv0 else ())
    assert p.parallel_rank == ranks


# --- recorded: the healthy control ----------------------------------------------------------


def test_healthy_tp2_is_progressing_with_two_moving_ranks():
    b = load("healthy-tp2")
    v = classify(b)
    assert v.verdict is VerdictKind.PROGRESSING
    f = Facts(b)
    assert not live_collective_hang(f)
    views = rank_views(f)
    assert [x.label for x in views] == ["TP0", "TP1"] and [x.rank for x in views] == [0, 1]
    assert all(x.device == "cpu" and x.dumps >= 2 for x in views)
    assert all(x.stuck is False for x in views)  # both ranks' frames move between dumps
    assert any(x.kind == stk.KIND_COMPILED for x in views)  # the forward runs in an inductor graph


def test_healthy_tp2_frozen_would_still_not_be_a_collective_hang():
    # Take the token rise away: ranks whose frames move are busy, not stuck in a collective.
    b = load("healthy-tp2")
    first = b.samples[0].metrics
    frozen = tuple(replace(s, metrics=replace(s.metrics, text=first.text)) if s.metrics else s for s in b.samples)
    assert not live_collective_hang(Facts(replace(b, samples=frozen)))


def test_rank_summaries_one_object_per_rank():
    out = rank_summaries(load("healthy-tp2"))
    assert [r["label"] for r in out] == ["TP0", "TP1"]
    assert {"rank", "pid", "role", "device", "state", "cpu_cores", "where", "frame", "stack"} <= set(out[0])
    assert out[0]["role"] == "worker" and isinstance(out[0]["cpu_cores"], float)


# --- GPU-side signatures: SYNTHETIC frame names (no GPU run recorded them) -----------------


def _native_thread(*names: str) -> dict:
    """A py-spy --native main thread: native frames (no .py file) over vLLM's worker loop."""
    frames = [{"name": n, "filename": "libsynthetic.so", "line": 0} for n in names]
    frames += [{"name": "WorkerProc.execute_model", "filename": "vllm/v1/worker/gpu_worker.py", "line": 1},
               {"name": "WorkerProc.worker_busy_loop", "filename": "vllm/v1/executor/multiproc_executor.py", "line": 1}]
    return {"thread_name": "MainThread", "frames": frames}


def _view(label: str, rank: int, thread: dict) -> RankView:
    group, kind, frame = stk.rank_position(thread)
    return RankView(pid=100 + rank, label=label, rank=rank, parallel={"TP": rank}, device=f"cuda:{rank}", state="S",
                    cpu_cores=0.01, group=group, kind=kind, frame=frame, stuck=True, dumps=4, native=True)


def test_synthetic_gpu_rank_never_arrived():
    waiting = _view("TP0", 0, _native_thread("cudaStreamSynchronize", "at::native::_local_scalar_dense"))
    lagging = _view("TP1", 1, {"thread_name": "MainThread", "frames": [
        {"name": "Event.wait", "filename": "threading.py", "line": 1},
        {"name": "Model.forward", "filename": "model.py", "line": 1}] + _native_thread()["frames"]})
    assert waiting.kind == stk.KIND_DEVICE_SYNC and lagging.kind == stk.KIND_MODEL
    sig = device_signature([waiting, lagging])
    assert sig is not None and sig[0] == NEVER_ARRIVED and "TP1" in sig[1]


def test_synthetic_gpu_kernel_never_finished():
    views = [_view("TP0", 0, _native_thread("cuEventSynchronize")), _view("TP1", 1, _native_thread("cudaStreamSynchronize"))]
    sig = device_signature(views)
    assert sig is not None and sig[0] == KERNEL_NEVER_FINISHED


def test_synthetic_nccl_wait_is_inside_a_collective():
    group, kind, frame = stk.rank_position(_native_thread("ncclCommWatchdog", "c10d::ProcessGroupNCCL::WorkNCCL::wait"))
    assert (group, kind) == (stk.INSIDE, stk.KIND_COLLECTIVE) and "native" in frame


def test_no_signature_without_native_frames():
    v = _view("TP0", 0, _native_thread("cudaStreamSynchronize"))
    assert device_signature([replace(v, native=False), replace(v, native=False, rank=1)]) is None


# --- the log rule ---------------------------------------------------------------------------


def test_rpc_timeout_in_the_log_is_a_step_that_never_completed():
    lines = (
        "(Worker_TP0 pid=11) INFO 12-01 19:00:00 [cpu_model_runner.py:91] Warming up done.",
        "(Worker_TP1 pid=12) INFO 12-01 19:00:00 [cpu_model_runner.py:91] Warming up done.",
        "(EngineCore pid=10) ERROR 12-01 19:05:00 [core.py:1] TimeoutError: RPC call to execute_model timed out.",
        "(APIServer pid=9) ERROR 12-01 19:05:00 [async_llm.py:1] EngineDeadError: EngineCore encountered an issue.",
    )
    v = classify(Bundle(Manifest(source="log"), log_lines=lines))
    assert v.verdict is VerdictKind.ENGINE_DEAD and v.rule == "log_step_timeout"
    assert v.facts["method"] == "execute_model" and v.facts["ranks_in_log"] == ["TP0", "TP1"]


def test_recorded_rpc_timeout_log():
    # The real server log of a collective-hold run left to VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=150.
    from wedgectl.store.sources import bundle_from_log

    log = Path(__file__).parent / "fixtures" / "logs" / "collective-hang-timeout.log"
    v = classify(bundle_from_log(log))
    assert v.verdict is VerdictKind.ENGINE_DEAD and v.rule == "log_step_timeout"
    assert v.facts == {"method": "execute_model", "ranks_in_log": ["TP0", "TP1"]}
    assert "RPC call to execute_model timed out" in v.evidence[0].what


# --- recorded: the collective hang (compiled mode) ------------------------------------------


def test_recorded_collective_hang_names_rank_1_from_the_cpu_contrast():
    b = load("collective-hang")
    v = classify(b)
    assert v.verdict is VerdictKind.COLLECTIVE_HANG and b.verdict.verdict is v.verdict
    assert v.facts["lagging_ranks"] == [1] and v.facts["waiting_ranks"] == [0]
    assert v.facts["collective_inferred"] is True  # no collective frame in the Python stack
    assert "model_forward_then_hold" in v.facts["laggard_frames"]["TP1"]
    tp0, tp1 = rank_views(Facts(b))
    assert (tp0.group, tp0.kind, tp0.stuck) == (stk.INSIDE, stk.KIND_COMPILED, True)
    assert (tp1.group, tp1.kind, tp1.stuck) == (stk.BEFORE, stk.KIND_MODEL, True)
    assert tp0.spinning and tp1.parked  # rank 0 runnable every sample, rank 1 asleep
    assert "torch_compile_cache" in str(b.samples[-1].stacks) or "inductor" in tp0.frames[2]


def test_recorded_collective_hang_without_the_contrast_is_not_named():
    # Take rank 0's CPU and runnable state away: a rank parked in a compiled graph is not
    # evidence of a collective, and the rule must not guess.
    b = load("collective-hang")
    rank0 = rank_views(Facts(b))[0].pid
    calm = tuple(replace(s, processes=tuple(
        replace(p, cpu_user_s=0.0, cpu_system_s=0.0, threads=tuple(replace(t, state="S") for t in p.threads))
        if p.pid == rank0 else p for p in s.processes)) for s in b.samples)
    f = Facts(replace(b, samples=calm))
    assert not live_collective_hang(f)
    assert classify(replace(b, samples=calm)).verdict is not VerdictKind.COLLECTIVE_HANG


def test_recorded_native_frames_name_shm_allreduce():
    # `diagnose --native` of the same hang: py-spy's native frames from vLLM's csrc/cpu/shm.cpp.
    b = load("collective-hang-native")
    v = classify(b)
    assert v.verdict is VerdictKind.COLLECTIVE_HANG and v.facts["lagging_ranks"] == [1]
    assert v.facts["collective"] == "shm_allreduce (native)" and v.facts["collective_inferred"] is False
    assert v.facts["hang_shape"] == NEVER_ARRIVED  # the GPU-side rule on CPU native frames
    tp0, tp1 = rank_views(Facts(b))
    assert tp0.native and tp0.kind == stk.KIND_COLLECTIVE and tp1.kind == stk.KIND_MODEL
    assert v.confidence > classify(load("collective-hang")).confidence


def test_single_worker_deadlock_is_not_a_collective_hang():
    v = classify(load("engine-deadlock"))
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK
