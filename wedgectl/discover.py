"""Finding the deployment: any pid (or a URL) to its process tree, roles, ports and metrics URL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from wedgectl.collect import processes, procfs, procread
from wedgectl.collect.scrape import metrics_url_for
from wedgectl.errors import NoSuchProcess, NotVllm
from wedgectl.redact import redact_argv
from wedgectl.types import Role


@dataclass(frozen=True)
class Deployment:
    """What a capture looks at."""

    root_pid: int | None
    api_pid: int | None
    roles: dict[int, Role]
    base_url: str | None
    metrics_url: str | None
    log_path: str | None = None
    # pid -> its start time (clock ticks after boot) when discovered: what a signal checks
    start_ticks: Mapping[int, int] = field(default_factory=dict)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(self.roles)


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/metrics"):
        url = url[: -len("/metrics")]
    return url


def tree_roles(root_pid: int) -> dict[int, Role]:
    """Every live process of the deployment rooted at root_pid, with its role."""
    out: dict[int, Role] = {}
    for proc in processes.process_tree(root_pid):
        out[proc.pid] = processes.role_of(proc)
    return out


def base_url_from_listening(listening: tuple[str, ...]) -> str | None:
    """The HTTP base URL from a LISTEN address such as '0.0.0.0:8000' or '[::]:8000'."""
    if not listening:
        return None
    addr = sorted(listening, key=lambda a: (":" in a.rsplit(":", 1)[0], a))[0]
    return normalise_url(metrics_url_for(addr)) if addr else None


def log_path_of(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The regular file the process's stdout or stderr goes to: the server log, if redirected."""
    for fd in (2, 1):
        try:
            target = os.readlink(proc_root / str(pid) / "fd" / str(fd))
        except OSError:
            continue
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")) and os.path.isfile(target):
            return target
    return None


def port_from_cmdline(cmdline: list[str]) -> int:
    """vLLM's --port (default 8000)."""
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline) and cmdline[i + 1].isdigit():
            return int(cmdline[i + 1])
        if arg.startswith("--port=") and arg[7:].isdigit():
            return int(arg[7:])
    return 8000


def listening_of(pid: int, proc_root: Path = Path("/proc")) -> tuple[str, ...]:
    """The API server's LISTEN addresses: from its own socket fds, or, where those are not
    readable (no CAP_SYS_PTRACE), the LISTEN sockets of the netns on the port its cmdline names."""
    try:
        listening, _ = processes.sockets_from_procfs(pid, proc_root)
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
        for e in processes.parse_proc_net_tcp(text):
            if e.state == processes.TCP_LISTEN and e.local.rsplit(":", 1)[-1] == str(port):
                found.append(e.local)
    return tuple(sorted(found))


def discover(pid: int | None = None, url: str | None = None) -> Deployment:
    """Resolve the target. NoSuchProcess / NotVllm for a bad pid; a URL alone is metrics-only."""
    if pid is None:
        base = normalise_url(url or "")
        return Deployment(None, None, {}, base, metrics_url_for(base))
    if pid <= 0 or not psutil.pid_exists(pid):
        raise NoSuchProcess(f"pid {pid}: no such process")
    try:
        target = psutil.Process(pid)
        is_vllm = processes.looks_like_vllm(target)
        name, argv = processes.name_cmdline(pid)
        what = " ".join(redact_argv(argv))[:60] or name  # redacted before it is cut
    except (psutil.Error, OSError):
        raise NoSuchProcess(f"pid {pid}: exited before it could be read") from None
    if not is_vllm:
        # The pid itself must be part of vLLM: its children being vLLM (pid 1, a shell) is not enough.
        raise NotVllm(f"pid {pid} is not part of a vLLM deployment ({what})")
    tree = processes.process_tree(pid)
    if not tree:
        raise NoSuchProcess(f"pid {pid}: exited before it could be read")
    roles = {p.pid: processes.role_of(p) for p in tree}
    if roles[tree[0].pid] is not Role.API_SERVER:
        # Above the API servers (a supervisor with a vLLM-looking title): which deployment is meant?
        servers = processes.api_servers_below(tree[0].pid)
        if servers:
            raise NotVllm(f"pid {pid} is not part of one vLLM deployment: it runs {len(servers)} API "
                          f"server(s) (pids {' '.join(map(str, servers))}); give one of them")
    ticks = {p: t for p in roles if (t := procfs.start_ticks(p)) is not None}
    api = next((p for p, r in roles.items() if r == Role.API_SERVER), None)
    listening: tuple[str, ...] = ()
    if api is not None:
        listening = listening_of(api)
    base = normalise_url(url) if url else base_url_from_listening(listening)
    log = log_path_of(api) if api is not None else None
    return Deployment(tree[0].pid, api, roles, base, metrics_url_for(base) if base else None, log, ticks)
