"""GET /metrics and /health (collect.scrape) against real local sockets: each test's server
answers with the bytes a real server (or a broken one) sends, and the scrape must turn every
answer, or none, into a MetricsScrape within its timeout without raising."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from wedgectl.collect import scrape

METRICS = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"


def _response(status: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = {"Content-Length": str(len(body)), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"HTTP/1.1 {status}\r\n{lines}\r\n".encode() + body


class Server:
    """One listening socket on loopback; each connection gets `answer(conn, request_bytes)`."""

    def __init__(self, answer: Callable[[socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(4096)
                if not got:
                    return
                data += got
            self.requests.append(data)
            try:
                self.answer(conn, data)
            except OSError:
                pass  # the client gave up first: what some tests want

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, bytes], None]], Server]]:
    servers: list[Server] = []

    def start(answer: Callable[[socket.socket, bytes], None]) -> Server:
        servers.append(Server(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _send(raw: bytes) -> Callable[[socket.socket, bytes], None]:
    return lambda conn, _req: conn.sendall(raw)


def test_scrape_ok(serve) -> None:
    srv = serve(_send(_response("200 OK", METRICS.encode(), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})))
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert s.ok and s.status == 200 and s.text == METRICS and s.error is None and s.elapsed_s >= 0
    request = srv.requests[0].decode()
    assert request.startswith("GET /metrics HTTP/1.1\r\n")
    assert "Connection: close" in request and "Accept-Encoding" not in request  # identity: nothing to inflate


def test_scrape_chunked_body_and_a_query_string(serve) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    for part in (METRICS[:20], METRICS[20:]):
        chunked += f"{len(part):x}\r\n{part}\r\n".encode()
    srv = serve(_send(chunked + b"0\r\n\r\n"))
    s = scrape.scrape_metrics(f"{srv.url}/metrics?name=vllm")
    assert s.ok and s.text == METRICS
    assert srv.requests[0].startswith(b"GET /metrics?name=vllm HTTP/1.1")


def test_scrape_request_names_its_host(serve) -> None:
    srv = serve(_send(_response("200 OK", METRICS.encode(), {"Content-Type": "text/plain"})))
    scrape.scrape_metrics(f"{srv.url}/metrics")
    port = srv.url.rsplit(":", 1)[1]
    head = srv.requests[0].decode().split("\r\n")
    assert f"Host: 127.0.0.1:{port}" in head and "User-Agent: wedgectl" in head and head[-2:] == ["", ""]


def test_scrape_a_large_body_sent_with_its_headers_in_one_write(serve) -> None:
    """Headers and a body of many reads' worth in one send: the lines are read off a buffer that
    already holds the body, and the body comes out whole (Content-Length, chunked, and close)."""
    body = "".join(f"vllm:x{{i=\"{i}\"}} {i}.0\n" for i in range(20000)).encode()  # ~0.5 MB
    chunked = b"".join(f"{len(body[i:i + 70000]):x};ext=1\r\n".encode() + body[i:i + 70000] + b"\r\n"
                       for i in range(0, len(body), 70000))
    for raw in (_response("200 OK", body, {"Content-Type": "text/plain"}),
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked + b"0\r\nX-Trailer: 1\r\n\r\n",
                b"HTTP/1.0 200 OK\r\n\r\n" + body):
        srv = serve(_send(raw))
        s = scrape.scrape_metrics(f"{srv.url}/metrics")
        assert s.ok and s.text == body.decode(), (raw[:60], s.error)


def test_scrape_skips_an_interim_answer_and_reads_folded_headers(serve) -> None:
    srv = serve(_send(b"HTTP/1.1 100 Continue\r\n\r\n" + _response(
        "200 OK", METRICS.encode(), {"Content-Type": "text/plain;", "X-Folded": "a\r\n b"})))
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert s.ok and s.status == 200 and s.text == METRICS


def test_scrape_malformed_framing_is_bad_data_by_kind(serve) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
    cases = {
        head + b"no colon here\r\n\r\nx": "BadHeaderLine",
        head + b"Content-Length: -5\r\n\r\nx": "BadContentLength",
        head + b"Transfer-Encoding: gzip\r\n\r\nx": "UnknownTransferEncoding",
        head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nx": "IncompleteRead",
        head + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nx": "IncompleteRead",
        b"HTTP/1.1 099 Odd\r\n\r\n": "BadStatusLine",
        head + b"Transfer-Encoding: chunked\r\n\r\n10\r\nonly a part": "IncompleteRead",
        head + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcXY": "IncompleteRead",
        head + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n": "TooManyHeaders: got more than 100 headers",
        head + b"Content-Le": "RemoteDisconnected",
        b"HTTP/1.1 abc OK\r\n\r\n": "BadStatusLine",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n": "no final answer",
    }
    for raw, kind in cases.items():
        srv = serve(_send(raw))
        s = scrape.scrape_metrics(f"{srv.url}/metrics", timeout=2.0)
        assert s.text is None and s.error.startswith("bad_data") and kind in s.error, (raw[-40:], s.error)


def test_scrape_body_ended_by_close(serve) -> None:
    srv = serve(_send(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + METRICS.encode()))
    assert scrape.scrape_metrics(f"{srv.url}/metrics").text == METRICS


def test_scrape_500_keeps_status_and_body(serve) -> None:
    srv = serve(_send(_response("500 Internal Server Error", b"Internal Server Error", {"Content-Type": "text/plain"})))
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert not s.ok and s.status == 500 and s.text == "Internal Server Error" and "500" in s.error


def test_scrape_redirect_is_not_followed(serve) -> None:
    srv = serve(_send(_response("302 Found", b"", {"Location": "http://127.0.0.1:9/metrics"})))
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert s.status == 302 and not s.ok and len(srv.requests) == 1


def test_scrape_silent_server_times_out(serve) -> None:
    srv = serve(lambda conn, _req: time.sleep(30))  # a daemon thread: nothing waits for it
    t0 = time.monotonic()
    s = scrape.scrape_metrics(f"{srv.url}/metrics", timeout=0.3)
    assert time.monotonic() - t0 < 5.0  # bounded by its timeout, not the server's 30 s (margin for a loaded host)
    assert s.status is None and s.error.startswith("timeout") and "ReadTimeout" in s.error


def test_scrape_trickled_body_is_abandoned_at_the_deadline(serve) -> None:
    """A server that sends its headers and then a byte every 50 ms never finishes within the
    timeout: the scrape gives up at the deadline, however often bytes arrive."""

    def trickle(conn: socket.socket, _req: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(200):
            conn.sendall(b"#")
            time.sleep(0.05)

    srv = serve(trickle)
    t0 = time.monotonic()
    s = scrape.scrape_metrics(f"{srv.url}/metrics", timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert s.status == 200 and s.text is None and "body not complete within 0.5s" in s.error


def test_scrape_an_endless_flood_of_tiny_chunks_ends_at_the_deadline(serve) -> None:
    def flood(conn: socket.socket, _req: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
        stop = time.monotonic() + 5
        while time.monotonic() < stop:
            conn.sendall(b"1\r\na\r\n" * 4096)

    srv = serve(flood)
    t0 = time.monotonic()
    s = scrape.scrape_metrics(f"{srv.url}/metrics", timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert s.status == 200 and s.text is None and "body not complete within 0.5s" in s.error


def test_scrape_body_over_the_cap(serve, monkeypatch) -> None:
    monkeypatch.setattr(scrape, "MAX_BODY_BYTES", 1000)
    srv = serve(_send(_response("200 OK", b"x" * 5000, {"Content-Type": "text/plain"})))
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert s.text is None and s.error == "bad_data: body over 1000 bytes"


def test_scrape_non_text(serve) -> None:
    srv = serve(_send(_response("200 OK", b"\x89PNG\r\n\x1a\n\x00", {"Content-Type": "image/png"})))
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert s.status == 200 and s.text is None and not s.ok and s.error.startswith("bad_data")
    for body, headers in ((b"\xff\xfe\x00bad", {}), (b"ok\x00", {"Content-Type": "text/plain"}),
                          (b"x", {"Content-Type": "text/plain; charset=no-such-charset"}),
                          (b"\x1f\x8b\x08\x00", {"Content-Type": "text/plain", "Content-Encoding": "gzip"})):
        srv = serve(_send(_response("200 OK", body, headers)))
        assert scrape.scrape_metrics(f"{srv.url}/metrics").error.startswith("bad_data"), (body, headers)


def test_scrape_garbage_and_cut_off_answers_are_bad_data(serve) -> None:
    for raw in (b"SSH-2.0-OpenSSH_9.2\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\nshort",
                b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n"):
        srv = serve(_send(raw))
        s = scrape.scrape_metrics(f"{srv.url}/metrics")
        assert s.text is None and s.error.startswith("bad_data"), (raw[:40], s.error)
    srv = serve(_send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 500\r\n\r\nshort"))
    assert scrape.scrape_metrics(f"{srv.url}/metrics").error == "bad_data: body cut off: 5 of the 500 bytes announced"


def test_scrape_closed_without_an_answer(serve) -> None:
    srv = serve(lambda conn, _req: None)
    s = scrape.scrape_metrics(f"{srv.url}/metrics")
    assert s.status is None and s.error.startswith("bad_data") and "RemoteDisconnected" in s.error


def test_scrape_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = scrape.scrape_metrics(f"http://127.0.0.1:{port}/metrics")
    assert s.status is None and s.error.startswith("unreachable") and "refused" in s.error


@pytest.mark.parametrize("url", ["ftp://h/metrics", "http:///metrics", "http://h:99999/metrics", "http://h:x/metrics",
                                 "http://127.0.0.1:1/me trics", "http://127.0.0.1:1/m\x00"])
def test_scrape_bad_url_never_raises(url: str) -> None:
    s = scrape.scrape_metrics(url)
    assert s.status is None and s.error.startswith("error: bad URL"), s.error


def test_probe_health(serve) -> None:
    srv = serve(_send(_response("200 OK", b"")))
    assert scrape.probe_health(srv.url) == (200, None)
    assert srv.requests[0].startswith(b"GET /health HTTP/1.1")
    srv = serve(_send(_response("503 Service Unavailable", b"")))
    assert scrape.probe_health(f"{srv.url.removeprefix('http://')}/v1") == (503, None)  # host:port/prefix
    assert srv.requests[0].startswith(b"GET /health ")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    status, error = scrape.probe_health(f"http://127.0.0.1:{port}")
    assert status is None and error.startswith("unreachable")


def test_probe_health_does_not_wait_for_the_body(serve) -> None:
    def headers_then_silence(conn: socket.socket, _req: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        time.sleep(30)

    srv = serve(headers_then_silence)
    t0 = time.monotonic()
    assert scrape.probe_health(srv.url, timeout=10.0) == (200, None)
    assert time.monotonic() - t0 < 5.0  # waiting for the body would take the 10 s timeout; margin for a loaded host


def test_ipv6_loopback(serve) -> None:
    sock = socket.create_server(("::1", 0), family=socket.AF_INET6)
    port = sock.getsockname()[1]

    def one() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(_response("200 OK", METRICS.encode(), {"Content-Type": "text/plain"}))

    t = threading.Thread(target=one, daemon=True)
    t.start()
    try:
        assert scrape.scrape_metrics(f"http://[::1]:{port}/metrics").text == METRICS
    finally:
        t.join(timeout=5)
        sock.close()


def test_scraper_is_safe_from_threads_side_by_side(serve) -> None:
    srv = serve(_send(_response("200 OK", METRICS.encode(), {"Content-Type": "text/plain"})))
    out: list[object] = []
    with scrape.Scraper(2.0) as s:
        threads = [threading.Thread(target=lambda: out.append(s.metrics(f"{srv.url}/metrics").text)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        out.append(s.health(srv.url))
    assert out[:8] == [METRICS] * 8 and out[8] == (200, None)


def _restricting(page: str, status: str = "200 OK", restricted: bytes | None = None) -> Callable[[socket.socket, bytes], None]:
    """A server that answers GET /metrics with `page` and GET /metrics/?name[]=... with `restricted`
    (by default the lines of `page` whose series the query names, as prometheus_client's
    restricted registry does) and `status`."""
    from urllib.parse import parse_qs, unquote, urlsplit

    def answer(conn: socket.socket, req: bytes) -> None:
        target = req.split(b" ", 2)[1].decode()
        parts = urlsplit(target)
        if parts.path == "/metrics":
            conn.sendall(_response("200 OK", page.encode(), {"Content-Type": "text/plain"}))
            return
        names = set(parse_qs(parts.query).get("name[]", []))
        body = restricted if restricted is not None else "".join(
            line + "\n" for line in page.splitlines() if line.split("{")[0].split(" ")[0] in names).encode()
        assert unquote(parts.path) == "/metrics/"
        conn.sendall(_response(status, body, {"Content-Type": "text/plain"}))
    return answer


PAGE = ("vllm:num_requests_running 2.0\nvllm:num_requests_waiting 0.0\n"
        "vllm:e2e_request_latency_seconds_bucket{le=\"1.0\"} 7.0\nvllm:generation_tokens_total 1234.0\n")


def test_a_scraper_with_series_asks_for_them_and_keeps_to_the_restricted_page(serve) -> None:
    srv = serve(_restricting(PAGE))
    s = scrape.Scraper(2.0, series=("vllm:num_requests_running", "vllm:generation_tokens_total"))
    url = f"{srv.url}/metrics"
    first, second = s.metrics(url), s.metrics(url)
    assert first.ok and first.text == "vllm:num_requests_running 2.0\nvllm:generation_tokens_total 1234.0\n"
    assert second.text == first.text and s.restricted == {url: True}
    asked = [r.decode().split(" ")[1] for r in srv.requests]
    restricted = scrape.restricted_url(url, s.series)
    # the first restricted page is checked against the whole page once; then restricted alone
    assert [srv.url + a for a in asked] == [restricted, url, restricted]
    assert asked[0] == "/metrics/?name%5B%5D=vllm%3Anum_requests_running&name%5B%5D=vllm%3Ageneration_tokens_total"
    assert "?" in first.url  # the scrape says what was asked for: a bundle shows it was restricted


@pytest.mark.parametrize("status, body", [
    ("404 Not Found", b"not found"),  # a server with no such route
    ("200 OK", b"<html>a proxy's page</html>"),  # a page with no vLLM series
    ("200 OK", b""),  # an older vLLM: none of the series asked for
])
def test_a_restricted_page_that_does_not_serve_means_the_whole_page_for_the_session(serve, status, body) -> None:
    srv = serve(_restricting(PAGE, status, body))
    s = scrape.Scraper(2.0, series=("vllm:num_requests_running",))
    url = f"{srv.url}/metrics"
    first = s.metrics(url)
    assert first.ok and first.text == PAGE  # this scrape too: within the same call
    assert s.restricted == {url: False}
    assert s.metrics(url).text == PAGE
    asked = [r.decode().split(" ")[1] for r in srv.requests]
    assert asked[0].startswith("/metrics/?") and asked[1:] == ["/metrics", "/metrics"]  # asked once, then never again


def test_a_scrape_with_no_answer_decides_nothing(serve) -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    s = scrape.Scraper(0.5, series=("vllm:num_requests_running",))
    url = f"http://127.0.0.1:{port}/metrics"
    got = s.metrics(url)
    assert not got.ok and got.status is None and got.error.startswith("unreachable")
    assert s.restricted == {}  # the next scrape asks for the restricted page again
    srv = serve(_restricting(PAGE))
    assert s.metrics(f"{srv.url}/metrics").text == "vllm:num_requests_running 2.0\n"


def test_a_scraper_without_series_scrapes_the_whole_page(serve) -> None:
    srv = serve(_restricting(PAGE))
    s = scrape.Scraper(2.0)
    assert s.metrics(f"{srv.url}/metrics").text == PAGE and s.restricted == {}
    assert [r.decode().split(" ")[1] for r in srv.requests] == ["/metrics"]


def test_a_restricted_page_that_leaves_out_a_judged_series_means_the_whole_page(serve) -> None:
    """prometheus_client's restricted registry leaves out a collector that names nothing up front
    (the engine plugin's heartbeat, on vLLM 0.32): the whole page holds that series, so it wins."""
    with_heartbeat = PAGE + "wedge_engine:steps_total 42.0\n"
    srv = serve(_restricting(with_heartbeat, restricted=b"vllm:num_requests_running 2.0\n"))
    s = scrape.Scraper(2.0, series=("vllm:num_requests_running", "wedge_engine:steps_total"))
    url = f"{srv.url}/metrics"
    first = s.metrics(url)
    assert first.text == with_heartbeat and s.restricted == {url: False}
    assert s.metrics(url).text == with_heartbeat
    assert [r.decode().split(" ")[1].split("?")[0] for r in srv.requests] == ["/metrics/", "/metrics", "/metrics"]


def test_the_whole_page_is_taken_now_and_then_and_a_series_that_appeared_switches_to_it(serve, monkeypatch) -> None:
    monkeypatch.setattr(scrape, "VERIFY_EVERY", 3)
    state = {"page": PAGE}
    restricted = b"vllm:num_requests_running 2.0\n"

    def answer(conn: socket.socket, req: bytes) -> None:
        whole = req.split(b" ", 2)[1] == b"/metrics"
        body = state["page"].encode() if whole else restricted
        conn.sendall(_response("200 OK", body, {"Content-Type": "text/plain"}))

    srv = serve(answer)
    s = scrape.Scraper(2.0, series=("vllm:num_requests_running", "wedge_engine:steps_total"))
    url = f"{srv.url}/metrics"
    texts = [s.metrics(url).text for _ in range(5)]  # first (checked), 3 restricted, then a whole page
    assert texts == [restricted.decode()] * 4 + [PAGE] and s.restricted == {url: True}
    state["page"] = PAGE + "wedge_engine:steps_total 1.0\n"  # the heartbeat appears (the engine is up now)
    texts = [s.metrics(url).text for _ in range(4)]
    assert texts == [restricted.decode()] * 3 + [state["page"]] and s.restricted == {url: False}
    assert s.metrics(url).text == state["page"]
    paths = [r.decode().split(" ")[1].split("?")[0] for r in srv.requests]
    assert paths == ["/metrics/", "/metrics"] + ["/metrics/"] * 3 + ["/metrics"] + ["/metrics/"] * 3 + ["/metrics"] * 2
