"""`wedgectl watch` with no target: it finds the vLLM servers on the host by itself and stops cleanly on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from cli_run import stop_gracefully

from wedgectl.collect.control import free_port

pytestmark = pytest.mark.integration


def test_host_mode_finds_the_session_server_and_stops_on_sigterm(vllm_server, tmp_path):
    port = free_port()
    err = (tmp_path / "watch.err").open("wb")
    watch = subprocess.Popen([sys.executable, "-m", "wedgectl", "watch", "--listen", f"127.0.0.1:{port}",
                              "--interval", "2", "--ebpf", "off"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
    server_port = vllm_server.url.rsplit(":", 1)[1]
    found = None
    try:
        deadline = time.monotonic() + 90
        with httpx.Client(timeout=5, trust_env=False) as c:
            while found is None and time.monotonic() < deadline and watch.poll() is None:
                time.sleep(1)
                try:
                    targets = c.get(f"http://127.0.0.1:{port}/v1/targets").json()["targets"]
                except httpx.HTTPError:
                    continue
                found = next((t for t in targets if t["pid"] == vllm_server.pid
                              and t["verdict"] in ("idle", "progressing")), None)
            assert found is not None, (tmp_path / "watch.err").read_text()[-2000:]
            assert found["target"].endswith(f":{server_port}/tiny")
            assert found["live"] and found["episodes"] == []
            assert c.get(f"http://127.0.0.1:{port}/livez").status_code == 200
    finally:
        rc = stop_gracefully(watch)
        err.close()
    assert rc == 0
    # No episode on a healthy server. Host mode watches every vLLM on the host: another worker's wedged repro
    # may have an episode of its own, so only this server's lines count.
    ours = [line for line in watch.stdout.read().decode().splitlines() if f" {found['target']}: " in line]
    assert ours == []
