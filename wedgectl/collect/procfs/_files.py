"""The proc root, the kernel's units, and the one way this package reads a /proc file."""

from __future__ import annotations

import os
from pathlib import Path

COLLECTOR = "procfs"
PROC = Path("/proc")

try:
    CLK_TCK = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    CLK_TCK = 100

try:
    PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
    PAGE_SIZE = 4096


def read_text(path: Path | str) -> str:
    # One read() of a small /proc file is atomic for the kernel's seq_file. os.open/os.read, not
    # open(): `top` reads three files of every thread that ran each refresh, and a file object costs more
    # than the read.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode("utf-8", "replace")
    finally:
        os.close(fd)


def read_or_none(path: Path) -> str | None:
    try:
        return read_text(path)
    except OSError:
        return None


def readlinks(fd_dir: str, skip: frozenset[int] | set[int] = frozenset()) -> list[str]:
    links = []
    for fd in os.listdir(fd_dir):
        if skip and int(fd) in skip:
            continue
        try:
            links.append(os.readlink(fd_dir + fd))
        except FileNotFoundError:
            continue
    return links
