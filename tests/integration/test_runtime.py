"""The managed runtime serves the tiny model for real and fails a start that cannot succeed fast. (Its stop
leaves nothing behind: test_patched's last test, on that module's server.)"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from wedgectl.lab.runtime import (
    Server,
    ServerSpec,
    ServerStartError,
    free_port,
    running_server,
)

pytestmark = pytest.mark.integration

COMPLETION = {
    "model": "tiny",
    "prompt": "The capital of France is",
    "max_tokens": 16,
    "temperature": 0,
    "ignore_eos": True,
}


def test_completion_generates_the_requested_tokens(vllm_server: Server) -> None:
    reply = httpx.post(f"{vllm_server.url}/v1/completions", json=COMPLETION, timeout=60)
    reply.raise_for_status()
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["prompt_tokens"] == 6  # BOS + 5 words, as the tokenizer is built


def test_metrics_expose_the_generation_counter(vllm_server: Server) -> None:
    httpx.post(f"{vllm_server.url}/v1/completions", json=COMPLETION, timeout=60)
    text = httpx.get(f"{vllm_server.url}/metrics", timeout=10).text
    assert "vllm:generation_tokens_total" in text
    assert "vllm:num_requests_running" in text


def test_a_real_server_answers_the_restricted_page_top_scrapes(vllm_server: Server) -> None:
    """top asks vLLM for JUDGED_SERIES alone (/metrics/?name[]=...): vLLM 0.32 serves that page,
    with every series a snapshot reads, at a fraction of the whole page; once the server is
    idle, both pages give the same values."""
    from wedgectl.collect.scrape import Scraper, restricted_url
    from wedgectl.read.metrics import JUDGED_SERIES, parse_metrics
    from wedgectl.tui.source import LiveSource

    httpx.post(f"{vllm_server.url}/v1/completions", json=COMPLETION, timeout=60)
    url = f"{vllm_server.url}/metrics"
    scraper = Scraper(5.0, series=JUDGED_SERIES)
    restricted = scraper.metrics(url)
    whole = Scraper(5.0).metrics(url)
    assert restricted.ok and scraper.restricted == {url: True}
    assert restricted.url.endswith(restricted_url(url, JUDGED_SERIES).split("/metrics", 1)[1])
    assert len(restricted.text) * 5 < len(whole.text)
    names = {line.split("{")[0].split(" ")[0] for line in restricted.text.splitlines() if line and line[0] != "#"}
    assert names <= set(JUDGED_SERIES) and "vllm:generation_tokens_total" in names
    fields = ("running", "waiting", "kv_usage", "generation_tokens", "prompt_tokens", "requests_finished", "iterations")

    def values(text: str) -> dict[str, float | None]:
        snap = parse_metrics(text)
        return {f: getattr(snap, f) for f in fields}

    # The engine publishes its stats a moment after the reply: scrape both until nothing moves
    # between them (bounded), then compare.
    deadline = time.monotonic() + 30
    while values(restricted.text) != values(whole.text) and time.monotonic() < deadline:
        time.sleep(0.5)
        restricted, whole = scraper.metrics(url), Scraper(5.0).metrics(url)
    assert values(restricted.text) == values(whole.text)
    assert values(restricted.text)["generation_tokens"] >= 16
    # top's source scrapes that way (through the live session it holds)
    assert LiveSource.connect(pid=vllm_server.pid).session.scraper.series == JUDGED_SERIES


def test_start_fails_fast_with_the_log_tail(vllm_python: Path, tmp_path: Path) -> None:
    spec = ServerSpec(model=tmp_path / "no-such-model", port=free_port())
    started = time.monotonic()
    with pytest.raises(ServerStartError) as failure:
        with running_server(spec, vllm_python, tmp_path / "server.log", health_timeout=120):
            pass
    # It exits after its imports; waiting out health_timeout would be a bug.
    assert time.monotonic() - started < 90
    message = str(failure.value)
    assert "exited with code" in message
    assert "no-such-model" in message
