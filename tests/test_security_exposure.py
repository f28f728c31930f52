"""Issue 33, findings 10 and 11: what `watch` prints and serves, and to whom.

10. A name a target chose (its model_name label) is printed escaped: it cannot end a text line early,
    forge the next one or drive a terminal (watch's episode lines, /livez, the text renderers).
11. /v1/targets (stacks, paths, pids: what took ptrace rights to collect) is served on a loopback
    address only, unless a --web-config-file (the Prometheus exporter-toolkit's format) authenticates
    its readers; every path asks for basic auth when one is configured; TLS is real TLS.

Everything runs for real on loopback: the servers, the HTTP and TLS clients, the bcrypt hashes, a
self-signed certificate from the openssl CLI, and `wedgectl watch` itself in a child process. A
listener on 0.0.0.0 is only ever connected to at 127.0.0.1: the rule looks at the bound address.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from page_server import page_server
import yaml

from wedgectl.model.types import Evidence, Verdict, VerdictKind
from wedgectl.watch import Snapshot, Tracker
from wedgectl.watch.daemon import episode_lines
from wedgectl.watch.exposition import Endpoint

ROOT = Path(__file__).resolve().parents[1]
V = VerdictKind
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A model_name that, printed raw, ends the line and forges the next one, then clears the terminal line.
FORGED = "2001-01-01T00:00:00Z node:8000/tiny: engine_deadlock ended after 5s (began x), no bundle"
EVIL_MODEL = f"tiny\n{FORGED}\x1b[2K\x1b]0;owned\x07"


def verdict(kind: VerdictKind, confidence: float = 0.9) -> Verdict:
    return Verdict(kind, confidence, f"{kind.value} summary", f"rule_{kind.value}")


# ------------------------------------------------------------------ a vLLM /metrics page, served for real


def _page(model: str) -> bytes:
    label = model.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # the text format's escapes
    return "".join(f'vllm:{name}{{model_name="{label}"}} {value}\n' for name, value in (
        ("num_requests_running", 0.0), ("num_requests_waiting", 3.0), ("generation_tokens_total", 10.0),
        ("prompt_tokens_total", 10.0))).encode()


@pytest.fixture
def vllm_metrics():
    """A server on 127.0.0.1 answering /metrics with a page whose model_name is EVIL_MODEL."""

    with page_server(lambda path: _page(EVIL_MODEL) if path.startswith("/metrics") else b"ok") as url:
        yield url


def _tracker_in_a_wedge(name: str, now: float) -> Tracker:
    tr = Tracker(name)
    tr.observe(verdict(V.PROGRESSING), now - 300)
    tr.observe(verdict(V.ADMISSION_WEDGE, 0.95), now - 100, 3)
    return tr


def _snapshot(now: float = 1000.0, grace: float = 60.0, name: str = "n:8001/wedged") -> Snapshot:
    tr = _tracker_in_a_wedge(name, now)
    return Snapshot(now, grace, (tr.view("http://127.0.0.1:8001", 11, True),), {})


# ------------------------------------------------------------------ finding 10: escaped names


def test_a_served_model_name_forges_no_episode_line_and_no_livez_line(vllm_metrics):
    from wedgectl.capture.options import SamplerOptions
    from wedgectl.watch.targets import Spec, Watched

    w = Watched.connect(Spec(url=vllm_metrics), "node")
    try:
        w.sample(full=False, stacks=False, options=SamplerOptions())
    finally:
        w.close()
    assert w.name.endswith("/" + EVIL_MODEL)  # the name really carries what the server sent
    now = time.time()
    tr = _tracker_in_a_wedge(w.name, now)
    (ep,) = tr.episodes
    for event in ("start", "end"):
        (line,) = episode_lines(event, ep, False, now)
        assert not CONTROL.search(line), repr(line)
        assert "tiny\\n2001-01-01T00:00:00Z" in line and "\\x1b[2K\\x1b]0;owned\\x07" in line
    (line,) = episode_lines("start", ep, True, now)  # JSON keeps the name exactly, escaped by JSON itself
    assert "\n" not in line and json.loads(line)["target"] == w.name
    ep_http = Endpoint("127.0.0.1:0", lambda: Snapshot(now, 60.0, (tr.view(vllm_metrics, None, False),), {})).start()
    try:
        with httpx.Client(timeout=10, trust_env=False) as c:
            r = c.get(f"http://{ep_http.address}/livez")
    finally:
        ep_http.close()
    assert r.status_code == 503
    lines = r.text.splitlines()
    assert len(lines) == 1 and not CONTROL.search(lines[0]) and "admission_wedge for 100s" in lines[0], r.text
    assert not any(line.startswith("2001-01-01") for line in lines)


def test_the_text_renderers_escape_what_a_target_or_bundle_chose():
    from wedgectl.render.text import render_report, render_threads
    from wedgectl.model.types import ThreadProbe

    v = Verdict(V.ENGINE_DEADLOCK, 0.9, f"stuck in {EVIL_MODEL}", f"rule\n{FORGED}",
                evidence=(Evidence("stack\x1b[31m", f"what {EVIL_MODEL}",
                                   values={"frames": [f"frame {EVIL_MODEL}"], "comm": "a\nb"}),),
                advice=(f"advice {EVIL_MODEL}",))
    lines = list(render_report(v, False, log=f"/tmp/{EVIL_MODEL}.log", pid=7,
                               ranks=[{"label": "a\nb", "pid": 1, "device": "x", "where": f"w {EVIL_MODEL}",
                                       "kind": "k", "frame": EVIL_MODEL}] * 2,
                               collector_failures=[{"collector": "c", "kind": "k", "message": EVIL_MODEL}]))
    lines += list(render_threads([ThreadProbe(tid=1, pid=1, comm="x\nFORGED\x1b[2J", backend="proc")]))
    text = "\n".join(lines)
    assert not CONTROL.search(text.replace("\n", "")), [ln for ln in lines if CONTROL.search(ln)]
    assert not any(ln.startswith(("2001-01-01", "FORGED")) for ln in lines)
    assert "\\x1b" in text and "x\\nFORGED\\x1b[2J" in text
    (js,) = render_report(v, True)
    assert json.loads(js)["summary"] == f"stuck in {EVIL_MODEL}"  # JSON: the value itself, escaped by JSON


# ------------------------------------------------------------------ finding 11: who may read /v1/targets


def _get(url: str, **kw: object) -> httpx.Response:
    with httpx.Client(timeout=10, trust_env=False, **kw) as c:
        return c.get(url)


@pytest.mark.parametrize("listen, served", [("127.0.0.1:0", True), ("127.0.0.2:0", True), ("0.0.0.0:0", False)])
def test_targets_are_served_on_loopback_only(listen, served):
    ep = Endpoint(listen, lambda: _snapshot(grace=200.0)).start()
    port = ep.server.server_address[1]
    host = listen.rsplit(":", 1)[0].replace("0.0.0.0", "127.0.0.1")  # connect to loopback, always
    try:
        targets = _get(f"http://{host}:{port}/v1/targets")
        metrics, livez, index = (_get(f"http://{host}:{port}{p}") for p in ("/metrics", "/livez", "/"))
    finally:
        ep.close()
    assert metrics.status_code == 200 and "wedgectl_verdict{" in metrics.text
    assert livez.status_code == 200 and livez.text == "ok\n"
    if served:
        assert targets.status_code == 200 and targets.json()["targets"][0]["target"] == "n:8001/wedged"
        assert "/v1/targets" in index.text and ep.exposure is None
    else:
        assert targets.status_code == 403 and "loopback" in targets.text and "n:8001" not in targets.text
        assert targets.text.count("\n") == 1 and "/v1/targets" not in index.text
        assert "not a loopback address" in ep.exposure and "/v1/targets" in ep.exposure


def test_an_ipv6_wildcard_is_not_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        ep = Endpoint("[::]:0", _snapshot).start()
    except OSError:
        pytest.skip("cannot bind ::")
    try:
        r = _get(f"http://[::1]:{ep.server.server_address[1]}/v1/targets")
    except httpx.ConnectError:
        pytest.skip("no ::1")
    finally:
        ep.close()
    assert r.status_code == 403


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False),
                                            ("10.1.2.3", False), ("::ffff:10.0.0.1", False), ("", False),
                                            ("localhost", False)])
def test_is_loopback(host, loopback):
    from wedgectl.watch.exposition import is_loopback

    assert is_loopback(host) is loopback


# --- web configs


def _bcrypt(password: str) -> str:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()


def _write(path: Path, doc: object, mode: int = 0o600) -> Path:
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 from the openssl CLI (it also serves as the client CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return d / "cert.pem", d / "key.pem"


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_basic_auth_guards_every_path_and_unlocks_targets_off_loopback(tmp_path):
    from wedgectl.watch.exposition import load_web_config

    web = load_web_config(_write(tmp_path / "web.yml", {"basic_auth_users": {"prom": _bcrypt("s3cret-pw"),
                                                                             "other": _bcrypt("other-pw")}}))
    ep = Endpoint("0.0.0.0:0", lambda: _snapshot(grace=200.0), web).start()
    base = f"http://127.0.0.1:{ep.server.server_address[1]}"
    try:
        with httpx.Client(timeout=10, trust_env=False) as c:
            for path in ("/metrics", "/livez", "/v1/targets", "/", "/nope"):
                r = c.get(base + path)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic"), path
                for headers in (_basic("prom", "wrong"), _basic("nobody", "s3cret-pw"), _basic("other", "s3cret-pw"),
                                {"Authorization": "Basic !!notbase64"}, {"Authorization": "Bearer s3cret-pw"},
                                {"Authorization": "Basic " + base64.b64encode(b"prom").decode()},
                                _basic("prom", "s3cret-pw" + "x" * 80)):
                    assert c.get(base + path, headers=headers).status_code == 401, (path, headers)
            ok = _basic("prom", "s3cret-pw")
            r = c.get(base + "/v1/targets", headers=ok)
            assert r.status_code == 200 and r.json()["targets"][0]["target"] == "n:8001/wedged"
            assert c.get(base + "/metrics", headers=ok).status_code == 200
            assert c.get(base + "/livez", headers=ok).text == "ok\n"
            t0 = time.monotonic()
            for _ in range(20):  # a remembered pair costs no bcrypt: twenty scrapes in well under a second each
                assert c.get(base + "/metrics", headers=ok).status_code == 200
            assert time.monotonic() - t0 < 20
            assert c.get(base + "/metrics", headers=_basic("prom", "wrong")).status_code == 401  # still checked
    finally:
        ep.close()
    assert "no tls_server_config" in ep.exposure  # passwords in clear off loopback: said at start


def test_tls_with_basic_auth(tmp_path, cert):
    from wedgectl.watch.exposition import load_web_config

    crt, key = cert
    web = load_web_config(_write(tmp_path / "web.yml", {"tls_server_config": {"cert_file": str(crt),
                                                                              "key_file": str(key)},
                                                        "basic_auth_users": {"prom": _bcrypt("s3cret-pw")}}))
    ep = Endpoint("0.0.0.0:0", _snapshot, web).start()
    port = ep.server.server_address[1]
    ca = ssl.create_default_context(cafile=str(crt))
    try:
        assert ep.url.startswith("https://") and ep.exposure is None
        assert _get(f"https://127.0.0.1:{port}/v1/targets", verify=ca).status_code == 401
        r = _get(f"https://127.0.0.1:{port}/v1/targets", verify=ca, headers=_basic("prom", "s3cret-pw"))
        assert r.status_code == 200 and r.json()["targets"][0]["target"] == "n:8001/wedged"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            _get(f"http://127.0.0.1:{port}/metrics", headers=_basic("prom", "s3cret-pw"))
        # A client that connects and never says hello holds its own thread, not the listener.
        with socket.create_connection(("127.0.0.1", port)):
            t0 = time.monotonic()
            r = _get(f"https://127.0.0.1:{port}/metrics", verify=ca, headers=_basic("prom", "s3cret-pw"))
            assert r.status_code == 200 and time.monotonic() - t0 < 8
    finally:
        ep.close()


def test_client_certificates_alone_unlock_targets(tmp_path, cert):
    from wedgectl.watch.exposition import load_web_config

    crt, key = cert
    # relative names: from the config's own directory, as the exporter-toolkit reads them
    shutil.copy(crt, tmp_path / "c.pem")
    shutil.copy(key, tmp_path / "k.pem")
    web = load_web_config(_write(tmp_path / "web.yml", {"tls_server_config": {
        "cert_file": "c.pem", "key_file": "k.pem", "client_ca_file": "c.pem",
        "client_auth_type": "RequireAndVerifyClientCert", "min_version": "TLS13"}}))
    ep = Endpoint("0.0.0.0:0", _snapshot, web).start()
    url = f"https://127.0.0.1:{ep.server.server_address[1]}/v1/targets"
    try:
        with pytest.raises(httpx.HTTPError):
            _get(url, verify=ssl.create_default_context(cafile=str(crt)))  # no client certificate
        ctx = ssl.create_default_context(cafile=str(crt))
        ctx.load_cert_chain(str(crt), str(key))
        assert _get(url, verify=ctx).status_code == 200
    finally:
        ep.close()


def _watch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", "watch", "--url", "http://127.0.0.1:1",
                           "--interval", "0.5", "--max-seconds", "1", *args],
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_watch_warns_when_it_binds_a_non_loopback_address_without_a_web_config():
    r = _watch("--listen", "0.0.0.0:0")
    assert r.returncode == 0, r.stderr
    (warning,) = [ln for ln in r.stderr.splitlines() if "warning:" in ln]
    assert "0.0.0.0" in warning and "not a loopback address" in warning and "/v1/targets" in warning
    assert "/metrics, /livez and /readyz;" in r.stderr  # the start line says what is served
    r = _watch("--listen", "127.0.0.1:0")
    assert r.returncode == 0 and "warning:" not in r.stderr and "/v1/targets" in r.stderr


def test_watch_serves_with_a_web_config(tmp_path):
    cfg = _write(tmp_path / "web.yml", {"basic_auth_users": {"prom": _bcrypt("pw")}})
    r = _watch("--listen", "127.0.0.1:0", "--web-config-file", str(cfg))
    assert r.returncode == 0 and "warning:" not in r.stderr, r.stderr


@pytest.mark.parametrize("doc, mode, why", [
    ({"basic_auth_users": {"prom": "plaintext"}}, 0o600, "not a bcrypt hash"),
    ({"basic_auth_users": {}}, 0o600, "basic_auth_users"),
    ({"http_server_config": {"http2": True}}, 0o600, "http_server_config not supported"),
    ({"tls_server_config": {"cert_file": "/nonexistent/c.pem", "key_file": "/nonexistent/k.pem"}}, 0o600,
     "No such file"),
    ({"tls_server_config": {"cert_file": "/etc/hostname"}}, 0o600, "needs cert_file and key_file"),
    ("basic_auth_users: [unclosed\n", 0o600, "not YAML"),
    ("- a list\n", 0o600, "mapping"),
    ({"basic_auth_users": {"prom": "$2b$04$" + "a" * 53}}, 0o666, "another user can change it"),
])
def test_a_bad_web_config_is_one_line_and_a_usage_error(tmp_path, doc, mode, why):
    r = _watch("--listen", "127.0.0.1:0", "--web-config-file", str(_write(tmp_path / "web.yml", doc, mode)))
    assert r.returncode == 2 and why in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_a_web_config_another_user_owns_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to nobody needs root")
    cfg = _write(tmp_path / "web.yml", {"basic_auth_users": {"prom": _bcrypt("pw")}}, 0o644)
    os.chown(cfg, 65534, 65534)
    r = _watch("--listen", "127.0.0.1:0", "--web-config-file", str(cfg))
    assert r.returncode == 2 and "owner uid 65534" in r.stderr and "Traceback" not in r.stderr


# --- deploy/: the fleet exposes /metrics and /livez only


def _watch_args() -> list[list[str]]:
    docs = [d for p in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]
    return [c["args"] for d in docs if d["kind"] in ("DaemonSet", "Deployment")
            for c in d["spec"]["template"]["spec"]["containers"] if c.get("args", [""])[0] == "watch"]


def test_the_kubernetes_watchers_serve_metrics_and_livez_but_not_targets():
    """Each watch in deploy/kubernetes binds the pod's or node's address with no web config; the same
    listener, made here (port 0), refuses /v1/targets and serves the rest."""
    invocations = _watch_args()
    assert len(invocations) == 2
    for args in invocations:
        assert not any(a.startswith("--web-config-file") for a in args)
        (listen,) = [a.split("=", 1)[1] for a in args if a.startswith("--listen=")]
        host = listen.rsplit(":", 1)[0]
        ep = Endpoint(f"{host}:0", _snapshot).start()
        try:
            port = ep.server.server_address[1]
            assert _get(f"http://127.0.0.1:{port}/v1/targets").status_code == 403
            assert _get(f"http://127.0.0.1:{port}/metrics").status_code == 200
            assert _get(f"http://127.0.0.1:{port}/livez").status_code == 503  # the snapshot's wedge, past grace
        finally:
            ep.close()
