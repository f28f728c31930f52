"""Leaked capacity, the deferred-admission wedge, and the two log-rule mistakes, on evidence recorded
from real vLLM 0.32 repros (tests/fixtures/bundles, tests/fixtures/capacity/README.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import Facts, classify
from wedgectl.classify import confidence as C
from wedgectl.classify.leak import count_points, live_leaked_capacity
from wedgectl.store.sources import bundle_from_log
from wedgectl.model.types import Role, VerdictKind

FIXTURES = Path(__file__).parent / "fixtures"
BUNDLES = FIXTURES / "bundles"
CAPACITY = FIXTURES / "capacity"


def load(name: str):
    return read_bundle(BUNDLES / f"{name}.tar.gz")


def with_api_connections(bundle, connections):
    """The same bundle with the API server's established-connection count set in every sample."""
    def fix(p):
        return replace(p, connections=connections(p) if callable(connections) else connections) if p.role == Role.API_SERVER else p

    return replace(bundle, samples=tuple(replace(s, processes=tuple(fix(p) for p in s.processes)) for s in bundle.samples))


# --- the deferred-admission wedge ----------------------------------------------


def test_deferred_wedge_names_the_reason():
    b = load("deferred-wedge")
    v = classify(b)
    assert v.verdict is VerdictKind.ADMISSION_WEDGE and b.verdict.verdict is v.verdict
    assert v.facts["reason"] == "deferred"
    assert v.facts["waiting_deferred"] == 2 and v.facts["waiting_capacity"] == 1
    assert "reason: deferred" in v.summary
    assert "0 running + 2 deferred = --max-num-seqs 2" in v.evidence[0].what
    assert v.facts["kv_usage_pct"] < 1  # KV mostly free
    assert any("--max-num-seqs" in a for a in v.advice)


def test_capacity_wedge_still_says_capacity():
    v = classify(load("admission-wedge"))
    assert v.verdict is VerdictKind.ADMISSION_WEDGE
    assert v.facts["reason"] == "capacity" and not v.facts["waiting_deferred"]
    assert "reason: capacity" in v.summary and "deferred" not in v.evidence[0].what
    assert any("KV blocks" in a for a in v.advice)


# --- leaked capacity -------------------------------------------------------------


def test_leaked_capacity_counts_requests_against_connections():
    b = load("leaked-capacity")
    v = classify(b)
    assert v.verdict is VerdictKind.LEAKED_CAPACITY and b.verdict.verdict is v.verdict
    f = v.facts
    assert f["counted"] == f["running"] + f["waiting"] == 4
    assert f["running"] == 3  # the three ghosts hold every max_num_seqs slot
    # The real client, and the clients' process polling /metrics on a keep-alive connection: a
    # scraper counts as a client (it can hide a leak, never fake one); wedgectl's own sockets do not.
    assert f["client_connections"] == 2
    assert f["leaked"] == 2
    assert f["tokens_per_s"] > 0  # the engine keeps generating for nobody
    assert f["kv_usage_pct"] > 0
    assert v.confidence in (C.LEAK_NO_CLIENTS, C.LEAK_FEWER_CLIENTS)
    pts = count_points(Facts(b))
    assert len(pts) >= 2 and all(p.unbacked >= 2 for p in pts)
    assert v.confidence == C.LEAK_FEWER_CLIENTS


def test_a_connection_behind_every_request_is_not_a_leak():
    # Keep-alive clients, a pool, a proxy: one connection per request in progress, or more.
    b = with_api_connections(load("leaked-capacity"), 4)
    assert not live_leaked_capacity(Facts(b))
    assert classify(b).verdict is not VerdictKind.LEAKED_CAPACITY


def test_no_connection_count_no_leak_verdict():
    # Sockets unreadable (no CAP_SYS_PTRACE): the count is unknown, not zero.
    b = with_api_connections(load("leaked-capacity"), None)
    assert count_points(Facts(b)) == ()
    assert classify(b).verdict is not VerdictKind.LEAKED_CAPACITY


def test_a_moment_without_excess_is_not_held():
    # A burst: requests outnumber connections in one sample only (gauges a step behind).
    b = load("leaked-capacity")
    first_api = {s.t for s in b.samples[:1]}
    b2 = replace(b, samples=tuple(
        replace(s, processes=tuple(replace(p, connections=10) if p.role == Role.API_SERVER and s.t not in first_api else p
                                   for p in s.processes)) for s in b.samples))
    assert not live_leaked_capacity(Facts(b2))


def test_a_keep_alive_connection_that_closes_mid_window_leaves_the_smallest_leak():
    # The run CI met: the clients' poller's keep-alive connection open in the early samples (2
    # connections), closed by uvicorn's 5 s idle timeout before the last (1). The leak is the
    # excess every sample shows, 2 of the 4 counted, not the last sample's 3; the summary says both.
    b = load("leaked-capacity")
    last = b.samples[-1].t
    b2 = replace(b, samples=tuple(
        replace(s, processes=tuple(replace(p, connections=1) if p.role == Role.API_SERVER and s.t == last else p
                                   for p in s.processes)) for s in b.samples))
    v = classify(b2)
    assert v.verdict is VerdictKind.LEAKED_CAPACITY
    assert (v.facts["client_connections"], v.facts["leaked"]) == (1, 2)
    assert "(4 counted, 1-2 connections over the window)" in v.summary
    assert "(4 counted, 2 connection(s))" in classify(b).summary


def test_no_client_at_all_is_the_certain_tier():
    v = classify(with_api_connections(load("leaked-capacity"), 0))
    assert v.verdict is VerdictKind.LEAKED_CAPACITY and v.confidence == C.LEAK_NO_CLIENTS


@pytest.mark.parametrize("name", ["idle", "healthy", "starved", "admission-wedge", "engine-deadlock", "deferred-wedge"])
def test_other_recorded_bundles_are_not_leaks(name):
    assert not live_leaked_capacity(Facts(load(name))) or classify(load(name)).verdict is not VerdictKind.LEAKED_CAPACITY


def test_healthy_stream_has_a_connection_per_request():
    # The healthy repro: two clients streaming short requests back to back on pooled connections.
    for p in count_points(Facts(load("healthy"))):
        assert p.unbacked <= 0


# --- log: queue state outweighs one line's throughput ---------------------------


def test_late_throughput_line_does_not_hide_a_wedge():
    v = classify(bundle_from_log(CAPACITY / "wedge_late_throughput.log"))
    assert v.verdict is VerdictKind.ADMISSION_WEDGE, v.summary
    assert v.facts["held_lines"] == 2 and v.facts["reason"] == "capacity"
    assert "interval average" in v.evidence[0].what and v.evidence[1].values["gen_tokens_per_s"] == 8.2


def test_one_line_with_throughput_and_running_zero_is_not_yet_a_wedge(tmp_path):
    # The same real line alone, not held across lines and without the silence: undecided by it.
    lines = (CAPACITY / "wedge_late_throughput.log").read_bytes().split(b"\n")
    keep = [ln for ln in lines if b"Engine 000" not in ln or b"8.2 tokens/s" in ln]
    cut = next(i for i, ln in enumerate(keep) if b"8.2 tokens/s" in ln)
    p = tmp_path / "one.log"
    p.write_bytes(b"\n".join(keep[: cut + 1]) + b"\n")
    assert classify(bundle_from_log(p)).verdict is not VerdictKind.ADMISSION_WEDGE


def test_deferred_reason_in_the_log():
    v = classify(bundle_from_log(BUNDLES / "deferred-wedge.log"))
    assert v.verdict is VerdictKind.ADMISSION_WEDGE
    assert v.facts["reason"] == "deferred" and "deferred holding slots" in v.evidence[-2].what


# --- log: a server never asked anything is idle ------------------------------------


def test_never_asked_server_is_idle_with_the_quiet_measured():
    v = classify(bundle_from_log(FIXTURES / "real" / "idle_server.log"))
    assert v.verdict is VerdictKind.IDLE and v.rule == "log_never_asked"
    assert v.facts["quiet_s"] == 38 and v.confidence == C.IDLE_LOG_QUIET
    assert v.facts["probes"] == 2 and "quiet 38 s" in v.summary


def test_just_started_server_is_idle_but_unsure():
    v = classify(bundle_from_log(CAPACITY / "never_asked_just_started.log"))
    assert v.verdict is VerdictKind.IDLE and v.rule == "log_never_asked"
    assert v.facts["quiet_s"] is None and v.confidence == C.IDLE_LOG_QUIET_SHORT < C.IDLE_LOG_QUIET


def test_an_inference_request_is_not_never_asked(tmp_path):
    text = (CAPACITY / "never_asked_just_started.log").read_bytes()
    p = tmp_path / "asked.log"
    p.write_bytes(text + b'INFO:     127.0.0.1:34290 - "POST /v1/completions HTTP/1.1" 200 OK\n')
    assert classify(bundle_from_log(p)).rule != "log_never_asked"


def test_probes_without_start_up_are_still_inconclusive(tmp_path):
    p = tmp_path / "probes.log"
    p.write_text('(APIServer pid=7) INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK\n' * 3)
    assert classify(bundle_from_log(p)).verdict is VerdictKind.INCONCLUSIVE


def test_parked_sessions_with_no_client_are_leaked_not_a_deadlock():
    # The deferred-wedge bundle with its one capacity-waiting request gone: only the two paused
    # sessions remain, counted as deferred; vLLM 0.32 owes them no step, so the engine sleeps.
    b = load("deferred-wedge")

    def quiet(s):
        text = (s.metrics.text.replace('model_name="tiny"} 3.0', 'model_name="tiny"} 2.0')
                .replace('reason="capacity"} 1.0', 'reason="capacity"} 0.0'))
        procs = tuple(replace(p, connections=0 if p.role == Role.API_SERVER else p.connections,
                              cpu_user_s=1.0, cpu_system_s=0.0) for p in s.processes)  # asleep
        return replace(s, metrics=replace(s.metrics, text=text), processes=procs, stacks=())

    b2 = replace(b, samples=tuple(quiet(s) for s in b.samples))
    f = Facts(b2)
    assert f.waiting == 2 and f.last_metrics.waiting_deferred == 2 and f.engine_parked
    v = classify(b2)
    assert v.verdict is VerdictKind.LEAKED_CAPACITY, v.summary
    assert v.facts["counted"] == 2 and v.facts["client_connections"] == 0 and v.confidence == C.LEAK_NO_CLIENTS
