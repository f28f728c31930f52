"""A real vLLM server on a host short of CPU: saturated by 8 concurrent streams it is `progressing`, decided on two
answered scrapes; held by a CPU limit to next to no CPU it is no hang."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.classify.facts import CPU_WAIT_SHARE, Facts
from wedgectl.collect.processes import STEPPING_ROLES, role_of
from wedgectl.model.exitcodes import VERDICT_CODES
from wedgectl.lab.repro import scrape_snapshot
from wedgectl.capture.policy import CERTAIN, engine_stepping
from wedgectl.model.types import VerdictKind

from cpu_limit import CgroupCpuLimit

HANGS = {VerdictKind.ENGINE_DEADLOCK, VerdictKind.ADMISSION_WEDGE, VerdictKind.COLLECTIVE_HANG,
         VerdictKind.SHUTDOWN_HANG, VerdictKind.ENGINE_DEAD}

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


@pytest.fixture(scope="module")
def loaded(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, int]]:
    """The `healthy-loaded` repro, kept: 8 streams saturating the host, run by a detached holder (diagnose is its
    own process, as on call). Its JSON and exit code; the module's tests take it in turn, the CPU limit last."""
    out = tmp_path_factory.mktemp("loaded")
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", "healthy-loaded", "--keep", "--json",
                        "--python", str(vllm_python), "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert r.stdout.strip(), r.stderr[-3000:]
    control = json.loads(r.stdout)
    try:
        yield control, r.returncode
    finally:
        _end_session(control["pid"])


def test_saturated_server_is_progressing_without_waiting_out_the_window(loaded, tmp_path):
    pid = loaded[0]["pid"]
    d = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "-q",
                        "--save-bundle", str(tmp_path / "loaded.tar.gz")], capture_output=True, text=True, timeout=120)
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


# --- an engine its CPU limit starves -------------------------------------------------


def _tokens_stop(url: str, quiet_s: float = 4.0, bound_s: float = 90.0) -> float:
    """Seconds until the server's generated-token count has held still for quiet_s. Tokens the
    engine made before the limit bit still drain to the API server for a while after it (the
    engine's output thread runs in the same starved limit), so a fixed sleep is not enough on a
    loaded host: the capture then sees a couple of tokens arrive and rightly says progressing."""
    start = last_change = time.monotonic()
    last = None
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() - start < bound_s:
            m = scrape_snapshot(client, url)
            now = time.monotonic()
            gen = m.generation_tokens if m is not None else None
            if gen != last:
                last, last_change = gen, now
            elif gen is not None and now - last_change >= quiet_s:
                return now - start
            time.sleep(0.5)
    raise AssertionError(f"tokens still arrived {bound_s:.0f} s into the CPU limit (last count {last})")


def test_an_engine_its_cpu_limit_starves_is_not_called_a_deadlock(loaded, tmp_path):
    """The `healthy-loaded` repro's streams, its EngineCore and Worker then held to 1 ms of CPU a second with
    busy loops beside them in the same limit, the engine's threads at the idle policy: no token comes, the engine's
    main threads queue for a CPU they are not given. Frozen counters with work in flight and an engine using no CPU
    read as a certain engine deadlock before the run delay was read; now no hang is named, and the verdict says the
    engine is waiting for a CPU. The module's last user of the kept server: the limit is not undone."""
    control, rc = loaded
    pid = control["pid"]
    hogs: list[subprocess.Popen] = []
    # First the control itself, before any limit: a classifier that cries wolf is worse than none.
    assert (control["verdict"], rc) == ("progressing", 0), control["summary"]
    assert control["facts"]["tokens_per_s"] > 10
    assert all(c.get("status") == 200 for c in control["client"] if "status" in c)
    try:
        engine = [p.pid for p in psutil.Process(pid).children(recursive=True) if role_of(p) in STEPPING_ROLES]
        assert len(engine) == 2, engine
        with CgroupCpuLimit() as limit:
            # Busy loops beside the engine take each period's sliver of quota (the quota is handed out
            # in slices, so a limited group overruns it a little), the engine's threads at the idle
            # policy so that the loops win it: with the loops alone the engine still made a token
            # every few seconds, and a capture that sees one rightly says progressing.
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
            for p in (*engine, *(h.pid for h in hogs)):
                limit.add(p)
            for p in engine:
                for t in psutil.Process(p).threads():
                    with contextlib.suppress(OSError):
                        os.sched_setscheduler(t.id, os.SCHED_IDLE, os.sched_param(0))
            # the quota of the period under way runs out, and tokens made before it drain
            settled = _tokens_stop(control["url"])
            d = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "-q",
                                "--window", "8", "--save-bundle", str(tmp_path / "limited.tar.gz")],
                               capture_output=True, text=True, timeout=120)
            for h in hogs:
                h.kill()
                h.wait()
    finally:
        for h in hogs:
            if h.poll() is None:
                h.kill()
        _end_session(pid)
    out = json.loads(d.stdout)
    print(f"tokens stopped {settled:.1f} s into the limit;", out["verdict"], out["rule"],
          " | ".join(e["what"] for e in out["evidence"]))
    assert out["verdict"] in ("inconclusive", "progressing") and d.returncode == VERDICT_CODES[VerdictKind(out["verdict"])]
    b = read_bundle(tmp_path / "limited.tar.gz")
    _, waited, span = Facts(b).engine_cpu_wait
    # queued for a CPU most of the window; on an overloaded host the run delay can understate it,
    # and the quota running out while the engine was runnable says it (Facts.engine_throttled)
    assert waited >= CPU_WAIT_SHARE * span or Facts(b).engine_throttled, (waited, span)
    rules = [classify(replace(b, samples=b.samples[:k])) for k in range(2, len(b.samples) + 1)]
    assert not [v.verdict for v in rules if v.verdict in HANGS], [(v.verdict, v.rule) for v in rules]
    print("rules over the samples:", [v.rule for v in rules])
    assert "live_engine_waits_for_cpu" in [v.rule for v in rules]
    # the limit itself, read from the engine's cgroup: it ran out of quota in the window's periods
    p, throttled, periods = Facts(b).engine_throttling
    assert p.cpu_limit.quota_us == CgroupCpuLimit.QUOTA_US and p.cpu_limit.period_us == CgroupCpuLimit.PERIOD_US
    assert periods >= 3 and throttled >= periods - 1
    if out["verdict"] == "inconclusive":
        assert any("CPU limit (0.001 CPUs" in e["what"] for e in out["evidence"])
        assert out["advice"][0].startswith("Raise the engine's CPU limit")
