"""Find a vLLM deployment's process tree, name each process's role, and sample it (psutil + procfs)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from stat import S_IRGRP, S_IROTH, S_IRUSR, S_ISREG
from typing import BinaryIO, Sequence

import psutil

from wedgectl.collect import procfs, procread
from wedgectl.collect._failures import failure_from_oserror, permission_hint
from wedgectl.collect.sockets import (
    TcpTables, listening_of, own_tcp_addresses, sockets_from_tables,
)
from wedgectl.model.errors import UnreadableInput
from wedgectl.read.redact import redact_argv
from wedgectl.model.types import CollectorFailure, FailureKind, ProcessSample, Role

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


MP_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")


def is_mp_helper(cmdline: Sequence[str]) -> bool:
    """multiprocessing's own helper (the resource tracker every vLLM server starts, a forkserver):
    it runs none of the server's code, so its stack says nothing of a hang."""
    entry, rest = _entry(_tokens(cmdline))
    code = " ".join(rest[:4])  # the -c code, or its words where a title put the argv in one string
    return entry == "-c" and any(h in code for h in MP_HELPERS)


def name_cmdline(
    pid: int, proc_root: Path = procfs.PROC, timeout: float = procread.READ_TIMEOUT_S,
    stat: procfs.ProcessStat | None = None,
) -> tuple[str, list[str]]:
    """(name, argv) of a process, as psutil's name() and cmdline() give them, with the cmdline
    read bounded (procread.read_cmdline). `stat`: its stat line, where the caller has just read
    it. Raises OSError (TimeoutError included) when unreadable."""
    failures: tuple[CollectorFailure, ...] = ()
    if stat is None:
        stat, failures = procfs.read_process_stat(pid, proc_root)
    if stat is None:
        gone = not failures or failures[0].kind is FailureKind.GONE
        raise (ProcessLookupError if gone else OSError)(failures[0].message if failures else f"pid {pid}: gone")
    key = (str(proc_root), pid, stat.starttime_ticks, stat.comm)
    now = time.monotonic()
    hit = _CMDLINES.get(key)
    if hit is not None and now - hit[0] < CMDLINE_TTL_S:
        return hit[1], list(hit[2])
    cmdline = procread.read_cmdline(pid, proc_root, timeout)
    name = stat.comm
    if len(name) >= _COMM_LEN and cmdline:
        # comm is cut at 15 characters; psutil takes the full name from argv[0] when it starts so
        full = os.path.basename(cmdline[0])
        if full.startswith(name):
            name = full
    if len(_CMDLINES) > 256:
        _CMDLINES.clear()
    _CMDLINES[key] = (now, name, tuple(cmdline))
    return name, cmdline


# One sample reads each process's cmdline several times (its role, its parent's role, the tree's
# root, the sample itself), each read a bounded read in a thread of its own, and `top` samples every
# second for hours. A read is reused for CMDLINE_TTL_S, keyed by start time and comm: a reused pid
# reads afresh, and so does a retitled process (setproctitle, as vLLM names its processes, sets
# comm with the argv); only an exec that keeps comm is seen up to CMDLINE_TTL_S late.
CMDLINE_TTL_S = 5.0
_CMDLINES: dict[tuple[str, int, int, str], tuple[float, str, tuple[str, ...]]] = {}


def _name_cmdline(proc: psutil.Process) -> tuple[str, list[str]]:
    return name_cmdline(proc.pid)


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


def role_of_pid(pid: int) -> Role | None:
    """role_of for a pid; None once it has gone."""
    try:
        return role_of(psutil.Process(pid))
    except (psutil.Error, OSError):
        return None


def role_of(proc: psutil.Process) -> Role:
    """classify_role, plus what the parent tells: an untitled multiprocessing child (or a
    fork that still shows its parent's cmdline) of an API server is its engine core, and
    of an engine core a worker."""
    try:
        name, cmdline = _name_cmdline(proc)
    except (psutil.Error, OSError):
        return Role.OTHER
    role = classify_role(name, cmdline)
    if is_mp_helper(cmdline):
        return Role.OTHER
    try:
        parent = proc.parent()
        if parent is None:
            return role
        p_name, p_cmdline = _name_cmdline(parent)
    except (psutil.Error, OSError):
        return role
    # A fork that still shows its parent's cmdline and name; one that titled itself (comm) is what its title says.
    forked = role is not Role.OTHER and list(cmdline) == list(p_cmdline) and name == p_name
    if role is Role.OTHER and _is_mp_child(cmdline) or forked:
        parent_role = role_of(parent) if forked else classify_role(p_name, p_cmdline)
        if parent_role is Role.API_SERVER:
            return Role.ENGINE_CORE
        if parent_role is Role.ENGINE_CORE:
            return Role.WORKER
    return role


def _title_kind(name: str, cmdline: Sequence[str]) -> str:
    """The NAME of a 'PREFIX::NAME' title (argv[0] first, then comm), or ''."""
    tokens = _tokens(cmdline)
    for text in (tokens[0] if tokens else "", name):
        m = _TITLE.match(text)
        if m:
            return m.group(2)
    return ""


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
_CLI_MODULE = "vllm.entrypoints.cli.main"
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


def vllm_cli_serve(cmdline: Sequence[str]) -> list[str] | None:
    """The arguments after `serve` when `cmdline` runs vLLM's own CLI `serve`; None otherwise. Read from
    the argv as the kernel holds it: one string with spaces (a title written over argv) is no command."""
    if len(cmdline) < 2:
        return None
    entry, rest = _entry(list(cmdline))
    entry = entry.replace("\\", "/")
    cli = os.path.basename(entry) == "vllm" or entry == _CLI_MODULE or entry.endswith("vllm/entrypoints/cli/main.py")
    return list(rest[1:]) if cli and rest and rest[0] == "serve" else None


def _runs_python(proc: psutil.Process) -> bool:
    """Whether the process's executable is a Python interpreter; True when it cannot be read (then
    its argv alone tells)."""
    try:
        exe = os.readlink(procfs.PROC / str(proc.pid) / "exe")
    except PermissionError:
        return True
    except OSError:
        return False
    return bool(_PYTHON.match(os.path.basename(exe.removesuffix(" (deleted)"))))


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
            name, cmdline = _name_cmdline(child)
            key: object = "launched" if _LAUNCHED.match(_title_kind(name, cmdline)) else tuple(cmdline)
            starts.setdefault(key, []).append(child.create_time())
        except (psutil.Error, OSError):
            continue
    spread = max((max(t) - min(t) for t in starts.values() if len(t) > 1), default=0.0)
    return spread if spread > RESTART_SPREAD_S else None


def is_vllm_cli(proc: psutil.Process) -> list[str] | None:
    """`serve`'s arguments when `proc` runs vLLM's own CLI `serve` by its code (a Python interpreter, the
    console script or module) and has not restarted an API server; None otherwise."""
    try:
        _, cmdline = _name_cmdline(proc)
    except (psutil.Error, OSError):
        return None
    args = vllm_cli_serve(cmdline)
    if args is None or not _runs_python(proc) or restarted_servers(proc) is not None:
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
        name, cmdline = _name_cmdline(proc)
        if not _LAUNCHED.match(_title_kind(name, cmdline)):
            return None
        parent = proc.parent()
        if parent is None or parent.pid <= 1:
            return None
        p_name, p_cmdline = _name_cmdline(parent)
        if _DP_SERVER.match(_title_kind(p_name, p_cmdline)):
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
        _, argv = _name_cmdline(parent)
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


@dataclass(frozen=True)
class HeldLog:
    """The server log as the process holds it: its descriptor fd, the file (dev, ino) that fd held when
    found, and the process's credentials then. path (what /proc/PID/fd/FD reads as) is for people:
    in another mount namespace, or once renamed, it may name another file (a root-only one bind-mounted
    there), so the file is opened through the descriptor (open), never by that path unchecked."""

    pid: int
    fd: int
    path: str
    dev: int
    ino: int
    uid: int  # the process's filesystem uid and gids: whether it could read the file itself
    gids: frozenset[int]
    fd_readable: bool  # the process opened it for reading too (O_RDONLY or O_RDWR)
    proc_root: Path = procfs.PROC

    def __str__(self) -> str:
        return self.path

    def open(self) -> BinaryIO:
        return open_held_log(self)


def _credentials(pid: int, proc_root: Path) -> tuple[int, frozenset[int]] | None:
    """The filesystem uid and the gids (fs gid and supplementary groups) in /proc/PID/status."""
    try:
        text = (proc_root / str(pid) / "status").read_text(errors="replace")
    except OSError:
        return None
    fields = dict(line.partition(":")[::2] for line in text.splitlines()[:64])
    try:
        uid = int(fields["Uid"].split()[3])
        gids = {int(fields["Gid"].split()[3]), *(int(g) for g in fields.get("Groups", "").split())}
    except (KeyError, IndexError, ValueError):
        return None
    return uid, frozenset(gids)


def _fd_readable(pid: int, fd: int, proc_root: Path) -> bool:
    """Whether the process opened fd for reading (fdinfo's flags); False when unknown."""
    try:
        text = (proc_root / str(pid) / "fdinfo" / str(fd)).read_text(errors="replace")
        flags = next(int(line.split()[1], 8) for line in text.splitlines() if line.startswith("flags:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return False
    return flags & os.O_ACCMODE != os.O_WRONLY


def log_path_of(pid: int, proc_root: Path = procfs.PROC) -> HeldLog | None:
    """The regular file the process's stdout or stderr goes to (the server log, if redirected), as the
    process holds it. The file is stat'ed through /proc/PID/fd/N, which reaches the process's own file
    in its own mount namespace; the path it reads as is never stat'ed here."""
    creds = _credentials(pid, proc_root)
    if creds is None:
        return None
    for fd in (2, 1):
        link = proc_root / str(pid) / "fd" / str(fd)
        try:
            target = os.readlink(link)
            st = os.stat(link)
        except OSError:
            continue
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")) and S_ISREG(st.st_mode):
            return HeldLog(pid, fd, target, st.st_dev, st.st_ino, creds[0], creds[1],
                           _fd_readable(pid, fd, proc_root), proc_root)
    return None


def _target_could_read(log: HeldLog, st: os.stat_result) -> bool:
    """Whether the process could read the file itself: through its descriptor, or by the mode bits for
    its uid and gids (ACLs aside). A log it may only write is not ours to read on its behalf."""
    if log.fd_readable or log.uid == 0:
        return True
    if st.st_uid == log.uid:
        return bool(st.st_mode & S_IRUSR)
    if st.st_gid in log.gids:
        return bool(st.st_mode & S_IRGRP)
    return bool(st.st_mode & S_IROTH)


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _open_checked(where: str | Path, log: HeldLog) -> BinaryIO:
    """where opened for reading if it is the file found (same dev and ino), checked before a byte is
    read; a FIFO or device swapped in is stat'ed, never opened. UnreadableInput otherwise."""
    st = os.stat(where)
    if (st.st_dev, st.st_ino) != (log.dev, log.ino):
        raise _NotTheLog()
    fd = os.open(where, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (log.dev, log.ino) or not S_ISREG(st.st_mode):
            raise _NotTheLog()
        if not _target_could_read(log, st):
            raise UnreadableInput(f"{log.path}: process {log.pid} (uid {log.uid}) could not read this file itself; "
                                  f"not read (give --log to read it anyway)")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _NotTheLog(Exception):
    """What is there now is not the file the process wrote its log to."""


def open_held_log(log: HeldLog) -> BinaryIO:
    """The server log, opened through /proc/PID/fd/N while that descriptor still holds the file found;
    by its path once it does not (the process exited, or reopened its output), but only where the path
    still leads to that very file. Either way device and inode are checked before any byte is read (so
    a reused pid changes nothing). UnreadableInput says why not."""
    try:
        return _open_checked(log.proc_root / str(log.pid) / "fd" / str(log.fd), log)
    except (OSError, _NotTheLog):
        pass  # gone, or it holds another file now: the path, checked the same way
    try:
        return _open_checked(log.path, log)
    except _NotTheLog:
        raise UnreadableInput(f"{log.path}: no longer the file process {log.pid} wrote its log to "
                              "(another device or inode); not read") from None
    except FileNotFoundError:
        raise UnreadableInput(f"{log.path}: gone, and process {log.pid} no longer holds it; not read") from None
    except OSError as exc:
        raise UnreadableInput(f"{log.path}: {exc.strerror or exc}") from None


# Device nodes through which a process holds an accelerator (and its memory): NVIDIA, AMD/Intel DRM,
# AMD KFD, Habana/AWS Neuron and the generic accel class.
_ACCEL_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd", "/dev/accel", "/dev/neuron", "/dev/hl")


def accelerator_devices(pid: int, proc_root: Path = procfs.PROC, links: list[str] | None = None) -> tuple[str, ...]:
    """The accelerator device nodes `pid` holds open (`links`: its procfs.fd_links, if read); () when
    none or unreadable."""
    if links is None:
        try:
            links = procfs.fd_links(pid, proc_root)
        except OSError:
            return ()
    return tuple(sorted({link for link in links if link.startswith(_ACCEL_PREFIXES)}))


# ---------------------------------------------------------------------------
# sampling


# The processes whose main threads take every engine step: the EngineCore schedules it and
# collects its output, each Worker runs its shard of the model.
STEPPING_ROLES = frozenset({Role.ENGINE_CORE, Role.WORKER})

# top's memo of each process's fds, read at each tree walk (sample_roles):
# pid -> (listening addresses, established connections, accelerator devices)
FdsMemo = dict[int, tuple[tuple[str, ...], int | None, tuple[str, ...]]]


def _psutil_failure(exc: BaseException, pid: int, what: str) -> CollectorFailure:
    if isinstance(exc, psutil.NoSuchProcess):  # ZombieProcess too
        return CollectorFailure(COLLECTOR, FailureKind.GONE, f"{what}: process exited", str(pid))
    if isinstance(exc, psutil.AccessDenied):
        return CollectorFailure(COLLECTOR, FailureKind.PERMISSION, f"{what}: {permission_hint(pid)}", str(pid))
    if isinstance(exc, OSError):
        return failure_from_oserror(COLLECTOR, exc, str(pid), what, pid)
    return CollectorFailure(COLLECTOR, FailureKind.ERROR, f"{what}: {exc!r}", str(pid))


def sample_process(
    proc: psutil.Process | int,
    role: Role,
    with_threads: bool = True,
    proc_root: Path = procfs.PROC,
    timeout: float = 2.0,
    tables: tuple[TcpTables, frozenset[tuple[str, int]]] | None = None,
    threads_memo: procfs.ThreadMemo | None = None,
    fds_memo: FdsMemo | None = None,
) -> tuple[ProcessSample, tuple[CollectorFailure, ...]]:
    """One ProcessSample: state, CPU, RSS, start time, threads (procfs), name and cmdline, sockets.

    `proc`: a psutil.Process or a pid. RSS (statm) and the start time (the stat line already read)
    are psutil's figures, read without psutil's objects: `top` samples every process every second;
    psutil is asked only where those reads fail. Never raises: whatever could not be read is left
    at its default and reported. Each blocking read is bounded by ``timeout``.
    """
    pid = proc if isinstance(proc, int) else proc.pid
    failures: list[CollectorFailure] = []
    stat, stat_failures = procfs.read_process_stat(pid, proc_root)
    failures.extend(stat_failures)
    if stat is None and any(f.kind is FailureKind.GONE for f in stat_failures):
        return ProcessSample(pid=pid, ppid=0, role=role, name="", state=""), tuple(failures)

    name = stat.comm if stat else ""
    cmdline: tuple[str, ...] = ()
    try:
        name, argv = name_cmdline(pid, proc_root, timeout, stat)
        cmdline = tuple(redact_argv(argv))  # redacted at capture: bundles never hold secrets
    except TimeoutError:
        failures.append(
            CollectorFailure(
                COLLECTOR,
                FailureKind.TIMEOUT,
                f"cmdline read blocked > {timeout:.1f}s (mmap lock held: a thread in state D?)",
                str(pid),
            )
        )
    except OSError as exc:
        failures.append(_psutil_failure(exc, pid, "name/cmdline"))

    rss = procfs.read_rss(pid, proc_root)
    started = stat.started(proc_root) if stat is not None else None
    if rss is None or started is None:
        try:
            ps = psutil.Process(pid) if isinstance(proc, int) else proc
            rss = rss if rss is not None else ps.memory_info().rss
            started = started if started is not None else _create_time(ps)
        except (psutil.Error, OSError) as exc:
            failures.append(_psutil_failure(exc, pid, "memory_info"))

    listening: tuple[str, ...] = ()
    connections: int | None = None
    devices: tuple[str, ...] = ()
    kept = fds_memo.get(pid) if fds_memo is not None else None
    if kept is not None:  # top: the ports, client connections and devices read at the last tree walk
        listening, connections, devices = kept
    else:
        try:
            links: list[str] | None = procfs.fd_links(pid, proc_root)  # read once: sockets and devices
        except OSError:
            links = None
        if tables is None:  # a lone process: a table of its own, and wedgectl's sockets read before its
            lone = TcpTables(proc_root)
            tables = (lone, own_tcp_addresses(lone))
        devices = accelerator_devices(pid, proc_root, links)
        try:
            listening, connections = sockets_from_tables(pid, *tables, links=links)
            if fds_memo is not None and links is not None:
                fds_memo[pid] = (listening, connections, devices)
        except OSError as exc:  # its fds unreadable (no CAP_SYS_PTRACE over it), or it exited
            failures.append(_psutil_failure(exc, pid, "sockets"))

    threads: tuple = ()
    if with_threads:
        # top (a memo) leaves out the switch counts: no verdict reads them, and status is the dearest read
        threads, thread_failures = procfs.read_threads(pid, proc_root, timeout=timeout, unchanged=threads_memo,
                                                       switches=threads_memo is None)
        failures.extend(thread_failures)

    main_sched = procfs.main_thread_sched(pid, proc_root) if role in STEPPING_ROLES else (None, None)
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
        started=started,
        devices=devices,
        main_quiet_s=main_sched[0],
        main_runq_s=main_sched[1],
        cpu_limit=procfs.read_cpu_limit(pid, proc_root) if role in STEPPING_ROLES else None,
        exiting=stat.exiting if stat else False,
    )
    return sample, tuple(failures)


def _create_time(proc: psutil.Process) -> float | None:
    try:
        return proc.create_time()
    except (psutil.Error, OSError):
        return None


def sample_roles(roles: dict[int, Role], threads_memo: procfs.ThreadMemo | None = None,
                 fds_memo: FdsMemo | None = None,
                 ) -> tuple[tuple[ProcessSample, ...], list[CollectorFailure]]:
    """One sample of each live process in `roles` (pid -> role); zombies and the exited are left out.
    `threads_memo`: top's memo of threads that have not run since its last refresh (procfs.read_threads);
    `fds_memo`: top's memo of each process's ports, established connections and devices (its fds:
    hundreds for a Worker; the TCP tables, whose read walks the kernel's whole connection hash,
    1.2 ms of CPU a table over sock_diag however few sockets it lists), kept until the tree is walked again, so the
    API server's client count in `top` is at most a walk old (5 s). A diagnose passes none."""
    if threads_memo is not None:
        threads_memo.forget_others(roles)
    failures: list[CollectorFailure] = []
    out = []
    tables = TcpTables()
    # wedgectl's own addresses read the table: only when some process's sockets will be read
    reading = any(fds_memo is None or pid not in fds_memo for pid in roles)
    ours = own_tcp_addresses(tables) if reading else frozenset()
    for pid, role in roles.items():
        sample, fails = sample_process(pid, role, tables=(tables, ours), threads_memo=threads_memo, fds_memo=fds_memo)
        if not sample.state and fails and fails[0].kind is FailureKind.GONE:
            continue  # gone before its stat was read: not part of this sample, as before it was found
        failures.extend(fails)
        if sample.state and sample.state not in ("Z", "X"):  # a zombie has exited; only its parent's wait is missing
            out.append(sample)
    return tuple(out), failures


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
