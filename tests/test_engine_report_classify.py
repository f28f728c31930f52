"""The engine report in the classifier and the bundle: recorded captures with a report of a chosen state added.

Each capture below is a real one (tests/fixtures/bundles/); the engine readings put on its samples are a real
EngineCore report (recorded from a vLLM 0.32 repro: tests/engine_reports.py) with the state a test is about
(a stage and its age, the scheduler's counts, the requests) put in its place. The reports of whole real
captures, as nobody recorded them, are test_engine_report_recorded.py's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine_reports import missing, reading, with_readings
from wedgectl.classify import classify
from wedgectl.classify.enginerules import SHUTDOWN_LONG_S
from wedgectl.classify.facts import Facts
from wedgectl.model.types import Bundle, CollectorFailure, FailureKind, Role, VerdictKind
from wedgectl.render.text import render_verdict
from wedgectl.store.bundle import read_bundle, write_bundle

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
STUCK = {"name": "execute_model_wait", "since_mono_ns": 100, "phase": None}
RUNNING = {"running": 1, "waiting": 0, "waiting_by_reason": {"capacity": 0, "deferred": 0}, "paused": False,
           "kv_blocks": {"free": 60, "total": 64, "block_size": 16}}
HELD = [{"id": "cmpl-held-0", "state": "running", "age_s": 14.0, "prompt_tokens": 9, "output_tokens": 3,
         "blocks_held": 1, "blocks_needed": 0, "client_connected": True}]


def load(name: str) -> Bundle:
    return replace(read_bundle(BUNDLES / f"{name}.tar.gz"), verdict=None)


def pid_of(b: Bundle, role: Role) -> int:
    return next(p.pid for p in b.samples[-1].processes if p.role == role)


def deadlocked(b: Bundle, stuck_for: float = 12.0, age_s: float = 0.3) -> Bundle:
    """The EngineCore's report at each sample: stuck in execute_model_wait since stuck_for before the last."""
    pid, end = pid_of(b, Role.ENGINE_CORE), b.samples[-1].t
    return with_readings(b, lambda i, s: (reading(pid, s.t, age_s, stuck_for - (end - s.t), stage=STUCK,
                                                  steps=500, scheduler=RUNNING, requests=HELD, requests_total=1),))


def no_ptrace(b: Bundle) -> Bundle:
    """The same capture as a user without CAP_SYS_PTRACE sees it: every py-spy dump refused."""
    fails = tuple(CollectorFailure("pyspy", FailureKind.PERMISSION, "py-spy was refused ptrace access", str(p.pid))
                  for p in b.samples[0].processes)
    return replace(b, samples=tuple(replace(s, stacks=(), failures=s.failures + fails) for s in b.samples))


# --- engine deadlock -----------------------------------------------------------------------------------

def test_a_stuck_stage_decides_a_deadlock_and_says_the_engine_did():
    v = classify(deadlocked(load("engine-deadlock")))
    assert (v.verdict, v.rule, v.confidence) == (VerdictKind.ENGINE_DEADLOCK, "live_engine_report_deadlock", 0.95)
    first = v.evidence[0]
    assert first.source == "engine" and first.what.startswith("stage execute_model_wait for 12 s, running 1")
    assert any(e.source == "engine" and "cmpl-held-0" in e.what for e in v.evidence)
    assert v.facts["source"] == "engine" and v.facts["request_ids"] == ["cmpl-held-0"]


def test_the_report_decides_without_ptrace_or_metrics():
    b = no_ptrace(load("engine-deadlock"))
    b = replace(b, log_lines=(), samples=tuple(replace(s, metrics=None) for s in b.samples))
    assert classify(b).verdict is VerdictKind.INCONCLUSIVE  # nothing else to go on
    v = classify(deadlocked(b))
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK and v.rule == "live_engine_report_deadlock"


def test_a_short_stall_is_not_certain():
    v = classify(deadlocked(load("engine-deadlock"), stuck_for=3.0))
    assert v.rule == "live_engine_report_deadlock" and v.confidence == 0.85


def test_a_stale_report_does_not_decide_but_is_said():
    """A report not rewritten for 3 intervals: the rule wants a fresh one; the metrics' deadlock cites it."""
    v = classify(deadlocked(load("engine-deadlock"), age_s=9.0))
    assert v.rule == "live_engine_deadlock"
    line = next(e for e in v.evidence if "not rewritten" in e.what)
    assert line.source == "engine" and "not running Python" in line.what


def _engine_core_as(b: Bundle, state: str, cores: float) -> Bundle:
    """The capture with its EngineCore in `state` at every sample, using `cores` of CPU over the window."""
    pid, t0 = pid_of(b, Role.ENGINE_CORE), b.samples[0].t
    def one(s):
        return replace(s, processes=tuple(replace(p, state=state, cpu_user_s=cores * (s.t - t0), cpu_system_s=0.0)
                                          if p.pid == pid else p for p in s.processes))
    return replace(b, samples=tuple(one(s) for s in b.samples))


def test_a_stale_report_says_why_no_python_runs_where_the_samples_tell():
    """Stopped (state T), spinning in native code (CPU used), or neither: the line says which the samples show."""
    said = {}
    for state, cores in (("T", 0.0), ("R", 1.0), ("S", 0.0)):
        v = classify(_engine_core_as(deadlocked(load("engine-deadlock"), age_s=9.0), state, cores))
        line = next(e for e in v.evidence if "not rewritten" in e.what)
        said[state] = (line.values["why"], line.what)
    assert said["T"][0] == "stopped" and "the process is stopped, state T" in said["T"][1], said["T"]
    assert said["R"][0] == "native" and "native code with the GIL held: 1.00 cores" in said["R"][1], said["R"]
    assert said["S"][0] in ("blocked", "no_cpu"), said["S"]  # the recorded run delay decides which


def test_a_stepping_engine_is_not_stuck_in_its_stage():
    b = load("engine-deadlock")
    pid = pid_of(b, Role.ENGINE_CORE)
    b = with_readings(b, lambda i, s: (reading(pid, s.t, 0.3, 5.0, stage=STUCK, steps=100 + 50 * i,
                                               written_mono_ns=10**9 * (i + 1), scheduler=RUNNING),))
    assert classify(b).rule == "live_engine_deadlock"  # the metrics' verdict, not the report's


# --- admission wedge -------------------------------------------------------------------------------------

def wedged(b: Bundle) -> Bundle:
    pid = pid_of(b, Role.ENGINE_CORE)
    sched = {"running": 0, "waiting": 1, "waiting_by_reason": {"capacity": 1, "deferred": 0}, "paused": False,
             "kv_blocks": {"free": 4, "total": 4, "block_size": 16}}
    req = [{"id": "cmpl-big-0", "state": "waiting", "age_s": 30.0, "prompt_tokens": 70, "output_tokens": 0,
            "blocks_held": 0, "blocks_needed": 5, "client_connected": True}]
    return with_readings(b, lambda i, s: (reading(pid, s.t, 0.2, 0.001, stage={"name": "scheduling",
                                                                               "since_mono_ns": 1, "phase": None},
                                                  steps=1000 * (i + 1), written_mono_ns=10**9 * (i + 1),
                                                  scheduler=sched, requests=req, requests_total=1),))


def test_a_request_that_never_fits_is_named():
    v = classify(wedged(load("admission-wedge")))
    assert (v.verdict, v.rule, v.confidence) == (VerdictKind.ADMISSION_WEDGE, "live_engine_report_wedge", 0.95)
    assert v.evidence[0].source == "engine"
    assert v.evidence[0].what == ("request cmpl-big-0 needs 5 KV blocks; the pool holds 4 in all, 3 for requests "
                                  "(one is vLLM's null block), 4 free")
    assert "stepped 5000 times" in v.evidence[1].what
    assert "cmpl-big-0" in v.advice[0] and "cmpl-big-0" in v.summary
    assert v.facts["request"] == "cmpl-big-0" and v.facts["blocks_needed"] == 5


def test_one_report_cannot_show_the_engine_stepping():
    b = wedged(load("admission-wedge"))
    v = classify(replace(b, samples=b.samples[:1]))
    assert v.rule != "live_engine_report_wedge"


def with_history(b: Bundle, history: list[list[int]], as_written: bool = False) -> Bundle:
    """b with each report carrying `history` (the writer's last writes); `as_written`: each report's own
    write and step count made the history's last entry's, as the writer's are."""
    def carry(rep):
        rep = replace(rep, history=tuple(tuple(e) for e in history))
        return replace(rep, written_mono_ns=history[-1][0], steps=history[-1][1]) if as_written else rep

    return replace(b, samples=tuple(replace(s, engine=tuple(
        replace(r, report=carry(r.report)) if r.report else r for r in s.engine)) for s in b.samples))


def test_one_report_with_its_history_decides_a_wedge():
    b = wedged(load("admission-wedge"))
    one = with_history(replace(b, samples=b.samples[:1]),
                       [[10**9 * k, 1000 * k, 0] for k in range(6, 11)], as_written=True)  # one a second, rising
    assert Facts(one).engine_report_steps == (6000, 10000, 4.0)
    v = classify(one)
    assert (v.verdict, v.rule) == (VerdictKind.ADMISSION_WEDGE, "live_engine_report_wedge")
    assert v.confidence >= 0.9  # certain: the capture stops on it (capture.policy.decided_by_the_report)
    assert "stepped 4000 times in 4.0 s" in v.evidence[1].what


def test_a_history_that_does_not_rise_decides_no_wedge():
    b = wedged(load("admission-wedge"))
    flat = with_history(replace(b, samples=b.samples[:1]), [[10**9 * k, 1000, 0] for k in range(6, 11)],
                        as_written=True)
    assert Facts(flat).engine_report_steps == (1000, 1000, 4.0)
    assert classify(flat).rule != "live_engine_report_wedge"


def test_the_history_counts_where_it_spans_longer_than_the_window():
    b = wedged(load("admission-wedge"))  # steps 1000 to 6000, written 1 s apart: 5 s over the window
    short = with_history(b, [[10**9 * 5, 5000, 0], [10**9 * 6, 6000, 0]])
    assert Facts(short).engine_report_steps == (1000, 6000, 5.0)  # the window spans longer
    long = with_history(b, [[10**9 * k, 1000 * k, 0] for k in range(7)])
    assert Facts(long).engine_report_steps == (0, 6000, 6.0)  # the last report's history spans longer
    assert classify(long).rule == classify(b).rule == "live_engine_report_wedge"


def test_a_deadlock_reads_only_the_history_of_its_stage():
    b = load("engine-deadlock")
    pid, t = pid_of(b, Role.ENGINE_CORE), b.samples[0].t
    stuck = {**STUCK, "since_mono_ns": 10**9 * 10}
    one = with_readings(replace(b, samples=b.samples[:1]), lambda i, s: (reading(
        pid, t, 0.3, 3.0, stage=stuck, steps=500, written_mono_ns=10**9 * 13, scheduler=RUNNING, requests=HELD,
        requests_total=1),))
    # stepping until the stage began 3 s ago, then nothing: the steps before it are what led into it
    one = with_history(one, [[10**9 * 9, 400, 400], [10**9 * 10, 500, 500], [10**9 * 11, 500, 500],
                             [10**9 * 12, 500, 500], [10**9 * 13, 500, 500]])
    v = classify(one)
    assert (v.verdict, v.rule) == (VerdictKind.ENGINE_DEADLOCK, "live_engine_report_deadlock")
    # steps that rose within the stage: the engine stepped, whatever its stage says
    rising = with_history(one, [[10**9 * 11, 500, 500], [10**9 * 12, 600, 600], [10**9 * 13, 700, 700]])
    assert classify(rising).rule != "live_engine_report_deadlock"


# --- shutdown and start-up ------------------------------------------------------------------------------

def test_a_long_shutting_down_stage_supports_a_shutdown_hang():
    b = load("shutdown-hang")
    pid = pid_of(b, Role.API_SERVER)
    b = with_readings(b, lambda i, s: (reading(pid, s.t, 0.2, SHUTDOWN_LONG_S + 20, role="api_server",
                                               stage={"name": "shutting_down", "since_mono_ns": 1, "phase": None},
                                               scheduler=None, requests=[]),))
    v = classify(b)
    assert v.verdict is VerdictKind.SHUTDOWN_HANG
    assert any(e.source == "engine" and e.what.startswith("stage shutting_down for 30 s") for e in v.evidence)
    # with the log and the stacks gone, the report is the sign that a shutdown began
    bare = replace(b, log_lines=(), samples=tuple(replace(s, stacks=()) for s in b.samples))
    assert classify(bare).verdict is VerdictKind.SHUTDOWN_HANG
    assert classify(replace(bare, samples=tuple(replace(s, engine=()) for s in bare.samples))).verdict \
        is not VerdictKind.SHUTDOWN_HANG


def test_the_start_up_verdict_names_the_reported_phase():
    b = load("startup-hang")
    pid = pid_of(b, Role.WORKER)
    b = with_readings(b, lambda i, s: (reading(pid, s.t, 0.2, 95.0, role="worker", scheduler=None, requests=[],
                                               steps=None, model_steps=None,
                                               stage={"name": "starting", "since_mono_ns": 1,
                                                      "phase": "KV cache / profiling"}),))
    v = classify(b)  # the Worker's stack names its phase: that stays, and the report's line is cited
    assert v.verdict is VerdictKind.STARTUP_HANG and v.facts["phase"] == "graph capture / warm-up"
    assert any(e.source == "engine" and "stage starting (KV cache / profiling)" in e.what for e in v.evidence)
    blind = classify(replace(b, samples=tuple(replace(s, stacks=()) for s in b.samples)))
    assert blind.verdict is VerdictKind.STARTUP_HANG and blind.facts["phase"] == "KV cache profiling"
    assert "KV cache profiling" in blind.summary


# --- what could not be read ------------------------------------------------------------------------------

def test_no_ptrace_and_no_report_says_what_would_decide():
    b = no_ptrace(load("engine-deadlock"))
    b = replace(b, log_lines=(), samples=tuple(replace(s, metrics=None) for s in b.samples))
    b = with_readings(b, lambda i, s: tuple(missing(p.pid, s.t) for p in s.processes if p.role != Role.OTHER))
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE
    line = next(e for e in v.evidence if "WEDGE_ENGINE_REPORT=1" in e.what)
    assert "CAP_SYS_PTRACE" in line.what and "not found" in line.what and "refused ptrace" in line.what


def test_a_weaker_verdict_says_it_too_and_a_bundle_without_reports_says_nothing():
    """Four samples of the deadlock without stacks: the metrics' deadlock at 0.85, short of certain."""
    b = no_ptrace(load("engine-deadlock"))
    b = replace(b, samples=b.samples[:4])
    plain = classify(b)
    looked = classify(with_readings(b, lambda i, s: tuple(missing(p.pid, s.t) for p in s.processes)))
    assert (looked.verdict, looked.confidence) == (plain.verdict, plain.confidence) == (VerdictKind.ENGINE_DEADLOCK,
                                                                                        0.85)
    assert not any("WEDGE_ENGINE_REPORT" in e.what for e in plain.evidence)  # an old bundle never looked
    assert any("WEDGE_ENGINE_REPORT=1" in e.what for e in looked.evidence)
    assert classify(load("engine-deadlock")).evidence == classify(
        with_readings(load("engine-deadlock"), lambda i, s: tuple(missing(p.pid, s.t) for p in s.processes))
    ).evidence  # a certain verdict, with stacks: nothing to add


# --- facts ---------------------------------------------------------------------------------------------

def test_the_facts_read_the_last_report():
    b = wedged(load("admission-wedge"))
    f = Facts(b)
    assert f.engine_stage == ("scheduling", 0.001) and f.engine_report_fresh
    assert f.engine_scheduler is not None and f.engine_scheduler.waiting == 1
    assert [r.id for r in f.engine_requests] == ["cmpl-big-0"]
    assert f.engine_report_steps == (1000, 6000, 5.0)
    assert set(f.engine_readings) == {pid_of(b, Role.ENGINE_CORE)}
    assert Facts(load("admission-wedge")).engine_report is None


# --- bundle and rendering --------------------------------------------------------------------------------

def test_an_old_bundle_reads_with_no_engine_reports():
    b = read_bundle(BUNDLES / "engine-deadlock.tar.gz")
    assert b.samples and all(s.engine == () for s in b.samples)


def test_engine_readings_survive_the_bundle(tmp_path):
    b = deadlocked(load("engine-deadlock"))
    b = with_readings(b, lambda i, s: (*s.engine, missing(1, s.t, "unreadable: EACCES on /tmp/x")))
    back = read_bundle(write_bundle(b, tmp_path / "b.tar.gz"))
    assert [s.engine for s in back.samples] == [s.engine for s in b.samples]
    assert classify(back).rule == "live_engine_report_deadlock"


def test_the_evidence_renders_with_its_source():
    lines = list(render_verdict(classify(deadlocked(load("engine-deadlock")))))
    assert any(line.startswith("  [engine] stage execute_model_wait for 12 s, running 1") for line in lines)
    lines = list(render_verdict(classify(wedged(load("admission-wedge")))))
    assert "  [engine] request cmpl-big-0 needs 5 KV blocks; the pool holds 4 in all, 3 for" in lines


def test_a_wrong_type_in_a_bundles_engine_reading_is_refused_naming_the_field(tmp_path):
    import json
    import pytest
    from wedgectl.model.errors import BadBundle
    from wedgectl.store.bundle import decode, encode

    files = encode(deadlocked(load("engine-deadlock")))
    lines = files["samples.jsonl"].decode().splitlines()
    first = json.loads(lines[0])
    first["engine"][0]["report"]["stage"]["since_mono_ns"] = "soon"
    files["samples.jsonl"] = "\n".join([json.dumps(first), *lines[1:]]).encode()
    with pytest.raises(BadBundle, match=r"samples.jsonl line 1: engine\[0\].report.stage.since_mono_ns"):
        decode(files, "b")


def test_each_sample_reads_the_reports_of_the_engine_processes(monkeypatch):
    from wedgectl.capture import sample
    from wedgectl.capture.discover import Deployment
    from wedgectl.capture.options import SamplerOptions

    procs = load("idle").samples[0].processes
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url=None, metrics_url=None)
    asked: list[list[int]] = []
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (procs, []))
    monkeypatch.setattr(sample, "read_engine_reports", lambda pids: asked.append(pids) or tuple(
        missing(p, 0.0) for p in pids))
    got = sample.begin_sample(dep, None, SamplerOptions(), burst=0).sample(dep)
    engine = [p.pid for p in procs if p.role in (Role.API_SERVER, Role.ENGINE_CORE, Role.WORKER)]
    assert asked == [engine] and [r.pid for r in got.engine] == engine


def test_a_watched_sample_counts_its_engine_reports_against_the_budget():
    from wedgectl.watch.targets import sample_bytes

    s = load("engine-deadlock").samples[0]
    assert sample_bytes(deadlocked(load("engine-deadlock")).samples[0]) > sample_bytes(s)


def test_with_several_ranks_a_stuck_stage_leaves_the_collective_to_the_ranks_stacks():
    """TP 2: the EngineCore waits in execute_model_wait whether a rank deadlocked or never reached the all-reduce;
    the report cannot tell them apart, the ranks' stacks do (seen live: `--native` stopped early on the report's
    deadlock before the collective rule had its evidence)."""
    b = load("collective-hang")
    assert sum(p.role == Role.WORKER for p in b.samples[-1].processes) == 2
    v = classify(deadlocked(b))
    assert v.verdict is VerdictKind.COLLECTIVE_HANG and v.rule != "live_engine_report_deadlock", v.summary


def test_a_start_up_without_stacks_is_placed_by_the_reports_own():
    """The recorded start-up hang with py-spy's dumps gone (refused, or not taken in time under load): the Worker's
    report, overdue in its start-up stage, took its own stacks, and those name the phase and the frame."""
    b = no_ptrace(load("startup-hang"))
    pid = pid_of(b, Role.WORKER)
    frames = [{"file": "wedge_engine/faults/startstall.py", "line": 82, "function": "stall"},
              {"file": "vllm/v1/worker/worker_base.py", "line": 300, "function": "compile_or_warm_up_model"}]
    stacks = {"reason": "stage starting for 30.0 s", "taken_mono_ns": 1,
              "threads": [{"name": "MainThread", "id": 1, "frames": frames}]}
    stage = {"name": "starting", "since_mono_ns": 100, "phase": "graph capture / warm-up"}
    v = classify(with_readings(b, lambda i, s: (reading(pid, s.t, 0.4, 30.0, role="worker", stage=stage,
                                                        scheduler=None, requests=[], stacks=stacks),)))
    assert v.verdict is VerdictKind.STARTUP_HANG, v.summary
    assert any("compile_or_warm_up_model" in e.what and "the engine's own report" in e.what for e in v.evidence)
