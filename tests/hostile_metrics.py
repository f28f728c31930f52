"""A hostile /metrics server on 127.0.0.1 (a free port), for the scrape, diagnose and watch tests.

Each mode is one way a target can answer /metrics to stall or bloat whoever scrapes it:

- ``punycode``: ``charset=punycode`` and a 400 KB body shaped so that Python's punycode decoder
  (quadratic) takes seconds on it;
- ``undefined``: ``charset=undefined``, whose codec raises a bare UnicodeError on any decode;
- ``badutf8``: a body that is not valid UTF-8, in the default charset;
- ``garbage``: valid UTF-8 that is no exposition: one 400 KB line of C1 control characters, which
  a parse error quotes back;
- ``redos``: a ``# HELP`` line of ``("a: [" + "x" * 30) * n`` (~400 KB), the shape the redaction
  regex once rescanned to the line's end at every ``[``;
- ``drip``: the headers, then one byte of body every 0.5 s, for ever;
- ``endless``: a chunked body that never ends, 4 KiB chunks as fast as about 2 MB/s (so a
  scrape's deadline, not its size cap, ends it: the cap is 32 MiB);
- ``oversized``: a body over 32 MiB, with its Content-Length; ``oversized-unannounced``: the
  same without one (read until the cap);
- ``big``: a valid vLLM page padded to ``size`` bytes with long comment lines (a page a watcher
  would keep); ``bigseries``: padded with sample lines instead (no lean copy makes it smaller);
- ``good``: a recorded vLLM /metrics page (tests/fixtures/real/metrics_idle.txt).

``python tests/hostile_metrics.py MODE [SIZE]`` serves one until killed and prints its URL.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

RECORDED = Path(__file__).parent / "fixtures" / "real" / "metrics_idle.txt"
MODES = ("punycode", "undefined", "badutf8", "garbage", "redos", "drip", "endless", "oversized",
         "oversized-unannounced", "big", "bigseries", "good")
OVER_CAP = 32 * 1024 * 1024 + 4096
TEXT = "text/plain; version=0.0.4; charset=utf-8"


def recorded_page() -> bytes:
    return RECORDED.read_bytes()


def punycode_body(size: int = 400_000) -> bytes:
    """A base of ASCII, then one digit 'a' per inserted character: each insertion rebuilds the
    decoded string, so the decode is quadratic in the body's length (seconds at 400 KB)."""
    half = size // 2
    return b"x" * half + b"-" + b"a" * (size - half - 1)


def redos_line(size: int = 400_000) -> bytes:
    unit = b"a: [" + b"x" * 30
    return b"# HELP vllm:hostile " + unit * (size // len(unit)) + b"\n"


def padded_page(size: int, series: bool = False) -> bytes:
    """The recorded page, padded to about `size` bytes: with comment lines of 4 KiB, or with
    sample lines (`series`), which a lean copy keeps."""
    page = recorded_page()
    if series:
        line = b'vllm:hostile_padding_total{i="%07d",pad="' + b"p" * 40 + b'"} 1\n'
        n = max(0, size - len(page)) // len(line % 0)
        return page + b"".join(line % i for i in range(n))
    line = b"# " + b"p" * 4093 + b"\n"
    return page + line * (max(0, size - len(page)) // len(line))


class HostileMetrics:
    """One server in one mode: ``url`` is its base URL (``/metrics`` is answered at any path)."""

    def __init__(self, mode: str, size: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.size = size
        self.closed = threading.Event()
        self.requests = 0
        self._body = self._make_body()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"hostile-{mode}")
        self.thread.start()

    def _make_body(self) -> bytes:
        mode, size = self.mode, self.size
        if mode == "punycode":
            return punycode_body(size or 400_000)
        if mode == "redos":
            return redos_line(size or 400_000)
        if mode == "garbage":
            return "\u0080\u009b".encode() * ((size or 400_000) // 4) + b" 1\n"
        if mode == "badutf8":
            return recorded_page() + b"# \xff\xfe not utf-8 \xc3\x28\n"
        if mode in ("big", "bigseries"):
            return padded_page(size or 6 << 20, series=mode == "bigseries")
        if mode in ("oversized", "oversized-unannounced"):
            return b"# " + b"o" * (1 << 20) + b"\n"  # one MiB, sent again and again past the cap
        return recorded_page()

    def __enter__(self) -> HostileMetrics:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.close()
        except OSError:
            pass

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True, name=f"hostile-{self.mode}-conn").start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request and len(request) < 65536:
                data = conn.recv(4096)
                if not data:
                    return
                request += data
            self.requests += 1
            self._answer(conn, request)
        except OSError:
            pass  # the scraper gave up and closed: what a hostile server expects
        finally:
            conn.close()

    def _head(self, conn: socket.socket, ctype: str, length: int | None = None, chunked: bool = False) -> None:
        head = f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nConnection: close\r\n"
        if length is not None:
            head += f"Content-Length: {length}\r\n"
        if chunked:
            head += "Transfer-Encoding: chunked\r\n"
        conn.sendall((head + "\r\n").encode("latin-1"))

    def _answer(self, conn: socket.socket, request: bytes) -> None:
        mode, body = self.mode, self._body
        if mode == "punycode":
            self._head(conn, "text/plain; charset=punycode", len(body))
            conn.sendall(body)
        elif mode == "undefined":
            self._head(conn, "text/plain; version=0.0.4; charset=undefined", len(body))
            conn.sendall(body)
        elif mode == "drip":
            self._head(conn, TEXT)
            while not self.closed.is_set():
                conn.sendall(b"#")
                time.sleep(0.5)
        elif mode == "endless":
            self._head(conn, TEXT, chunked=True)
            chunk = b"# endless\n" * 409 + b"#\n"  # 4 KiB
            frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
            while not self.closed.is_set():
                conn.sendall(frame)
                time.sleep(0.002)
        elif mode in ("oversized", "oversized-unannounced"):
            self._head(conn, TEXT, OVER_CAP if mode == "oversized" else None)
            sent = 0
            while sent < OVER_CAP and not self.closed.is_set():
                part = body[: OVER_CAP - sent]
                conn.sendall(part)
                sent += len(part)
        else:  # badutf8, garbage, redos, big, bigseries, good
            self._head(conn, TEXT, len(body))
            conn.sendall(body)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES:
        print(f"usage: hostile_metrics.py MODE [SIZE]   (MODE: {', '.join(MODES)})", file=sys.stderr)
        return 2
    server = HostileMetrics(argv[0], int(argv[1]) if len(argv) > 1 else None)
    print(server.url, flush=True)
    try:
        server.closed.wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
