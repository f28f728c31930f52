"""The leaked-capacity and deferred-admission repros end to end on the real CPU vLLM 0.32."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from nobody import check_as_nobody
from test_repros import evidence_text, repro, stop_kept  # the helpers that run `wedgectl repro NAME --json`
from wedgectl.collect.control import stop_tree
from wedgectl.store.bundle import read_bundle
from wedgectl.read.metrics import parse_metrics

pytestmark = pytest.mark.integration


def test_deferred_wedge(vllm_python, tmp_path):
    rc, out = repro("deferred-wedge", tmp_path, "--keep")
    try:
        check_deferred(rc, out)
        # as nobody: the engine's report shows its loop stepping, admitting nothing, and names the waiting
        check_as_nobody(out["pid"], out, "nothing running and 3 waiting (capacity 1, deferred 2)", "waiting: cmpl-")
    finally:
        stop_kept("deferred-wedge")


def check_deferred(rc: int, out: dict) -> None:
    assert (out["verdict"], out["expected"], rc) == ("admission_wedge", "admission_wedge", 0), evidence_text(out)
    facts = out["facts"]
    assert facts["reason"] == "deferred"
    assert facts["waiting_deferred"] == 2 and facts["waiting_capacity"] >= 1  # two parked sessions, one new request
    assert facts["kv_usage_pct"] < 5  # KV mostly free
    assert facts["frozen_s"] >= 2
    assert "= --max-num-seqs 2" in evidence_text(out)
    b = read_bundle(out["bundle"])
    m = parse_metrics(b.samples[-1].metrics.text)
    assert m.running == 0 and b.samples[-1].health_status == 200  # health passes, nothing runs


def test_leaked_capacity_then_remedied_by_a_restart(vllm_python, tmp_path):
    """Kept, diagnosed, then `wedgectl remedy --restart` gives the capacity back: the ghosts have no connection
    to end and no id to abort by, so it restarts the server as swap does (the reaper on from then)."""
    rc, out = repro("leaked-capacity", tmp_path, "--keep")
    new_pid = None
    try:
        check_leak(rc, out)
        # as nobody: no connection count can be read; the API server's report names the requests whose client went
        ghosts = out["facts"]["request_ids"]
        check_as_nobody(out["pid"], out, "requests with no client: ", *ghosts)
        r = subprocess.run([sys.executable, "-m", "wedgectl", "remedy", "--pid", str(out["pid"]), "--yes", "--json"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
        planned = json.loads(r.stdout)  # without --restart: no act ends it, and it says why
        assert (r.returncode, planned["plan"]["action"], planned["acted"]) == (47, "none", False), planned
        assert planned["failed"].endswith("run again with --restart")
        r = subprocess.run([sys.executable, "-m", "wedgectl", "remedy", "--pid", str(out["pid"]), "--yes", "--restart",
                            "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        done = json.loads(r.stdout)
        new_pid = done["new_pid"]
        assert (r.returncode, done["plan"]["action"], done["gone"]) == (0, "restart", True), (done, r.stderr[-3000:])
        assert new_pid is not None and new_pid != out["pid"] and done["after"]["verdict"] in ("idle", "progressing")
        page = parse_metrics(httpx.get(f"{out['url']}/metrics", timeout=10, trust_env=False).text)
        assert (page.running, page.waiting) == (0, 0) and not page.kv_usage  # the slots and the KV blocks are back
        assert list(tmp_path.glob("wedgectl-remedy-*.tar.gz"))  # the evidence, saved before each act
    finally:
        if new_pid is not None:
            stop_tree(new_pid, grace=10)
        subprocess.run([sys.executable, "-m", "wedgectl", "repro", "--stop", "leaked-capacity"], capture_output=True,
                       timeout=120)


def check_leak(rc: int, out: dict) -> None:
    assert (out["verdict"], out["expected"], rc) == ("leaked_capacity", "leaked_capacity", 0), evidence_text(out)
    facts = out["facts"]
    assert facts["running"] == 3 and facts["waiting"] == 1  # three ghosts hold every slot; one real client waits
    assert facts["tokens_per_s"] > 0  # the engine generates for nobody
    b = read_bundle(out["bundle"])
    assert sum("fault lost-abort: client gone" in line for line in b.log_lines) == 3
    ghosts = [r for r in out["client"] if "error" in r and "Timeout" in r["error"]]
    assert len(ghosts) == 3  # the three clients gave up
    # The repro's server reports (WEDGE_ENGINE_REPORT=1): the API server names the three requests whose client went,
    # and counts the one real client still waiting (the metrics' reading of it, by connections, is the recorded
    # bundles' to test: tests/test_classify_versions.py).
    assert out["rule"] == "live_engine_report_leak", evidence_text(out)
    assert (facts["leaked"], facts["client_connections"], len(facts["request_ids"])) == (3, 1, 3), facts
    assert all(rid in evidence_text(out) for rid in facts["request_ids"])


# The reaper on this workload (each disconnect the fault leaves unaborted is reaped, the real client
# answered) is asserted by test_patched.py's leaked-capacity run, on a patched server of its own.
