"""A process's sockets: LISTEN addresses and established connections, from the kernel's socket
tables (sock_diag netlink, or /proc/PID/net/tcp[6]) and the inodes of its socket fds.

wedgectl's own connections to the target (its /metrics and /health requests)
are told apart, so they never count as the target's clients.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wedgectl.collect import procfs, procread

TCP_ESTABLISHED = 0x01
TCP_LISTEN = 0x0A

# sock_diag (linux/sock_diag.h, linux/inet_diag.h): what `ss` asks the kernel
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_msg: family, state, timer, retrans, id (sport, dport, src, dst, if, cookie), expires, rqueue, wqueue,
# uid, inode
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16s4x8s4x4x4x4xI")
DIAG_TIMEOUT_S = 2.0
DIAG_MAX_BYTES = 64 << 20  # a dump past this (a host with ~600k sockets) is not read on: /proc is asked instead


def format_address(ip: str, port: int) -> str:
    """'ip:port', with IPv6 addresses in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _hex_ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    # the kernel prints each 32-bit word in host (little-endian) byte order
    return _packed_ip(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))


def _packed_ip(packed: bytes) -> str:
    addr = ipaddress.ip_address(packed)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)


End = str | tuple[bytes, int]  # a table row's end: /proc's hex 'ADDR:PORT', or sock_diag's (packed, port)


def endpoint(end: End) -> tuple[str, int]:
    """(ip, port) of a table row's end: /proc's hex 'ADDR:PORT' or sock_diag's (packed, port).
    ValueError on a row the kernel never writes."""
    if isinstance(end, str):
        ip, port = end.rsplit(":", 1)
        return _hex_ip(ip), int(port, 16)
    return _packed_ip(end[0]), end[1]


def _port(end: End) -> int:
    """The port of a table row's end, its address left undecoded."""
    return int(end.rsplit(":", 1)[1], 16) if isinstance(end, str) else end[1]


@dataclass(frozen=True)
class DiagRow:
    """One socket of a sock_diag dump, as the kernel wrote it: what SOCK_DESTROY names it by too."""

    family: int
    state: int
    local: tuple[bytes, int]  # (packed address, port)
    remote: tuple[bytes, int]
    cookie: bytes  # the socket's 8-byte cookie: a socket made since with the same addresses has another
    inode: int


def parse_diag_dump(data: bytes, into: dict[int, tuple[int, End, End]]) -> bool:
    """Add one sock_diag reply's inet_diag_msgs to `into` (inode -> (state, local, remote)), sockets
    no process holds (inode 0) left out; True once the dump is done. OSError for the kernel's error."""

    def keep(row: DiagRow) -> None:
        if row.inode and row.state in (TCP_ESTABLISHED, TCP_LISTEN):
            into[row.inode] = (row.state, row.local, row.remote)

    return diag_rows(data, keep)


def diag_rows(data: bytes, on_row: Callable[[DiagRow], None]) -> bool:
    """Hand each inet_diag_msg of one sock_diag reply to `on_row`; True once the dump is done.
    OSError for the kernel's error."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            raise OSError("sock_diag: a malformed reply")
        if kind == NLMSG_DONE:
            return True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", data, off + _NLMSG.size)[0] if length >= _NLMSG.size + 4 else 0
            raise OSError(errno, f"sock_diag: {os.strerror(errno) if errno > 0 else 'error'}")
        if kind == SOCK_DIAG_BY_FAMILY and length >= _NLMSG.size + _DIAG_MSG.size:
            family, state, _t, _r, sport, dport, src, dst, cookie, inode = _DIAG_MSG.unpack_from(
                data, off + _NLMSG.size)
            n = 4 if family == socket.AF_INET else 16
            on_row(DiagRow(family, state, (src[:n], int.from_bytes(sport, "big")),
                           (dst[:n], int.from_bytes(dport, "big")), cookie, inode))
        off += (length + 3) & ~3
    return False


def diag_tcp(family: int, timeout: float = DIAG_TIMEOUT_S) -> dict[int, tuple[int, End, End]]:
    """This network namespace's LISTEN and ESTABLISHED TCP sockets of one address family, asked of
    the kernel over sock_diag netlink, as `ss` does: the kernel filters on the state and writes
    binary records. Reading /proc/net/tcp walks the same tables and makes and parses their text:
    3.6 ms of CPU a table against sock_diag's 1.2 ms, measured beside a serving vLLM on 2 cores.
    Bounded in time and bytes; OSError (TimeoutError) past them."""
    out: dict[int, tuple[int, End, End]] = {}
    diag_dump(family, (1 << TCP_ESTABLISHED) | (1 << TCP_LISTEN), lambda data: parse_diag_dump(data, out), timeout)
    return out


def diag_dump(family: int, states: int, parse: Callable[[bytes], bool], timeout: float = DIAG_TIMEOUT_S) -> None:
    """Ask the kernel for the TCP sockets of one family in `states` (a bit mask) and hand each reply to
    `parse` until it says the dump is done. Bounded in time and bytes; OSError (TimeoutError) past them."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
        req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, states) + bytes(48)  # inet_diag_req_v2
        sock.settimeout(timeout)
        sock.sendto(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req,
                    (0, 0))
        got = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"sock_diag: no end of the dump within {timeout:.1f}s")
            sock.settimeout(left)
            data = sock.recv(1 << 16)
            got += len(data)
            if not data or got > DIAG_MAX_BYTES:
                raise OSError("sock_diag: the dump ended early or ran past its size bound")
            if parse(data):
                return


def tcp6_in_use(path: Path | str = "/proc/net/sockstat6") -> bool:
    """Whether wedgectl's network namespace holds any IPv6 TCP socket ("TCP6: inuse N" in
    sockstat6). A sock_diag dump walks the kernel's whole connection hash, however few sockets
    it lists: 1.1 ms of CPU for an IPv6 table with no socket in it, measured, against 0.03 ms for
    this read. True where it cannot tell (unreadable, another format): then the table is asked.
    A host without IPv6 has no sockstat6 and no IPv6 socket: False."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(4096)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for line in text.splitlines():
        if line.startswith("TCP6:"):
            fields = line.split()
            if len(fields) >= 3 and fields[1] == "inuse" and fields[2].isdigit():
                return int(fields[2]) > 0
            break
    return True


def socket_inodes(pid: int, proc_root: Path = procfs.PROC, links: list[str] | None = None) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (readlink /proc/PID/fd/* -> 'socket:[N]'; `links`:
    its procfs.fd_links, if read). PermissionError (no CAP_SYS_PTRACE over the target)
    propagates: "no sockets" would be a lie."""
    if links is None:
        links = procfs.fd_links(pid, proc_root)
    return {int(link[8:-1]) for link in links if link.startswith("socket:[") and link[8:-1].isdigit()}


def listening_of(pid: int, proc_root: Path = procfs.PROC) -> tuple[str, ...]:
    """The API server's LISTEN addresses: from its own socket fds, or, where those are not
    readable (no CAP_SYS_PTRACE), the LISTEN sockets of the netns on the port its cmdline names."""
    tables = TcpTables(proc_root)
    try:
        return tuple(sorted({local for state, local, _ in tables.of(pid) if state == TCP_LISTEN}))
    except OSError:
        pass
    try:
        port = port_from_cmdline(procread.read_cmdline(pid, proc_root))
        return tables.listening_on(pid, port)
    except OSError:
        return ()


def port_from_cmdline(cmdline: list[str]) -> int:
    """vLLM's --port (default 8000)."""
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline) and cmdline[i + 1].isdigit():
            return int(cmdline[i + 1])
        if arg.startswith("--port=") and arg[7:].isdigit():
            return int(arg[7:])
    return 8000


class TcpTables:
    """The TCP sockets of the network namespaces one sample meets, each namespace's table read once.

    A namespace's table lists every socket in it: on a busy host thousands, mostly TIME_WAIT.
    wedgectl's own namespace (a target beside it on the host) is asked over sock_diag netlink
    (diag_tcp), which gives only the LISTEN and ESTABLISHED ones; a target in another namespace
    (a container), or a host where netlink is refused, is read from /proc/PID/net/tcp[6], once per
    sample, only LISTEN and ESTABLISHED rows kept. A socket no process holds has inode 0 and is
    skipped; an address is decoded only for a socket a sampled process holds."""

    def __init__(self, proc_root: Path = procfs.PROC, diag: bool = True) -> None:
        self.proc_root = proc_root
        self.diag = diag  # False: /proc's tables even for wedgectl's own namespace
        self._tables: dict[str, dict[int, tuple[int, End, End]]] = {}  # netns -> inode -> (state, local, remote)
        self.diag_failed: str | None = None  # why sock_diag could not be used, once it could not
        self._own_ns: str | None = None

    def _own_netns(self) -> str | None:
        if self._own_ns is None:
            try:
                self._own_ns = os.readlink("/proc/self/ns/net")
            except OSError:
                self._own_ns = ""
        return self._own_ns or None

    def _table(self, pid: int) -> dict[int, tuple[int, End, End]]:
        base = self.proc_root / str(pid)
        try:
            ns = os.readlink(base / "ns" / "net")
        except OSError:
            ns = f"pid {pid}"  # unreadable: a table of its own
        table = self._tables.get(ns)
        if table is None:
            if self.diag and self.proc_root == procfs.PROC and ns == self._own_netns() and self.diag_failed is None:
                try:
                    table = diag_tcp(socket.AF_INET)
                    if tcp6_in_use():
                        table.update(diag_tcp(socket.AF_INET6))
                except OSError as exc:  # netlink refused (a seccomp profile), or past its bounds
                    self.diag_failed, table = str(exc) or type(exc).__name__, None
            if table is None:
                table = _proc_table(base)
            self._tables[ns] = table
        return table

    def of(self, pid: int, links: list[str] | None = None) -> list[tuple[int, str, tuple[str, int]]]:
        """(state, local 'ip:port', remote (ip, port)) of each LISTEN or ESTABLISHED socket pid holds.
        Raises OSError (PermissionError without CAP_SYS_PTRACE over it) when its fds are unreadable."""
        table = self._table(pid)
        out = []
        for inode in socket_inodes(pid, self.proc_root, links):
            row = table.get(inode)
            if row is None:
                continue
            state, local, remote = row
            try:
                lip, lport = endpoint(local)
                out.append((state, format_address(lip, lport), endpoint(remote)))
            except ValueError:
                continue  # a row the kernel never writes: skipped, not fatal
        return out

    def listening_on(self, pid: int, port: int) -> tuple[str, ...]:
        """Every LISTEN address on `port` in pid's network namespace, whoever holds it."""
        found = set()
        for state, local, _remote in self._table(pid).values():
            if state != TCP_LISTEN:
                continue
            try:
                if _port(local) == port:  # the port first: only a match's address is decoded
                    found.add(format_address(*endpoint(local)))
            except (ValueError, IndexError):
                continue  # a row the kernel never writes
        return tuple(sorted(found))


def _proc_table(base: Path) -> dict[int, tuple[int, End, End]]:
    """A namespace's LISTEN and ESTABLISHED sockets held by some process, from base/net/tcp[6]."""
    table: dict[int, tuple[int, End, End]] = {}
    for name in ("tcp", "tcp6"):
        try:
            text = (base / "net" / name).read_text()
        except FileNotFoundError:
            continue  # no IPv6
        for line in text.splitlines()[1:]:
            f = line.split(None, 10)
            if len(f) >= 10 and f[3] in ("01", "0A") and f[9] != "0" and f[9].isdigit():
                table[int(f[9])] = (int(f[3], 16), f[1], f[2])
    return table


def own_tcp_addresses(tables: TcpTables) -> frozenset[tuple[str, int]]:
    """wedgectl's own local TCP addresses (its scrape and /health connections), read through `tables`.

    Its socket fds are read both before and after the table (a dump the first time it is asked):
    a scrape finishing beside the read closes its connection at any moment, and one closed after
    the dump but before a single fd read would still be ESTABLISHED in the table on the server's
    side and count as a client. Read on both sides, every connection of ours the table holds is
    known as ours."""
    me = os.getpid()
    try:
        before = procfs.own_fd_links()
        tables.of(me, [])  # the table, dumped (or read) now: after `before`, before `after`
        mine = tables.of(me, before + procfs.own_fd_links())  # one set of inodes, each decoded once
    except OSError:
        return frozenset()
    out = set()
    for _state, local, _remote in mine:
        ip, port = local.rsplit(":", 1)
        out.add((ip.strip("[]"), int(port)))
    return frozenset(out)


def sockets_from_tables(pid: int, tables: TcpTables, ours: frozenset[tuple[str, int]],
                        links: list[str] | None = None) -> tuple[tuple[str, ...], int]:
    """(listening addresses, established connections not made by wedgectl itself). Our own /metrics
    and /health requests run beside this read; counted, they would pass for clients (a leaked-capacity
    count compares clients with requests). `ours` are wedgectl's own addresses (own_tcp_addresses),
    read before the process's: one of ours opened after that read can only be counted as a client,
    which hides a leak, never makes one."""
    listening, established = set(), 0
    for state, local, remote in tables.of(pid, links):
        if state == TCP_LISTEN:
            listening.add(local)
        elif state == TCP_ESTABLISHED and remote not in ours:
            established += 1
    return tuple(sorted(listening)), established
