"""GET /metrics and /health from a vLLM server with bounded timeouts; never raises."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from encodings import normalize_encoding
from encodings.aliases import aliases as _CODEC_ALIASES
from urllib.parse import urlencode, urlsplit, urlunsplit

from wedgectl.read.redact import redact_url
from wedgectl.model.types import FailureKind, MetricsScrape

COLLECTOR = "metrics"
MAX_BODY_BYTES = 32 * 1024 * 1024
_TEXT_TYPES = ("text/", "application/openmetrics-text")
# The only codecs a body is decoded with, by the codec module's name. The server names the charset:
# any other codec (punycode is quadratic, "undefined" raises, a UTF-16 page is no exposition) is
# refused before a byte is decoded. The name is matched through the alias table alone, so no codec
# module the server names is imported.
CHARSETS = {"utf_8": "utf-8", "ascii": "ascii", "latin_1": "latin-1"}
MAX_CHARSET = 40  # characters of a charset name looked at (and quoted back)
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


def restricted_url(metrics_url: str, series: Sequence[str]) -> str:
    """The exposition at `metrics_url` restricted to `series`: prometheus_client's `name[]` query,
    which its exposition app answers with those series alone (its registry's
    restricted_registry). vLLM 0.32 routes the exact path /metrics to its instrumentator's
    handler, which ignores the query, and /metrics/ (the path with a slash) to prometheus_client's
    app, which honours it: the slash is what reaches it."""
    parts = urlsplit(metrics_url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + "/",
                       urlencode([("name[]", name) for name in series]), ""))


def series_names(text: str | None) -> set[str]:
    """The series named in an exposition text (each sample line's name)."""
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in (text or "").splitlines() if line and line[0] != "#"}


def _serves_series(scrape: MetricsScrape) -> bool:
    """A 200 whose text has a vLLM series line: the restricted page answered as asked. An older
    vLLM without these series answers an empty page; a proxy, a page of its own."""
    return scrape.ok and "\nvllm:" in "\n" + (scrape.text or "")


def health_url_for(base: str) -> str:
    """The server's /health endpoint (at the root, like /metrics)."""
    scheme, netloc, _ = _root_url(base)
    return urlunsplit((scheme, netloc, "/health", "", ""))


CONNECT_S = 1.0  # a connect (and TLS handshake) gets at most this much of the timeout
READ_CHUNK = 64 * 1024
MAX_LINE = 65536  # a status or header line, as the standard library's client bounds it
MAX_HEADERS = 100
_tls_context = None  # built on the first https scrape: loading the CA store costs more CPU than a loopback scrape


class _Refused(Exception):
    """Why a URL is not fetched at all (a scheme or host wedgectl does not speak to)."""


class _BadAnswer(Exception):
    """An answer that is not HTTP/1.x as a server sends it: bad_data, named by its kind."""

    def __init__(self, kind: str, what: str) -> None:
        super().__init__(what)
        self.kind = kind


def _tls():  # noqa: ANN202 - ssl is imported only when a target speaks TLS
    global _tls_context
    if _tls_context is None:
        import ssl

        _tls_context = ssl.create_default_context()
    return _tls_context


def _connect(url: str, timeout: float) -> tuple[socket.socket, bytes]:
    """An open socket to url's host (connect, and any TLS handshake, bounded by CONNECT_S) and
    the request to send on it. HTTP/1.1 spoken directly over a socket, a GET and its answer and
    nothing else: no proxy from the environment (a loopback scrape must not be rerouted), no
    redirect followed, no connection kept between scrapes (between them wedgectl holds no
    socket, so collect.processes finds none of ours among the server's). A general-purpose
    client (httpx, or the standard library's http.client with the email package it parses
    headers with) cost more CPU to import than a run's scrapes."""
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
    if any(c <= " " or c == "\x7f" for c in host + path):
        raise _Refused("a control character or space in the host or path")
    default = 443 if scheme == "https" else 80
    name = host if host.isascii() else host.encode("idna").decode("ascii")  # a UnicodeError is a bad URL
    name = f"[{name}]" if ":" in name else name
    request = (f"GET {path} HTTP/1.1\r\nHost: {name}{'' if port in (None, default) else f':{port}'}\r\n"
               "Accept: text/plain, */*\r\nConnection: close\r\nUser-Agent: wedgectl\r\n\r\n").encode("ascii")
    connect_s = min(timeout, CONNECT_S)
    # An ASCII host goes to getaddrinfo as bytes: a str one is IDNA-encoded first, and that
    # codec's first use imports stringprep and unicodedata (3 ms of CPU, for "127.0.0.1").
    address = (host.encode() if host.isascii() else host, port or default)
    sock = socket.create_connection(address, timeout=connect_s)  # type: ignore[arg-type]  # getaddrinfo takes bytes
    try:
        if scheme == "https":
            sock = _tls().wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return sock, request


class _Answer:
    """The answer read off one socket: status and headers, then the body on demand, every read
    bounded by the deadline it is given."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.length: int | None = None  # body bytes still to come, from Content-Length
        self.chunked = False
        self._chunk_left = 0  # bytes of the current chunk still to come
        self.done = False

    def _fill(self, deadline: float) -> bool:
        """More bytes into the buffer; False at the end of the stream."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        data = self.sock.recv(READ_CHUNK)
        self.buf += data
        return bool(data)

    def _line(self, deadline: float) -> bytes:
        """One line, its end included; what is left at the end of the stream (maybe b"")."""
        while True:
            end = self.buf.find(b"\n")
            if end >= 0 or len(self.buf) > MAX_LINE:
                if end < 0 or end >= MAX_LINE:
                    raise _BadAnswer("LineTooLong", f"a line of the answer is over {MAX_LINE} bytes")
                line = bytes(self.buf[: end + 1])
                del self.buf[: end + 1]
                return line
            if not self._fill(deadline):
                line = bytes(self.buf)
                self.buf.clear()
                return line

    def read_head(self, deadline: float, body: bool = True) -> None:
        """The status line and the headers (1xx interim answers skipped)."""
        for _ in range(8):
            line = self._line(deadline)
            if not line.endswith(b"\n"):
                raise _BadAnswer("RemoteDisconnected", "the server closed the connection without a whole status line"
                                 if line else "the server closed the connection without an answer")
            version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit() or code < "100" or rest[3:4] not in ("", " "):
                raise _BadAnswer("BadStatusLine", f"not an HTTP/1.x status line: {line[:80]!r}")
            self.status = int(code)
            self.headers = self._read_headers(deadline)
            if not 100 <= self.status < 200 or self.status == 101:
                break
        if self.status < 200:
            raise _BadAnswer("BadStatusLine", f"no final answer after interim {self.status} answers")
        coding = self.headers.get("transfer-encoding", "").lower()
        if coding:
            if coding.replace(" ", "").split(",")[-1] != "chunked":
                raise _BadAnswer("UnknownTransferEncoding", f"transfer-encoding {coding!r}")
            self.chunked = True
        elif "content-length" in self.headers:
            raw = self.headers["content-length"].split(",")[0].strip()
            if not raw.isdigit():
                raise _BadAnswer("BadContentLength", f"content-length {raw[:40]!r}")
            self.length = int(raw)
        if not body or self.status in (204, 304):
            self.done = True

    def _read_headers(self, deadline: float) -> dict[str, str]:
        headers: dict[str, str] = {}
        last = ""
        for _ in range(MAX_HEADERS + 1):
            line = self._line(deadline)
            if line in (b"\r\n", b"\n"):
                return headers
            if not line.endswith(b"\n"):
                raise _BadAnswer("RemoteDisconnected", "the connection closed inside the headers")
            text = line.decode("latin-1").rstrip("\r\n")
            if text[:1] in (" ", "\t") and last:  # an obsolete folded continuation
                headers[last] += " " + text.strip()
                continue
            name, colon, value = text.partition(":")
            if not colon or not name or name != name.strip():
                raise _BadAnswer("BadHeaderLine", f"not a header line: {text[:80]!r}")
            last = name.lower()
            value = value.strip()
            headers[last] = f"{headers[last]}, {value}" if last in headers else value
        raise _BadAnswer("TooManyHeaders", f"got more than {MAX_HEADERS} headers")

    def read1(self, deadline: float) -> bytes:
        """Some of the body (b"" once it is complete, or the stream ended)."""
        if self.done:
            return b""
        if self.chunked:
            return self._read_chunk(deadline)
        if self.length == 0:
            self.done = True
            return b""
        if not self.buf and not self._fill(deadline):
            self.done = True
            return b""
        take = len(self.buf) if self.length is None else min(len(self.buf), self.length)
        data = bytes(self.buf[:take])
        del self.buf[:take]
        if self.length is not None:
            self.length -= take
        return data

    def _read_chunk(self, deadline: float) -> bytes:
        if self._chunk_left == 0:
            size_line = self._line(deadline)
            if not size_line.endswith(b"\n"):
                raise _BadAnswer("IncompleteRead", "the connection closed inside a chunked body")
            size = size_line.split(b";", 1)[0].strip()
            if not size or size.lstrip(b"0123456789abcdefABCDEF"):  # hex digits only: no sign, no "0x"
                raise _BadAnswer("IncompleteRead", f"bad chunk size {size[:20]!r}")
            self._chunk_left = int(size, 16)
            if self._chunk_left == 0:  # the last chunk: the trailer, then the end
                self._read_headers(deadline)
                self.done = True
                return b""
        if not self.buf and not self._fill(deadline):
            raise _BadAnswer("IncompleteRead", "the connection closed inside a chunk")
        take = min(len(self.buf), self._chunk_left)
        data = bytes(self.buf[:take])
        del self.buf[:take]
        self._chunk_left -= take
        if self._chunk_left == 0:  # the chunk's own line end
            end = self._line(deadline)
            if end not in (b"\r\n", b"\n"):
                raise _BadAnswer("IncompleteRead", "a chunk not followed by its line end")
        return data

    def charset(self) -> str | None:
        for param in self.headers.get("content-type", "").split(";")[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "charset":
                return value.strip().strip('"') or None
        return None


def _get(sock: socket.socket, request: bytes, deadline: float, body: bool = True) -> _Answer:
    """Send the request and read the status line and headers, within the deadline."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(request)
    answer = _Answer(sock)
    answer.read_head(deadline, body)
    return answer


def failure_kind(error: str | None) -> FailureKind:
    """The FailureKind a scrape's error starts with (unreachable for none it names)."""
    kind = (error or "").split(":", 1)[0]
    return next((k for k in FailureKind if k.value == kind), FailureKind.UNREACHABLE)


def _error_for(exc: BaseException, timeout: float, connected: bool) -> str:
    if isinstance(exc, _Refused):
        return f"{FailureKind.ERROR.value}: bad URL: {exc}"
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        what = "ReadTimeout" if connected else "ConnectTimeout"
        return f"{FailureKind.TIMEOUT.value}: no answer within {timeout:.1f}s ({what})"
    if isinstance(exc, _BadAnswer):  # a bad status line, headers, or a cut-off body
        return f"{FailureKind.BAD_DATA.value}: {exc.kind}: {exc}"
    if isinstance(exc, OSError) and not connected:  # refused, no route, no such host
        return f"{FailureKind.UNREACHABLE.value}: {exc or 'connection failed'}"
    if isinstance(exc, ValueError):  # UnicodeError too: a host IDNA cannot encode
        return f"{FailureKind.ERROR.value}: bad URL: {exc}"
    return f"{FailureKind.ERROR.value}: {type(exc).__name__}: {exc}"


def codec_for(charset: str | None) -> str | None:
    """The codec a body in `charset` is decoded with (utf-8 when none is named), or None for one
    not allowed (CHARSETS). Aliases count ("UTF8", "us-ascii", "ISO-8859-1")."""
    if charset is None:
        return "utf-8"
    if len(charset) > MAX_CHARSET:
        return None
    key = normalize_encoding(charset.lower())
    return CHARSETS.get(_CODEC_ALIASES.get(key, key))


def _decode(body: bytes, charset: str | None) -> tuple[str | None, str | None]:
    """(text, None) or (None, the bad_data error): a linear decode with an allowed codec only."""
    codec = codec_for(charset)
    if codec is None:
        return None, (f"{FailureKind.BAD_DATA.value}: not Prometheus metrics: charset "
                      f"{ascii((charset or '')[:MAX_CHARSET])} (utf-8, ascii or latin-1 only)")
    try:
        return body.decode(codec), None
    except UnicodeDecodeError as exc:
        return None, (f"{FailureKind.BAD_DATA.value}: not Prometheus metrics: body is not {codec} text "
                      f"(byte {exc.start})")


def scrape_metrics(url: str, timeout: float = 2.0, max_bytes: int = MAX_BODY_BYTES) -> MetricsScrape:
    """One GET of ``url``. The whole call ends within about ``timeout`` (connect at most 1 s,
    and the body is abandoned once the deadline passes; the decode, linear with an allowed codec,
    counts against it too). ``error`` starts with a FailureKind value; a non-200 answer keeps its
    status and body and says so in ``error``. A body over ``max_bytes`` (at most MAX_BODY_BYTES),
    in a charset other than utf-8, ascii or latin-1, or not valid in its charset is bad_data:
    not Prometheus metrics. Never raises.
    """
    start = time.monotonic()
    deadline = start + timeout
    max_bytes = min(max_bytes, MAX_BODY_BYTES)
    status: int | None = None
    sock: socket.socket | None = None
    late = f"{FailureKind.TIMEOUT.value}: body not complete within {timeout:.1f}s"
    try:
        sock, request = _connect(url, timeout)
        resp = _get(sock, request, deadline)
        status = resp.status
        ctype = resp.headers.get("content-type", "")
        encoding = resp.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: content-encoding "
                         f"{ascii(encoding[:MAX_CHARSET])} not asked for")
        mime = ctype.split(";", 1)[0].strip().lower()
        if mime and not mime.startswith(_TEXT_TYPES):
            return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: content-type "
                         f"{ascii(mime[:MAX_CHARSET])} is not text")
        charset = resp.charset()
        if codec_for(charset) is None:  # refused before the body is read
            return _done(url, start, status, error=_decode(b"", charset)[1])
        if resp.length is not None and resp.length > max_bytes:
            return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body over {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            if time.monotonic() >= deadline:  # a body arriving faster than it is read is bounded too
                return _done(url, start, status, error=late)
            try:
                chunk = resp.read1(deadline)
            except TimeoutError:
                return _done(url, start, status, error=late)
            if not chunk:
                if resp.length:  # the connection closed before Content-Length's bytes came
                    return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body cut off: "
                                 f"{size} of the {size + resp.length} bytes announced")
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body over {max_bytes} bytes")
        body = b"".join(chunks)
        del chunks
        text, error = _decode(body, charset)
    except Exception as exc:  # noqa: BLE001 - never raise: the failure is the data
        return _done(url, start, status, error=_error_for(exc, timeout, sock is not None))
    finally:
        if sock is not None:
            sock.close()
    if error is not None or text is None:  # _decode gives one of the two
        return _done(url, start, status, error=error)
    if "\x00" in text:
        return _done(url, start, status, error=f"{FailureKind.BAD_DATA.value}: body contains NUL bytes")
    error = None if status == 200 else f"{FailureKind.ERROR.value}: HTTP {status}"
    return _done(url, start, status, text=text, error=error)


def _done(url: str, start: float, status: int | None, text: str | None = None,
          error: str | None = None) -> MetricsScrape:
    return MetricsScrape(
        t=time.time(), url=redact_url(url), status=status, text=text, elapsed_s=time.monotonic() - start, error=error
    )


def probe_health(base_url: str, timeout: float = 2.0) -> tuple[int | None, str | None]:
    """GET /health: (status, None) for any answer, (None, error) for none. vLLM answers
    200 while its engine lives and 503 once the engine is dead."""
    sock: socket.socket | None = None
    try:
        url = health_url_for(base_url)
        sock, request = _connect(url, timeout)
        # the body is not needed: don't wait for it
        return _get(sock, request, time.monotonic() + timeout, body=False).status, None
    except Exception as exc:  # noqa: BLE001
        return None, _error_for(exc, timeout, sock is not None)
    finally:
        if sock is not None:
            sock.close()


VERIFY_EVERY = 60  # restricted scrapes between two whole pages (a minute at top's 1 s refresh)


class Scraper:
    """What a whole run (a diagnose, a `top` session, a watcher's target) scrapes with.

    Each call opens and closes its own connection (nothing is held between scrapes), so it is
    thread-safe: the sampler's scrape and health check go side by side. The TLS context, the
    only costly part of a client, is built once per process and only for an https target."""

    def __init__(self, timeout: float = 2.0, series: Sequence[str] | None = None,
                 max_bytes: int = MAX_BODY_BYTES) -> None:
        self.timeout = timeout
        self.series = tuple(series) if series else None
        self.max_bytes = max_bytes  # a bigger page is bad_data (watch keeps its pages within a budget)
        # Per metrics URL, whether its restricted page answers as asked (absent: not known yet).
        self.restricted: dict[str, bool] = {}
        self._asked: dict[str, str] = {}  # metrics URL -> its restricted URL, built once
        self._last: dict[str, str] = {}  # metrics URL -> its last restricted page (named only when checked)
        self._scrapes: dict[str, int] = {}  # metrics URL -> restricted scrapes since the last whole page

    def metrics(self, url: str, timeout: float | None = None) -> MetricsScrape:
        """One scrape of url; with `series`, of those series alone (restricted_url), where the
        server answers that. The first definite answer decides for the session: a restricted
        page that is not a 200 with vLLM series in it, or one that leaves out a judged series
        the whole page (scraped once beside it) holds, means the whole page, for this scrape too
        (within what is left of the timeout) and every later one. Every VERIFY_EVERY scrapes the
        whole page is taken instead, and checked the same way. A scrape that got no answer at
        all (a timeout, a refused connection) decides nothing and is returned as it failed."""
        timeout = self.timeout if timeout is None else timeout
        if self.series is None or self.restricted.get(url) is False:
            return scrape_metrics(url, timeout, self.max_bytes)
        if self.restricted.get(url) and self._scrapes.get(url, 0) >= VERIFY_EVERY:
            # Now and then the whole page, as this scrape: a series the restricted page leaves out
            # (one that appeared since, from a collector the server's registry does not index by
            # name) means the whole page from then on.
            got = scrape_metrics(url, timeout, self.max_bytes)
            if got.ok:
                self._scrapes[url] = 0
                if self._left_out(url, got):
                    self.restricted[url] = False
            return got
        start = time.monotonic()
        asked = self._asked.get(url)
        if asked is None:
            asked = self._asked[url] = restricted_url(url, self.series)
        got = scrape_metrics(asked, timeout, self.max_bytes)
        if got.status is None:
            return got
        if self.restricted.get(url):
            self._scrapes[url] = self._scrapes.get(url, 0) + 1
            if got.ok:
                self._last[url] = got.text or ""
            return got
        left = lambda: max(0.1, timeout - (time.monotonic() - start))  # noqa: E731 - what is left of the timeout
        if not _serves_series(got):
            self.restricted[url] = False
            return scrape_metrics(url, left(), self.max_bytes)
        # The first restricted page: checked against the whole page once. prometheus_client's
        # restricted registry collects only collectors it indexes by name, so a collector that
        # names nothing up front (a plugin's) is left out of it: the whole page then.
        whole = scrape_metrics(url, left(), self.max_bytes)
        if not whole.ok:
            return got  # nothing decided: checked again at the next scrape
        self._last[url] = got.text or ""
        if self._left_out(url, whole):
            self.restricted[url] = False
            return whole
        self.restricted[url] = True
        self._scrapes[url] = 0
        return got

    def _left_out(self, url: str, whole: MetricsScrape) -> bool:
        """Whether the whole page holds a judged series the last restricted page did not (that
        page's series are named here, at the check, not at every scrape)."""
        assert self.series is not None
        return bool((series_names(whole.text) & set(self.series)) - series_names(self._last.get(url, "")))

    def health(self, base_url: str, timeout: float | None = None) -> tuple[int | None, str | None]:
        return probe_health(base_url, self.timeout if timeout is None else timeout)

    def close(self) -> None:
        """Nothing is held between calls; kept so a Scraper reads as the resource it was."""

    def __enter__(self) -> Scraper:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
