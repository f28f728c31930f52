"""A vLLM deployment's processes: the deployment a pid belongs to (its API server, or vLLM's
multi-API-server launcher above it, and their descendants; never a supervisor above or a server
beside), whether a parent would start its API server again, and every API server on the host.

What each process is (its role) lives in `roles`, one sample of each in `procsample`, and the log an
API server holds in `heldlog`; their public names are re-exported here, where callers have always
found them (``processes.sample_roles``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import psutil

from wedgectl.collect.heldlog import HeldLog, log_path_of, open_held_log
from wedgectl.collect.procsample import (
    COLLECTOR, STEPPING_ROLES, FdsMemo, accelerator_devices, sample_process, sample_roles,
)
from wedgectl.collect.roles import (
    CMDLINE_TTL_S, MP_HELPERS, classify_role, is_mp_helper, looks_like_vllm, name_cmdline, role_of, role_of_pid,
    runs_python, title_kind, vllm_cli_serve,
)
from wedgectl.collect.sockets import listening_of
from wedgectl.model.types import Role
from wedgectl.read.redact import redact_argv

__all__ = [
    "COLLECTOR", "CMDLINE_TTL_S", "MP_HELPERS", "RESTART_SPREAD_S", "STEPPING_ROLES", "FdsMemo", "HeldLog", "Identity",
    "ProcessGone", "ServerProcess", "accelerator_devices", "api_servers", "api_servers_below", "classify_role",
    "deployment_root", "identify", "is_alive", "is_mp_helper", "is_vllm_cli", "launcher_of", "log_path_of",
    "looks_like_vllm", "name_cmdline", "open_held_log", "process_tree", "restarted_servers", "role_of",
    "role_of_pid", "sample_process", "sample_roles", "server_supervisor", "vllm_cli_serve",
]


class ProcessGone(Exception):
    """The process exited (or could no longer be read) while it was being looked at."""


def is_alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie has exited, only its parent's wait is missing."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True)
class Identity:
    """What `discover` needs to know of a pid before it walks the tree."""

    vllm: bool  # looks_like_vllm
    name: str
    argv: tuple[str, ...]  # as read: the caller redacts before showing it


def identify(pid: int) -> Identity | None:
    """The pid's Identity; None when there is no such process. ProcessGone if it exits mid-read."""
    if pid <= 0 or not psutil.pid_exists(pid):
        return None
    try:
        vllm = looks_like_vllm(psutil.Process(pid))
        name, argv = name_cmdline(pid)
    except (psutil.Error, OSError):
        raise ProcessGone(pid) from None
    return Identity(vllm, name, tuple(argv))


# vLLM's multi-API-server launcher (`vllm serve --api-server-count N`, entrypoints/cli/serve.py
# run_multi_api_server) stays a `vllm serve` process (or, under a data-parallel supervisor, one titled
# APIServer_DP<n>) and spawns N API servers that title themselves APIServer_<i>
# (v1/utils.run_api_server_worker_proc); comm cuts that title to "VLLM::APIServer".
_LAUNCHED = re.compile(r"^APIServer(_\d+)?$")
_DP_SERVER = re.compile(r"^APIServer_DP\d+$")
# A title is no evidence: any process sets its own (prctl, or over its argv). The launcher is known by
# what it runs: a Python interpreter (/proc/PID/exe) running vLLM's own CLI (the `vllm` console script,
# or its module) with `serve`, not held to one API server; and it never starts an API server again
# (it stops them all when one dies), so servers of one parent started this far apart were restarted.
_COUNT_FLAGS = ("--api-server-count", "-asc")
RESTART_SPREAD_S = 15.0


def _flag_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The last value given to any of `names` (`--flag V` or `--flag=V`), as argparse keeps it."""
    value = None
    for i, arg in enumerate(args):
        flag, eq, rest = arg.partition("=")
        if flag in names:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def restarted_servers(proc: psutil.Process) -> float | None:
    """Seconds between the first and the last start of the API servers among `proc`'s children that are
    copies of one another (titled as a launcher titles them, APIServer_<i>, or running the same argv),
    when more than RESTART_SPREAD_S: it started one again (a supervisor). None otherwise.

    Servers that differ (another port, another model) are not compared: a shell or a test runner
    that started two servers a minute apart restarted nothing."""
    starts: dict[object, list[float]] = {}
    try:
        children = proc.children()
    except (psutil.Error, OSError):
        return None
    for child in children:
        try:
            if role_of(child) is not Role.API_SERVER:
                continue
            name, cmdline = name_cmdline(child.pid)
            key: object = "launched" if _LAUNCHED.match(title_kind(name, cmdline)) else tuple(cmdline)
            starts.setdefault(key, []).append(child.create_time())
        except (psutil.Error, OSError):
            continue
    spread = max((max(t) - min(t) for t in starts.values() if len(t) > 1), default=0.0)
    return spread if spread > RESTART_SPREAD_S else None


def is_vllm_cli(proc: psutil.Process) -> list[str] | None:
    """`serve`'s arguments when `proc` runs vLLM's own CLI `serve` by its code (a Python interpreter, the
    console script or module) and has not restarted an API server; None otherwise."""
    try:
        _, cmdline = name_cmdline(proc.pid)
    except (psutil.Error, OSError):
        return None
    args = vllm_cli_serve(cmdline)
    if args is None or not runs_python(proc) or restarted_servers(proc) is not None:
        return None
    return args


def _multi_server(args: Sequence[str]) -> bool:
    """Whether `vllm serve` with these arguments may run several API servers (not --headless, and no
    --api-server-count of 1 or less; without one vLLM defaults it to the data-parallel size)."""
    count = _flag_value(args, _COUNT_FLAGS)
    try:
        return "--headless" not in args and (count is None or int(count) > 1)
    except ValueError:
        return False


def launcher_of(proc: psutil.Process) -> psutil.Process | None:
    """The multi-API-server launcher that spawned ``proc``, when ``proc`` is one of its API servers: a
    parent that is vLLM's launcher by its code (is_vllm_cli), or a data-parallel server (APIServer_DP<n>)
    that vLLM's CLI started. A parent with a vLLM-looking title or name alone is none."""
    try:
        name, cmdline = name_cmdline(proc.pid)
        if not _LAUNCHED.match(title_kind(name, cmdline)):
            return None
        parent = proc.parent()
        if parent is None or parent.pid <= 1:
            return None
        p_name, p_cmdline = name_cmdline(parent.pid)
        if _DP_SERVER.match(title_kind(p_name, p_cmdline)):
            above = parent.parent()
            ok = above is not None and above.pid > 1 and is_vllm_cli(above) is not None
            return parent if ok and restarted_servers(parent) is None else None
    except (psutil.Error, OSError):
        return None
    args = is_vllm_cli(parent)
    return parent if args is not None and _multi_server(args) else None


def deployment_root(pid: int) -> psutil.Process | None:
    """The API server that owns ``pid`` (or the launcher above it): the root of its deployment.

    From an API server: itself, or vLLM's multi-API-server launcher that
    spawned it. From an engine core, a worker or a helper: up through parents
    that are the deployment's own engine cores and workers to the API server
    above them. A parent that merely looks like vLLM (a supervisor under a
    path with /vllm/, a `ray::` title) is never climbed into: it is not the
    deployment, and its subtree holds other servers. Without an API server
    above, the topmost engine process reached is the root (a headless
    engine). None if ``pid`` is gone.
    """
    try:
        proc = psutil.Process(pid)
    except (psutil.Error, OSError):
        return None
    for _ in range(8):
        if role_of(proc) is Role.API_SERVER:
            return launcher_of(proc) or proc
        try:
            parent = proc.parent()
        except (psutil.Error, OSError):
            return proc
        if parent is None or parent.pid <= 1 or role_of(parent) is Role.OTHER:
            return proc
        proc = parent
    return proc


def process_tree(pid: int) -> list[psutil.Process]:
    """The deployment ``pid`` belongs to (see `deployment_root`): its root followed by every
    descendant. [] if ``pid`` is gone."""
    root = deployment_root(pid)
    if root is None:
        return []
    try:
        descendants = root.children(recursive=True)
    except (psutil.Error, OSError):
        descendants = []
    return [root, *descendants]


def api_servers_below(pid: int) -> list[int]:
    """The deployment roots among the descendants of ``pid`` (what a supervisor runs)."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except (psutil.Error, OSError):
        return []
    return [p.pid for p in below if role_of(p) is Role.API_SERVER and launcher_of(p) is None]


def server_supervisor(pid: int) -> tuple[int, str] | None:
    """(its pid, why) when the parent of the deployment ``pid`` belongs to is something that would start
    its API server again: a parent that looks like vLLM (its argv or title) but is not vLLM's own
    launcher by its code, the more so when it runs other API servers. None for
    any other parent (a shell, an init, a test runner, vLLM's own CLI): swap then stops the deployment
    alone. Any parent that started a copy of an API server again (restarted_servers) is one too. The
    fixed supervisors (systemd, Kubernetes, ...) are swap's detect_supervisor's.
    """
    root = deployment_root(pid)
    try:
        parent = root.parent() if root is not None else None
        if parent is None or parent.pid <= 1:
            return None
        _, argv = name_cmdline(parent.pid)
        children = parent.children()
    except (psutil.Error, OSError):
        return None
    if is_vllm_cli(parent) is not None:
        return None
    what = f"pid {parent.pid} ({' '.join(redact_argv(argv))[:80]})"
    again = restarted_servers(parent)
    if again is not None:
        return parent.pid, f"{what} started an API server again, {again:.0f} s after its first"
    if not looks_like_vllm(parent):
        return None
    servers = [c.pid for c in children if role_of(c) is Role.API_SERVER]
    if len(servers) > 1:
        return parent.pid, f"{what} runs {len(servers)} API servers (pids {' '.join(map(str, servers))})"
    return parent.pid, f"{what} runs the API server and looks like vLLM, but is not vLLM's own launcher"


# ------------------------------------------------------------------ every server on the host


@dataclass(frozen=True)
class ServerProcess:
    """A vLLM API server at the root of its deployment, as the host scan found it."""

    pid: int
    listening: tuple[str, ...]
    started: float  # its create_time
    argv: tuple[str, ...]  # redacted: the picker shows it, secrets never reach the screen


def api_servers(process_iter=psutil.process_iter) -> list[ServerProcess]:
    """Every vLLM API server on the host that no multi-API-server launcher owns (the launcher is
    listed), in process-table order. `process_iter`: the seam for unit tests."""
    found = []
    for proc in process_iter():
        try:
            if not looks_like_vllm(proc) or role_of(proc) != Role.API_SERVER:
                continue
            if launcher_of(proc) is not None:
                continue  # one of a multi-API-server launcher's servers: the launcher is listed
            argv = tuple(redact_argv(name_cmdline(proc.pid)[1]))
            found.append(ServerProcess(proc.pid, listening_of(proc.pid), proc.create_time(), argv))
        except (psutil.Error, OSError):
            continue
    return found
