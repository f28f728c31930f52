"""The /dev/shm files a stopped process tree left behind: removed unless someone else still holds them."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from collections.abc import Iterable

SHM = "/dev/shm"  # where shm_open(3) puts POSIX shared memory
log = logging.getLogger(__name__)


def remove_unheld(paths: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(removed, kept): unlink those of `paths` (files right under /dev/shm) that no live process maps
    or holds open. Kept: the ones still held, and any whose holders cannot be told."""
    removed, kept = [], []
    for path in sorted(set(paths)):
        if os.path.dirname(path) != SHM:
            continue
        held = _unlink_unheld(path)
        if held is None:
            continue  # gone already
        (kept if held else removed).append(path)
    if kept:
        log.info("kept %d /dev/shm file(s) of the stopped tree that are still held", len(kept))
    return tuple(removed), tuple(kept)


def _unlink_unheld(path: str) -> bool | None:
    """Unlink `path` unless another process holds it; whether it was held (None: it was gone).

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
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return True  # held (EAGAIN), or leases not permitted here: unsure is held
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)
