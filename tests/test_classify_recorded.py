"""The live rules on evidence recorded from real repros (tests/fixtures/bundles/record.py).

Each bundle is what `wedgectl repro NAME` captured from a real vLLM 0.32 server on CPU:
metrics text, /proc thread states, py-spy dumps, the log. These pin the classifier's
answers to real data, and show which piece of evidence each rule leans on by taking it away.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import LIVE_RULES, LOG_RULES, Facts, classify
from wedgectl.classify import confidence
from wedgectl.store.sources import bundle_from_log
from wedgectl.model.types import VerdictKind

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"

EXPECTED = {
    "idle": VerdictKind.IDLE,
    "healthy": VerdictKind.PROGRESSING,
    "admission-wedge": VerdictKind.ADMISSION_WEDGE,
    "engine-deadlock": VerdictKind.ENGINE_DEADLOCK,
    "shutdown-hang": VerdictKind.SHUTDOWN_HANG,
    "starved": VerdictKind.STARVED,
    "engine-dead": VerdictKind.ENGINE_DEAD,  # recorded by record_engine_dead.py, not a repro
}


NAMED_CONFIDENCES = {v for k, v in vars(confidence).items() if k.isupper() and isinstance(v, float)}


def load(name: str):
    return read_bundle(BUNDLES / f"{name}.tar.gz")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_bundle_gives_the_expected_verdict(name):
    b = load(name)
    v = classify(b)
    assert v.verdict is EXPECTED[name], v.summary
    assert b.verdict is not None and b.verdict.verdict is v.verdict  # same answer as at capture


def test_wedge_evidence():
    v = classify(load("admission-wedge"))
    f = v.facts
    assert f["waiting"] == 1 and f["waiting_capacity"] == 1 and f["kv_usage_pct"] == 0
    assert f["engine_cores"] > 0.5
    assert f["worker_model_share"] == 0  # the Worker never ran the model in the burst
    assert v.confidence >= 0.85


def test_wedge_without_process_evidence_is_less_certain():
    # Metrics alone cannot tell a wedge from a blocked engine: drop /proc and stacks.
    b = load("admission-wedge")
    bare = replace(b, samples=tuple(replace(s, processes=(), stacks=()) for s in b.samples))
    v = classify(bare)
    assert v.verdict is VerdictKind.ADMISSION_WEDGE
    assert v.confidence < classify(b).confidence
    assert any("metrics-only" in e.what for e in v.evidence)


def test_deadlock_evidence():
    v = classify(load("engine-deadlock"))
    f = v.facts
    assert f["running"] >= 1 and f["engine_cores"] < 0.2
    assert f["worker_model_share"] == 1.0
    assert any("execute_model_then_stall" in e.what for e in v.evidence)


def test_deadlock_is_not_a_wedge_because_the_engine_sleeps():
    # The same frozen gauges with a spinning engine would be read as stepping, not blocked.
    b = load("engine-deadlock")
    facts = Facts(b)
    assert facts.engine_cores is not None and facts.engine_parked
    assert classify(b).rule == "live_engine_deadlock"


def test_shutdown_hang_evidence():
    b = load("shutdown-hang")
    v = classify(b)
    api = Facts(b).api_server
    assert api is not None and not api.listening and api.connections >= 1
    assert v.facts["shutdown_age_s"] > 0
    assert any("Waiting for connections" in e.what for e in v.evidence)


def test_shutdown_hang_needs_the_process_alive():
    # If the API server is gone by the last sample, it finished exiting: not a hang.
    b = load("shutdown-hang")
    gone = replace(b, samples=b.samples + (replace(b.samples[-1], t=b.samples[-1].t + 1, processes=(), stacks=()),))
    assert classify(gone).verdict is not VerdictKind.SHUTDOWN_HANG


def test_starved_evidence():
    v = classify(load("starved"))
    f = v.facts
    assert f["waiting"] == 3 and f["running"] == 1
    assert f["tokens_per_s"] > 0 and f["kv_growth_pct_per_min"] > 0


def test_engine_dead_evidence():
    # The EngineCore SIGKILLed while six clients were served (record_engine_dead.py): the API server
    # lives on, listening, answering /health with 503 and every request with 500.
    b = load("engine-dead")
    v, f = classify(b), Facts(b)
    api = f.api_server
    assert v.rule == "live_engine_dead" and v.confidence == confidence.ENGINE_DEAD_LIVE
    assert api is not None and api.pid == b.manifest.target.pid and api.listening
    assert f.engine_core is None and f.last_health == 503
    whats = [e.what for e in v.evidence]
    assert whats[0] == f"API server pid {api.pid} alive, listening on {', '.join(api.listening)}; no EngineCore process"
    assert "GET /health answered 503" in whats
    dead = [e for e in v.evidence if e.source == "log"]
    assert dead and "EngineDeadError" in b.log_lines[dead[0].values["line"] - 1]


def test_engine_dead_stands_on_the_503_or_on_the_missing_engine_and_its_log():
    b = load("engine-dead")
    unanswered = replace(b, samples=tuple(replace(s, health_status=None, health_error="refused") for s in b.samples))
    undying = tuple(line for line in b.log_lines if "EngineDeadError" not in line)
    # either half alone still says the engine died, and cites only what is there
    for half in (unanswered, replace(b, log_lines=undying)):
        v = classify(half)
        assert v.verdict is VerdictKind.ENGINE_DEAD and v.rule == "live_engine_dead"
        assert ("GET /health answered 503" in [e.what for e in v.evidence]) == (half is not unanswered)
        assert any(e.source == "log" for e in v.evidence) == (half is unanswered)
    # neither: no EngineCore beside a listening API server is not enough
    assert classify(replace(unanswered, log_lines=undying)).verdict is not VerdictKind.ENGINE_DEAD


def test_healthy_is_not_starved_or_stuck():
    v = classify(load("healthy"))
    assert v.facts["tokens_per_s"] > 10


@pytest.mark.parametrize("name, expected", [
    ("admission-wedge", VerdictKind.ADMISSION_WEDGE),
    ("engine-deadlock", VerdictKind.ENGINE_DEADLOCK),
])
def test_recorded_server_logs_alone(name, expected):
    # The server's own log, 40 s into the hang: the stats lines have stopped.
    v = classify(bundle_from_log(BUNDLES / f"{name}.log"))
    assert v.verdict is expected, v.summary


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_first_rule_that_holds_names_the_verdict(name):
    b = load(name)
    facts = Facts(b)
    first = next(r for r in LIVE_RULES if r.holds(facts))
    v = classify(b)
    assert first.name == v.rule
    assert v.confidence in NAMED_CONFIDENCES  # no bare numbers: each comes from confidence.py


def test_every_rule_is_a_documented_predicate():
    names = [r.name for r in LIVE_RULES + LOG_RULES]
    assert len(set(names)) == len(names)
    assert all(r.name.startswith("live_") for r in LIVE_RULES) and all(r.name.startswith("log_") for r in LOG_RULES)
    for r in LIVE_RULES + LOG_RULES:
        assert len(r.holds.__doc__ or "") > 80, r.name  # which hang, and which vLLM behaviour it relies on


def test_the_classifier_imports_no_collector():
    # classify is a pure function of a bundle: importing it must not pull in the code that
    # reads /proc, spawns py-spy or speaks HTTP.
    code = ("import sys, wedgectl.classify; "
            "print(sorted(m for m in sys.modules if m.startswith('wedgectl.collect') or m in ('psutil', 'httpx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_slope_is_the_least_squares_fit_of_the_recorded_counters():
    import statistics

    from wedgectl.classify.series import slope_per_s
    from wedgectl.read.metrics import parse_metrics

    b = load("starved")
    points = [(s.t, parse_metrics(s.metrics.text).value("vllm:generation_tokens_total")) for s in b.samples
              if s.metrics is not None and s.metrics.text]
    assert len(points) >= 3 and points[-1][1] > points[0][1]
    want = statistics.linear_regression([t for t, _ in points], [v for _, v in points]).slope
    assert slope_per_s(points) == pytest.approx(want, rel=1e-12) and want > 0
    assert slope_per_s(points[:1]) is None
    assert slope_per_s([(5.0, 1.0), (5.0, 9.0)]) is None  # one instant: no rate
