"""Finding the deployment: any pid (or a URL) to its process tree, roles, ports and metrics URL.

Also what `diagnose`, `top` and `watch` say about a deployment the same way: the servers on the
host (`find_servers`), the model a server serves (`served_model`), the manifest of a capture of it
(`deployment_manifest`, its URL redacted) and how much of its log a verdict or a bundle reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from wedgectl import __version__
from wedgectl.collect import processes, procfs, sockets
from wedgectl.collect.scrape import metrics_url_for
from wedgectl.model.errors import NoSuchProcess, NotVllm
from wedgectl.read.redact import redact_argv, redact_url
from wedgectl.store.sources import host_facts
from wedgectl.model.types import Manifest, Role, Target

# The server log's tail: what a verdict reads (diagnose's in-window verdicts, each refresh of top,
# each evaluation of watch), and what a saved bundle keeps (diagnose's, top's save, watch's onset).
VERDICT_LOG_BYTES = 256 << 10
BUNDLE_LOG_BYTES = 4 << 20


@dataclass(frozen=True)
class Deployment:
    """What a capture looks at."""

    root_pid: int | None
    api_pid: int | None
    roles: dict[int, Role]
    base_url: str | None
    metrics_url: str | None
    log_path: str | None = None  # the server log as shown (log.path); read only through log
    # pid -> its start time (clock ticks after boot) when discovered: what a signal checks
    start_ticks: Mapping[int, int] = field(default_factory=dict)
    log: processes.HeldLog | None = None  # the server log as the process holds it (processes.open_held_log)

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


def discover(pid: int | None = None, url: str | None = None) -> Deployment:
    """Resolve the target. NoSuchProcess / NotVllm for a bad pid; a URL alone is metrics-only."""
    if pid is None:
        given = normalise_url(url or "")
        return Deployment(None, None, {}, given, metrics_url_for(given))
    try:
        found = processes.identify(pid)
    except processes.ProcessGone:
        raise NoSuchProcess(f"pid {pid}: exited before it could be read") from None
    if found is None:
        raise NoSuchProcess(f"pid {pid}: no such process")
    if not found.vllm:
        what = " ".join(redact_argv(list(found.argv)))[:60] or found.name  # redacted before it is cut
        # The pid itself must be part of vLLM: its children being vLLM (pid 1, a shell) is not enough.
        raise NotVllm(f"pid {pid} is not part of a vLLM deployment ({what})")
    tree = processes.process_tree(pid)
    if not tree:
        raise NoSuchProcess(f"pid {pid}: exited before it could be read")
    roles = {p.pid: processes.role_of(p) for p in tree}
    if roles[tree[0].pid] is not Role.API_SERVER or processes.is_vllm_cli(tree[0]) is None:
        # Above the API servers (a supervisor with a vLLM-looking title, or one named like a server,
        # `x_serve.py serve`: only vLLM's own CLI launches them): which deployment is meant?
        servers = processes.api_servers_below(tree[0].pid)
        if servers:
            raise NotVllm(f"pid {pid} is not part of one vLLM deployment: it runs {len(servers)} API "
                          f"server(s) (pids {' '.join(map(str, servers))}); give one of them")
    ticks = {p: t for p in roles if (t := procfs.start_ticks(p)) is not None}
    api = next((p for p, r in roles.items() if r == Role.API_SERVER), None)
    listening: tuple[str, ...] = ()
    if api is not None:
        listening = sockets.listening_of(api)
    base = normalise_url(url) if url else base_url_from_listening(listening)
    # An orphaned engine (its API server killed) still writes to the server log it inherited.
    log = processes.log_path_of(api if api is not None else tree[0].pid)
    return Deployment(tree[0].pid, api, roles, base, metrics_url_for(base) if base else None,
                      log.path if log else None, ticks, log)


def served_model(argv: Iterable[str]) -> str | None:
    """The model a vLLM server serves, as it labels its own series: the first --served-model-name
    (vLLM takes several: the first is the label; the last flag given wins, as argparse has it), else
    the last part of the model's path (`serve PATH`, `--model PATH`, `--model=PATH`). Read from the
    argv redacted (redact_argv, which leaves a redacted argv as it is), so a secret never names a
    target, and raw and already-redacted argvs name it alike. None when the argv names no model."""
    args = redact_argv(argv)
    served = flag = positional = None
    for i, arg in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else None
        if arg == "--served-model-name":
            served = nxt or served
        elif arg.startswith("--served-model-name="):
            served = arg.split("=", 1)[1] or served
        elif arg == "--model":
            flag = nxt or flag
        elif arg.startswith("--model="):
            flag = arg.split("=", 1)[1] or flag
        elif arg == "serve" and positional is None:
            positional = nxt or ""  # the subcommand: a later "serve" is some flag's value
    if served:
        return served
    model = positional or flag  # `vllm serve PATH --model OTHER` serves PATH, as vLLM has it
    return (os.path.basename(model.rstrip("/")) or None) if model else None


def deployment_manifest(dep: Deployment, pid: int | None, notes: tuple[str, ...] = (),
                        log_path: str | None = None, startup_quiet_s: float | None = None) -> Manifest:
    """The manifest of a capture of dep, as diagnose, top and watch write it: pid as the operator
    named it (None for a URL), the URL without its user:password, the log's path (log_path when
    given, as --log gives it), this host's facts."""
    return Manifest(
        created=time.time(),
        wedgectl_version=__version__,
        source="live" if dep.root_pid is not None else "url",
        target=Target(pid=pid, url=redact_url(dep.base_url), log_path=log_path or dep.log_path, pids=dep.pids),
        host=host_facts(),
        notes=notes,
        startup_quiet_s=startup_quiet_s,
    )


@dataclass(frozen=True)
class ServerInfo:
    """One vLLM API server found on this machine."""

    pid: int
    url: str | None
    model: str  # served_model, or "?"
    started: float
    cmdline: str  # redacted


def find_servers(scan: Callable[[], list[processes.ServerProcess]] = processes.api_servers) -> list[ServerInfo]:
    """Every vLLM API server on the machine (the root of each deployment), oldest first: what top's
    picker lists and what `watch` with no target watches."""
    found = [ServerInfo(p.pid, base_url_from_listening(p.listening), served_model(p.argv) or "?",
                        p.started, " ".join(p.argv)) for p in scan()]
    return sorted(found, key=lambda s: s.started)
