"""The startup-hang and orphaned-engine rules on evidence recorded from real repros (vLLM 0.32, CPU).

startup-hang.tar.gz / .log: `wedgectl repro startup-hang` (the Worker's warm-up never returns);
orphaned-engine.tar.gz: `wedgectl repro orphaned-engine` (stock vLLM, API server SIGKILLed,
diagnosed from the surviving Worker's pid). Each test takes one piece of evidence away or moves
the clock, to show what the rule leans on.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify, confidence as C
from wedgectl.classify import startup
from wedgectl.classify.facts import Facts
from wedgectl.classify.startup import (
    DEVICE_INIT,
    ENGINE_INIT,
    KV_PROFILING,
    SERVING,
    STARTUP_QUIET_S,
    WARM_UP,
    WEIGHT_LOADING,
    live_startup_hang,
    log_startup_hang,
    phase_lines,
    startup_state,
)
from wedgectl.store.sources import bundle_from_log
from wedgectl.model.types import ProcessSample, Role, VerdictKind

FIXTURES = Path(__file__).parent / "fixtures"
BUNDLES = FIXTURES / "bundles"


def load(name: str):
    return read_bundle(BUNDLES / f"{name}.tar.gz")


def with_processes(bundle, change):
    """The bundle with change(ProcessSample) applied to every process of every sample."""
    samples = tuple(replace(s, processes=tuple(change(p) for p in s.processes)) for s in bundle.samples)
    return replace(bundle, samples=samples)


def shifted(bundle, seconds: float):
    """The bundle as if captured `seconds` earlier (the log unchanged): a younger stall."""
    return replace(bundle, samples=tuple(replace(s, t=s.t - seconds) for s in bundle.samples))


# ------------------------------------------------------------------ orphaned engine


def test_recorded_orphan_names_the_survivors_and_what_they_hold():
    b = load("orphaned-engine")
    v = classify(b)
    assert v.verdict is VerdictKind.ORPHANED_ENGINE and v.confidence == C.ORPHAN_REPARENTED
    assert b.verdict is not None and b.verdict.verdict is v.verdict
    f = v.facts
    procs = b.samples[-1].processes
    assert sorted(f["pids"]) == sorted(p.pid for p in procs) and set(f["roles"].values()) == {"engine_core", "worker"}
    assert f["rss_bytes"] == sum(p.rss_bytes for p in procs) > 1 << 30
    assert f["devices"] == [] and f["reparented"] is True
    assert b.manifest.target.pid == next(p.pid for p in procs if p.role is Role.WORKER)  # found from a Worker
    text = " | ".join(e.what for e in v.evidence)
    assert "parent pid 1 (init: its parent died)" in text
    assert text.count("accelerator memory: not visible") == 2
    assert "ends without any shutdown line" in text
    assert v.advice[0].startswith("Kill them: kill -9 " + " ".join(map(str, f["pids"])))


def test_orphan_under_a_subreaper_is_less_certain():
    b = load("orphaned-engine")
    top = next(p for p in b.samples[-1].processes if p.role is Role.ENGINE_CORE)
    v = classify(with_processes(b, lambda p: replace(p, ppid=4242) if p.pid == top.pid else p))
    assert v.verdict is VerdictKind.ORPHANED_ENGINE and v.confidence == C.ORPHAN_NO_API
    assert v.facts["reparented"] is False


def test_orphan_holding_a_gpu_names_the_devices():
    b = with_processes(load("orphaned-engine"), lambda p: replace(
        p, devices=("/dev/nvidia0", "/dev/nvidiactl") if p.role is Role.WORKER else ()))
    v = classify(b)
    assert v.facts["devices"] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert "accelerator: /dev/nvidia0, /dev/nvidiactl" in " | ".join(e.what for e in v.evidence)
    assert "accelerator memory behind those devices" in v.advice[1]


def test_engine_processes_in_their_exit_are_not_a_certain_orphan():
    """A deployment killed whole on a loaded host: its API server gone, its EngineCore and Workers
    still in the process table (state R) while the kernel tears them down, PF_EXITING set
    (seen in the live exits-mid-capture test: 3 s later, read as a certain orphan). The rule
    still names them, below certainty, so a capture goes on and sees them go, or stay."""
    from wedgectl.capture.policy import CERTAIN

    b = with_processes(load("orphaned-engine"), lambda p: replace(p, exiting=True, state="R"))
    v = classify(b)
    assert (v.verdict, v.confidence) == (VerdictKind.ORPHANED_ENGINE, C.ORPHAN_EXITING) and v.confidence < CERTAIN
    assert v.facts["exiting"] is True and "are in their exit" in v.summary
    assert v.advice[0].startswith("Diagnose again in a few seconds")
    procs = b.samples[-1].processes
    text = " | ".join(e.what for e in v.evidence)
    assert text.count("in its exit (PF_EXITING") == len(procs)
    # one of them not in its exit: left behind, as certain as before
    worker = next(p.pid for p in procs if p.role is Role.WORKER)
    v = classify(with_processes(b, lambda p: replace(p, exiting=False) if p.pid == worker else p))
    assert v.confidence == C.ORPHAN_REPARENTED and "exiting" not in v.facts
    assert v.advice[0].startswith("Kill them: kill -9")
    # then gone: the deployment exited, no orphan
    gone = replace(b, samples=(*b.samples, replace(b.samples[-1], t=b.samples[-1].t + 1, processes=())))
    assert classify(gone).verdict is not VerdictKind.ORPHANED_ENGINE


def test_an_api_server_in_the_tree_is_no_orphan():
    b = load("orphaned-engine")
    top = next(p for p in b.samples[-1].processes if p.role is Role.ENGINE_CORE)
    api = ProcessSample(pid=top.ppid + 7, ppid=1, role=Role.API_SERVER, name="python", state="S",
                        listening=("127.0.0.1:8000",), connections=0)
    b = replace(b, samples=tuple(replace(s, processes=(api, *(replace(p, ppid=api.pid) if p.pid == top.pid else p
                                                               for p in s.processes))) for s in b.samples))
    assert classify(b).verdict is not VerdictKind.ORPHANED_ENGINE


# ------------------------------------------------------------------ startup hang


def test_recorded_startup_hang_names_phase_and_duration():
    b = load("startup-hang")
    v = classify(b)
    assert v.verdict is VerdictKind.STARTUP_HANG and v.confidence == C.STARTUP_PARKED_CORROBORATED
    assert b.verdict is not None and b.verdict.verdict is v.verdict
    f = v.facts
    assert f["phase"] == WARM_UP and f["deadline_s"] == STARTUP_QUIET_S
    assert STARTUP_QUIET_S <= f["stuck_s"] == f["quiet_s"] <= f["age_s"]
    text = " | ".join(e.what for e in v.evidence)
    assert "never listening" in text and "compile_or_warm_up_model" in text and "CPU KV cache size" in text
    assert "parked" in text
    assert v.summary.startswith(f"Start-up stuck in {WARM_UP} for ")


def test_a_younger_stall_is_not_called_hung_but_named_starting():
    b = load("startup-hang")
    quiet = classify(b).facts["quiet_s"]
    young = shifted(b, quiet - STARTUP_QUIET_S + 5)  # quiet 55 s at capture
    assert not live_startup_hang(Facts(young))
    v = classify(young)
    assert v.verdict is VerdictKind.INCONCLUSIVE
    # where it is, how long, and what to check; not "check the metrics URL"
    assert v.summary.startswith(f"Starting: in {WARM_UP} for 55 s, short of the 60 s ")
    assert re.match(r"Diagnose again once [56]\.0 s more have passed", v.advice[0]), v.advice  # 60 - 55, rounded up
    assert "--startup-quiet" in v.advice[1] and not any("metrics URL" in a for a in v.advice)
    assert any("compile_or_warm_up_model" not in e.what and "last start-up line" in e.what for e in v.evidence)


def with_bound(bundle, seconds):
    return replace(bundle, manifest=replace(bundle.manifest, startup_quiet_s=seconds))


def test_the_bound_set_by_startup_quiet_decides_and_is_named():
    b = load("startup-hang")
    quiet = classify(b).facts["quiet_s"]
    young = shifted(b, quiet - 25)  # quiet 25 s at capture
    assert classify(young).verdict is VerdictKind.INCONCLUSIVE  # the default bound, 60 s
    v = classify(with_bound(young, 20.0))
    assert v.verdict is VerdictKind.STARTUP_HANG and v.facts["deadline_s"] == 20.0
    assert any("(bound 20 s, not the default 60 s)" in e.what for e in v.evidence)
    # longer than the recorded stall: not hung yet, and the wait it names is the set bound's
    v = classify(with_bound(b, quiet + 100))
    assert v.verdict is VerdictKind.INCONCLUSIVE and "Diagnose again once 2 min more" in v.advice[0], v.advice


@pytest.mark.parametrize("hostile", [float("nan"), float("inf"), -1.0, 0.0, 4.9, 3600.1, 1e300, True, "20"])
def test_a_bound_a_bundle_records_outside_the_range_is_not_used(hostile):
    b = load("startup-hang")
    young = shifted(b, classify(b).facts["quiet_s"] - 25)
    assert startup.quiet_bound(Facts(with_bound(young, hostile))) == STARTUP_QUIET_S
    assert classify(with_bound(young, hostile)).verdict is VerdictKind.INCONCLUSIVE


def test_a_busy_engine_gets_the_long_deadline():
    b = load("startup-hang")
    # The same samples with the engine burning a core: loading, compiling or capturing, not stuck (yet).
    n = {id(s): i for i, s in enumerate(b.samples)}
    busy = replace(b, samples=tuple(replace(s, processes=tuple(
        replace(p, cpu_user_s=p.cpu_user_s + n[id(s)] * 2.0) if p.role in (Role.ENGINE_CORE, Role.WORKER) else p
        for p in s.processes)) for s in b.samples))
    assert not Facts(busy).engine_parked
    assert classify(busy).verdict is VerdictKind.INCONCLUSIVE


def test_without_stacks_the_log_alone_names_the_phase():
    b = load("startup-hang")
    v = classify(replace(b, samples=tuple(replace(s, stacks=()) for s in b.samples)))
    assert v.verdict is VerdictKind.STARTUP_HANG and v.confidence == C.STARTUP_PARKED
    assert v.facts["phase"] == WARM_UP


def test_a_server_that_listened_is_not_starting():
    b = with_processes(load("startup-hang"), lambda p: replace(p, listening=("127.0.0.1:8000",)) if p.role is Role.API_SERVER else p)
    assert classify(b).verdict is not VerdictKind.STARTUP_HANG


def test_unreadable_sockets_decide_nothing():
    b = with_processes(load("startup-hang"), lambda p: replace(p, connections=None) if p.role is Role.API_SERVER else p)
    assert classify(b).verdict is not VerdictKind.STARTUP_HANG


def test_phase_lines_of_a_real_start():
    lines = tuple((BUNDLES / "startup-hang.log").read_text().splitlines())
    phases = [p.phase for p in phase_lines(lines)]
    for earlier, later in ((ENGINE_INIT, DEVICE_INIT), (DEVICE_INIT, WEIGHT_LOADING), (WEIGHT_LOADING, KV_PROFILING),
                           (KV_PROFILING, WARM_UP)):
        assert phases.index(earlier) < phases.index(later)
    assert phases[-1] == WARM_UP and SERVING not in phases
    healthy = tuple((FIXTURES / "real" / "idle_server.log").read_text().splitlines())
    assert [p.phase for p in phase_lines(healthy)][-1] == SERVING


# ------------------------------------------------------------------ the log rule


def test_log_of_a_stalled_start_read_late_is_a_startup_hang():
    recorded = load("startup-hang")
    b = bundle_from_log(BUNDLES / "startup-hang.log")
    late = replace(b, manifest=replace(b.manifest, created=recorded.samples[-1].t))
    v = classify(late)
    assert v.verdict is VerdictKind.STARTUP_HANG and v.rule == "log_startup_hang" and v.confidence == C.STARTUP_LOG
    assert v.facts["phase"] == WARM_UP and v.facts["quiet_s"] >= STARTUP_QUIET_S
    assert v.advice[0].startswith("Check the server's pid still lives")


def test_log_read_soon_after_the_stall_decides_nothing():
    recorded = load("startup-hang")
    b = bundle_from_log(BUNDLES / "startup-hang.log")
    f = Facts(recorded)
    early = recorded.samples[-1].t - (startup_state(f).quiet_s - 30)  # 30 s after the last progress
    b = replace(b, manifest=replace(b.manifest, created=early))
    assert not log_startup_hang(Facts(b))
    assert classify(b).verdict is VerdictKind.INCONCLUSIVE


def test_a_log_that_reached_serving_is_no_startup_hang():
    b = bundle_from_log(FIXTURES / "real" / "idle_server.log")
    assert not log_startup_hang(Facts(b))


@pytest.mark.parametrize("name", ["idle", "healthy", "admission-wedge", "engine-deadlock", "shutdown-hang", "starved"])
def test_the_new_rules_leave_the_recorded_classes_alone(name):
    f = Facts(load(name))
    assert not live_startup_hang(f) and classify(load(name)).verdict not in (VerdictKind.STARTUP_HANG, VerdictKind.ORPHANED_ENGINE)
