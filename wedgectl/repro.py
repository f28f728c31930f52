"""Reproducing each hang class on a real vLLM server, from the configs in wedgectl/repros/."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from wedgectl import exitcodes
from wedgectl.bundle import write_bundle
from wedgectl.classify import classify
from wedgectl.errors import WedgectlError
from wedgectl.metrics import MetricsParseError, MetricsSnapshot, parse_metrics
from wedgectl.types import Bundle, Verdict

REPROS_DIR = Path(__file__).with_name("repros")
ENGINE_DIR = Path(__file__).resolve().parent.parent / "engine"


class ReproError(WedgectlError):
    exit_code = exitcodes.REPRO_FAILED


@dataclass(frozen=True)
class RequestSpec:
    """One or more identical completions the workload sends and holds open."""

    prompt: str | None = None
    prompt_tokens: int | None = None  # a prompt of exactly this many token ids
    max_tokens: int = 16
    ignore_eos: bool = False
    count: int = 1
    after_generated: int = 0  # send once vllm:generation_tokens_total reaches this
    stalled_upload: bool = False  # send the headers and part of the body, then hold the socket

    def body(self, index: int = 0) -> dict[str, Any]:
        if self.prompt is not None:
            prompt: Any = self.prompt
        else:
            # Distinct ids per request and per config, so the prefix cache shares no blocks.
            rng = random.Random(f"{self.prompt_tokens}/{self.max_tokens}/{index}")
            prompt = [rng.randrange(10, 800) for _ in range(self.prompt_tokens or 1)]
        return {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": self.ignore_eos,
        }


@dataclass(frozen=True)
class StreamSpec:
    """A steady stream of short completions (the healthy control)."""

    prompt: str = "The capital of France is"
    max_tokens: int = 32
    concurrency: int = 1


@dataclass(frozen=True)
class ReproConfig:
    name: str
    expected: str
    description: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    requests: tuple[RequestSpec, ...] = ()
    stream: StreamSpec | None = None
    until: str = "idle"
    timeout_s: float = 60.0
    settle_s: float = 3.0
    shutdown_signal: str | None = None
    shutdown_after_s: float = 3.0
    path: Path | None = None

    @property
    def faults(self) -> tuple[str, ...]:
        return tuple(v for k, v in self.env.items() if k == "WEDGE_ENGINE_FAULT")


def load_config(path: Path) -> ReproConfig:
    try:
        data = tomllib.loads(path.read_text())
        server = data.get("server", {})
        workload = data.get("workload", {})
        symptom = data.get("symptom", {})
        shutdown = data.get("shutdown", {})
        return ReproConfig(
            name=data["name"],
            expected=data["expected"],
            description=data.get("description", ""),
            flags=tuple(str(f) for f in server.get("flags", ())),
            env={str(k): str(v) for k, v in server.get("env", {}).items()},
            requests=tuple(RequestSpec(**r) for r in workload.get("requests", ())),
            stream=StreamSpec(**workload["stream"]) if "stream" in workload else None,
            until=symptom.get("until", "idle"),
            timeout_s=float(symptom.get("timeout_s", 60)),
            settle_s=float(symptom.get("settle_s", 3)),
            shutdown_signal=shutdown.get("signal"),
            shutdown_after_s=float(shutdown.get("after_s", 3)),
            path=path,
        )
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as exc:
        raise ReproError(f"{path}: bad repro config: {exc}") from None


def list_configs() -> list[ReproConfig]:
    return [load_config(p) for p in sorted(REPROS_DIR.glob("*.toml"))]


def find_config(name: str) -> ReproConfig:
    path = Path(name)
    if path.suffix == ".toml" and path.exists():
        return load_config(path)
    for cfg in list_configs():
        if cfg.name == name:
            return cfg
    names = ", ".join(c.name for c in list_configs())
    raise ReproError(f"no repro named {name!r} (have: {names})", exit_code=exitcodes.USAGE)


# ------------------------------------------------------------------ workload


class Workload:
    """Client threads that send the config's requests and hold their connections open."""

    def __init__(self, base_url: str, cfg: ReproConfig, hold_s: float = 900.0) -> None:
        self.base_url = base_url
        self.cfg = cfg
        self.hold_s = hold_s
        self.results: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()
        self._sent: set[RequestSpec] = set()
        self._sockets: list[socket.socket] = []

    def _client(self) -> httpx.Client:
        c = httpx.Client(timeout=httpx.Timeout(self.hold_s, connect=5.0))
        with self._lock:
            self._clients.append(c)
        return c

    def _send(self, body: dict[str, Any]) -> None:
        t0 = time.monotonic()
        result: dict[str, Any] = {"max_tokens": body["max_tokens"]}
        try:
            r = self._client().post(f"{self.base_url}/v1/completions", json=body)
            result.update(status=r.status_code, body=r.text[:400])
            if r.status_code == 200:
                usage = r.json().get("usage", {})
                result["completion_tokens"] = usage.get("completion_tokens")
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"[:200]
        result["elapsed_s"] = round(time.monotonic() - t0, 3)
        with self._lock:
            self.results.append(result)

    def _stalled_upload(self, body: dict[str, Any]) -> None:
        """A client that announces a body and stops sending it (a stuck upload or proxy).
        uvicorn counts the request as in progress and, on shutdown, waits for it forever."""
        host, port = self.base_url.rsplit("//", 1)[1].rsplit(":", 1)
        data = json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(head + data[: len(data) // 2])
        with self._lock:
            self._sockets.append(sock)
            self.results.append({"stalled_upload": True, "sent_bytes": len(data) // 2, "of": len(data)})

    def _stream(self, spec: StreamSpec) -> None:
        body = RequestSpec(prompt=spec.prompt, max_tokens=spec.max_tokens).body()
        while not self._stop.is_set():
            self._send(body)

    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _start(self, spec: RequestSpec) -> None:
        for i in range(spec.count):
            if spec.stalled_upload:
                self._stalled_upload(spec.body(i))
            else:
                self._spawn(self._send, spec.body(i))

    def start_now(self) -> None:
        for spec in self.cfg.requests:
            if spec.after_generated == 0:
                self._start(spec)
        if self.cfg.stream is not None:
            for _ in range(self.cfg.stream.concurrency):
                self._spawn(self._stream, self.cfg.stream)

    def start_later(self, generated: float) -> bool:
        """Send the requests gated on the generation counter; True once all are sent."""
        pending = [s for s in self.cfg.requests if s.after_generated > 0]
        for spec in pending:
            if generated >= spec.after_generated and spec not in self._sent:
                self._sent.add(spec)
                self._start(spec)
        return all(s in self._sent for s in pending)

    def stop(self, join_s: float = 3.0) -> None:
        """Stop the stream and let short requests finish (an open one would hold uvicorn's shutdown)."""
        self._stop.set()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            for sock in self._sockets:
                sock.close()
            for c in self._clients:
                try:
                    c.close()
                except Exception:  # closing a client whose request is in flight may raise; it is going anyway
                    pass


# ------------------------------------------------------------------ symptom


def scrape_snapshot(client: httpx.Client, url: str) -> MetricsSnapshot | None:
    """One /metrics scrape, parsed; None when it fails."""
    try:
        r = client.get(f"{url}/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, MetricsParseError):
        return None


def symptom_reached(until: str, history: list[tuple[float, MetricsSnapshot]], settle_s: float) -> bool:
    """Whether the metric history shows the state a config waits for, held for settle_s."""
    if not history:
        return False
    t_last, m = history[-1]
    recent = [(t, s) for t, s in history if t >= t_last - settle_s]
    span_ok = history[0][0] <= t_last - settle_s
    gen = [s.generation_tokens or 0 for _, s in recent]
    frozen = span_ok and len(set(gen)) == 1
    rising = len(gen) >= 2 and gen[-1] > gen[0]
    running, waiting = m.running or 0, m.waiting or 0
    if until == "wedged":
        return frozen and waiting >= 1 and running == 0 and (m.generation_tokens or 0) > 0
    if until == "stalled":
        return frozen and running >= 1
    if until == "starved":
        return rising and (m.waiting_capacity or waiting) >= 1
    if until == "flowing":
        return rising
    if until == "idle":
        return span_ok and running == 0 and waiting == 0
    raise ReproError(f"unknown symptom {until!r}")


_scrape = scrape_snapshot  # the name wedgectl.patched imports


# ------------------------------------------------------------------ the run


@dataclass
class ReproResult:
    config: ReproConfig
    verdict: Verdict | None
    pid: int | None
    url: str | None
    bundle_path: Path | None
    log_path: Path | None
    client_results: list[dict[str, Any]]
    symptom_s: float | None
    notes: list[str]

    @property
    def matched(self) -> bool:
        return self.verdict is not None and self.verdict.verdict.value == self.config.expected


def ensure_engine_plugin(python: Path, progress: Callable[[str], None]) -> None:
    """Install engine/ (the wedge_engine plugin) into the server's environment if it is not there."""
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('wedgectl-engine'))"],
        capture_output=True, text=True, timeout=60,
    )
    want = _engine_version()
    marker = _engine_marker(python)
    source = _engine_source_hash()
    installed = marker.read_text().strip() if marker.exists() else ""
    if (probe.returncode == 0 and probe.stdout.strip() == want and installed == source
            and not os.environ.get("WEDGECTL_REINSTALL_ENGINE")):
        return
    if not (ENGINE_DIR / "pyproject.toml").exists():
        raise ReproError(f"the engine plugin source is not at {ENGINE_DIR}; install wedgectl-engine into {python}'s env")
    progress(f"installing the engine plugin into {python}")
    with tempfile.TemporaryDirectory(prefix="wedge-engine-") as tmp:
        # Build from a copy: pip leaves build/ and egg-info behind in the folder it builds.
        src = Path(tmp) / "engine"
        shutil.copytree(ENGINE_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        r = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(src)],
            capture_output=True, text=True, timeout=300,
        )
    if r.returncode != 0:
        raise ReproError(f"pip could not install the engine plugin: {r.stderr.strip().splitlines()[-1:]}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(source + "\n")


def _engine_source_hash() -> str:
    """A digest of engine/'s sources: a change reinstalls the plugin even at the same version."""
    h = hashlib.sha256()
    for path in sorted(ENGINE_DIR.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".toml") and "build" not in path.parts:
            h.update(str(path.relative_to(ENGINE_DIR)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _engine_marker(python: Path) -> Path:
    """Where we note which engine/ sources were installed into that interpreter's environment."""
    from wedgectl.runtime.install import cache_dir

    key = hashlib.sha256(str(Path(python).absolute()).encode()).hexdigest()[:16]
    return cache_dir() / "engine-installed" / f"{key}.txt"


def _engine_version() -> str:
    try:
        data = tomllib.loads((ENGINE_DIR / "pyproject.toml").read_text())
        return str(data["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return ""


def run_repro(
    cfg: ReproConfig,
    python: str | None = None,
    out_dir: Path | None = None,
    keep: bool = False,
    patched: bool = False,
    window_s: float = 6.0,
    progress: Callable[[str], None] = lambda _m: None,
) -> ReproResult:
    """Start the server, drive the workload, wait for the symptom, diagnose, tear down."""
    from wedgectl.runtime.install import runtime_python
    from wedgectl.runtime.launcher import ServerSpec, free_port, start_server, stop_server
    from wedgectl.runtime.tinymodel import ensure_tiny_model
    from wedgectl.sampler import SamplerOptions, capture

    py = runtime_python(python)
    ensure_engine_plugin(py, progress)
    model = ensure_tiny_model(py)
    out_dir = out_dir or Path.cwd() / "wedgectl-repro" / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "server.log"
    if log_path.exists():
        log_path.unlink()
    env = dict(cfg.env)
    if patched:
        env["WEDGE_ENGINE_FIXES"] = "all"
    spec = ServerSpec(model=model, port=free_port(), extra_args=cfg.flags, env=env)
    progress(f"starting vLLM ({' '.join(cfg.flags) or 'default flags'}; {', '.join(f'{k}={v}' for k, v in env.items()) or 'no fault'})")
    t0 = time.monotonic()
    server = start_server(spec, py, log_path)
    progress(f"server pid {server.pid} healthy at {server.url} after {time.monotonic() - t0:.0f} s")
    notes: list[str] = []
    workload = Workload(server.url, cfg)
    holder: subprocess.Popen | None = None
    verdict: Verdict | None = None
    bundle_path: Path | None = None
    symptom_s: float | None = None
    try:
        if keep:
            # The clients must outlive wedgectl, or vLLM aborts their requests and the hang is gone.
            holder = subprocess.Popen(
                [sys.executable, "-m", "wedgectl._hold", server.url, str(server.pid), str(cfg.path), str(out_dir / "client.json")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        else:
            workload.start_now()
        history: list[tuple[float, MetricsSnapshot]] = []
        start = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() - start < cfg.timeout_s:
                snap = scrape_snapshot(client, server.url)
                if snap is not None:
                    history.append((time.monotonic(), snap))
                    all_sent = keep or workload.start_later(snap.generation_tokens or 0)
                    if symptom_reached(cfg.until, history, cfg.settle_s) and all_sent:
                        symptom_s = time.monotonic() - start
                        break
                time.sleep(0.5)
        if symptom_s is None:
            notes.append(f"symptom {cfg.until!r} not seen within {cfg.timeout_s:.0f} s; diagnosing anyway")
            progress(notes[-1])
        else:
            progress(f"symptom {cfg.until!r} established after {symptom_s:.1f} s")
        if cfg.shutdown_signal:
            sig = getattr(signal, cfg.shutdown_signal)
            progress(f"sending {cfg.shutdown_signal} to the API server pid {server.pid}")
            os.kill(server.pid, sig)
            time.sleep(cfg.shutdown_after_s)
        progress("diagnosing")
        bundle = capture(pid=server.pid, log_path=str(log_path), options=SamplerOptions(window_s=window_s, progress=progress))
        verdict = classify(bundle)
        bundle = replace(bundle, verdict=verdict)
        bundle_path = write_bundle(bundle, out_dir / "bundle.tar.gz")
        if not keep:
            (out_dir / "client.json").write_text(json.dumps(workload.results, indent=2))
    finally:
        if keep:
            from wedgectl.runtime import launcher

            launcher.detach(server)
            progress(f"--keep: server left running, pid {server.pid}, {server.url}; its clients: pid "
                     f"{holder.pid if holder else '?'} (they hold the requests open for up to 1 h)")
        else:
            workload.stop()
            elapsed = stop_server(server, grace=5)
            notes.append(f"teardown took {elapsed:.1f} s")
    results = list(workload.results)
    if keep and (out_dir / "client.json").exists():
        try:
            results = json.loads((out_dir / "client.json").read_text())
        except (OSError, ValueError):
            pass
    return ReproResult(cfg, verdict, server.pid, server.url, bundle_path, log_path, results, symptom_s, notes)


def repro_main_text(result: ReproResult) -> list[str]:
    from wedgectl.render import render_verdict

    lines = [f"repro {result.config.name}: {result.config.description}"]
    if result.verdict is not None:
        lines += list(render_verdict(result.verdict, expected=result.config.expected))
    lines.append(f"bundle: {result.bundle_path}")
    lines.append(f"server log: {result.log_path}")
    lines += [f"note: {n}" for n in result.notes]
    return lines


def progress_to_stderr(msg: str) -> None:
    print(f"wedgectl: {msg}", file=sys.stderr, flush=True)
