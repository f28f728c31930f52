"""The patched engine on a real CPU vLLM: no repro'd hang hangs, and the healthy output is unchanged."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from wedgectl.collect.scrape import Scraper
from wedgectl.read.metrics import JUDGED_SERIES, parse_metrics
from wedgectl.lab.lifecycle import log_tail
from wedgectl.lab.patched import run_patched
from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.render.text import render_patched
from wedgectl.lab.repro import find_config, list_configs
from wedgectl.lab.runtime import Server, ServerSpec, free_port, running_server

pytestmark = pytest.mark.integration

OVERHANG_FLAGS = ("--num-gpu-blocks-override", "4", "--max-model-len", "-1")
WEDGING = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 110, "temperature": 0,
           "ignore_eos": True}


# Controls whose patched run another patched run already covers (each costs a server start, 40-90 s):
# idle and healthy are both inside healthy-loaded (a stream that drains, then a SIGTERM to a quiet
# patched server, its exit bounded) and test_healthy_output_unchanged_by_the_plugin; healthy-tp2's
# patched TP2 server starts, serves and exits in bound in collective-hang's run too, which exits
# in bound with a rank hung besides (and test_repros_tp runs healthy-tp2 itself).
COVERED_ELSEWHERE = {"idle", "healthy", "healthy-tp2"}
# The starved repro paces its runaway to last 90 s so that a diagnosis sees the starvation; the
# patched run only asserts that every queued request completes once it ends, which 20 s shows too.
# startup-hang: `repro --patched` gives the start-up deadline 90 s (a healthy start on a loaded host
# stays under it); the hung start here never ends by itself, so 30 s ends it as surely, 60 s sooner
# (on a loaded host the deadline may pass before the warm-up that hangs: the start fails all the same).
EXTRA_ENV = {"starved": {"WEDGE_ENGINE_FAULT_HOLD_S": "20"}, "startup-hang": {"WEDGE_ENGINE_STARTUP_S": "30"}}


@pytest.mark.parametrize("name", [c.name for c in list_configs() if c.name not in COVERED_ELSEWHERE])
def test_repro_patched_does_not_hang(name: str, vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    result = run_patched(find_config(name), python=str(vllm_python), out_dir=tmp_path, extra_env=EXTRA_ENV.get(name))
    report = "\n".join(render_patched(result))
    assert result.passed, f"{report}\n--- server log tail ---\n{log_tail(result.log_path) if result.log_path else ''}"
    if name == "startup-hang":  # the deadline this run set is the one that ended the start
        assert result.log_path is not None and "start-up did not finish within 30" in log_tail(result.log_path, 400)
    if name == "leaked-capacity":
        # the reaper, not luck: each of the three disconnects the fault left unaborted was reaped
        assert result.log_path is not None
        log = result.log_path.read_text(errors="replace")
        assert log.count("fault lost-abort: client gone") == 3 and log.count("reaper: client of request") == 3, \
            log_tail(result.log_path)
        assert result.observation.reaped == 3
    if result.config.expected in ("startup_hang", "orphaned_engine"):
        return  # no SIGTERM in these: the server ends its own start-up, or its API server is SIGKILLed
    exit_check = next(c for c in result.checks if c.name == "exit on SIGTERM")
    assert exit_check.seconds is not None and exit_check.seconds <= result.observation.shutdown_s + 0.5


def _completions(url: str) -> list[str]:
    prompts = ["The capital of France is", "Once upon a time", "def main():", "1, 2, 3,"]
    out = []
    with httpx.Client(timeout=60) as c:
        for p in prompts:
            r = c.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 32,
                                                      "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
    return out


def test_healthy_output_unchanged_by_the_plugin(vllm_server: Server, vllm_python: Path, tiny_model: Path,
                                                tmp_path: Path) -> None:
    ensure_engine_plugin(vllm_python, lambda _m: None)
    want = _completions(vllm_server.url)  # the session's stock server: the same spec, no plugin env
    patched_spec = ServerSpec(model=tiny_model, port=free_port(), env={"WEDGE_ENGINE_FIXES": "all"})
    with running_server(patched_spec, vllm_python, tmp_path / "patched.log") as patched:
        got = _completions(patched.url)
        whole = httpx.get(f"{patched.url}/metrics").text
        metrics = parse_metrics(whole)
        # top and a watcher's cheap ticks ask for the judged series alone; the heartbeat must come
        # with them, on the restricted page itself (the plugin's collector names its series up
        # front; one that did not was left out of it, and the scraper took the whole page)
        scraper = Scraper(10.0, series=JUDGED_SERIES)
        restricted = scraper.metrics(f"{patched.url}/metrics")
        stayed_restricted = scraper.restricted.get(f"{patched.url}/metrics")
    assert got == want
    assert metrics.has_heartbeat and metrics.heartbeat_model_steps >= 4 * 32 - 4
    lean = parse_metrics(restricted.text)
    assert restricted.ok and lean.has_heartbeat and stayed_restricted is True
    assert len(restricted.text or "") < len(whole) / 4  # the small page (2.3 KB of 50 KB on a stock server, measured)
    assert lean.heartbeat_model_steps >= metrics.heartbeat_model_steps >= 4 * 32 - 4
    assert lean.heartbeat_model_step_age is not None and lean.heartbeat_step_age is not None


def test_scheduler_guard_fails_the_wedging_request_on_first_refusal(vllm_python: Path, tiny_model: Path,
                                                                    tmp_path: Path) -> None:
    """With the advertised length left dishonest, the scheduler guard alone ends the admission wedge."""
    ensure_engine_plugin(vllm_python, lambda _m: None)
    env = {"WEDGE_ENGINE_FAULT": "admission-overhang", "WEDGE_ENGINE_FIXES": "all",
           "WEDGE_ENGINE_HONEST_MAX_MODEL_LEN": "0"}
    spec = ServerSpec(model=tiny_model, port=free_port(), extra_args=OVERHANG_FLAGS, env=env)
    with running_server(spec, vllm_python, tmp_path / "server.log") as server:
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 128
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=WEDGING, timeout=60)
        elapsed = time.monotonic() - t0
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "4 KV-cache blocks for 97 tokens" in msg and "3 blocks allocatable" in msg and "96 tokens" in msg
        assert elapsed < 5
        m = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        assert m.value("wedge_engine:admission_rejections_total") == 1
        assert httpx.get(f"{server.url}/health").status_code == 200  # the server stays usable
        ok = httpx.post(f"{server.url}/v1/completions", json={**WEDGING, "max_tokens": 60}, timeout=60)
        assert ok.status_code == 200


def test_heartbeat_age_grows_while_the_engine_is_blocked(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    ensure_engine_plugin(vllm_python, lambda _m: None)
    env = {"WEDGE_ENGINE_FAULT": "model-stall", "WEDGE_ENGINE_FAULT_AFTER_STEPS": "3",
           "WEDGE_ENGINE_FIXES": "heartbeat,shutdown"}
    spec = ServerSpec(model=tiny_model, port=free_port(), env=env)
    with running_server(spec, vllm_python, tmp_path / "server.log") as server:
        threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/completions", json={**WEDGING, "max_tokens": 64},
                                                   timeout=120), daemon=True).start()
        time.sleep(3)
        a = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        time.sleep(2)
        b = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        assert a.heartbeat_steps == b.heartbeat_steps and a.heartbeat_model_steps == b.heartbeat_model_steps
        assert b.heartbeat_model_step_age >= a.heartbeat_model_step_age + 1.5
        assert b.heartbeat_step_age >= a.heartbeat_step_age + 1.5  # blocked: not even no-op steps
        assert b.running and b.running >= 1  # vLLM's own gauges are frozen at "running"
        assert httpx.get(f"{server.url}/health").status_code == 200  # no watchdog here: vLLM says healthy


def test_watchdog_ends_the_spinning_wedge(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Without the admission guard the engine spins (steps, none runs the model); the watchdog still ends it."""
    ensure_engine_plugin(vllm_python, lambda _m: None)
    env = {"WEDGE_ENGINE_FAULT": "admission-overhang", "WEDGE_ENGINE_FIXES": "all,-admission",
           "WEDGE_ENGINE_WATCHDOG_S": "4"}
    spec = ServerSpec(model=tiny_model, port=free_port(), extra_args=OVERHANG_FLAGS, env=env)
    log = tmp_path / "server.log"
    with running_server(spec, vllm_python, log) as server:
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=WEDGING, timeout=60)
        elapsed = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert "spinning" in r.json()["error"]["message"]
        assert 4 <= elapsed < 4 + 4
        assert httpx.get(f"{server.url}/health").status_code == 503
        again = httpx.post(f"{server.url}/v1/completions", json={**WEDGING, "max_tokens": 8}, timeout=10)
        assert again.status_code == 503  # refused at once, not queued behind the hang
        m = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        assert m.heartbeat_steps > m.heartbeat_model_steps + 100  # it span: steps without model work
    text = log.read_text(errors="replace")
    assert "wedge_engine watchdog: engine stalled" in text
    assert "(most recent call first)" in text  # the engine processes dumped their stacks
