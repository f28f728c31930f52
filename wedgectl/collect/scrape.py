"""GET /metrics and /health from a vLLM server with bounded timeouts; never raises."""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

import httpx

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


def _timeout(timeout: float) -> httpx.Timeout:
    return httpx.Timeout(timeout, connect=min(timeout, 1.0))


def _client(timeout: float, transport: httpx.BaseTransport | None) -> httpx.Client:
    return httpx.Client(
        transport=transport,
        timeout=_timeout(timeout),
        # No kept connection: between scrapes wedgectl holds no socket, so the /proc reading of the
        # server's sockets (collect.processes, which sets ours apart) finds none of ours to match
        # against the host's whole TCP table. A loopback connect costs far less than that read.
        limits=httpx.Limits(max_keepalive_connections=0),
        follow_redirects=False,
        trust_env=False,  # HTTP(S)_PROXY must not reroute a loopback scrape
    )


def _error_for(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"{FailureKind.TIMEOUT.value}: no answer within {timeout:.1f}s ({type(exc).__name__})"
    if isinstance(exc, httpx.ConnectError):
        return f"{FailureKind.UNREACHABLE.value}: {exc or 'connection failed'}"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.DecodingError)):
        return f"{FailureKind.BAD_DATA.value}: {type(exc).__name__}: {exc}"
    if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
        return f"{FailureKind.ERROR.value}: bad URL: {exc}"
    return f"{FailureKind.ERROR.value}: {type(exc).__name__}: {exc}"


def scrape_metrics(url: str, timeout: float = 2.0, transport: httpx.BaseTransport | None = None,
                   client: httpx.Client | None = None) -> MetricsScrape:
    """One GET of ``url``. The whole call ends within about ``timeout`` (connect at most 1 s,
    and the body is abandoned once the deadline passes). ``error`` starts with a
    FailureKind value; a non-200 answer keeps its status and body and says so in ``error``.
    ``client`` (a `Scraper`'s) is reused; without one, a client is built for this call.
    """
    if client is None:
        with _client(timeout, transport) as own:
            return scrape_metrics(url, timeout, client=own)
    start = time.monotonic()
    deadline = start + timeout
    status: int | None = None
    try:
        with client.stream("GET", url, timeout=_timeout(timeout)) as resp:
            status = resp.status_code
            ctype = resp.headers.get("content-type", "")
            chunks: list[bytes] = []
            size = 0
            for chunk in resp.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body over {MAX_BODY_BYTES} bytes")
                if time.monotonic() > deadline:
                    return _done(url, start, status, error=f"{FailureKind.TIMEOUT.value}: body not complete within {timeout:.1f}s")
            body = b"".join(chunks)
    except Exception as exc:  # noqa: BLE001 - never raise: the failure is the data
        return _done(url, start, status, error=_error_for(exc, timeout))

    mime = ctype.split(";", 1)[0].strip().lower()
    if mime and not mime.startswith(_TEXT_TYPES):
        return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: content-type {mime!r} is not text")
    try:
        text = body.decode(resp.encoding or "utf-8")
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


def probe_health(
    base_url: str, timeout: float = 2.0, transport: httpx.BaseTransport | None = None,
    client: httpx.Client | None = None,
) -> tuple[int | None, str | None]:
    """GET /health: (status, None) for any answer, (None, error) for none. vLLM answers
    200 while its engine lives and 503 once the engine is dead."""
    if client is None:
        with _client(timeout, transport) as own:
            return probe_health(base_url, timeout, client=own)
    url = health_url_for(base_url)
    try:
        with client.stream("GET", url, timeout=_timeout(timeout)) as resp:
            return resp.status_code, None  # the body is not needed: don't wait for it
    except Exception as exc:  # noqa: BLE001
        return None, _error_for(exc, timeout)


class Scraper:
    """One HTTP client for a whole run (a diagnose, a `top` session, a watcher's target).

    Building an httpx.Client costs more CPU than a loopback scrape (it loads a TLS context).
    Thread-safe: httpx's pool serves the sampler's scrape and health check side by side."""

    def __init__(self, timeout: float = 2.0, transport: httpx.BaseTransport | None = None) -> None:
        self.timeout = timeout
        self.client = _client(timeout, transport)

    def metrics(self, url: str, timeout: float | None = None) -> MetricsScrape:
        return scrape_metrics(url, self.timeout if timeout is None else timeout, client=self.client)

    def health(self, base_url: str, timeout: float | None = None) -> tuple[int | None, str | None]:
        return probe_health(base_url, self.timeout if timeout is None else timeout, client=self.client)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
