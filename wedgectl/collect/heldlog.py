"""The server's log as an API server holds it (HeldLog): the regular file its stdout or stderr goes to,
found through /proc/PID/fd, and opened only while it is the file the process held and only if the
process could read it itself."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from stat import S_IRGRP, S_IROTH, S_IRUSR, S_ISREG
from typing import BinaryIO

from wedgectl.collect import procfs
from wedgectl.model.errors import UnreadableInput


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
