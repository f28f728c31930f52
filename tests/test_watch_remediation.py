"""`watch --remediate`: when the watcher acts (the class, the grace, one at a time, the budget), when a storm
stops it, and how its acts are served (/metrics, /v1/targets)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wedgectl.model.types import Verdict, VerdictKind as V
from wedgectl.watch import Snapshot, Tracker, make_registry
from wedgectl.watch.remediation import (BUDGET_WINDOW_S, ERROR, GONE, NOT_GONE, Act, Policy, TargetRemediation,
                                        parse_classes)
from wedgectl.watch.state import TargetLabels

WEDGE = V.ADMISSION_WEDGE
POLICY = Policy(frozenset({WEDGE, V.ORPHANED_ENGINE}), budget=2)


def test_it_acts_only_on_a_named_class_past_the_grace_one_act_at_a_time():
    r = TargetRemediation()
    assert r.due(POLICY, V.ENGINE_DEADLOCK, 0.0, 1000.0, 60.0) == (False, None)  # not named
    assert r.due(POLICY, WEDGE, None, 1000.0, 60.0) == (False, None)  # no open episode
    assert r.due(POLICY, WEDGE, 950.0, 1000.0, 60.0) == (False, None)  # 50 s in, grace 60 s
    assert r.due(POLICY, WEDGE, 900.0, 1000.0, 60.0) == (True, None)
    r.begin(1000.0)
    assert r.due(POLICY, WEDGE, 900.0, 1001.0, 60.0) == (False, None)  # the last act still runs
    r.acted(Act(1000.0, WEDGE, "end-client-connections", NOT_GONE))
    assert r.due(POLICY, WEDGE, 900.0, 1010.0, 60.0) == (True, None)


def test_the_budget_counts_the_acts_of_the_last_hour():
    r = TargetRemediation()
    for t in (1000.0, 1100.0):
        r.acted(Act(t, WEDGE, "end-client-connections", NOT_GONE))
    go, why = r.due(POLICY, WEDGE, 0.0, 1200.0, 60.0)
    assert not go and why == "--remediate-budget 2 per hour spent"
    assert r.due(POLICY, WEDGE, 0.0, 1000.0 + BUDGET_WINDOW_S + 1, 60.0) == (True, None)  # the first one aged out


def test_the_same_class_back_soon_after_an_act_ended_it_is_a_storm_and_stops_the_acts():
    r = TargetRemediation()
    r.acted(Act(1000.0, WEDGE, "end-client-connections", GONE))
    assert r.episode_opened(POLICY, V.ORPHANED_ENGINE, 1100.0) is None  # another class: no storm
    why = r.episode_opened(POLICY, WEDGE, 1100.0)
    assert why is not None and why.startswith("admission_wedge came back 100s after a remedy")
    assert r.episode_opened(POLICY, WEDGE, 1200.0) is None  # said once
    go, held = r.due(POLICY, WEDGE, 1100.0, 5000.0, 60.0)
    assert not go and held == why  # however long it lasts, whatever the budget


@pytest.mark.parametrize("result", [NOT_GONE, ERROR])
def test_an_act_that_did_not_end_it_is_no_storm(result):
    r = TargetRemediation()
    r.acted(Act(1000.0, WEDGE, "end-client-connections", result))
    assert r.episode_opened(POLICY, WEDGE, 1100.0) is None


def test_a_return_after_the_window_is_no_storm():
    r = TargetRemediation()
    r.acted(Act(1000.0, WEDGE, "end-client-connections", GONE))
    assert r.episode_opened(POLICY, WEDGE, 1000.0 + POLICY.storm_window_s) is None


def test_remediate_names_hang_classes_only():
    assert parse_classes("admission_wedge, orphaned_engine,") == frozenset({WEDGE, V.ORPHANED_ENGINE})
    for bad, says in (("starved", "not a hang"), ("idle", "not a hang"), ("wedge", "'wedge' is not a verdict"),
                      (",,", "at least one"), ("\x1b[2J", "is not a verdict")):
        with pytest.raises(ValueError, match=says):
            parse_classes(bad)


def test_acts_and_the_storm_are_served():
    t = Tracker("n:8001/wedged", TargetLabels("n", "8001", "wedged"))
    t.observe(Verdict(WEDGE, 0.9, "s", "r"), 900.0, 1)
    acts = (Act(950.0, WEDGE, "end-client-connections", GONE, "ended 127.0.0.1:5 -> 127.0.0.1:8001"),
            Act(990.0, WEDGE, "end-client-connections", GONE))
    view = replace(t.view("http://127.0.0.1:8001", 11, False, up=True), remediations=acts,
                   remediation_storm="admission_wedge came back")
    snap = Snapshot(1000.0, 60.0, (view,))
    fams = {f.name: f.samples for f in text_string_to_metric_families(generate_latest(make_registry(lambda: snap))
                                                                        .decode())}
    (storm,) = fams["wedgectl_remediation_storm"]
    assert storm.value == 1.0 and storm.labels["model_name"] == "wedged"
    (count,) = [s for s in fams["wedgectl_remediations"] if s.name.endswith("_total")]
    assert count.value == 2.0 and (count.labels["verdict"], count.labels["action"], count.labels["result"]) == (
        "admission_wedge", "end-client-connections", "gone")
    served = json.loads(json.dumps(snap.targets_json()))["targets"][0]
    assert served["remediation_storm"] == "admission_wedge came back"
    assert [a["result"] for a in served["remediations"]] == ["gone", "gone"]
    assert served["remediations"][0]["detail"].startswith("ended 127.0.0.1:5")


def test_a_remedy_whose_diagnosis_disagrees_is_not_counted():
    r = TargetRemediation()
    r.begin(1000.0)
    r.cancel()
    assert r.acts == [] and r.due(POLICY, WEDGE, 900.0, 1001.0, 60.0) == (True, None)
