"""Every bundled repro, end to end on the real CPU vLLM: the verdict, and the evidence behind it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nobody import check_as_nobody
from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.capture.window import summarise as _summarise  # the progress line's summary of a sample
from wedgectl.model.types import Role

pytestmark = pytest.mark.integration


def repro(name: str, out: Path, *extra: str) -> tuple[int, dict]:
    r = subprocess.run(
        [sys.executable, "-m", "wedgectl", "repro", name, "--json", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=400,
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def evidence_text(out: dict) -> str:
    """The verdict's evidence, then what each sample of the saved bundle saw: a failing repro's
    message says why, from the run CI had, not one tried again on another day."""
    text = " | ".join(e["what"] for e in out["evidence"])
    try:
        b = read_bundle(out["bundle"])
    except Exception as exc:  # the message must not hide the failure it explains
        return f"{text} || bundle unreadable: {exc!r}"
    rows = [f"{s.t - b.samples[0].t:.1f}s {_summarise(s)}, conns "
            + ",".join(str(p.connections) for p in s.processes if p.role is Role.API_SERVER) for s in b.samples]
    return f"{text} || samples: {'; '.join(rows)} || notes: {'; '.join(b.manifest.notes)}"


def test_list_names_every_config():
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", "--list"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    names = {line.split()[0] for line in r.stdout.splitlines() if line.strip() and not line.startswith(" ")}
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    assert names == {"admission-wedge", "engine-deadlock", "shutdown-hang", "starved", "healthy", "idle",
                     "healthy-loaded", "deferred-wedge", "leaked-capacity", "startup-hang", "orphaned-engine",
                     "collective-hang", "healthy-tp2"}


def test_unknown_repro_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", "no-such"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no repro named" in r.stderr


def test_admission_wedge(admission_wedge):
    # `repro admission-wedge --keep --json`, run once for the session (conftest.KeptWedge): its JSON is
    # what `repro` prints without --keep too; top and watch then use the wedge it keeps.
    rc, out = admission_wedge.rc, admission_wedge.out
    assert (out["verdict"], out["expected"], rc) == ("admission_wedge", "admission_wedge", 0), evidence_text(out)
    facts = out["facts"]
    assert facts["waiting"] >= 1 and facts["waiting_capacity"] >= 1  # waiting by reason capacity
    assert facts["kv_usage_pct"] == 0  # an empty pool, and still not admitted
    # The engine's own report (on in every repro) decides at the first sample, with no window to watch the
    # counters freeze: the request, by id, needs more KV blocks than the pool gives one, and the report's
    # history of its last writes shows the loop stepping, nothing running (it spins, refusing it each step).
    assert (out["rule"], out["confidence"]) == ("live_engine_report_wedge", 0.9), evidence_text(out)
    assert facts["request"].startswith("cmpl-") and facts["blocks_needed"] > facts["kv_total"] - 1
    stepped = next(e["values"] for e in out["evidence"] if e["source"] == "engine" and "steps_last" in e["values"])
    assert stepped["steps_last"] - stepped["steps_first"] >= 20 and stepped["running"] == 0
    # 6 + 110 tokens against a pool of 96: the request stopped in the last block.
    b = read_bundle(out["bundle"])
    assert classify(b).verdict.value == "admission_wedge"
    assert any("reduced from" in line and "to 128" in line for line in b.log_lines)  # the advertised overhang
    assert isinstance(out["pid"], int) and out["url"].startswith("http://127.0.0.1:")


# `repro engine-deadlock` end to end runs in test_unprivileged.py (test_engine_deadlock_repro): kept, it serves
# the unprivileged checks too, so that no server starts twice for it.


def stop_kept(name: str) -> None:
    subprocess.run([sys.executable, "-m", "wedgectl", "repro", "--stop", name], capture_output=True, timeout=120)


def test_shutdown_hang(vllm_python, tmp_path):
    rc, out = repro("shutdown-hang", tmp_path, "--keep")
    try:
        check_shutdown_hang(rc, out)
        # as nobody: no sockets, no stacks, no log; the API server's own report says it is shutting down and
        # still tracks the request no EngineCore is left to finish
        check_as_nobody(out["pid"], out, "stage shutting_down for", "no EngineCore is left to finish them: cmpl-")
    finally:
        stop_kept("shutdown-hang")


def check_shutdown_hang(rc: int, out: dict) -> None:
    assert (out["verdict"], rc) == ("shutdown_hang", 0), evidence_text(out)
    text = evidence_text(out)
    assert "no listening socket" in text  # listener closed
    assert "alive" in text  # process alive
    assert "parked in futex waits" in text  # where its threads wait
    assert "Waiting for connections to close" in text
    b = read_bundle(out["bundle"])
    api = [p for s in b.samples for p in s.processes if p.role is Role.API_SERVER]
    assert api and all(not p.listening for p in api)
    assert any(t.futex_addr for t in api[-1].threads)


def test_starved(vllm_python, tmp_path):
    rc, out = repro("starved", tmp_path, "--keep")
    try:
        assert (out["verdict"], rc) == ("starved", 0), evidence_text(out)
        facts = out["facts"]
        assert facts["tokens_per_s"] > 0 and facts["waiting"] >= 1
        assert facts["kv_growth_pct_per_min"] > 0 and facts["seconds_to_kv_full"] > 0
        # the runaway, by id, from the engine's report: the one running request, holding most of the pool
        assert len(facts["request_ids"]) == 1 and facts["request_ids"][0] in evidence_text(out)
        check_as_nobody(out["pid"], out, "stage ", f"request {facts['request_ids'][0]} holds")
    finally:
        stop_kept("starved")


# The two controls run elsewhere, from the same `repro` command, so that no server starts twice for them:
# `repro healthy` (progressing, exit 0, tokens flowing, every client answered 200) is asserted in
# test_diagnose_loaded.py before its CPU limit, and `repro idle` (idle, exit 0) in test_wheel.py, run
# from the installed wheel.
