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
