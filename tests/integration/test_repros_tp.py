"""Tensor parallelism 2 on the real CPU vLLM, compiled mode: the collective hang, every rank found from any rank, and the healthy control.

Each server costs a compiled start-up (~75 s on 2 idle cores, minutes under load): the hung
one is shared by the module's tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_run import kill_group
from nobody import check_as_nobody
from wedgectl.store.bundle import read_bundle
from wedgectl.lab.repro import find_config, run_repro
from wedgectl.model.types import Role, VerdictKind

pytestmark = pytest.mark.integration


# First: it runs its own server, which must be gone before the module's hung one starts.
def test_healthy_tp2_is_progressing(vllm_python, tmp_path):
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", "healthy-tp2", "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    out = json.loads(r.stdout)
    assert (out["verdict"], r.returncode) == ("progressing", 0), out["summary"]


@pytest.fixture(scope="module")
def hung_tp2(vllm_python, tmp_path_factory):
    """A real collective hang, kept hung: the ReproResult. In this process on purpose: the
    workload's clients live here and keep the request in flight (see test_top_live)."""
    out = tmp_path_factory.mktemp("collective")
    result = run_repro(find_config("collective-hang"), python=str(vllm_python), out_dir=out, keep=True)
    try:
        assert result.symptom_s is not None, f"the hang did not happen: {result.notes}"
        yield result
    finally:
        kill_group(result.pid)


def _diagnose(pid: int, *extra: str) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "--window", "4",
                        "--ebpf", "off", *extra], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip(), r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout)


def _worker_pids(result) -> list[int]:
    b = read_bundle(result.bundle_path)
    return sorted(p.pid for p in b.samples[-1].processes if p.role is Role.WORKER)


def test_collective_hang_names_rank_1(hung_tp2):
    v = hung_tp2.verdict
    assert v is not None and v.verdict is VerdictKind.COLLECTIVE_HANG, v and v.summary
    assert v.facts["lagging_ranks"] == [1] and v.facts["waiting_ranks"] == [0]
    assert "TP1" in v.facts["laggard_frames"]
    ranks = {r["label"]: r for r in v.facts["ranks"]}
    assert ranks["TP0"]["where"] == "inside a collective" and ranks["TP1"]["where"] == "before the collective"
    assert ranks["TP0"]["kind"] == "compiled graph"  # compiled mode: no collective frame in Python
    assert ranks["TP0"]["stuck"] and ranks["TP1"]["stuck"]
    # The ranks' own reports (on in every repro): each one's steps and last collective, in the bundle and cited.
    b = read_bundle(hung_tp2.bundle_path)
    workers = {p.pid for p in b.samples[-1].processes if p.role is Role.WORKER}
    reports = [r.report for r in b.samples[-1].engine if r.pid in workers and r.report is not None]
    assert len(reports) == 2 and all(r.rank and r.rank.steps and r.rank.collective for r in reports)
    cited = {e.values["rank"]: e for e in v.evidence if e.source == "engine" and "rank" in e.values}
    assert set(cited) == {"TP0", "TP1"} and all(e.values["steps"] and e.values["collective"] for e in cited.values())
    # Compiled, the all-reduce they wait in is inlined into the graph and runs no Python: both ranks' last recorded
    # collective is the same one, returned, in the same step, and the reports say the stacks decide.
    assert not any(e.values["inside"] for e in cited.values())
    assert any(e.values.get("agree") for e in v.evidence if e.source == "engine")


def test_diagnose_from_any_rank_finds_every_rank(hung_tp2):
    workers = _worker_pids(hung_tp2)
    assert len(workers) == 2
    for pid in workers:
        rc, out = _diagnose(pid)
        assert (out["verdict"], rc) == ("collective_hang", 19), out["summary"]
        assert sorted(r["label"] for r in out["ranks"]) == ["TP0", "TP1"]
        assert {r["pid"] for r in out["ranks"]} == set(workers)
        assert out["facts"]["lagging_ranks"] == [1]


def test_native_frames_name_the_collective(hung_tp2):
    """--native (asked for: py-spy pauses each process briefly) names shm_allreduce in rank 0."""
    rc, out = _diagnose(_worker_pids(hung_tp2)[0], "--native")
    assert (out["verdict"], rc) == ("collective_hang", 19), out["summary"]
    ranks = {r["label"]: r for r in out["ranks"]}
    assert ranks["TP0"]["native"] and ranks["TP0"]["kind"] == "collective"
    assert "shm_allreduce" in ranks["TP0"]["frame"]
    assert out["facts"]["hang_shape"] == "rank_never_arrived"


def test_as_nobody_the_ranks_reports_and_cpu_name_rank_1(hung_tp2):
    """No ptrace: no stacks of any rank. Each rank's report says it is in its step with no Python collective
    open (compiled: the one they wait in is inlined), its CPU says which spins in it and which sleeps before."""
    root = {"verdict": "collective_hang", "confidence": hung_tp2.verdict.confidence}
    out = check_as_nobody(hung_tp2.pid, root, "stage execute_model_wait for", "requests frozen in the step: cmpl-",
                          "rank TP0 (Worker pid", "rank TP1 (Worker pid")
    assert out["facts"]["lagging_ranks"] == [1] and out["facts"]["waiting_ranks"] == [0]
