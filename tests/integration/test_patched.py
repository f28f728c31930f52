"""The patched engine on a real CPU vLLM: no repro'd hang hangs, and the healthy output is unchanged."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.collect.scrape import Scraper
from wedgectl.read.metrics import JUDGED_SERIES, parse_metrics
from wedgectl.lab.lifecycle import log_tail
from wedgectl.lab.patched import HEARTBEAT_SLACK_S, run_patched
from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.render.text import render_patched
from wedgectl.lab.repro import find_config, list_configs
from wedgectl.lab.runtime import Server, ServerSpec, free_port, running_server, stop_server

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
# patched run only asserts that every queued request completes once it ends, which 10 s shows too.
# startup-hang: `repro --patched` gives the start-up deadline 90 s (a healthy start on a loaded host
# stays under it); the hung start here never ends by itself, so 15 s ends it as surely, 75 s sooner
# (the warm-up that hangs comes ~15 s after the launch on 2 idle cores: on a loaded host the deadline
# passes before it, and the start fails all the same, by the same deadline).
STARTUP_DEADLINE_S = 15
EXTRA_ENV = {"starved": {"WEDGE_ENGINE_FAULT_HOLD_S": "10"},
             "startup-hang": {"WEDGE_ENGINE_STARTUP_S": str(STARTUP_DEADLINE_S)}}


@pytest.mark.parametrize("name", [c.name for c in list_configs() if c.name not in COVERED_ELSEWHERE])
def test_repro_patched_does_not_hang(name: str, vllm_python: Path, tiny_model: Path, tmp_path: Path) -> None:
    cfg = find_config(name)
    if name == "collective-hang":
        # eager: the hung rank waits in the same all-reduce, and the patched checks read no stack; the compiled
        # start (test_repros_tp's) costs 13 s and 12 CPU s more on 2 cores
        cfg = replace(cfg, flags=tuple(f for f in cfg.flags if f != "--no-enforce-eager"))
    result = run_patched(cfg, python=str(vllm_python), out_dir=tmp_path, extra_env=EXTRA_ENV.get(name))
    report = "\n".join(render_patched(result))
    assert result.passed, f"{report}\n--- server log tail ---\n{log_tail(result.log_path) if result.log_path else ''}"
    if name == "startup-hang":  # the deadline this run set is the one that ended the start
        assert result.log_path is not None and f"start-up did not finish within {STARTUP_DEADLINE_S}" in log_tail(result.log_path, 400)
    if name == "leaked-capacity":
        # the reaper, not luck: each of the three disconnects the fault left unaborted was reaped
        assert result.log_path is not None
        log = result.log_path.read_text(errors="replace")
        assert log.count("fault lost-abort: client gone") == 3 and log.count("reaper: client of request") == 3, \
            log_tail(result.log_path)
        assert result.observation.reaped == 3
    if name == "engine-deadlock":
        # blocked (not even an empty step), the heartbeat froze and aged with the clock while vLLM's own /health
        # still said 200: what an alert on it sees before the watchdog ends the hang
        beat = next(c for c in result.checks if c.name == "heartbeat ages while blocked")
        hb = result.observation.heartbeat
        assert beat.passed and hb is not None and hb["frozen_s"] >= 2.0, (beat, hb)
        assert min(hb["model_step_age_grew_s"], hb["step_age_grew_s"]) >= hb["frozen_s"] - HEARTBEAT_SLACK_S
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


# The sleeping engine's watchdog limit: short, so that a pause well past it costs seconds.
SLEEP_WATCHDOG_S = 3.0


@pytest.fixture(scope="module")
def patched_server(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One patched server for the module's healthy checks (every fix on, the watchdog at SLEEP_WATCHDOG_S, vLLM's
    dev-mode /sleep on): its output and heartbeat, then its engine paused past the watchdog's limit."""
    ensure_engine_plugin(vllm_python, lambda _m: None)
    env = {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_WATCHDOG_S": f"{SLEEP_WATCHDOG_S:g}", "VLLM_SERVER_DEV_MODE": "1"}
    log = tmp_path_factory.mktemp("patched") / "server.log"
    with running_server(ServerSpec(model=tiny_model, port=free_port(), env=env), vllm_python, log) as server:
        yield server


def test_healthy_output_unchanged_by_the_plugin(vllm_server: Server, patched_server: Server) -> None:
    want = _completions(vllm_server.url)  # the session's stock server: the same spec, no plugin env
    patched = patched_server
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


def test_a_sleeping_engine_stays_healthy_past_the_watchdog_limit(patched_server: Server) -> None:
    """The watchdog leaves a paused (sleeping, level 0) engine alone, and its request completes.

    vLLM's dev-mode ``/sleep?level=0&mode=keep`` pauses the scheduler with the requests kept: a request sent then
    waits, by design, with no model step. The watchdog must not fail it nor turn /health to 503 while the engine
    sleeps, and after ``/wake_up`` the request completes. (Before: it tripped after the limit, failed the request
    with 503 and kept /health at 503 for good.)"""
    server = patched_server
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
    time.sleep(3 * SLEEP_WATCHDOG_S)  # well past the limit (and the 1 s polls)
    assert client.is_alive() and not answer  # still waiting, not failed with 503
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    r = httpx.post(f"{server.url}/wake_up", params={"tags": "scheduling"}, timeout=30)
    assert r.status_code == 200, r.text
    client.join(timeout=90)
    assert answer and isinstance(answer[0], httpx.Response), answer
    assert answer[0].status_code == 200, answer[0].text
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    text = server.log_path.read_text(errors="replace")
    assert "wedge_engine" in text  # the plugin and its watchdog were on
    assert "engine stalled" not in text


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


def test_stop_server_tears_the_whole_tree_down(patched_server: Server) -> None:
    """The module's last user of its server stops it: the API server, its EngineCore, Worker and multiprocessing's
    resource tracker all gone, the exit status reaped, the server's own TMPDIR removed. (The fixture's own stop
    after it is then a no-op: stop_server is idempotent.)"""
    server = patched_server
    try:
        pids = server.tree_pids()
        assert len(pids) >= 3  # API server, EngineCore, Worker and the resource tracker
        reply = httpx.post(f"{server.url}/v1/completions", json={**WEDGING, "max_tokens": 16}, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == 16
    finally:
        seconds = stop_server(server)
    assert seconds < 30
    assert [pid for pid in pids if psutil.pid_exists(pid)] == []
    assert server.popen.returncode is not None
    assert server.tmp_dir is not None and not server.tmp_dir.exists()
