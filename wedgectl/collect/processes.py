"""Find a vLLM deployment's process tree, name each process's role, and sample it (psutil + procfs)."""

from __future__ import annotations

import ipaddress
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from wedgectl.collect import procfs
from wedgectl.collect._failures import failure_from_oserror, permission_hint
from wedgectl.types import CollectorFailure, FailureKind, ProcessSample, Role

COLLECTOR = "psutil"

# vLLM's set_process_title: f"{VLLM_PROCESS_NAME_PREFIX}::{name}[_{suffix}]", prefix "VLLM" by default.
_TITLE = re.compile(r"^\s*([\w.-]+)::(\w*)")
_TITLE_ROLES = (("EngineCore", Role.ENGINE_CORE), ("Worker", Role.WORKER), ("APIServer", Role.API_SERVER))
_PYTHON = re.compile(r"^(python|pypy)[\d.]*$")
_COMM_LEN = 15  # task->comm holds 15 characters: a title seen through name() may be cut


def _tokens(cmdline: Sequence[str]) -> list[str]:
    # setproctitle can leave the whole title in argv[0] with spaces instead of NULs
    if len(cmdline) == 1 and " " in cmdline[0]:
        return cmdline[0].split()
    return list(cmdline)


def _entry(tokens: Sequence[str]) -> tuple[str, list[str]]:
    """What a command runs (script path, '-m' module or '-c'), and the arguments after it."""
    if not tokens:
        return "", []
    if not _PYTHON.match(os.path.basename(tokens[0])):
        return tokens[0], list(tokens[1:])
    i = 1
    while i < len(tokens):
        t = tokens[i]
        if t in ("-m", "-c"):
            if t == "-c":
                return "-c", list(tokens[i + 1 :])
            return (tokens[i + 1] if i + 1 < len(tokens) else ""), list(tokens[i + 2 :])
        if t in ("-X", "-W", "-Q"):
            i += 2
            continue
        if t.startswith("-"):
            i += 1
            continue
        return t, list(tokens[i + 1 :])
    return "", []


def _role_from_title(text: str, may_be_cut: bool) -> Role | None:
    m = _TITLE.match(text)
    if not m:
        return None
    kind = m.group(2)
    for title, role in _TITLE_ROLES:
        if kind.startswith(title) or (may_be_cut and kind and title.startswith(kind)):
            return role
    return Role.OTHER  # some other titled vLLM process, e.g. DPCoordinator


def classify_role(name: str, cmdline: Sequence[str]) -> Role:
    """The role a process plays, from its name (comm/title) and cmdline alone.

    Titled processes ("VLLM::EngineCore_DP0", "VLLM::Worker_TP0",
    "VLLM::APIServer_0") are recognised whatever the prefix. Untitled API
    servers are recognised by how they were started: `vllm serve`,
    `-m vllm.entrypoints.openai.api_server`, `entrypoints/cli/main.py serve`,
    or a `*_serve.py` launcher given a `serve` argument. Everything else,
    the multiprocessing resource tracker included, is OTHER: a spawned
    engine without setproctitle needs its parent to tell (see `role_of`).
    """
    tokens = _tokens(cmdline)
    if tokens:
        role = _role_from_title(tokens[0], may_be_cut=False)
        if role is not None:
            return role
    role = _role_from_title(name, may_be_cut=len(name) >= _COMM_LEN)
    if role is not None:
        return role

    entry, rest = _entry(tokens)
    if entry == "-c":
        return Role.OTHER  # multiprocessing spawn_main / resource_tracker
    base = entry.replace("\\", "/")
    first = rest[0] if rest else ""
    if os.path.basename(base) == "vllm" and first == "serve":
        return Role.API_SERVER
    if base == "vllm.entrypoints.openai.api_server" or base.endswith("vllm/entrypoints/openai/api_server.py"):
        return Role.API_SERVER
    if (base == "vllm.entrypoints.cli.main" or base.endswith("entrypoints/cli/main.py")) and first == "serve":
        return Role.API_SERVER
    if base.endswith("_serve.py") and "serve" in rest:
        return Role.API_SERVER
    return Role.OTHER


def _mentions_vllm(cmdline: Sequence[str]) -> bool:
    """A python whose entry point is vLLM's (module vllm.*, a `vllm` script, a file under vllm/)."""
    tokens = _tokens(cmdline)
    if not tokens or not _PYTHON.match(os.path.basename(tokens[0])) and os.path.basename(tokens[0]) != "vllm":
        return False
    entry, _ = _entry(tokens)
    entry = entry.replace("\\", "/")
    return entry.startswith("vllm.") or os.path.basename(entry) == "vllm" or "/vllm/" in entry


def _is_mp_child(cmdline: Sequence[str]) -> bool:
    entry, rest = _entry(_tokens(cmdline))
    return entry == "-c" and bool(rest) and "multiprocessing" in rest[0]


def _name_cmdline(proc: psutil.Process) -> tuple[str, list[str]]:
    with proc.oneshot():
        return proc.name(), proc.cmdline()


def looks_like_vllm(proc: psutil.Process, _depth: int = 0) -> bool:
    """Whether a process belongs to a vLLM deployment: a vLLM role or entry point, or a
    multiprocessing child (spawned engine, resource tracker) of such a process."""
    try:
        name, cmdline = _name_cmdline(proc)
        if classify_role(name, cmdline) is not Role.OTHER or _mentions_vllm(cmdline):
            return True
        if _TITLE.match(name) or (cmdline and _TITLE.match(cmdline[0])):
            return True  # a titled vLLM helper (DPCoordinator, ...)
        if _depth < 4 and _is_mp_child(cmdline):
            parent = proc.parent()
            return parent is not None and looks_like_vllm(parent, _depth + 1)
    except (psutil.Error, OSError):
        pass
    return False


def role_of(proc: psutil.Process) -> Role:
    """classify_role, plus what the parent tells: an untitled multiprocessing child (or a
    fork that still shows its parent's cmdline) of an API server is its engine core, and
    of an engine core a worker."""
    try:
        name, cmdline = _name_cmdline(proc)
    except (psutil.Error, OSError):
        return Role.OTHER
    role = classify_role(name, cmdline)
    entry, rest = _entry(_tokens(cmdline))
    if entry == "-c" and rest and "resource_tracker" in rest[0]:
        return Role.OTHER
    try:
        parent = proc.parent()
        if parent is None:
            return role
        p_name, p_cmdline = _name_cmdline(parent)
    except (psutil.Error, OSError):
        return role
    forked = role is not Role.OTHER and list(cmdline) == list(p_cmdline)
    if role is Role.OTHER and _is_mp_child(cmdline) or forked:
        parent_role = role_of(parent) if forked else classify_role(p_name, p_cmdline)
        if parent_role is Role.API_SERVER:
            return Role.ENGINE_CORE
        if parent_role is Role.ENGINE_CORE:
            return Role.WORKER
    return role


def process_tree(pid: int) -> list[psutil.Process]:
    """The whole deployment ``pid`` belongs to: its root (found by walking up while the
    parent still looks like vLLM) followed by every descendant. [] if ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
    except (psutil.Error, OSError):
        return []
    for _ in range(32):
        try:
            parent = root.parent()
        except (psutil.Error, OSError):
            break
        if parent is None or parent.pid <= 1 or not looks_like_vllm(parent):
            break
        root = parent
    try:
        descendants = root.children(recursive=True)
    except (psutil.Error, OSError):
        descendants = []
    return [root, *descendants]


# ---------------------------------------------------------------------------
# sockets


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


def socket_inodes(pid: int, proc_root: Path = procfs.PROC) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (readlink /proc/PID/fd/* -> 'socket:[N]')."""
    inodes = set()
    fd_dir = proc_root / str(pid) / "fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(fd_dir / fd)
        except FileNotFoundError:
            continue  # closed meanwhile
        # PermissionError (no CAP_SYS_PTRACE over the target) propagates: "no sockets" would be a lie
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


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


def _sockets_from_psutil(proc: psutil.Process) -> tuple[tuple[str, ...], int]:
    conns = proc.net_connections(kind="inet")
    listening = {format_address(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    established = sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED)
    return tuple(sorted(listening)), established


# ---------------------------------------------------------------------------
# sampling


def _call_bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """Run fn in a daemon thread; (True, result or exception) or (False, None) after timeout.

    Reading /proc/PID/cmdline takes the target's mmap lock, which a thread
    stuck in the GPU driver (state D) can hold indefinitely.
    """
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box.append(exc)

    t = threading.Thread(target=run, name="wedgectl-bounded-read", daemon=True)
    t.start()
    t.join(timeout)
    return (True, box[0]) if box else (False, None)


def _psutil_failure(exc: BaseException, pid: int, what: str) -> CollectorFailure:
    if isinstance(exc, psutil.NoSuchProcess):  # ZombieProcess too
        return CollectorFailure(COLLECTOR, FailureKind.GONE, f"{what}: process exited", str(pid))
    if isinstance(exc, psutil.AccessDenied):
        return CollectorFailure(COLLECTOR, FailureKind.PERMISSION, f"{what}: {permission_hint(pid)}", str(pid))
    if isinstance(exc, OSError):
        return failure_from_oserror(COLLECTOR, exc, str(pid), what, pid)
    return CollectorFailure(COLLECTOR, FailureKind.ERROR, f"{what}: {exc!r}", str(pid))


def sample_process(
    proc: psutil.Process,
    role: Role,
    with_threads: bool = True,
    proc_root: Path = procfs.PROC,
    timeout: float = 2.0,
) -> tuple[ProcessSample, tuple[CollectorFailure, ...]]:
    """One ProcessSample: state, CPU, threads (procfs) and name, cmdline, RSS, sockets (psutil).

    Never raises: whatever could not be read is left at its default and
    reported. Each blocking read is bounded by ``timeout``.
    """
    pid = proc.pid
    failures: list[CollectorFailure] = []
    stat, stat_failures = procfs.read_process_stat(pid, proc_root)
    failures.extend(stat_failures)
    if stat is None and any(f.kind is FailureKind.GONE for f in stat_failures):
        return ProcessSample(pid=pid, ppid=0, role=role, name="", state=""), tuple(failures)

    name, cmdline = (stat.comm if stat else ""), ()
    done, result = _call_bounded(lambda: _name_cmdline(proc), timeout)
    if not done:
        failures.append(
            CollectorFailure(
                COLLECTOR,
                FailureKind.TIMEOUT,
                f"cmdline read blocked > {timeout:.1f}s (mmap lock held: a thread in state D?)",
                str(pid),
            )
        )
    elif isinstance(result, BaseException):
        failures.append(_psutil_failure(result, pid, "name/cmdline"))
    else:
        name, cmdline = result[0], tuple(result[1])

    rss = None
    try:
        rss = proc.memory_info().rss
    except (psutil.Error, OSError) as exc:
        failures.append(_psutil_failure(exc, pid, "memory_info"))

    listening: tuple[str, ...] = ()
    connections: int | None = None
    try:
        listening, connections = _sockets_from_psutil(proc)
    except (psutil.Error, OSError) as exc:
        try:
            listening, connections = sockets_from_procfs(pid, proc_root)
        except (OSError, ValueError) as exc2:
            failures.append(_psutil_failure(exc, pid, "net_connections"))
            if not isinstance(exc2, PermissionError):
                failures.append(
                    failure_from_oserror(COLLECTOR, exc2, str(pid), "/proc/PID/net/tcp fallback", pid)
                    if isinstance(exc2, OSError)
                    else CollectorFailure(COLLECTOR, FailureKind.BAD_DATA, f"/proc/net/tcp: {exc2}", str(pid))
                )

    threads: tuple = ()
    if with_threads:
        threads, thread_failures = procfs.read_threads(pid, proc_root, timeout=timeout)
        failures.extend(thread_failures)

    sample = ProcessSample(
        pid=pid,
        ppid=stat.ppid if stat else 0,
        role=role,
        name=name,
        cmdline=cmdline,
        state=stat.state if stat else "",
        cpu_user_s=stat.utime_s if stat else 0.0,
        cpu_system_s=stat.stime_s if stat else 0.0,
        num_threads=stat.num_threads if stat else len(threads),
        rss_bytes=rss,
        listening=listening,
        connections=connections,
        threads=threads,
    )
    return sample, tuple(failures)
