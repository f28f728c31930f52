"""Ending a server's client connections from the server's side, as `ss -K` does: SOCK_DESTROY over
sock_diag netlink. The kernel aborts the socket (tcp_abort: the peer gets a reset, the process holding
it an ECONNABORTED on its next use), so the server sees the client gone; vLLM's API server then aborts
the request that connection carried.

Needs CAP_NET_ADMIN in the server's network namespace and a kernel built with CONFIG_INET_DIAG_DESTROY;
where either is missing the kernel answers EPERM or EOPNOTSUPP, and the caller says so. Only wedgectl's
own network namespace is reached (a sidecar shares its pod's). A connection is named by its addresses
and the cookie the kernel gave the socket: one made since with the same addresses is never touched.
"""

from __future__ import annotations

import errno as errnos
import os
import socket
import struct
from dataclasses import dataclass

from wedgectl.collect import sockets

SOCK_DESTROY = 21  # linux/sock_diag.h
NLM_F_ACK = 0x4
ALL_STATES = 0xFFFFFFFF
DESTROY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Connection:
    """One established client connection of a server, as the kernel names it."""

    row: sockets.DiagRow

    @property
    def local(self) -> tuple[str, int]:
        return sockets.endpoint(self.row.local)

    @property
    def remote(self) -> tuple[str, int]:
        return sockets.endpoint(self.row.remote)

    def describe(self) -> str:
        return f"{sockets.format_address(*self.remote)} -> {sockets.format_address(*self.local)}"


def client_connections(pid: int, port: int, exclude: frozenset[tuple[str, int]] = frozenset()) -> list[Connection]:
    """The ESTABLISHED TCP connections `pid` holds on its local `port` (its clients' connections), from this
    network namespace's tables; `exclude`: remote addresses to leave out (wedgectl's own). OSError when the
    process's fds or the tables cannot be read."""
    inodes = sockets.socket_inodes(pid)
    found: list[Connection] = []

    def keep(row: sockets.DiagRow) -> None:
        if row.inode in inodes and row.state == sockets.TCP_ESTABLISHED and row.local[1] == port:
            conn = Connection(row)
            if conn.remote not in exclude:
                found.append(conn)

    for family in (socket.AF_INET, socket.AF_INET6):
        sockets.diag_dump(family, 1 << sockets.TCP_ESTABLISHED, lambda data: sockets.diag_rows(data, keep))
    return found


def destroy_request(row: sockets.DiagRow, seq: int = 1) -> bytes:
    """The netlink message that asks the kernel to destroy the socket `row` names."""
    src = row.local[0].ljust(16, b"\0")
    dst = row.remote[0].ljust(16, b"\0")
    sockid = row.local[1].to_bytes(2, "big") + row.remote[1].to_bytes(2, "big") + src + dst + struct.pack("=I", 0)
    req = struct.pack("=BBBBI", row.family, socket.IPPROTO_TCP, 0, 0, ALL_STATES) + sockid + row.cookie
    header = struct.pack("=IHHII", 16 + len(req), SOCK_DESTROY, sockets.NLM_F_REQUEST | NLM_F_ACK, seq, 0)
    return header + req


def ack_error(data: bytes) -> int:
    """The errno of the kernel's answer to one request (0: done). ValueError on anything else."""
    if len(data) < 20:
        raise ValueError("sock_diag: a short answer")
    _length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", data)
    if kind != sockets.NLMSG_ERROR:
        raise ValueError(f"sock_diag: answer of type {kind}, not an acknowledgement")
    return -struct.unpack_from("=i", data, 16)[0]


def destroy(conn: Connection, timeout: float = DESTROY_TIMEOUT_S) -> None:
    """Abort the connection in the kernel. OSError with the kernel's errno: EPERM without CAP_NET_ADMIN,
    EOPNOTSUPP on a kernel without CONFIG_INET_DIAG_DESTROY, ENOENT once the socket is gone."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, sockets.NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(timeout)
        sock.sendto(destroy_request(conn.row), (0, 0))
        try:
            code = ack_error(sock.recv(4096))
        except ValueError as exc:
            raise OSError(errnos.EPROTO, str(exc)) from None
    if code:
        raise OSError(code, f"SOCK_DESTROY {conn.describe()}: {os.strerror(code)}")


__all__ = ["Connection", "ack_error", "client_connections", "destroy", "destroy_request"]
