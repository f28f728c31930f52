"""The API server's client-connection count on real sockets: clients count, wedgectl's own scrapes do not."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil

from wedgectl.collect.processes import sample_process
from wedgectl.model.types import Role

SERVER = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
held = []
s.settimeout(30)
while True:
    try:
        held.append(s.accept()[0])
    except OSError:
        break
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("ok", flush=True)
time.sleep(30)
"""


def _established(pid: int, want: int, deadline_s: float = 5.0) -> int:
    n = -1
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        sample, _ = sample_process(psutil.Process(pid), Role.API_SERVER, with_threads=False)
        n = sample.connections
        if n == want:
            break
        time.sleep(0.05)
    return n


def test_own_connections_are_not_clients():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen] = []
    ours = None
    try:
        port = int(server.stdout.readline())
        ours = socket.create_connection(("127.0.0.1", port), timeout=5)  # as wedgectl's scrape would be
        assert _established(server.pid, 0) == 0
        for _ in range(2):
            c = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
            clients.append(c)
            assert c.stdout.readline().strip() == "ok"
        assert _established(server.pid, 2) == 2
    finally:
        if ours is not None:
            ours.close()
        for p in (*clients, server):
            p.kill()
            p.wait(timeout=5)


def test_a_server_in_another_network_namespace_is_read_from_its_own_table() -> None:
    """A container's server: sock_diag answers for wedgectl's namespace only, so its table is
    /proc/PID/net/tcp, and its listener is found there (not in ours, where nothing listens)."""
    import os
    import shutil

    from wedgectl.collect.sockets import TcpTables

    assert shutil.which("unshare"), "util-linux's unshare is part of the base system"
    # The port, held bound (never listening) in our namespace for the test's length: no other test's server can
    # listen on it here meanwhile, so "not there" below is about the namespaces, not a neighbour's luck.
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    proc = subprocess.Popen(["unshare", "-n", sys.executable, "-c", SERVER, str(held.getsockname()[1])],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert port == held.getsockname()[1]
        assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        tables = TcpTables()
        assert tables.listening_on(proc.pid, port) == (f"127.0.0.1:{port}",)
        assert [(state, local) for state, local, _ in tables.of(proc.pid)] == [(0x0A, f"127.0.0.1:{port}")]
        assert tables.listening_on(os.getpid(), port) == ()  # our namespace, over sock_diag: not there
        assert tables.diag_failed is None
    finally:
        proc.kill()
        proc.wait()
        held.close()


def test_the_ipv6_table_is_asked_only_while_an_ipv6_tcp_socket_exists(tmp_path, monkeypatch) -> None:
    """A sock_diag dump of an empty IPv6 table still walks the kernel's connection hash (1.1 ms of
    CPU): it is skipped while sockstat6 counts no IPv6 TCP socket, and a real IPv6 listener is
    still found once one exists."""
    import os

    import pytest

    from wedgectl.collect import sockets

    sockstat = tmp_path / "sockstat6"
    sockstat.write_text("TCP6: inuse 0\nUDP6: inuse 2\n")
    assert sockets.tcp6_in_use(sockstat) is False
    sockstat.write_text("TCP6: inuse 3\nUDP6: inuse 0\n")
    assert sockets.tcp6_in_use(sockstat) is True
    sockstat.write_text("TCP6 something else\n")
    assert sockets.tcp6_in_use(sockstat) is True  # cannot tell: the table is asked
    assert sockets.tcp6_in_use(tmp_path / "absent") is False  # no IPv6 on the host

    asked: list[int] = []
    real = sockets.diag_tcp
    monkeypatch.setattr(sockets, "diag_tcp", lambda family, *a: asked.append(family) or real(family, *a))
    if not sockets.tcp6_in_use():
        sockets.TcpTables().listening_on(os.getpid(), 1)
        assert asked == [socket.AF_INET]
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel: nothing to find")  # the unit checks above ran
    listener = socket.socket(socket.AF_INET6)
    try:
        listener.bind(("::1", 0))
    except OSError:
        listener.close()
        pytest.skip("no IPv6 loopback address here: nothing to find")
    try:
        listener.listen(1)
        port = listener.getsockname()[1]
        assert sockets.tcp6_in_use()
        asked.clear()
        tables = sockets.TcpTables()
        assert tables.listening_on(os.getpid(), port) == (f"[::1]:{port}",)
        assert asked == [socket.AF_INET, socket.AF_INET6] and tables.diag_failed is None
    finally:
        listener.close()
