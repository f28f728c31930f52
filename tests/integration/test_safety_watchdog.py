"""The wedge_engine watchdog leaves a paused (sleeping, level 0) real vLLM engine alone, and its request completes.

vLLM's dev-mode ``/sleep?level=0&mode=keep`` pauses the scheduler with the
requests kept: a request sent then waits, by design, with no model step. With
a watchdog limit of 3 s, the watchdog must not fail it nor turn /health to 503
while the engine sleeps, and after ``/wake_up`` the request completes.
(Before: it tripped after 3 s, failed the request with 503 and kept /health
at 503 for good.)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.lab.runtime import ServerSpec, free_port, running_server

pytestmark = pytest.mark.integration

WATCHDOG_S = 3.0


def test_a_sleeping_engine_stays_healthy_past_the_watchdog_limit(vllm_python: Path, tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    ensure_engine_plugin(vllm_python, lambda _m: None)
    env = {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_WATCHDOG_S": str(WATCHDOG_S), "VLLM_SERVER_DEV_MODE": "1"}
    log = tmp_path / "server.log"
    with running_server(ServerSpec(model=tiny_model, port=free_port(), env=env), vllm_python, log) as server:
        r = httpx.post(f"{server.url}/sleep", params={"level": 0, "mode": "keep"}, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/is_sleeping", timeout=5).json()["is_sleeping"] is True
        answer: list[object] = []
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}

        def send() -> None:
            try:
                answer.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120))
            except httpx.HTTPError as exc:
                answer.append(exc)

        client = threading.Thread(target=send)
        client.start()
        time.sleep(3 * WATCHDOG_S)  # well past the limit (and the 1 s polls)
        assert client.is_alive() and not answer  # still waiting, not failed with 503
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        r = httpx.post(f"{server.url}/wake_up", params={"tags": "scheduling"}, timeout=30)
        assert r.status_code == 200, r.text
        client.join(timeout=90)
        assert answer and isinstance(answer[0], httpx.Response), answer
        assert answer[0].status_code == 200, answer[0].text
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    text = log.read_text(errors="replace")
    assert "wedge_engine" in text  # the plugin and its watchdog were on
    assert "engine stalled" not in text
