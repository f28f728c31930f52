"""The /dev/shm files a stopped process tree left behind: removed if its own and no one else holds them."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from collections.abc import Collection, Iterable

SHM = "/dev/shm"  # where shm_open(3) puts POSIX shared memory
log = logging.getLogger(__name__)


def remove_unheld(paths: Iterable[str], owners: Collection[int] = (),
                  since: float | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(removed, kept): unlink those of `paths` that the stopped tree made and no live process maps or
    holds open.

    A tree maps files it did not make (another user's segment it may read, an older one), and root
    may unlink anything in /dev/shm, sticky bit or not: so only a regular file right under /dev/shm
    (not a link: opened O_NOFOLLOW), owned by one of `owners` (the tree's uids) and changed last no
    earlier than `since` (the tree's start, a unix time; ctime, which no one can set back) is removed.
    Kept: the others, the ones still held, and any whose holders cannot be told. Nothing is removed
    without `owners` and `since`.
    """
    removed: list[str] = []
    kept: list[str] = []
    foreign = 0
    for path in sorted(set(paths)):
        if os.path.dirname(path) != SHM:
            continue
        held = _unlink_unheld(path, frozenset(owners), since)
        if held is None:
            continue  # gone already
        if held == "foreign":
            foreign += 1
        (kept if held else removed).append(path)
    if kept:
        log.info("kept %d /dev/shm file(s) the stopped tree mapped: %d not its own, the others still held",
                 len(kept), foreign)
    return tuple(removed), tuple(kept)


def _its_own(st: os.stat_result, owners: frozenset[int], since: float | None) -> bool:
    """Whether the tree could have made the file: owned by its uid, and not older than the tree."""
    return since is not None and st.st_uid in owners and st.st_ctime >= since


def _unlink_unheld(path: str, owners: frozenset[int], since: float | None) -> bool | str | None:
    """Unlink `path` if it is the tree's own and no other process holds it. False: removed; None: it was
    gone; "foreign": not the tree's own (kept); True: held, or unsure (kept).

    The kernel grants a write lease only when no one else has the file open,
    and a mapping keeps its file open: no scan of every process's maps (some of
    which root may not read) can tell as surely. The lease is held across the
    unlink, so a process that opens it meanwhile waits for the lease to go.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # a link, or not ours to open: leave it
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return True
        if not _its_own(st, owners, since):
            return "foreign"
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return True  # held (EAGAIN), or leases not permitted here: unsure is held
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return True  # the name leads to another file now: not the one checked
            os.unlink(path)
        except FileNotFoundError:
            return None
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)
