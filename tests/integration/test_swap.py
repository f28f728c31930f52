"""`wedgectl swap` on a real CPU vLLM: a wedged stock server is replaced by the patched one on the same port."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.read.metrics import parse_metrics
from wedgectl.collect.control import stop_tree
from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.render.text import render_swap
from wedgectl.lab.repro import symptom_reached
from wedgectl.lab.runtime import ServerSpec, free_port, start_server, stop_server
from wedgectl.lab.swap import swap_deployment

pytestmark = pytest.mark.integration

OVERHANG_FLAGS = ("--num-gpu-blocks-override", "4", "--max-model-len", "-1")
WEDGING = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 110, "temperature": 0,
           "ignore_eos": True}


def _wait_wedged(url: str, timeout_s: float = 60) -> bool:
    history = []
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as c:
        while time.monotonic() < deadline:
            try:
                history.append((time.monotonic(), parse_metrics(c.get(f"{url}/metrics").text)))
            except (httpx.HTTPError, ValueError):
                pass
            if symptom_reached("wedged", history, 3.0):
                return True
            time.sleep(0.5)
    return False


def test_swap_replaces_a_wedged_stock_server(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    ensure_engine_plugin(vllm_python, lambda _m: None)  # the stock server needs it for its fault
    spec = ServerSpec(model=tiny_model, port=free_port(), extra_args=OVERHANG_FLAGS,
                      env={"WEDGE_ENGINE_FAULT": "admission-overhang", "API_TOKEN": "tok-do-not-print"})
    server = start_server(spec, vllm_python, tmp_path / "server.log")
    old_tree = server.tree_pids()
    new_pid = None
    stuck: dict = {}

    def wedging_client() -> None:
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=WEDGING, timeout=600)
            stuck["status"] = r.status_code
        except httpx.HTTPError as exc:
            stuck["error"] = type(exc).__name__

    client = threading.Thread(target=wedging_client, daemon=True)
    try:
        client.start()
        assert _wait_wedged(server.url), "the stock server did not wedge"
        assert client.is_alive() and not stuck  # no answer: the request waits forever

        steps: list[str] = []
        result = swap_deployment(server.pid, progress=steps.append, stop_grace_s=5.0, health_timeout_s=300)
        new_pid = result.new_pid
        print("\n".join(render_swap(result)))
        assert result.ok, f"{result.message}\n" + "\n".join(steps)
        assert result.url == server.url and new_pid not in old_tree
        assert result.downtime_s is not None and result.stop_s is not None
        assert not any("tok-do-not-print" in line for line in steps + list(render_swap(result)))
        client.join(timeout=10)
        assert not client.is_alive()  # the old server's end released the wedged client

        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=WEDGING, timeout=30)
        elapsed = time.monotonic() - t0
        assert 400 <= r.status_code < 600, r.text
        assert elapsed < 5
        print(f"re-sent wedging request: HTTP {r.status_code} in {elapsed:.3f} s: {r.text[:200]}")
        message = r.json()["error"]["message"]
        assert "96" in message and ("max_model_len" in message or "blocks" in message), message
        m = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        assert m.has_heartbeat
    finally:
        if new_pid is not None:
            stop_tree(new_pid, 15.0)
        stop_server(server, grace=5)
    survivors = [p for p in [*old_tree, *([new_pid] if new_pid else [])] if _alive(p)]
    assert survivors == []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
