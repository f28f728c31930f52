"""A process's sockets: LISTEN addresses and established connections, from /proc/PID/net/tcp[6]
and the inodes of its socket fds.

wedgectl's own connections to the target (its /metrics and /health requests)
are told apart, so they never count as the target's clients.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from wedgectl.collect import procfs, procread

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


    def listening_on(self, pid: int, port: int) -> tuple[str, ...]:
        """Every LISTEN address on `port` in pid's network namespace, whoever holds it."""
        found = set()
        for state, local, _remote in self._table(pid).values():
            if state == TCP_LISTEN and local.endswith(f":{port:04X}"):
                lip, lport = local.rsplit(":", 1)
                found.add(format_address(_hex_ip(lip), int(lport, 16)))
        return tuple(sorted(found))


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
