"""The engine's own report, recorded: tests/fixtures/bundles/unprivileged/admission-wedge.tar.gz is
`wedgectl diagnose --pid API --save-bundle` run as nobody (setpriv, no capabilities, no groups) against a kept
`repro admission-wedge` (vLLM 0.32, WEDGE_ENGINE_REPORT=1, the fault on): no py-spy, no /proc/PID/fd, no
environ; the report alone names the request that can never be admitted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from wedgectl.classify import classify
from wedgectl.model.types import VerdictKind
from wedgectl.store.bundle import read_bundle

BUNDLE = Path(__file__).parent / "fixtures" / "bundles" / "unprivileged" / "admission-wedge.tar.gz"


def test_the_report_alone_names_the_request_that_never_fits():
    b = read_bundle(BUNDLE)
    assert all(s.threads == () for s in b.samples[-1].stacks)  # no stacks: nothing read them
    v = classify(b)
    assert (v.verdict, v.rule) == (VerdictKind.ADMISSION_WEDGE, "live_engine_report_wedge")
    assert b.verdict is not None and b.verdict.rule == v.rule  # what the unprivileged run said
    engine = [e for e in v.evidence if e.source == "engine"]
    rid = engine[0].values["request"]
    assert rid.startswith("cmpl-") and rid in v.summary and rid in v.advice[0]
    needed, total = engine[0].values["blocks_needed"], engine[0].values["kv_total"]
    assert needed > total - 1  # the null block: a request gets at most total - 1
    assert engine[1].values["steps_last"] > engine[1].values["steps_first"]  # stepping, each step refuses it
    roles = {r.pid: r.report.role for r in b.samples[-1].engine if r.report is not None}
    assert sorted(roles.values()) == ["api_server", "engine_core", "worker"]


def test_without_the_report_the_same_evidence_is_weaker_and_says_why():
    b = read_bundle(BUNDLE)
    bare = replace(b, samples=tuple(replace(s, engine=()) for s in b.samples))
    v = classify(bare)
    assert v.rule != "live_engine_report_wedge"
    assert not any(e.source == "engine" for e in v.evidence)
    assert v.confidence <= classify(b).confidence


# --- every other class the repros make, recorded the same way (kept repro, diagnosed as nobody) ---------------

UNPRIVILEGED = BUNDLE.parent


def _classify(name: str):
    b = replace(read_bundle(UNPRIVILEGED / f"{name}.tar.gz"), verdict=None)
    assert not any(d.threads for s in b.samples for d in s.stacks)  # py-spy was refused: no stacks at all
    assert all(p.connections is None for s in b.samples for p in s.processes)  # nor sockets
    v = classify(b)
    return b, v, [e for e in v.evidence if e.source == "engine"]


def test_a_shutdown_hang_is_told_by_the_api_servers_own_report():
    b, v, engine = _classify("shutdown-hang")
    assert (v.verdict, v.rule, v.confidence) == (VerdictKind.SHUTDOWN_HANG, "live_shutdown_hang", 0.9)
    assert engine[0].values["stage"] == "shutting_down" and engine[0].values["stage_s"] >= 2
    assert engine[1].values["requests_total"] >= 1 and engine[1].values["ids"][0].startswith("cmpl-")
    assert "no EngineCore is left to finish them" in engine[1].what
    # without the report nothing there says a shutdown began: no verdict rather than a guess
    bare = replace(b, samples=tuple(replace(s, engine=()) for s in b.samples))
    assert classify(bare).verdict is VerdictKind.INCONCLUSIVE


def test_a_leak_names_the_ghosts_by_the_api_servers_report():
    b, v, engine = _classify("leaked-capacity")
    assert (v.verdict, v.rule) == (VerdictKind.LEAKED_CAPACITY, "live_engine_report_leak")
    ids = v.facts["request_ids"]
    assert len(ids) == v.facts["leaked"] == 3 and v.facts["client_connections"] == 1
    assert all(i in engine[0].what and i in engine[1].what for i in ids)  # gone clients, held by the scheduler
    assert engine[1].values["blocks_held"] > 0
    # without the report no connection count can be read: the leak is not seen (what root's sockets would show)
    bare = replace(b, samples=tuple(replace(s, engine=()) for s in b.samples))
    assert classify(bare).verdict is not VerdictKind.LEAKED_CAPACITY


def test_a_deferred_wedge_is_as_sure_without_stacks():
    b, v, engine = _classify("deferred-wedge")
    assert (v.verdict, v.rule, v.confidence) == (VerdictKind.ADMISSION_WEDGE, "live_admission_wedge", 0.9)
    stepped = engine[0].values
    assert stepped["steps_last"] > stepped["steps_first"] and stepped["waiting_by_reason"]["deferred"] == 2
    assert len(stepped["waiting_ids"]) == 3
    bare = replace(b, samples=tuple(replace(s, engine=()) for s in b.samples))
    assert classify(bare).confidence < v.confidence
    # no CPU figure nor main-thread quiet (a busy host can read either short): the report's steps still say it steps
    blind = replace(b, samples=tuple(replace(s, processes=()) for s in b.samples))
    seen = classify(blind)
    assert (seen.verdict, seen.confidence) == (VerdictKind.ADMISSION_WEDGE, 0.9), (seen.confidence, seen.summary)
    assert seen.summary.endswith("engine stepping.") and "stepped" in " ".join(e.what for e in seen.evidence)


def test_starved_names_the_runaway():
    _, v, engine = _classify("starved")
    assert (v.verdict, v.confidence) == (VerdictKind.STARVED, 0.9)
    hog = engine[0].values
    assert hog["blocks_held"] > hog["kv_total"] / 3 and v.facts["request_ids"] == [hog["request"]]


def test_an_orphan_is_seen_by_anyone_and_its_report_says_it_idles():
    _, v, engine = _classify("orphaned-engine")
    assert (v.verdict, v.rule) == (VerdictKind.ORPHANED_ENGINE, "live_orphaned_engine")
    assert engine[0].values["stage"] == "idle"


def test_a_collective_hang_without_stacks_is_told_by_the_ranks_reports_and_cpu():
    """Compiled TP=2: the all-gather they wait in is inlined, so both ranks' reports say "in the step, no
    collective open"; the one spinning in place waits in it, the parked one never came (as root's stacks say)."""
    b, v, engine = _classify("collective-hang")
    assert (v.verdict, v.rule, v.confidence) == (VerdictKind.COLLECTIVE_HANG, "live_collective_hang", 0.85)
    assert v.facts["lagging_ranks"] == [1] and v.facts["waiting_ranks"] == [0]
    ranks = {e.values["rank"] for e in engine if "rank" in e.values}
    assert ranks == {"TP0", "TP1"}
    assert any(e.what.startswith("requests frozen in the step: cmpl-") for e in engine)
    bare = replace(b, samples=tuple(replace(s, engine=()) for s in b.samples))
    assert classify(bare).verdict is not VerdictKind.COLLECTIVE_HANG  # no stacks, no reports: not decidable
