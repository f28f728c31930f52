"""A saturated real vLLM server (8 concurrent streams on a small host) is `progressing`, decided on two answered scrapes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from wedgectl.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.sampler import CERTAIN, engine_stepping
from wedgectl.types import VerdictKind

pytestmark = pytest.mark.integration


def _end_session(pid: int) -> None:
    """The kept server runs in its own session; its clients' holder exits once it is gone."""
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_saturated_server_is_progressing_without_waiting_out_the_window(vllm_python, tmp_path):
    # --keep: the streams run in a detached holder, and diagnose is its own process, as on call.
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", "healthy-loaded", "--keep", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert r.stdout.strip(), r.stderr[-3000:]
    pid = json.loads(r.stdout)["pid"]
    try:
        d = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "-q",
                            "--save-bundle", str(tmp_path / "loaded.tar.gz")], capture_output=True, text=True, timeout=120)
    finally:
        _end_session(pid)
    out = json.loads(d.stdout)
    assert (out["verdict"], d.returncode) == ("progressing", 0), " | ".join(e["what"] for e in out["evidence"])
    b = read_bundle(tmp_path / "loaded.tar.gz")
    v = classify(b)
    assert v.verdict is VerdictKind.PROGRESSING and v.confidence >= CERTAIN and v.facts["tokens_per_s"] > 0
    # Counters moving is decisive: the capture stopped at the first sample whose verdict was
    # certain, not at the window's end, and took no stack burst. (Which sample, not how many
    # seconds: on a saturated 2-core host diagnose itself waits seconds for a CPU.) An engine
    # /proc shows stepping costs no py-spy at all; otherwise the first sample took one dump per process.
    answered = [s for s in b.samples if s.metrics is not None and s.metrics.ok]
    assert len(answered) >= 2 and len(b.samples) <= 4
    for k in range(1, len(b.samples)):
        assert classify(replace(b, samples=b.samples[:k])).confidence < CERTAIN, f"certain at sample {k}, went on"
    assert all(len(s.stacks) <= len(s.processes) for s in b.samples)
    if engine_stepping(b.samples[0].processes):
        assert not any(s.stacks for s in b.samples)
    # The load was real: the API server held the streams' connections.
    api = [p for p in b.samples[-1].processes if p.pid == pid]
    assert api and (api[0].connections or 0) >= 4
