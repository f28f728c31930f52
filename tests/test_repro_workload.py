"""The repro clients' connections: a stream reuses one connection per stream, so a kept repro
holds a steady handful of sockets, not one more per finished request."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wedgectl.lab.repro import STREAM_BACKOFF_S, Workload, find_config


class _Completions(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn speaks
    peers: set[tuple[str, int]] = set()
    served = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).peers.add(self.client_address)
        type(self).served += 1
        body = json.dumps({"usage": {"completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def test_a_stream_reuses_one_connection_per_stream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = find_config("healthy")  # two concurrent streams of short completions
    workload = Workload(f"http://127.0.0.1:{server.server_address[1]}", cfg)
    try:
        workload.start_now()
        deadline = time.monotonic() + 30
        while _Completions.served < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        workload.stop()
        server.shutdown()
        server.server_close()
    assert _Completions.served >= 40
    assert len(workload._clients) == cfg.stream.concurrency  # one client per stream, not per request
    assert len(_Completions.peers) == cfg.stream.concurrency  # each kept its one connection
    assert sum(1 for r in workload.results if r.get("status") == 200) >= 40


def test_a_stream_backs_off_from_a_refusing_server():
    """A server going away refuses connections; the stream pauses between tries, not spins."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = find_config("healthy")
    workload = Workload(f"http://127.0.0.1:{port}", cfg)
    started = time.monotonic()
    try:
        workload.start_now()
        # a refusal, then 1.2 s more (a loaded host can take longer than that to run the first try)
        deadline = started + 30
        while not any("error" in r for r in list(workload.results)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.2)
    finally:
        workload.stop()
    span = time.monotonic() - started
    refused = [r for r in workload.results if "error" in r]
    assert refused, workload.results
    # STREAM_BACKOFF_S apart: at most span / backoff + 2 tries per stream (about 4 in 1.2 s); without it, hundreds
    assert len(refused) <= cfg.stream.concurrency * (span / STREAM_BACKOFF_S + 2), (len(refused), span)


def test_the_clients_process_stops_on_sigterm_with_its_results_written(tmp_path):
    """`repro` without --keep stops its clients' process before the server, so the results it
    reports are the workload's against a live server; the process writes them and exits."""
    import os
    import signal
    import subprocess
    import sys

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    results = tmp_path / "client.json"
    cfg = find_config("healthy")
    proc = subprocess.Popen([sys.executable, "-m", "wedgectl.lab._hold", f"http://127.0.0.1:{server.server_address[1]}",
                             str(os.getpid()), str(cfg.path), str(results), "120"])
    try:
        deadline = time.monotonic() + 60
        while not (results.exists() and json.loads(results.read_text() or "[]")) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.shutdown()
        server.server_close()
    assert rc == 0
    written = json.loads(results.read_text())
    assert written and all(r.get("status") == 200 for r in written)
