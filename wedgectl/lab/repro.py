"""Reproducing each hang class on a real vLLM server, from the configs in wedgectl/lab/repros/."""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from wedgectl.model import exitcodes
from wedgectl.store.bundle import write_bundle
from wedgectl.classify import classify
from wedgectl.model.errors import WedgectlError
from wedgectl.lab.lifecycle import (Server, detach, health_client, health_status, launch, signal_server, start_detached,
                                    stop_server)
from wedgectl.collect.control import Signal, free_port, stop_tree
from wedgectl.read.metrics import MetricsParseError, MetricsSnapshot, parse_metrics
from wedgectl.lab import kept
from wedgectl.lab.engine_install import FIXES_ENV, REPORT_ENV, ensure_engine_plugin
from wedgectl.model.types import Role, Verdict

REPROS_DIR = Path(__file__).with_name("repros")
HOLDER_STOP_S = 5.0  # the clients' process writes its results and exits on SIGTERM
# How long a kept repro (--keep) stays hung: its clients hold their requests open this long, and vLLM's own
# step timeout (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s in 0.32) is raised to it, or it would end an
# engine deadlock after five minutes.
KEEP_S = 3600
STREAM_BACKOFF_S = 0.5  # a stream's pause after an error or a refusal


class ReproError(WedgectlError):
    exit_code = exitcodes.REPRO_FAILED


class ReproNotApplicable(WedgectlError):
    """The release has not the code the repro's hang lives in (its `[requires]`); no server was started."""

    exit_code = exitcodes.REPRO_NOT_APPLICABLE


@dataclass(frozen=True)
class Requires:
    """A repro's precondition on the vLLM source: `source` (relative to site-packages) holds `contains`."""

    source: str
    contains: str
    why: str  # what a release without it does instead


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
    disconnect_after_s: float = 0.0  # > 0: the client gives up after this long and closes its connection

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
    log_marker: str | None = None  # until "starting": a line the log must hold before its quiet counts
    # The start-up bound its diagnosis is judged with (diagnose --startup-quiet); None: the default
    startup_quiet_s: float | None = None
    shutdown_signal: str | None = None
    shutdown_after_s: float = 3.0
    path: Path | None = None
    # The clients run in a process of their own (wedgectl.lab._hold), as real clients do: wedgectl
    # leaves its own sockets out of a server's client-connection count, so in-process clients would
    # read as requests with no client behind them (leaked_capacity).
    separate_clients: bool = True
    # `repro --patched`: why the patched engine has no fix for this hang (its run then checks only
    # that SIGTERM still ends the server and every client is answered); None: it has one.
    patched_no_fix: str | None = None
    health_timeout_s: float = 180.0  # compiled mode (torch.compile warm-up) on a loaded host needs more
    requires: Requires | None = None

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
            log_marker=symptom.get("log_marker"),
            startup_quiet_s=float(symptom["startup_quiet_s"]) if "startup_quiet_s" in symptom else None,
            shutdown_signal=shutdown.get("signal"),
            shutdown_after_s=float(shutdown.get("after_s", 3)),
            path=path,
            separate_clients=bool(workload.get("separate_process", True)),
            health_timeout_s=float(server.get("health_timeout_s", 180)),
            patched_no_fix=data.get("patched", {}).get("no_fix"),
            requires=Requires(**data["requires"]) if "requires" in data else None,
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

    def _client(self, hold_s: float | None = None) -> httpx.Client:
        # trust_env=False: the server is local; a proxy from the environment must not carry these.
        c = httpx.Client(timeout=httpx.Timeout(hold_s or self.hold_s, connect=5.0), trust_env=False)
        with self._lock:
            self._clients.append(c)
        return c

    def _send(self, body: dict[str, Any], give_up_s: float = 0.0, client: httpx.Client | None = None) -> dict[str, Any]:
        t0 = time.monotonic()
        result: dict[str, Any] = {"max_tokens": body["max_tokens"]}
        client = client or self._client(give_up_s or None)
        try:
            r = client.post(f"{self.base_url}/v1/completions", json=body)
            result.update(status=r.status_code, body=r.text[:400])
            if r.status_code == 200:
                usage = r.json().get("usage", {})
                result["completion_tokens"] = usage.get("completion_tokens")
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"[:200]
        if give_up_s:
            result["gave_up"] = True  # a client that leaves by design: no answer is owed to it
            client.close()  # the client is gone: its connection closes, vLLM sees the disconnect
        result["elapsed_s"] = round(time.monotonic() - t0, 3)
        with self._lock:
            self.results.append(result)
        return result

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
        # One client per stream, its connection reused: a client per request, kept until stop (as
        # a held request's must be), would leave every finished request's socket open, thousands
        # an hour in a kept repro, until the holder runs out of file descriptors.
        client = self._client()
        while not self._stop.is_set():
            if self._send(body, client=client).get("status") != 200:
                self._stop.wait(STREAM_BACKOFF_S)  # a refusing server is not hammered in a loop

    def _spawn(self, fn: Callable[..., object], *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _start(self, spec: RequestSpec) -> None:
        for i in range(spec.count):
            if spec.stalled_upload:
                self._stalled_upload(spec.body(i))
            else:
                self._spawn(self._send, spec.body(i), spec.disconnect_after_s)

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

    def drain(self, join_s: float) -> None:
        """Stop the stream and wait (bounded) for the requests in flight; connections stay open."""
        self._stop.set()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def wait_results(self, n: int, timeout_s: float) -> None:
        """Wait (bounded) until n requests have their outcome recorded."""
        deadline = time.monotonic() + timeout_s
        while len(self.results) < n and time.monotonic() < deadline:
            time.sleep(0.05)

    def uploads_closed(self) -> bool | None:
        """Whether the server closed each half-sent upload's socket (EOF or reset); None when there was none."""
        with self._lock:
            socks = list(self._sockets)
        if not socks:
            return None
        for sock in socks:
            try:
                sock.settimeout(1.0)
                while sock.recv(4096):
                    pass  # a response body, then EOF
            except (TimeoutError, socket.timeout):
                return False
            except OSError:
                continue  # reset: closed
        return True

    def stop(self, join_s: float = 3.0) -> None:
        """Stop the stream and let short requests finish (an open one would hold uvicorn's shutdown)."""
        self.drain(join_s)
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


def startup_stalled(client: httpx.Client, server: Server, log_path: Path, marker: str | None) -> bool:
    """A server stuck starting: alive, /health not 200, its log holding `marker` (ReproError if it
    exited or became healthy: then there is no start-up hang to diagnose)."""
    if server.popen.poll() is not None:
        raise ReproError(f"the server exited during start-up (log {log_path})")
    if health_status(client, server.url) == 200:
        raise ReproError("the server became healthy: no start-up hang")
    try:
        return marker is None or marker in log_path.read_text(errors="replace")
    except OSError:
        return False


def surviving_pid(server: Server, tree: tuple[int, ...]) -> int | None:
    """Once the API server died, a pid of what outlived it: a Worker if one lives (diagnose must
    find the whole orphaned deployment from any of its pids), else an EngineCore; None if it lives."""
    if server.popen.poll() is None:
        return None
    from wedgectl.capture.discover import tree_roles

    found: dict[int, Role] = {}
    for pid in tree[1:]:
        found.update(tree_roles(pid))
    for role in (Role.WORKER, Role.ENGINE_CORE):
        survivor = next((p for p, r in found.items() if r is role), None)
        if survivor is not None:
            return survivor
    return None


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
    stop_with: str | None = None  # for a kept repro: the command that ends it

    @property
    def matched(self) -> bool:
        return self.verdict is not None and self.verdict.verdict.value == self.config.expected


MAX_SOURCE_BYTES = 4 << 20


def not_applicable(cfg: ReproConfig, python: str | Path) -> str | None:
    """Why the repro cannot show its hang on `python`'s vLLM (its source lacks what `[requires]` names), or None:
    it can, or the source cannot be found to tell (then it runs, and its verdict says what happened)."""
    from wedgectl.lab.runtime.traits import find_vllm_dir, read_source, version_of

    req = cfg.requires
    if req is None:
        return None
    vllm_dir = find_vllm_dir(python)
    if vllm_dir is None:
        return None
    path = vllm_dir.parent / req.source
    text = read_source(path, MAX_SOURCE_BYTES)
    if text is None and path.parent.is_dir() and not path.exists():
        text = ""  # the module is gone: what it held is too
    if text is None or req.contains in text:
        return None
    return f"vLLM {version_of(vllm_dir) or '(unknown release)'}: {req.why}"


def start_repro_server(
    cfg: ReproConfig,
    env: dict[str, str],
    python: str | None,
    out_dir: Path,
    progress: Callable[[str], None],
    label: str = "vLLM",
) -> tuple[Server, Path]:
    """Install the plugin, then start the config's server with `env`, logging to out_dir/server.log."""
    from wedgectl.lab.runtime import ServerSpec, ensure_tiny_model, runtime_python, start_server

    py = runtime_python(python)
    why = not_applicable(cfg, py)
    if why is not None:
        raise ReproNotApplicable(f"{cfg.name} does not apply to {why}")
    ensure_engine_plugin(py, progress)
    model = ensure_tiny_model(py)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "server.log"
    log_path.unlink(missing_ok=True)
    spec = ServerSpec(model=model, port=free_port(), extra_args=cfg.flags, env=env)
    described = ", ".join(f"{k}={v}" for k, v in env.items()) or "no fault"
    progress(f"starting {label} ({' '.join(cfg.flags) or 'default flags'}; {described})")
    t0 = time.monotonic()
    if cfg.until == "starting":  # a server that never becomes healthy: do not wait for /health
        from wedgectl.lab.runtime.launcher import server_command

        server = launch(server_command(spec, py, log_path))
        progress(f"server pid {server.pid} launched; not waiting for /health")
        return server, log_path
    server = start_server(spec, py, log_path, health_timeout=cfg.health_timeout_s, progress=progress)
    progress(f"server pid {server.pid} healthy at {server.url} after {time.monotonic() - t0:.0f} s")
    return server, log_path


def repro_env(cfg: ReproConfig, patched: bool = False, keep: bool = False) -> dict[str, str]:
    """The server's environment beyond the launcher's defaults: the engine's own report (on in every repro,
    stock ones too, so that a kept repro can be diagnosed without ptrace; the fault still applies), the
    config's (its fault), the fixes when patched, and for a kept repro vLLM's step timeout raised to KEEP_S
    (a config's own setting wins)."""
    env = {**REPORT_ENV, **cfg.env, **(FIXES_ENV if patched else {})}
    if keep:
        env = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(KEEP_S), **env}
    return env


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
    from wedgectl.capture.options import SamplerOptions
    from wedgectl.capture.window import capture

    env = repro_env(cfg, patched, keep)
    out_dir = out_dir or Path.cwd() / "wedgectl-repro" / cfg.name
    server, log_path = start_repro_server(cfg, env, python, out_dir, progress)
    notes: list[str] = []
    workload = Workload(server.url, cfg)
    holder = None
    verdict: Verdict | None = None
    bundle_path: Path | None = None
    symptom_s: float | None = None
    stop_with: str | None = None
    try:
        if keep or cfg.separate_clients:
            # The clients must outlive wedgectl, or vLLM aborts their requests and the hang is gone.
            holder = start_detached([sys.executable, "-P", "-m", "wedgectl.lab._hold", server.url, str(server.pid),
                                     str(cfg.path), str(out_dir / "client.json"), str(KEEP_S)])
        else:
            workload.start_now()
        history: list[tuple[float, MetricsSnapshot]] = []
        marked: float | None = None
        start = time.monotonic()
        with health_client() as client:
            while time.monotonic() - start < cfg.timeout_s:
                if cfg.until == "starting":  # settle_s counts from the marker's first sight
                    if startup_stalled(client, server, log_path, cfg.log_marker):
                        marked = marked or time.monotonic()
                        if time.monotonic() - marked >= cfg.settle_s:
                            symptom_s = time.monotonic() - start
                            break
                    time.sleep(0.5)
                    continue
                snap = scrape_snapshot(client, server.url)
                if snap is not None:
                    history.append((time.monotonic(), snap))
                    all_sent = holder is not None or workload.start_later(snap.generation_tokens or 0)
                    if symptom_reached(cfg.until, history, cfg.settle_s) and all_sent:
                        symptom_s = time.monotonic() - start
                        break
                time.sleep(0.5)
        if symptom_s is None:
            notes.append(f"symptom {cfg.until!r} not seen within {cfg.timeout_s:.0f} s; diagnosing anyway")
            progress(notes[-1])
        else:
            progress(f"symptom {cfg.until!r} established after {symptom_s:.1f} s")
        target = server.pid
        if cfg.shutdown_signal:
            sig = Signal.named(cfg.shutdown_signal)
            tree = server.tree_pids()
            progress(f"sending {cfg.shutdown_signal} to the API server pid {server.pid}")
            signal_server(server, sig)
            time.sleep(cfg.shutdown_after_s)
            target = surviving_pid(server, tree) or server.pid
        progress("diagnosing" + (f" from surviving pid {target}" if target != server.pid else ""))
        bundle = capture(pid=target, log_path=str(log_path),
                         options=SamplerOptions(window_s=window_s, progress=progress,
                                                startup_quiet_s=cfg.startup_quiet_s))
        verdict = classify(bundle)
        bundle = replace(bundle, verdict=verdict)
        bundle_path = write_bundle(bundle, out_dir / "bundle.tar.gz", replace_own=True)  # a rerun's is ours
        if holder is None:
            (out_dir / "client.json").write_text(json.dumps(workload.results, indent=2))
    finally:
        if keep:
            detach(server)
            stop_with = f"wedgectl repro --stop {cfg.name}"
            try:
                kept.record(kept.new_record(cfg.name, server.pid, server.url, holder.pid if holder else None,
                                            out_dir, KEEP_S))
            except (OSError, WedgectlError) as exc:
                stop_with = f"kill -TERM -- -{server.pid}"  # its own session: the group is the whole server
                notes.append(f"not recorded for --stop ({exc}); stop it with: {stop_with}")
            progress(f"--keep: server left running, pid {server.pid}, {server.url}; its clients: pid "
                     f"{holder.pid if holder else '?'} (they hold the requests open for {KEEP_S // 60} min); "
                     f"stop it with: {stop_with}")
        else:
            # The clients first: what they record from here on is a server going away.
            if holder is not None:
                stop_tree(holder.pid, grace=HOLDER_STOP_S, popen=holder)
            else:
                workload.stop()
            elapsed = stop_server(server, grace=5)
            notes.append(f"teardown took {elapsed:.1f} s")
    results = list(workload.results)
    if holder is not None and (out_dir / "client.json").exists():
        try:
            results = json.loads((out_dir / "client.json").read_text())
        except (OSError, ValueError):
            pass
    return ReproResult(cfg, verdict, server.pid, server.url, bundle_path, log_path, results, symptom_s, notes,
                       stop_with)
