"""The start-up and orphan repros on real vLLM 0.32: the verdict, its evidence, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from nobody import check_as_nobody
from wedgectl.collect.procread import shm_files_of
from wedgectl.store.bundle import read_bundle

pytestmark = pytest.mark.integration


def repro(name: str, out: Path, *extra: str) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", name, "--json", "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=480)
    assert r.stdout.strip(), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def assert_nothing_left(bundle_path: Path) -> None:
    """Every pid the capture saw is gone (the orphans included): the repro's teardown ended them."""
    b = read_bundle(bundle_path)
    pids = {p.pid: p.started for s in b.samples for p in s.processes}
    assert pids
    for pid, started in pids.items():
        try:
            proc = psutil.Process(pid)
            same = started is not None and abs(proc.create_time() - started) < 1
            assert not same or proc.status() == psutil.STATUS_ZOMBIE, f"pid {pid} outlived the repro"
        except psutil.NoSuchProcess:
            pass


def test_orphaned_engine_from_a_surviving_worker_then_remedied(vllm_python, tmp_path):
    """Kept (--keep leaves the orphans running), diagnosed, then `wedgectl remedy` stops them and frees their
    shared memory."""
    rc, out = repro("orphaned-engine", tmp_path, "--keep")
    try:
        check_orphans_then_remedy(rc, out, tmp_path)
    finally:
        subprocess.run([sys.executable, "-m", "wedgectl", "repro", "--stop", "orphaned-engine"], capture_output=True,
                       timeout=120)


def check_orphans_then_remedy(rc: int, out: dict, tmp_path: Path) -> None:
    assert rc == 0 and out["verdict"] == "orphaned_engine", out["summary"]
    f = out["facts"]
    roles = set(f["roles"].values())
    assert {"engine_core", "worker"} <= roles and f["reparented"] is True
    assert f["rss_bytes"] > 100 * 2**20  # the survivors hold the model and the KV pool
    assert f["devices"] == []  # a CPU host: no accelerator held
    text = " | ".join(e["what"] for e in out["evidence"])
    assert "accelerator memory: not visible" in text and "parent pid 1" in text
    assert out["advice"][0].startswith("Kill them: kill -9 ") and all(str(p) in out["advice"][0] for p in f["pids"])
    held = shm_files_of(f["pids"])
    assert held  # vLLM's shared-memory queues and semaphores
    # as nobody: /proc's stat is anyone's to read; the EngineCore's report says it idles since its parent died
    check_as_nobody(f["pids"][0], out, "stage idle for")
    r = subprocess.run([sys.executable, "-m", "wedgectl", "remedy", "--pid", str(f["pids"][0]), "--yes", "--json",
                        "--save-bundle", str(tmp_path / "remedy.tar.gz")], capture_output=True, text=True, timeout=180)
    done = json.loads(r.stdout)
    assert (r.returncode, done["verdict"], done["plan"]["action"]) == (0, "orphaned_engine", "stop-orphans"), done
    assert done["gone"] and sorted(done["plan"]["pids"]) == sorted(f["pids"])
    assert_nothing_left(tmp_path / "bundle.tar.gz")
    assert [p for p in held if os.path.exists(p)] == []  # every segment they held is freed


def test_startup_hang_names_its_phase(vllm_python, tmp_path):
    rc, out = repro("startup-hang", tmp_path, "--keep")
    try:
        check_startup(rc, out, tmp_path)
        # as nobody: no sockets, no log, no py-spy; the engine's report says it is starting, in which phase
        check_as_nobody(out["pid"], out, "stage starting (graph capture / warm-up) for",
                        flags=("--startup-quiet", "20"))  # the repro's own bound (its diagnose's)
    finally:
        subprocess.run([sys.executable, "-m", "wedgectl", "repro", "--stop", "startup-hang"], capture_output=True,
                       timeout=120)
    assert_nothing_left(tmp_path / "bundle.tar.gz")


def check_startup(rc: int, out: dict, tmp_path: Path) -> None:
    assert rc == 0 and out["verdict"] == "startup_hang", out["summary"]
    f = out["facts"]
    # judged by the config's start-up bound (diagnose --startup-quiet 20), which the bundle records
    assert f["phase"] == "graph capture / warm-up" and f["stuck_s"] >= f["deadline_s"] == 20.0
    assert out["confidence"] >= 0.85
    text = " | ".join(e["what"] for e in out["evidence"])
    assert "never listening" in text and "compile_or_warm_up_model" in text
    assert "(bound 20 s, not the default 60 s)" in text
    bundle = tmp_path / "bundle.tar.gz"
    assert read_bundle(bundle).manifest.startup_quiet_s == 20.0
    # the same evidence by a bound it has not yet outlasted: starting, not (yet) hung
    again = {}
    for bound in ("20", str(int(f["stuck_s"]) + 30)):
        r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--bundle", str(bundle), "--startup-quiet",
                            bound, "--json"], capture_output=True, text=True, timeout=60)
        again[bound] = (r.returncode, json.loads(r.stdout)["verdict"])
    assert list(again.values())[0] == (16, "startup_hang")
    assert list(again.values())[1][1] != "startup_hang", again
