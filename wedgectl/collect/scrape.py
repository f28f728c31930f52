"""GET /metrics and /health from a vLLM server with bounded timeouts; never raises."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit, urlunsplit

from wedgectl.redact import redact_url
from wedgectl.types import FailureKind, MetricsScrape

COLLECTOR = "metrics"
MAX_BODY_BYTES = 32 * 1024 * 1024
_TEXT_TYPES = ("text/", "application/openmetrics-text")
_WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "[::1]", "": "127.0.0.1"}


def _root_url(base: str) -> tuple[str, str, str]:
    base = base.strip()
    if "://" not in base:
        base = "http://" + base
    parts = urlsplit(base)
    host = parts.hostname or ""
    netloc = parts.netloc
    if host in _WILDCARD:
        # a listening address: connect to loopback instead of the wildcard
        new = _WILDCARD[host]
        new = f"[{new}]" if ":" in new and not new.startswith("[") else new
        netloc = f"{new}:{parts.port}" if parts.port else new
    return parts.scheme, netloc, parts.path


def metrics_url_for(base: str) -> str:
    """'host:8000', 'http://host:8000/v1' or '0.0.0.0:8000' -> 'http://HOST:8000/metrics'.

    vLLM serves /metrics at the root whatever the API prefix, so any other
    path is dropped; a URL already ending in /metrics is kept.
    """
    scheme, netloc, path = _root_url(base)
    if path.rstrip("/").endswith("/metrics"):
        return urlunsplit((scheme, netloc, path.rstrip("/"), "", ""))
    return urlunsplit((scheme, netloc, "/metrics", "", ""))


def health_url_for(base: str) -> str:
    """The server's /health endpoint (at the root, like /metrics)."""
    scheme, netloc, _ = _root_url(base)
    return urlunsplit((scheme, netloc, "/health", "", ""))


CONNECT_S = 1.0  # a connect (and TLS handshake) gets at most this much of the timeout
READ_CHUNK = 64 * 1024
_tls_context = None  # built on the first https scrape: loading the CA store costs more CPU than a loopback scrape


class _Refused(Exception):
    """Why a URL is not fetched at all (a scheme or host wedgectl does not speak to)."""


def _tls():  # noqa: ANN202 - ssl is imported only when a target speaks TLS
    global _tls_context
    if _tls_context is None:
        import ssl

        _tls_context = ssl.create_default_context()
    return _tls_context


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """An open connection to url's host (connect bounded by CONNECT_S) and the request path.
    The standard library's client: no proxy from the environment (a loopback scrape must not be
    rerouted), no redirects followed, no connection kept between scrapes (between them wedgectl
    holds no socket, so collect.processes finds none of ours among the server's), and a fraction
    of the CPU and import time of a general-purpose client."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _Refused(f"unsupported scheme {parts.scheme!r} (http or https)")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise _Refused(str(exc)) from None
    if not host:
        raise _Refused("no host")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connect_s = min(timeout, CONNECT_S)
    if scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=connect_s, context=_tls())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=connect_s)
    try:
        conn.connect()
    except BaseException:
        conn.close()
        raise
    return conn, path


def _get(conn: http.client.HTTPConnection, path: str, deadline: float) -> http.client.HTTPResponse:
    """Send GET path and read the status line and headers, within the deadline."""
    conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
    conn.putrequest("GET", path, skip_accept_encoding=True)  # identity: nothing to inflate
    conn.putheader("Accept", "text/plain, */*")
    conn.putheader("Connection", "close")
    conn.putheader("User-Agent", "wedgectl")
    conn.endheaders()
    return conn.getresponse()


def _error_for(exc: BaseException, timeout: float, connected: bool) -> str:
    if isinstance(exc, _Refused):
        return f"{FailureKind.ERROR.value}: bad URL: {exc}"
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        what = "ReadTimeout" if connected else "ConnectTimeout"
        return f"{FailureKind.TIMEOUT.value}: no answer within {timeout:.1f}s ({what})"
    if isinstance(exc, http.client.HTTPException):  # a bad status line, headers, or a cut-off body
        return f"{FailureKind.BAD_DATA.value}: {type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and not connected:  # refused, no route, no such host
        return f"{FailureKind.UNREACHABLE.value}: {exc or 'connection failed'}"
    if isinstance(exc, ValueError):  # UnicodeError too: a host IDNA cannot encode
        return f"{FailureKind.ERROR.value}: bad URL: {exc}"
    return f"{FailureKind.ERROR.value}: {type(exc).__name__}: {exc}"


def scrape_metrics(url: str, timeout: float = 2.0) -> MetricsScrape:
    """One GET of ``url``. The whole call ends within about ``timeout`` (connect at most 1 s,
    and the body is abandoned once the deadline passes). ``error`` starts with a
    FailureKind value; a non-200 answer keeps its status and body and says so in ``error``.
    """
    start = time.monotonic()
    deadline = start + timeout
    status: int | None = None
    conn: http.client.HTTPConnection | None = None
    late = f"{FailureKind.TIMEOUT.value}: body not complete within {timeout:.1f}s"
    try:
        conn, path = _connect(url, timeout)
        sock = conn.sock  # getresponse may drop conn.sock when the answer closes; the body's reads still use it
        resp = _get(conn, path, deadline)
        status = resp.status
        ctype = resp.getheader("content-type", "") or ""
        encoding = (resp.getheader("content-encoding", "") or "").strip().lower()
        if encoding not in ("", "identity"):
            return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: content-encoding {encoding!r} not asked for")
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _done(url, start, status, error=late)
            sock.settimeout(left)
            try:
                chunk = resp.read1(READ_CHUNK)
            except TimeoutError:
                return _done(url, start, status, error=late)
            if not chunk:
                if resp.length:  # the connection closed before Content-Length's bytes came
                    return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body cut off: "
                                 f"{size} of the {size + resp.length} bytes announced")
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body over {MAX_BODY_BYTES} bytes")
        body = b"".join(chunks)
        charset = resp.headers.get_content_charset() or "utf-8"
    except Exception as exc:  # noqa: BLE001 - never raise: the failure is the data
        return _done(url, start, status, error=_error_for(exc, timeout, conn is not None))
    finally:
        if conn is not None:
            conn.close()

    mime = ctype.split(";", 1)[0].strip().lower()
    if mime and not mime.startswith(_TEXT_TYPES):
        return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: content-type {mime!r} is not text")
    try:
        text = body.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body is not valid text")
    if "\x00" in text:
        return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body contains NUL bytes")
    error = None if status == 200 else f"{FailureKind.ERROR.value}: HTTP {status}"
    return _done(url, start, status, text=text, error=error)


def _done(url: str, start: float, status: int | None, text: str | None = None, error: str | None = None) -> MetricsScrape:
    return MetricsScrape(
        t=time.time(), url=redact_url(url), status=status, text=text, elapsed_s=time.monotonic() - start, error=error
    )


def probe_health(base_url: str, timeout: float = 2.0) -> tuple[int | None, str | None]:
    """GET /health: (status, None) for any answer, (None, error) for none. vLLM answers
    200 while its engine lives and 503 once the engine is dead."""
    conn: http.client.HTTPConnection | None = None
    try:
        url = health_url_for(base_url)
        conn, path = _connect(url, timeout)
        return _get(conn, path, time.monotonic() + timeout).status, None  # the body is not needed: don't wait for it
    except Exception as exc:  # noqa: BLE001
        return None, _error_for(exc, timeout, conn is not None)
    finally:
        if conn is not None:
            conn.close()


class Scraper:
    """What a whole run (a diagnose, a `top` session, a watcher's target) scrapes with.

    Each call opens and closes its own connection (nothing is held between scrapes), so it is
    thread-safe: the sampler's scrape and health check go side by side. The TLS context, the
    only costly part of a client, is built once per process and only for an https target."""

    def __init__(self, timeout: float = 2.0) -> None:
        self.timeout = timeout

    def metrics(self, url: str, timeout: float | None = None) -> MetricsScrape:
        return scrape_metrics(url, self.timeout if timeout is None else timeout)

    def health(self, base_url: str, timeout: float | None = None) -> tuple[int | None, str | None]:
        return probe_health(base_url, self.timeout if timeout is None else timeout)

    def close(self) -> None:
        """Nothing is held between calls; kept so a Scraper reads as the resource it was."""

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
