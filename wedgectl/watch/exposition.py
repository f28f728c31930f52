"""What `watch` serves: Prometheus metrics (a prometheus_client Collector), /livez, /readyz and /v1/targets.

/readyz takes a hung replica out of rotation: 503 as soon as a target is in a hang class (no grace),
200 otherwise; /livez fails only once the hang has outlasted --grace, for a restart. Both take
`?target=NAME` (the `target` label) to answer for one target.

Who may read it. /v1/targets carries what took ptrace rights to collect (stacks, paths, pids of other
users' servers): it is served on a loopback address, or behind a web config that authenticates
(--web-config-file, the Prometheus exporter-toolkit's format that node_exporter reads: TLS and
bcrypt basic auth). Elsewhere it answers 403, and `watch` says so at start. With basic_auth_users,
every path asks for them, as the exporter-toolkit does.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import socket
import ssl
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from wedgectl import __version__
from wedgectl.read.redact import printable
from wedgectl.model.types import VerdictKind
from wedgectl.watch.state import HANG_CLASSES, TargetLabels, TargetView

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

    @property
    def unready(self) -> tuple[TargetView, ...]:
        """The targets in a hang class now, however briefly: out of rotation at once (/readyz)."""
        return tuple(v for v in self.targets if v.hang_since is not None)

    def only(self, name: str) -> Snapshot | None:
        """This snapshot narrowed to the target named `name` (its `target` label); None if there is none."""
        views = tuple(v for v in self.targets if v.name == name)
        return Snapshot(self.t, self.grace_s, views, self.failures) if views else None

    def targets_json(self) -> dict:
        return {"time": self.t, "grace_s": self.grace_s,
                "targets": [v.to_json(self.t, self.grace_s) for v in self.targets]}


# The runbooks the alert rules link to (deploy/prometheus/wedgectl-rules.yaml): the docs/ pages of the wedgectl
# that answers, carried in its wheel as wedgectl._docs. Only these names are served, from the package, never
# from a path the request names.
RUNBOOK_NAME = re.compile(r"(?:hang-[a-z0-9-]{1,40}|runbook-watch)\.md")
RUNBOOK_MAX_BYTES = 1 << 20


def runbook(name: str) -> bytes | None:
    """The runbook page `name` (hang-*.md, runbook-watch.md), or None for any other name."""
    if RUNBOOK_NAME.fullmatch(name) is None:
        return None
    from importlib import resources

    try:
        page = resources.files("wedgectl._docs").joinpath(name)
        if not page.is_file():
            return None
        with page.open("rb") as f:
            return f.read(RUNBOOK_MAX_BYTES)
    except (OSError, ModuleNotFoundError):
        return None


class WatchCollector(Collector):
    """The watcher's state as Prometheus metric families, built afresh at each scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        # Every per-target series carries `target` (NODE:PORT/MODEL, as alerts name it) and its parts as
        # labels of their own (TargetLabels: node, port, model_name, and pid where there is no port), so that
        # they join with vLLM's own series on model_name.
        ids = ["target", *TargetLabels.NAMES]
        verdict = GaugeMetricFamily("wedgectl_verdict", "The target's current verdict: 1 for it, 0 for every other.",
                                    labels=[*ids, "verdict"])
        confidence = GaugeMetricFamily("wedgectl_verdict_confidence", "Confidence of the current verdict (0..1).",
                                       labels=ids)
        state = GaugeMetricFamily("wedgectl_state_seconds", "Seconds the current verdict has held, from when the "
                                  "evidence dates it (a hang found already under way counts from its onset).",
                                  labels=ids)
        up = GaugeMetricFamily("wedgectl_target_up", "1 if the target's last look read it (/metrics answered 200, "
                               "or its processes where it has no URL), else 0.", labels=ids)
        episodes = CounterMetricFamily("wedgectl_episodes", "Hang episodes begun, by the hang class they began as.",
                                       labels=[*ids, "verdict"])
        last = GaugeMetricFamily("wedgectl_last_evaluation_timestamp_seconds",
                                 "Unix time of the target's last evaluation.", labels=ids)
        stale = GaugeMetricFamily("wedgectl_target_stale", "1 while the target's last tick was skipped (its evaluation "
                                  "before still ran, or no worker was free): its verdict is old.", labels=ids)
        kept = GaugeMetricFamily("wedgectl_kept_sample_bytes", "Bytes the target's kept samples take (estimated).",
                                 labels=ids)
        budget = CounterMetricFamily("wedgectl_budget_exceeded", "Times the target's kept samples went over its "
                                     "byte budget (--target-budget-mb, --total-budget-mb) and were trimmed.",
                                     labels=ids)
        acts = CounterMetricFamily("wedgectl_remediations", "Acts of watch --remediate on the target, by the hang "
                                   "class, the act (lab.remedy's name) and what it came to (gone, not_gone, no_path, "
                                   "error).", labels=[*ids, "verdict", "action", "result"])
        storm = GaugeMetricFamily("wedgectl_remediation_storm", "1 once watch --remediate stopped acting on the "
                                  "target: the same hang came back soon after an act ended it.", labels=ids)
        for v in snap.targets:
            me = [v.name, *(v.labels or TargetLabels(node=v.name)).values()]
            up.add_metric(me, 1.0 if v.up else 0.0)
            storm.add_metric(me, 1.0 if v.remediation_storm else 0.0)
            counts = Counter((a.verdict.value, a.action, a.result) for a in v.remediations)
            for (kind_name, action, result), n in sorted(counts.items()):
                acts.add_metric([*me, kind_name, action, result], float(n))
            stale.add_metric(me, 1.0 if v.stale else 0.0)
            kept.add_metric(me, float(v.kept_bytes))
            budget.add_metric(me, float(v.budget_exceeded))
            if v.verdict is None:
                continue
            for kind in VerdictKind:
                verdict.add_metric([*me, kind.value], 1.0 if kind is v.verdict.verdict else 0.0)
            confidence.add_metric(me, v.verdict.confidence)
            state.add_metric(me, v.state_seconds(snap.t))
            if v.last_evaluation is not None:
                last.add_metric(me, v.last_evaluation)
            for kind in HANG_CLASSES:
                episodes.add_metric([*me, kind.value], float(v.episodes_total.get(kind, 0)))
        failures = CounterMetricFamily("wedgectl_collector_failures", "Reads a collector could not make, by why.",
                                       labels=["collector", "kind"])
        for (collector, why), n in sorted(snap.failures.items()):
            failures.add_metric([collector, why], float(n))
        build = InfoMetricFamily("wedgectl_build", "The wedgectl that answers.", value={"version": __version__})
        targets = GaugeMetricFamily("wedgectl_targets", "Deployments under watch.", value=len(snap.targets))
        yield from (verdict, confidence, state, up, episodes, last, failures, build, targets, stale, kept, budget,
                    acts, storm)


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


def is_loopback(host: str) -> bool:
    """Whether a bound address is a loopback one (127.0.0.0/8, ::1, ::ffff:127.x); 0.0.0.0 and :: are not."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


# --- --web-config-file ----------------------------------------------------------------------------

WEB_CONFIG_MAX_BYTES = 64 << 10
_BCRYPT = re.compile(r"\$2[abxy]?\$\d\d\$[./A-Za-z0-9]{53}")
_TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
                 "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version"}


class WebConfigError(ValueError):
    """A --web-config-file that cannot be used as written; the message is one line."""


class BasicAuth:
    """basic_auth_users: user -> bcrypt hash. A pair that passed once is remembered (by a SHA-256 of it),
    so a scrape every few seconds costs no bcrypt; the bcrypt checks run one at a time, so a flood of
    wrong passwords takes one core at most; an unknown user costs a bcrypt too (no timing tells users apart)."""

    def __init__(self, users: Mapping[str, str]) -> None:
        self.users = {u: h.encode() for u, h in users.items()}
        self._decoy = next(iter(self.users.values()))
        self._passed: set[bytes] = set()
        self._lock = threading.Lock()

    def check(self, user: str, password: str) -> bool:
        import bcrypt

        key = hashlib.sha256(b"\0".join((user.encode(), password.encode(), self.users.get(user, b"")))).digest()
        if key in self._passed:
            return True
        with self._lock:
            try:
                ok = bcrypt.checkpw(password.encode(), self.users.get(user, self._decoy)) and user in self.users
            except ValueError:  # over bcrypt's 72 bytes: no hash takes it
                ok = False
            if ok:
                if len(self._passed) >= 64:
                    self._passed.clear()
                self._passed.add(key)
        return ok


@dataclass(frozen=True)
class WebConfig:
    """What a --web-config-file says, ready to serve with: a TLS context, the basic-auth users."""

    path: str
    tls: ssl.SSLContext | None = None
    auth: BasicAuth | None = None
    client_certs: bool = False  # client_auth_type RequireAndVerifyClientCert: only holders of a CA-signed cert

    @property
    def authenticates(self) -> bool:
        """Whether a reader must prove who it is (a password or a client certificate)."""
        return self.auth is not None or self.client_certs


def _owned_file(path: Path, what: str, max_bytes: int | None = None) -> bytes | None:
    """A regular file only its owner (root or this user) can change; its bytes when max_bytes is given."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise WebConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WebConfigError(f"{what} {path}: not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise WebConfigError(f"{what} {path}: another user can change it (owner uid {st.st_uid}, "
                                 f"mode {stat.S_IMODE(st.st_mode):o}); make it the owner's alone")
        if max_bytes is None:
            return None
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise WebConfigError(f"{what} {path}: larger than {max_bytes >> 10} KiB")
    return data


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read a web config in the Prometheus exporter-toolkit's format (node_exporter's --web.config.file):

        tls_server_config: {cert_file: F, key_file: F, client_ca_file: F, client_auth_type: T,
                            min_version: TLS12, max_version: TLS13}
        basic_auth_users: {USER: BCRYPT_HASH, ...}

    Relative file names are taken from the config's own directory, as the exporter-toolkit does. The
    file, and the files it names, must be changeable by their owner (root or this user) alone: whoever
    could edit it could let themselves in. Anything else in it is refused, not ignored. Raises
    WebConfigError."""
    import yaml

    file = Path(path)
    raw = _owned_file(file, "web config", WEB_CONFIG_MAX_BYTES)
    try:
        doc = yaml.safe_load(raw or b"")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise WebConfigError(f"web config {file}: not YAML{where}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise WebConfigError(f"web config {file}: expected a mapping at the top")
    unknown = sorted(map(str, set(doc) - {"tls_server_config", "basic_auth_users"}))
    if unknown:
        raise WebConfigError(f"web config {file}: {', '.join(unknown)} not supported "
                             "(wedgectl reads tls_server_config and basic_auth_users)")
    tls, client_certs = _tls_context(file, doc.get("tls_server_config"))
    users = doc.get("basic_auth_users")
    if users is not None:
        if not isinstance(users, dict) or not users:
            raise WebConfigError(f"web config {file}: basic_auth_users must map each user to a bcrypt hash")
        for user, hashed in users.items():
            if not isinstance(user, str) or not user or ":" in user:
                raise WebConfigError(f"web config {file}: basic_auth_users: {printable(str(user))!r} "
                                     "is not a user name")
            if not isinstance(hashed, str) or not _BCRYPT.fullmatch(hashed):
                raise WebConfigError(f"web config {file}: basic_auth_users: {printable(user)}: not a bcrypt hash "
                                     "(make one with `htpasswd -nBC 10 USER`)")
    return WebConfig(str(file), tls, BasicAuth(users) if users else None, client_certs)


def _tls_context(file: Path, tls: object) -> tuple[ssl.SSLContext | None, bool]:
    if tls is None:
        return None, False
    if not isinstance(tls, dict):
        raise WebConfigError(f"web config {file}: tls_server_config must be a mapping")
    unknown = sorted(map(str, set(tls) - _TLS_KEYS))
    if unknown:
        raise WebConfigError(f"web config {file}: tls_server_config: {', '.join(unknown)} not supported "
                             f"(wedgectl reads {', '.join(sorted(_TLS_KEYS))})")

    def named(key: str) -> Path | None:
        value = tls.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise WebConfigError(f"web config {file}: tls_server_config: {key} must be a file name")
        where = file.parent / value
        _owned_file(where, key)
        return where

    cert, key, ca = named("cert_file"), named("key_file"), named("client_ca_file")
    if cert is None or key is None:
        raise WebConfigError(f"web config {file}: tls_server_config needs cert_file and key_file")
    auth_type = tls.get("client_auth_type") or ("RequireAndVerifyClientCert" if ca else "NoClientCert")
    if auth_type not in _CLIENT_AUTH:
        raise WebConfigError(f"web config {file}: client_auth_type {printable(str(auth_type))!r} not supported "
                             f"(one of {', '.join(_CLIENT_AUTH)})")
    if _CLIENT_AUTH[auth_type] != ssl.CERT_NONE and ca is None:
        raise WebConfigError(f"web config {file}: client_auth_type {auth_type} needs client_ca_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        for bound, attr in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
            version = tls.get(bound, "TLS12" if bound == "min_version" else None)
            if version is not None:
                if version not in _TLS_VERSIONS:
                    raise WebConfigError(f"web config {file}: {bound} {printable(str(version))!r}: "
                                         f"one of {', '.join(_TLS_VERSIONS)}")
                setattr(ctx, attr, _TLS_VERSIONS[version])
        ctx.load_cert_chain(cert, key)
        if ca is not None:
            ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise WebConfigError(f"web config {file}: TLS: {printable(str(exc))}") from None
    ctx.verify_mode = _CLIENT_AUTH[auth_type]
    return ctx, auth_type == "RequireAndVerifyClientCert"


# --- the server -----------------------------------------------------------------------------------

HANDSHAKE_TIMEOUT_S = 10.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 16

    def __init__(self, address: tuple[str, int], snapshot: Callable[[], Snapshot], web: WebConfig | None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.snapshot = snapshot
        self.registry = make_registry(snapshot)
        self.web = web
        super().__init__(address, _Handler)
        self.loopback = is_loopback(str(self.server_address[0]))
        # the bound address decides, not the peer's: a proxy on loopback would make every peer look local
        self.targets_served = self.loopback or (web is not None and web.authenticates)

    def finish_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        """TLS: the handshake runs in the connection's own thread, bounded, never in the accepting one
        (a client that stalls it would stop every other)."""
        if self.web is None or self.web.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn = self.web.tls.wrap_socket(request, server_side=True)
        except (OSError, ValueError):
            return  # no TLS, a bad certificate, a stall: the connection just ends
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a client that sends nothing does not hold a thread for ever

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if not self._authorized():
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="wedgectl"')
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"unauthorized\n")
            return
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))
        elif path in ("/livez", "/readyz"):
            snap = self._snapshot_for(self.path)
            if snap is None:
                return
            live = path == "/livez"
            bad = snap.failing if live else snap.unready
            if bad:
                grace = f" (grace {snap.grace_s:.0f}s)" if live else ""
                body = "".join(f"{printable(v.name)}: {v.verdict.verdict.value if v.verdict else '?'} for "
                               f"{snap.t - (v.hang_since or snap.t):.0f}s{grace}\n" for v in bad)
                self._send(503, "text/plain; charset=utf-8", body.encode())
            else:
                self._send(200, "text/plain; charset=utf-8", b"ok\n")
        elif path == "/v1/targets" and not self.server.targets_served:
            self._send(403, "text/plain; charset=utf-8", TARGETS_REFUSED.encode())
        elif path == "/v1/targets":
            self._send(200, "application/json", json.dumps(self.server.snapshot().targets_json(), default=str).encode())
        elif path.startswith("/runbooks/"):
            text = runbook(path.removeprefix("/runbooks/"))
            if text is None:
                self._send(404, "text/plain; charset=utf-8", b"no such runbook\n")
            else:
                self._send(200, "text/markdown; charset=utf-8", text)
        elif path == "/":
            paths = "/metrics /livez /readyz /v1/targets" if self.server.targets_served else "/metrics /livez /readyz"
            paths += " /runbooks/"
            self._send(200, "text/plain; charset=utf-8", f"wedgectl watch: {paths}\n".encode())
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _snapshot_for(self, raw_path: str) -> Snapshot | None:
        """The snapshot, narrowed to `?target=NAME` when the request names one; None once an error is sent."""
        snap = self.server.snapshot()
        query = raw_path.partition("?")[2]
        if not query:
            return snap
        try:
            params = parse_qs(query, max_num_fields=MAX_QUERY_FIELDS, strict_parsing=True)
        except ValueError:
            self._send(400, "text/plain; charset=utf-8", b"bad query: only ?target=NAME is read\n")
            return None
        if set(params) - {"target"} or len(params.get("target", ())) != 1:
            self._send(400, "text/plain; charset=utf-8", b"bad query: only ?target=NAME is read\n")
            return None
        name = params["target"][0]
        one = snap.only(name)
        if one is None:
            self._send(404, "text/plain; charset=utf-8", f"no such target: {printable(name)[:200]}\n".encode())
        return one

    def _authorized(self) -> bool:
        auth = self.server.web.auth if self.server.web is not None else None
        if auth is None:
            return True
        scheme, _, credentials = (self.headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):  # binascii.Error is a ValueError
            return False
        return bool(sep) and auth.check(user, password)

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass  # a scrape every few seconds is not news


MAX_QUERY_FIELDS = 4
TARGETS_REFUSED = ("/v1/targets is served only on a loopback address, or behind a --web-config-file "
                   "that authenticates (basic_auth_users or client certificates)\n")


class Endpoint:
    """The HTTP server on --listen, in a daemon thread; close() stops it."""

    def __init__(self, listen: str, snapshot: Callable[[], Snapshot], web: WebConfig | None = None) -> None:
        self.server = _Server(parse_listen(listen), snapshot, web)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="wedgectl-watch-http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"[{host!s}]:{port}" if ":" in str(host) else f"{host!s}:{port}"

    @property
    def url(self) -> str:
        tls = self.server.web is not None and self.server.web.tls is not None
        return f"{'https' if tls else 'http'}://{self.address}"

    @property
    def paths(self) -> str:
        """What is served, for the start line."""
        if self.server.targets_served:
            return "/metrics, /livez, /readyz and /v1/targets"
        return "/metrics, /livez and /readyz"

    @property
    def exposure(self) -> str | None:
        """A warning when what is served reaches beyond this host unprotected; None on loopback."""
        web = self.server.web
        if self.server.loopback:
            return None
        if web is None or not web.authenticates:
            return (f"{self.address} is not a loopback address and nothing asks who reads it (no --web-config-file "
                    "with basic_auth_users or client certificates): /metrics, /livez and /readyz (target names, "
                    "models, verdicts) are open to whoever reaches it; /v1/targets (stacks, paths, pids) is not "
                    "served there")
        if web.tls is None:
            return (f"{self.address} is not a loopback address and {web.path} has no tls_server_config: "
                    "basic-auth passwords and /v1/targets cross the network in clear")
        return None

    def start(self) -> Endpoint:
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
