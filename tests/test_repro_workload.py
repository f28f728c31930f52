"""The repro clients' connections: a stream reuses one connection per stream, so a kept repro
holds a steady handful of sockets, not one more per finished request."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wedgectl.repro import Workload, find_config


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
