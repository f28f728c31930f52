"""A verdict without ptrace: `wedgectl diagnose --pid` run as nobody (no capabilities, no groups) against real
hung vLLM servers of root's. py-spy is refused, /proc/PID/{fd,environ,syscall,stack} are unreadable; what decides
is the engine's own report (WEDGE_ENGINE_REPORT=1, on in every repro server; the fault still applies), read from
the report directory by the pid alone. (Without the report the verdict says what it could not read, and what
would decide it: test_probes_engine, on its deadlock without one.)"""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from cli_run import stop_gracefully
from test_repros import evidence_text
from nobody import NOBODY, as_nobody, check_as_nobody, diagnose_as_nobody, engine_lines, nobody_wedgectl
from wedgectl.collect.control import free_port
from wedgectl.model.types import VerdictKind
from wedgectl.store.bundle import read_bundle

pytestmark = pytest.mark.integration


def test_engine_deadlock_repro(deadlock_with_report) -> None:
    """`repro engine-deadlock` as root, end to end: the verdict, and the evidence behind it."""
    rc, out = deadlock_with_report.rc, deadlock_with_report.out
    assert (out["verdict"], rc) == ("engine_deadlock", 0), evidence_text(out)
    facts = out["facts"]
    assert facts["running"] >= 1 and facts["frozen_s"] >= 2
    assert facts["engine_cores"] <= 0.2  # parked, not spinning
    assert facts["worker_model_share"] >= 0.9  # every Worker sample inside execute_model
    text = evidence_text(out)
    assert "EngineCore main thread: in model execution" in text
    assert "still listening" in text  # the API process keeps answering /metrics


def test_a_deadlock_as_nobody_is_decided_by_the_engines_report(deadlock_with_report) -> None:
    out = check_as_nobody(deadlock_with_report.pid, deadlock_with_report.out, "stage execute_model_wait for",
                          "requests frozen in the step: cmpl-")
    assert out["rule"] == "live_engine_report_deadlock"  # the report decided, and says so
    assert "cmpl-" in " ".join(out["advice"])  # the requests it holds, by id


def test_an_admission_wedge_as_nobody_names_the_request(admission_wedge) -> None:
    rc, out = diagnose_as_nobody(admission_wedge.pid)
    assert (out["verdict"], rc) == ("admission_wedge", 11), out["summary"]
    assert out["rule"] == "live_engine_report_wedge"
    engine = engine_lines(out)
    assert engine and engine[0].startswith("request cmpl-") and "KV blocks" in engine[0], engine
    rid = engine[0].split()[1]
    assert rid in out["summary"] and f"Abort request {rid}" in out["advice"][0]


T = TypeVar("T")


def _wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, alive: Callable[[], bool]) -> T:
    """probe() until it gives something truthy; an HTTP error (watch not listening yet) is a no."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            got = probe()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s:g} s" + ("" if alive() else " (watch exited)"))


def test_watch_as_nobody_serves_the_verdict_the_engines_report_decides(deadlock_with_report,
                                                                       tmp_path: Path) -> None:
    """`watch` as a sidecar without ptrace runs it (deploy/kubernetes/sidecar-example.yaml): another user, no
    capability; its bundles go into a directory of its own inside a volume anyone may write, as an emptyDir
    is. It decides the deadlock from the report and serves it: /metrics, /readyz, /livez past the grace,
    /v1/targets with the rule, and the onset bundle."""
    kept = deadlock_with_report
    python, env = nobody_wedgectl()
    port, grace_s = free_port(), 3
    # in /tmp: nobody may not search root's tmp_path
    volume = Path(tempfile.mkdtemp(prefix="wedgectl-sidecar-", dir="/tmp"))
    volume.chmod(0o777)
    bundles = volume / "wedgectl"
    out_path, err_path = tmp_path / "watch.out", tmp_path / "watch.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        watch = subprocess.Popen(
            as_nobody(python, "-m", "wedgectl", "watch", "--pid", str(kept.pid), "--listen", f"127.0.0.1:{port}",
                      "--interval", "1", "--grace", str(grace_s), "--bundle-dir", str(bundles), "--ebpf", "off",
                      "--json"),
            env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=5, trust_env=False) as c:
            def running() -> bool:
                return watch.poll() is None

            seen: list[tuple[str | None, str | None]] = []

            def view() -> dict | None:
                targets = c.get(f"{base}/v1/targets").json()["targets"]
                return targets[0] if targets else None

            def decided() -> dict | None:
                t = view()
                if t is not None and (t["verdict"], t["rule"]) not in seen:
                    seen.append((t["verdict"], t["rule"]))
                return t if t is not None and t["rule"] == "live_engine_report_deadlock" else None

            try:
                target = _wait_for("the report's verdict in /v1/targets", decided, 120, running)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; verdicts seen: {seen}") from None
            assert target["verdict"] == "engine_deadlock", target["summary"]
            assert target["up"]
            engine = " | ".join(e["what"] for e in target["evidence"] if e["source"] == "engine")
            assert "stage execute_model_wait for" in engine and "requests frozen in the step: cmpl-" in engine, engine
            said = " | ".join(e["what"] for e in target["evidence"] if e["source"] == "wedgectl")
            assert "no Python stacks" in said, said  # py-spy was refused: the report decided alone

            metrics = c.get(f"{base}/metrics").text
            assert re.search(r'(?m)^wedgectl_verdict\{[^}]*verdict="engine_deadlock"[^}]*\} 1\.0$', metrics), metrics
            assert c.get(f"{base}/readyz").status_code == 503  # out of rotation at once
            def failing_livez() -> str | None:
                r = c.get(f"{base}/livez")
                return r.text if r.status_code == 503 else None

            assert target["target"] in _wait_for("/livez 503 past the grace", failing_livez, 30, running)

            def saved() -> dict | None:
                t = view()
                return next((e for e in t["episodes"] if e["verdict"] == "engine_deadlock" and e["bundle"]), None) if (
                    t is not None) else None

            episode = _wait_for("the onset bundle", saved, 120, running)
        path = Path(episode["bundle"])
        assert path.parent == bundles and path.is_file()
        made = bundles.stat()
        assert (made.st_uid, stat.S_IMODE(made.st_mode)) == (NOBODY, 0o700)  # its own directory, in the volume
        b = read_bundle(path)
        assert b.verdict is not None and (b.verdict.verdict, b.verdict.rule) == (
            VerdictKind.ENGINE_DEADLOCK, "live_engine_report_deadlock")
        assert not any(d.threads for s in b.samples for d in s.stacks)  # no stacks: py-spy was refused
        assert any(r.report is not None for s in b.samples for r in s.engine)
    finally:
        rc = stop_gracefully(watch)
        shutil.rmtree(volume, ignore_errors=True)
    assert rc == 0, err_path.read_text()[-3000:]
    assert "Traceback" not in err_path.read_text()
    events = [json.loads(line) for line in out_path.read_text().splitlines() if line.startswith("{")]
    started = [e for e in events if e["event"] == "episode_start"]
    assert [e["verdict"] for e in started] == ["engine_deadlock"], events
