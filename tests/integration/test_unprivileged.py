"""A verdict without ptrace: `wedgectl diagnose --pid` run as nobody (no capabilities, no groups) against real
hung vLLM servers of root's. py-spy is refused, /proc/PID/{fd,environ,syscall,stack} are unreadable; what decides
is the engine's own report (WEDGE_ENGINE_REPORT=1, on in every repro server; the fault still applies), read from
the report directory by the pid alone. Without the report the verdict says what it could not read, and what
would decide it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from cli_run import kill_group
from nobody import as_nobody, nobody_wedgectl
from wedgectl.lab.repro import ReproResult, find_config, run_repro

pytestmark = pytest.mark.integration


def _kept_deadlock(python: Path, out: Path, report: bool) -> ReproResult:
    """A real engine deadlock kept hung, in this process (its clients live here and keep the requests in
    flight); with the report off (WEDGE_ENGINE_REPORT=0) it is a stock server but for the fault."""
    cfg = find_config("engine-deadlock")
    if not report:
        cfg = replace(cfg, env={**cfg.env, "WEDGE_ENGINE_REPORT": "0"})
    result = run_repro(cfg, python=str(python), out_dir=out, keep=True)
    assert result.symptom_s is not None, f"the hang did not happen: {result.notes}"
    return result


@pytest.fixture(scope="module")
def deadlocks(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, ReproResult]]:
    """Two real engine deadlocks side by side: one with the engine's report, one without."""
    kept: dict[bool, ReproResult] = {}
    try:
        for report in (True, False):
            kept[report] = _kept_deadlock(vllm_python, tmp_path_factory.mktemp(f"deadlock-report-{report}"), report)
        yield kept
    finally:
        for result in kept.values():
            kill_group(result.pid)


def diagnose_as_nobody(pid: int, *extra: str) -> tuple[int, dict]:
    python, env = nobody_wedgectl()
    r = subprocess.run(as_nobody(python, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "--window", "4",
                                 *extra), env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def _engine(out: dict) -> list[str]:
    return [e["what"] for e in out["evidence"] if e["source"] == "engine"]


def test_a_deadlock_as_nobody_is_decided_by_the_engines_report(deadlocks: dict[bool, ReproResult]) -> None:
    kept = deadlocks[True]
    rc, out = diagnose_as_nobody(kept.pid)
    assert (out["verdict"], rc) == ("engine_deadlock", 12), out["summary"]
    assert out["rule"] == "live_engine_report_deadlock"  # the report decided, and says so
    root = kept.verdict
    assert root is not None and out["confidence"] >= root.confidence  # as sure as root with py-spy, or surer
    engine = " | ".join(_engine(out))
    assert "stage execute_model_wait for" in engine and "requests frozen in the step: cmpl-" in engine, engine
    assert "cmpl-" in " ".join(out["advice"])  # the requests it holds, by id
    stacks = [e["what"] for e in out["evidence"] if e["source"] == "wedgectl"]
    assert any("no Python stacks" in w for w in stacks), stacks  # py-spy was refused: the report stood alone


def test_without_the_report_nobody_is_told_what_would_decide(deadlocks: dict[bool, ReproResult]) -> None:
    rc, out = diagnose_as_nobody(deadlocks[False].pid)
    assert _engine(out) == [] and out["rule"] != "live_engine_report_deadlock"
    said = " | ".join(e["what"] for e in out["evidence"] if e["source"] == "wedgectl")
    assert "py-spy was refused ptrace access" in said and "no engine report was read" in said, said
    assert "WEDGE_ENGINE_REPORT=1" in said and "CAP_SYS_PTRACE" in said, said
    with_report = diagnose_as_nobody(deadlocks[True].pid)[1]
    assert out["confidence"] <= with_report["confidence"]


def test_an_admission_wedge_as_nobody_names_the_request(admission_wedge) -> None:
    rc, out = diagnose_as_nobody(admission_wedge.pid)
    assert (out["verdict"], rc) == ("admission_wedge", 11), out["summary"]
    assert out["rule"] == "live_engine_report_wedge"
    engine = _engine(out)
    assert engine and engine[0].startswith("request cmpl-") and "KV blocks" in engine[0], engine
    rid = engine[0].split()[1]
    assert rid in out["summary"] and f"Abort request {rid}" in out["advice"][0]
