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


# --- the ranks' own reports: their steps and last collective ----------------------------------------------

def _rank(tp: int, steps: int | None, collective: dict | None) -> dict:
    return {"tp": tp, "pp": 0, "dp": 0, "world_size": 2, "steps": steps, "collective": collective}


def _coll(op: str, seq: int, since_s_before_write: float, inside: bool) -> dict:
    written = 100_000_000_000
    return {"op": op, "group": "tp", "seq": seq, "since_mono_ns": written - int(since_s_before_write * 1e9),
            "inside": inside}


def with_rank_reports(b: Bundle, rank0: dict, rank1: dict) -> Bundle:
    """The recorded hang with each Worker's report at every sample (built from the schema, engine_reports.py)."""
    from engine_reports import reading, with_readings

    views = rank_views(Facts(b))
    by_pid = {views[0].pid: rank0, views[1].pid: rank1}
    stage = {"name": "execute_model", "since_mono_ns": 90_000_000_000, "phase": None}
    return with_readings(b, lambda i, s: tuple(
        reading(pid, s.t, 0.4, 10.0, role="worker", stage=stage, steps=None, model_steps=None, scheduler=None,
                requests=[], requests_total=None, written_mono_ns=100_000_000_000, rank=rank)
        for pid, rank in by_pid.items()))


def _engine_lines(v) -> list[str]:
    return [e.what for e in v.evidence if e.source == "engine"]


def test_the_ranks_reports_name_the_rank_that_never_entered_the_collective():
    """Eager mode, as the repro with --enforce-eager showed on vLLM 0.32 (CPU): rank 0's report said it was inside
    all_reduce #19 on tp; rank 1's last, the previous step's all_gather #18, had returned; 4 steps each."""
    b = load("collective-hang")
    plain = classify(b)
    v = classify(with_rank_reports(b, _rank(0, 4, _coll("all_reduce", 19, 12.0, True)),
                                   _rank(1, 4, _coll("all_gather", 18, 12.5, False))))
    assert (v.verdict, v.rule, v.confidence) == (plain.verdict, plain.rule, plain.confidence)
    assert v.facts["lagging_ranks"] == plain.facts["lagging_ranks"] == [1]
    lines = _engine_lines(v)
    tp0, tp1 = rank_views(Facts(b))
    assert lines[0] == f"rank TP0 (Worker pid {tp0.pid}) by its own report: 4 steps; inside all_reduce #19 on tp for 12 s"
    assert lines[1] == (f"rank TP1 (Worker pid {tp1.pid}) by its own report: 4 steps; last collective all_gather #18 "
                        "on tp, returned 13 s ago")
    assert lines[2] == ("the ranks' reports: TP0 wait(s) inside all_reduce #19 on tp; TP1 never entered it (TP1's last, "
                        "all_gather #18 on tp, returned): the rank that never arrived")
    together = next(e for e in v.evidence if e.what == lines[2])
    assert together.values["never_entered"] == ["TP1"] and together.values["seq"] == 19
    first = next(e for e in v.evidence if e.what == lines[0])
    assert first.values["inside"] is True and first.values["collective_s"] == 12.4  # 12 s + the report's age


def test_in_compiled_mode_the_ranks_reports_agree_and_say_the_collective_is_out_of_sight():
    """What the repro (compiled, vLLM 0.32 on CPU) showed: the all-reduce is inlined into the graph, so both ranks'
    last recorded collective was the previous step's all_gather #4, returned, and both were in their 4th step."""
    b = load("collective-hang")
    gather = _coll("all_gather", 4, 9.0, False)
    v = classify(with_rank_reports(b, _rank(0, 4, gather), _rank(1, 4, gather)))
    assert v.verdict is VerdictKind.COLLECTIVE_HANG and v.facts["lagging_ranks"] == [1]
    lines = _engine_lines(v)
    assert len(lines) == 3 and "last collective all_gather #4 on tp, returned 9.4 s ago" in lines[0]
    assert lines[2].startswith("the ranks' reports agree: every rank in the same step")


def test_a_rank_a_step_behind_is_named_by_its_steps():
    b = load("collective-hang")
    v = classify(with_rank_reports(b, _rank(0, 5, _coll("all_gather", 38, 1.0, False)),
                                   _rank(1, 4, _coll("all_gather", 37, 2.0, False))))
    assert "TP1 behind in its steps (TP0 5, TP1 4)" in _engine_lines(v)[-1]


def test_reports_without_the_ranks_own_parts_add_nothing():
    """A writer from before the collectives: the rank part only; and a since from after the write."""
    b = load("collective-hang")
    old = {"tp": 0, "pp": 0, "dp": 0, "world_size": 2}
    assert _engine_lines(classify(with_rank_reports(b, old, {**old, "tp": 1}))) == []
    ahead = {"op": "barrier", "group": "tp", "seq": 3, "since_mono_ns": 200_000_000_000, "inside": True}
    lines = _engine_lines(classify(with_rank_reports(b, _rank(0, None, ahead), _rank(1, None, None))))
    assert lines[0].endswith("steps not counted; inside barrier #3 on tp")  # no duration from a bad clock
    assert lines[1].endswith("steps not counted; no collective recorded")


def _paused_by_our_dumps(b: Bundle, native: bool) -> Bundle:
    """The recorded --native capture, longer: after its first interval (rank 0 spinning) two more samples 3 s apart
    in which rank 0 ran not at all, stopped by the native dumps taken then (state t), as on a loaded host where each
    takes seconds. `native=False`: the same numbers with the dumps marked non-blocking."""
    first, second = b.samples[0], b.samples[1]
    rank0 = min(p.pid for p in second.processes if p.role is Role.WORKER)
    dumps = tuple(replace(d, native=native) for d in first.stacks)

    def later(k: int) -> object:
        procs = tuple(replace(p, state="t") if p.pid == rank0 else p for p in second.processes)
        return replace(second, t=second.t + 3.0 * k, processes=procs, stacks=dumps)
    return replace(b, samples=(replace(first, stacks=dumps), second, later(1), later(2)))


def test_a_rank_our_native_dumps_paused_is_judged_by_the_interval_it_ran():
    """--native stops each process for its dump: over the window rank 0's mean is 0.45 / 7 s (~0.06 cores, parked by
    the numbers), but in the interval it ran it spun (0.45 cores in 1 s, and runnable there); that interval stands
    for it, and the ranks are told apart as in the recorded capture. Without native dumps no interval is discounted."""
    b = read_bundle(BUNDLES / "collective-hang-native.tar.gz")
    v = classify(_paused_by_our_dumps(b, native=True))
    assert (v.verdict, v.facts["lagging_ranks"], v.facts["waiting_ranks"]) == (VerdictKind.COLLECTIVE_HANG, [1], [0])
    ranks = {r["label"]: r for r in v.facts["ranks"]}
    assert ranks["TP0"]["cpu_cores"] == pytest.approx(0.45, abs=0.02) and ranks["TP1"]["cpu_cores"] < 0.05
    plain = Facts(_paused_by_our_dumps(b, native=False))
    assert plain.cpu_by_pid(Role.WORKER)[min(plain.cpu_by_pid(Role.WORKER))] < 0.1  # what the mean alone says
