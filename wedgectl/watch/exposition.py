"""What `watch` serves: Prometheus metrics (a prometheus_client Collector), /livez and /v1/targets."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from wedgectl import __version__
from wedgectl.types import VerdictKind
from wedgectl.watch.state import HANG_CLASSES, TargetView

DEFAULT_LISTEN = "127.0.0.1:9464"


@dataclass(frozen=True)
class Snapshot:
    """Everything the endpoints answer from, taken at one instant under the watcher's lock."""

    t: float
    grace_s: float
    targets: tuple[TargetView, ...] = ()
    failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (collector, kind) -> count

    @property
    def failing(self) -> tuple[TargetView, ...]:
        """The targets in a hang class for longer than the grace."""
        return tuple(v for v in self.targets if v.failing_liveness(self.t, self.grace_s))

    def targets_json(self) -> dict:
        return {"time": self.t, "grace_s": self.grace_s,
                "targets": [v.to_json(self.t, self.grace_s) for v in self.targets]}


class WatchCollector(Collector):
    """The watcher's state as Prometheus metric families, built afresh at each scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        verdict = GaugeMetricFamily("wedgectl_verdict", "The target's current verdict: 1 for it, 0 for every other.",
                                    labels=["target", "verdict"])
        confidence = GaugeMetricFamily("wedgectl_verdict_confidence", "Confidence of the current verdict (0..1).",
                                       labels=["target"])
        state = GaugeMetricFamily("wedgectl_state_seconds", "Seconds the current verdict has held.", labels=["target"])
        episodes = CounterMetricFamily("wedgectl_episodes", "Hang episodes begun, by the hang class they began as.",
                                       labels=["target", "verdict"])
        last = GaugeMetricFamily("wedgectl_last_evaluation_timestamp_seconds",
                                 "Unix time of the target's last evaluation.", labels=["target"])
        for v in snap.targets:
            if v.verdict is None:
                continue
            for kind in VerdictKind:
                verdict.add_metric([v.name, kind.value], 1.0 if kind is v.verdict.verdict else 0.0)
            confidence.add_metric([v.name], v.verdict.confidence)
            state.add_metric([v.name], v.state_seconds(snap.t))
            if v.last_evaluation is not None:
                last.add_metric([v.name], v.last_evaluation)
            for kind in HANG_CLASSES:
                episodes.add_metric([v.name, kind.value], float(v.episodes_total.get(kind, 0)))
        failures = CounterMetricFamily("wedgectl_collector_failures", "Reads a collector could not make, by why.",
                                       labels=["collector", "kind"])
        for (collector, kind), n in sorted(snap.failures.items()):
            failures.add_metric([collector, kind], float(n))
        build = InfoMetricFamily("wedgectl_build", "The wedgectl that answers.", value={"version": __version__})
        targets = GaugeMetricFamily("wedgectl_targets", "Deployments under watch.", value=len(snap.targets))
        yield from (verdict, confidence, state, episodes, last, failures, build, targets)


def make_registry(snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WatchCollector(snapshot))
    return registry


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT', '[::1]:PORT' or ':PORT' (all interfaces) -> (host, port)."""
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 16

    def __init__(self, address: tuple[str, int], snapshot: Callable[[], Snapshot]) -> None:
        import socket

        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.snapshot = snapshot
        self.registry = make_registry(snapshot)
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a client that sends nothing does not hold a thread for ever

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))
        elif path == "/livez":
            snap = self.server.snapshot()
            failing = snap.failing
            if failing:
                body = "".join(f"{v.name}: {v.verdict.verdict.value if v.verdict else '?'} for "
                               f"{snap.t - (v.hang_since or snap.t):.0f}s (grace {snap.grace_s:.0f}s)\n" for v in failing)
                self._send(503, "text/plain; charset=utf-8", body.encode())
            else:
                self._send(200, "text/plain; charset=utf-8", b"ok\n")
        elif path == "/v1/targets":
            self._send(200, "application/json", json.dumps(self.server.snapshot().targets_json(), default=str).encode())
        elif path == "/":
            self._send(200, "text/plain; charset=utf-8", b"wedgectl watch: /metrics /livez /v1/targets\n")
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass  # a scrape every few seconds is not news


class Endpoint:
    """The HTTP server on --listen, in a daemon thread; close() stops it."""

    def __init__(self, listen: str, snapshot: Callable[[], Snapshot]) -> None:
        self.server = _Server(parse_listen(listen), snapshot)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="wedgectl-watch-http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def start(self) -> Endpoint:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
