"""What keeps a swap from doing harm: who may write the target's interpreter, a restore script, and signals mid-swap.

A swap runs the target's interpreter and pip as the target's user; if anyone
else could write that interpreter (or a folder above it, or the site-packages
pip writes to), wedgectl would run their code, so it refuses instead. Before
it stops anything it writes a script that starts the old command again exactly
as it ran; and while the old server is down, SIGINT, SIGTERM and SIGHUP do not
cut the swap in half: they turn into a rollback.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from wedgectl.collect.target import Credentials
from wedgectl.collect.control import ChildError, Signal, Stream, handle_signals, run_bounded

SETPRIV = "setpriv"
HANDLED_SIGNALS = (Signal.INT, Signal.TERM, Signal.HUP)


# ------------------------------------------------------------------ who may write a path


def _group_is_private(gid: int, owner: int) -> bool:
    """Whether only root and `owner` are in group `gid` (as members or by their primary group)."""
    try:
        group = grp.getgrgid(gid)
        names = {pwd.getpwuid(owner).pw_name, "root"}
    except KeyError:
        return False
    if any(m not in names for m in group.gr_mem):
        return False
    return all(p.pw_uid in (0, owner) for p in pwd.getpwall() if p.pw_gid == gid)


def _node_risk(node: str, st: os.stat_result, owner: int) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return None  # a link cannot be rewritten in place; its folder and its target are checked
    if st.st_uid not in (0, owner):
        return f"{node} is owned by uid {st.st_uid}"
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky_dir:
        return f"{node} is writable by every user"
    if st.st_mode & stat.S_IWGRP and not sticky_dir and st.st_gid != 0 and not _group_is_private(st.st_gid, owner):
        return f"{node} is writable by group {st.st_gid}, which has other members"
    return None


def path_risk(path: str, owner: int) -> str | None:
    """Why someone other than root or uid `owner` could change `path`, or None when nobody can.

    The file and every folder above it count, both as named and after its
    links are resolved. A sticky world-writable folder (/tmp) is allowed: others
    cannot replace what root or the owner put in it, and that entry is checked.
    """
    for name in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        parts = Path(name).parts
        for i in range(len(parts), 0, -1):
            node = str(Path(*parts[:i]))
            try:
                st = os.lstat(node)
            except OSError as exc:
                return f"{node}: {exc.strerror}"
            risk = _node_risk(node, st, owner)
            if risk:
                return risk
    return None


def can_append_as(path: str, run_as: Credentials, timeout_s: float = 10.0) -> bool:
    """Whether `run_as` may append to (or create) `path`: asked of a shell run as that user, so root
    never opens a file the user chose."""
    try:
        return run_bounded(["/bin/sh", "-c", ': >>"$0"', path], stdin=Stream.NULL, timeout=timeout_s, cwd="/",
                           **run_as.popen_kwargs).returncode == 0
    except (OSError, ChildError):
        return False


# ------------------------------------------------------------------ the restore script


def restore_script(argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str,
                   run_as: Credentials) -> str:
    """A shell script that starts `argv` again, detached, exactly as it ran: its environment
    alone, its folder, its user, its output appended to its log (opened as that user)."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    as_user = ""
    if run_as.popen_kwargs:
        groups = ",".join(map(str, run_as.groups))
        as_user = (f"{SETPRIV} --reuid={run_as.uid} --regid={run_as.gid} "
                   + (f"--groups={groups} " if groups else "--clear-groups ") + "-- ")
    inner = 'exec >>"$0" 2>&1 </dev/null; exec env -i "$@"'
    return (
        "#!/bin/sh\n"
        "# Written by wedgectl swap before it stopped the server: starts its command again as it ran.\n"
        "# It holds the server's environment (secrets included): keep it private, delete it once used.\n"
        f"cd {shlex.quote(cwd)} || exit 1\n"
        f"exec setsid -f {as_user}/bin/sh -c {shlex.quote(inner)} {shlex.quote(log_path)} "
        f"{assignments} {shlex.join(argv)}\n"
    )


def write_restore_script(folder: Path, port: int, text: str) -> Path:
    """Save the script 0600 (it holds secrets) under wedgectl's own cache; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"restore-{port}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sh"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return path


# ------------------------------------------------------------------ signals mid-swap


class SwapInterrupted(Exception):
    """A signal came while the old server was down: the swap rolls back."""

    def __init__(self, signum: Signal) -> None:
        super().__init__(signum.full_name)
        self.signum = signum


class SignalGuard:
    """SIGINT, SIGTERM and SIGHUP while it is entered: recorded, and raised as SwapInterrupted
    only where that is safe (`interruptible()` blocks: waits that start or stop nothing).

    A step that starts or stops a process is never cut in half: its signal is
    raised by the `check()` after it. Each signal is raised once. Handlers can
    only be set from the main thread; in another (top's worker) the guard does
    nothing and the caller's own handling stands.
    """

    def __init__(self) -> None:
        self.signum: Signal | None = None  # the last signal that came
        self.pending = False
        self.waiting = False
        self._restore: Callable[[], None] | None = None

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            self._restore = handle_signals(HANDLED_SIGNALS, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._restore is not None:
            self._restore()
        self._restore = None

    def _handle(self, signum: Signal) -> None:
        self.signum = signum
        if self.waiting:
            self.waiting = False
            raise SwapInterrupted(signum)
        self.pending = True

    def check(self) -> None:
        """Raise SwapInterrupted once for a signal that came during a step."""
        if self.pending and self.signum is not None:
            self.pending = False
            raise SwapInterrupted(self.signum)

    def interruptible(self) -> _Interruptible:
        return _Interruptible(self)


class _Interruptible:
    def __init__(self, guard: SignalGuard) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        self.guard.check()
        self.guard.waiting = True

    def __exit__(self, *exc: object) -> None:
        self.guard.waiting = False
