"""What a process of a vLLM deployment is, from its title, argv and parent: its role (API server,
engine core, worker), whether it belongs to vLLM at all, and whether it runs vLLM's own CLI `serve`.
A cmdline is read bounded (procread) and reused for a few seconds."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Sequence

import psutil

from wedgectl.collect import procfs, procread
from wedgectl.model.types import CollectorFailure, FailureKind, Role

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


def looks_like_vllm(proc: psutil.Process, _depth: int = 0) -> bool:
    """Whether a process belongs to a vLLM deployment: a vLLM role or entry point, or a
    multiprocessing child (spawned engine, resource tracker) of such a process."""
    try:
        name, cmdline = name_cmdline(proc.pid)
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
        name, cmdline = name_cmdline(proc.pid)
    except (psutil.Error, OSError):
        return Role.OTHER
    role = classify_role(name, cmdline)
    if is_mp_helper(cmdline):
        return Role.OTHER
    try:
        parent = proc.parent()
        if parent is None:
            return role
        p_name, p_cmdline = name_cmdline(parent.pid)
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


def title_kind(name: str, cmdline: Sequence[str]) -> str:
    """The NAME of a 'PREFIX::NAME' title (argv[0] first, then comm), or ''."""
    tokens = _tokens(cmdline)
    for text in (tokens[0] if tokens else "", name):
        m = _TITLE.match(text)
        if m:
            return m.group(2)
    return ""


_CLI_MODULE = "vllm.entrypoints.cli.main"


def vllm_cli_serve(cmdline: Sequence[str]) -> list[str] | None:
    """The arguments after `serve` when `cmdline` runs vLLM's own CLI `serve`; None otherwise. Read from
    the argv as the kernel holds it: one string with spaces (a title written over argv) is no command."""
    if len(cmdline) < 2:
        return None
    entry, rest = _entry(list(cmdline))
    entry = entry.replace("\\", "/")
    cli = os.path.basename(entry) == "vllm" or entry == _CLI_MODULE or entry.endswith("vllm/entrypoints/cli/main.py")
    return list(rest[1:]) if cli and rest and rest[0] == "serve" else None


def runs_python(proc: psutil.Process) -> bool:
    """Whether the process's executable is a Python interpreter; True when it cannot be read (then
    its argv alone tells)."""
    try:
        exe = os.readlink(procfs.PROC / str(proc.pid) / "exe")
    except PermissionError:
        return True
    except OSError:
        return False
    return bool(_PYTHON.match(os.path.basename(exe.removesuffix(" (deleted)"))))
