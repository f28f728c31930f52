"""Ctrl-C during a live capture: the verdict so far, marked partial, the bundle it was asked for, and exit 130.

The target is a local HTTP server answering its first /metrics with a recorded vLLM page and holding the next
one open; the Ctrl-C (a real SIGINT to a real `wedgectl diagnose`) comes once that second scrape is under way,
so a sample is in and the capture is waiting."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from page_server import page_server
from wedgectl.capture.options import INTERRUPTED_NOTE
from wedgectl.model import exitcodes
from wedgectl.store.bundle import read_bundle

PAGE = (Path(__file__).parent / "fixtures" / "real" / "metrics_idle.txt").read_bytes()


@pytest.fixture
def slow_second_scrape() -> Iterator[tuple[str, threading.Event]]:
    second = threading.Event()
    release = threading.Event()
    seen = [0]

    def body_for(path: str) -> bytes:
        if not path.startswith("/metrics"):
            return b""
        seen[0] += 1
        if seen[0] > 1:
            second.set()
            release.wait(30)
        return PAGE

    with page_server(body_for) as url:
        try:
            yield url, second
        finally:
            release.set()


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_prints_the_partial_verdict_and_saves_the_bundle(slow_second_scrape, tmp_path: Path,
                                                                as_json: bool) -> None:
    url, second = slow_second_scrape
    saved = tmp_path / "partial.tar.gz"
    proc = subprocess.Popen([sys.executable, "-m", "wedgectl", "diagnose", "--url", url, "--window", "60", "-q",
                             "--save-bundle", str(saved), *(["--json"] if as_json else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert second.wait(60), "the second scrape never came"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == exitcodes.INTERRUPTED == 130, (out, err)
    assert "Traceback" not in err
    if as_json:
        got = json.loads(out)
        assert got["partial"] is True and got["exit_code"] == 130 and got["verdict"] and got["bundle"] == str(saved)
    else:
        assert out.splitlines()[0].startswith("PARTIAL: interrupted (Ctrl-C)") and f"bundle: {saved}" in out
    b = read_bundle(saved)
    assert len(b.samples) >= 1 and b.verdict is not None
    assert any(n.startswith(INTERRUPTED_NOTE) for n in b.manifest.notes)
