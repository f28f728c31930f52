"""A process's sockets: LISTEN addresses and established connections, from psutil or /proc/PID/net.

wedgectl's own connections to the target (its /metrics and /health requests)
are told apart, so they never count as the target's clients.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from wedgectl.collect import procfs, procread


@dataclass(frozen=True)
class SocketEntry:
    """One row of /proc/PID/net/tcp[6]."""

    local: str  # "127.0.0.1:8000" or "[::1]:8000"
    state: int  # kernel TCP state: 0x0A LISTEN, 0x01 ESTABLISHED
    inode: int


TCP_ESTABLISHED = 0x01
TCP_LISTEN = 0x0A


def format_address(ip: str, port: int) -> str:
    """'ip:port', with IPv6 addresses in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _hex_ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    # the kernel prints each 32-bit word in host (little-endian) byte order
    fixed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(fixed)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)


def parse_proc_net_tcp(text: str) -> list[SocketEntry]:
    """Parse /proc/net/tcp or tcp6 (the header line is skipped)."""
    entries = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        ip_hex, port_hex = f[1].rsplit(":", 1)
        entries.append(SocketEntry(format_address(_hex_ip(ip_hex), int(port_hex, 16)), int(f[3], 16), int(f[9])))
    return entries


def socket_inodes(pid: int, proc_root: Path = procfs.PROC, links: list[str] | None = None) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (readlink /proc/PID/fd/* -> 'socket:[N]'; `links`:
    its procfs.fd_links, if read). PermissionError (no CAP_SYS_PTRACE over the target)
    propagates: "no sockets" would be a lie."""
    if links is None:
        links = procfs.fd_links(pid, proc_root)
    return {int(link[8:-1]) for link in links if link.startswith("socket:[") and link[8:-1].isdigit()}


def sockets_from_procfs(pid: int, proc_root: Path = procfs.PROC) -> tuple[tuple[str, ...], int]:
    """(listening addresses, established count) from /proc/PID/net/tcp* and fd inodes."""
    mine = socket_inodes(pid, proc_root)
    listening: set[str] = set()
    established = 0
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_root / str(pid) / "net" / name).read_text()
        except FileNotFoundError:
            continue  # no IPv6
        for e in parse_proc_net_tcp(text):
            if e.inode in mine:
                if e.state == TCP_LISTEN:
                    listening.add(e.local)
                elif e.state == TCP_ESTABLISHED:
                    established += 1
    return tuple(sorted(listening)), established


def listening_of(pid: int, proc_root: Path = procfs.PROC) -> tuple[str, ...]:
    """The API server's LISTEN addresses: from its own socket fds, or, where those are not
    readable (no CAP_SYS_PTRACE), the LISTEN sockets of the netns on the port its cmdline names."""
    try:
        listening, _ = sockets_from_procfs(pid, proc_root)
        return listening
    except OSError:
        pass
    try:
        port = port_from_cmdline(procread.read_cmdline(pid, proc_root))
    except OSError:
        return ()
    found = []
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_root / str(pid) / "net" / name).read_text()
        except OSError:
            continue
        for e in parse_proc_net_tcp(text):
            if e.state == TCP_LISTEN and e.local.rsplit(":", 1)[-1] == str(port):
                found.append(e.local)
    return tuple(sorted(found))


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

    /proc/PID/net/tcp[6] lists every socket of the namespace: on a busy host thousands of lines,
    mostly TIME_WAIT. psutil reads and decodes it whole once per process asked; here it is read
    once per sample, only LISTEN and ESTABLISHED rows are kept (a socket no process holds has
    inode 0 and is skipped), and an address is decoded only for a socket a sampled process holds."""

    def __init__(self, proc_root: Path = procfs.PROC) -> None:
        self.proc_root = proc_root
        self._tables: dict[str, dict[int, tuple[int, str, str]]] = {}  # netns -> inode -> (state, local, remote) hex

    def _table(self, pid: int) -> dict[int, tuple[int, str, str]]:
        base = self.proc_root / str(pid)
        try:
            ns = os.readlink(base / "ns" / "net")
        except OSError:
            ns = f"pid {pid}"  # unreadable: a table of its own
        table = self._tables.get(ns)
        if table is None:
            table = self._tables[ns] = {}
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
                lip, lport = local.rsplit(":", 1)
                rip, rport = remote.rsplit(":", 1)
                out.append((state, format_address(_hex_ip(lip), int(lport, 16)), (_hex_ip(rip), int(rport, 16))))
            except ValueError:
                continue  # a row the kernel never writes: skipped, not fatal
        return out


def own_tcp_addresses(tables: TcpTables) -> frozenset[tuple[str, int]]:
    """wedgectl's own local TCP addresses (its scrape and /health connections), read through `tables`."""
    try:
        mine = tables.of(os.getpid())
    except OSError:
        return frozenset()
    out = set()
    for _state, local, _remote in mine:
        ip, port = local.rsplit(":", 1)
        out.add((ip.strip("[]"), int(port)))
    return frozenset(out)


def sockets_from_tables(pid: int, tables: TcpTables, ours: frozenset[tuple[str, int]],
                        links: list[str] | None = None) -> tuple[tuple[str, ...], int]:
    """(listening addresses, established connections not made by wedgectl itself): `ours` are
    wedgectl's own addresses, read before the process's (see sockets_from_psutil for why)."""
    listening, established = set(), 0
    for state, local, remote in tables.of(pid, links):
        if state == TCP_LISTEN:
            listening.add(local)
        elif state == TCP_ESTABLISHED and remote not in ours:
            established += 1
    return tuple(sorted(listening)), established


def own_addresses() -> set[tuple[str, int]]:
    """This process's own socket addresses: wedgectl's scrape and /health connections to the target."""
    try:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp") if c.laddr}
    except (psutil.Error, OSError):
        return set()


def sockets_from_psutil(proc: psutil.Process, own: frozenset[tuple[str, int]] | None = None) -> tuple[tuple[str, ...], int]:
    """(listening addresses, established connections not made by wedgectl itself). Our own /metrics
    and /health requests run beside this read; counted, they would pass for clients (a leaked-capacity
    count compares clients with requests). Ours are read before and after, so one open across the
    read is seen; a caller sampling several processes reads them once for all (`own`), each read
    being the host's whole TCP table. One of ours opened after that read can only be counted as a
    client: that hides a leak, never makes one."""
    before = own_addresses() if own is None else own
    conns = proc.net_connections(kind="tcp")
    ours = before | (own_addresses() if own is None else set())
    listening = {format_address(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    established = sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED
                      and not (c.raddr and (c.raddr.ip, c.raddr.port) in ours))
    return tuple(sorted(listening)), established
