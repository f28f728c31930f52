"""The flight recorder: an evidence bundle saved at each episode's onset, rotated by count and size."""

from __future__ import annotations

import itertools
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from wedgectl.store.bundle import open_bundle_dir, write_archive_at
from wedgectl.model.errors import UnwritableOutput
from wedgectl.model.types import Bundle

PREFIX = "wedgectl-watch-"
SUFFIX = ".tar.gz"
DEFAULT_KEEP = 50  # bundles
DEFAULT_MAX_BYTES = 512 << 20  # all bundles together

# What bundle_name makes, and all that rotation may delete: PREFIX, the target and verdict (with the
# -N of a second episode in one second), the UTC stamp, SUFFIX. Names are at most 255 bytes.
_OURS = re.compile(r"wedgectl-watch-[A-Za-z0-9._-]{1,200}-\d{8}T\d{6}Z\.tar\.gz")


@dataclass(frozen=True)
class Rotation:
    """How many onset bundles, and how many bytes of them, the directory may hold."""

    keep: int = DEFAULT_KEEP
    max_bytes: int = DEFAULT_MAX_BYTES


def bundle_name(target: str, verdict: str, t: float) -> str:
    """wedgectl-watch-TARGET-VERDICT-YYYYmmddTHHMMSSZ.tar.gz, the target made safe for a file name."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", target).strip("_")[:80] or "target"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))
    return f"{PREFIX}{safe}-{verdict}-{stamp}{SUFFIX}"


def check_bundle_dir(directory: Path) -> None:
    """Make --bundle-dir (0700) or check the existing one: ours, not a link, writable by no one else.
    UnwritableOutput says why not; watch refuses to start on it rather than find out at an onset."""
    os.close(open_bundle_dir(directory))


def _recorded_at(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """The onset bundles in the directory dir_fd, oldest first: regular files of ours (our euid, not
    links) named as bundle_name names them. Anything else there is never touched."""
    found = []
    for name in os.listdir(dir_fd):
        if not _OURS.fullmatch(name):
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            found.append((name, st))
    return sorted(found, key=lambda f: (f[1].st_mtime, f[0]))


def recorded(directory: Path) -> list[Path]:
    """The onset bundles in directory, oldest first ([] when it is missing or not one of ours:
    open_bundle_dir). Other files there, and links, are never touched."""
    try:
        dir_fd = open_bundle_dir(directory, create=False)
    except UnwritableOutput:
        return []
    try:
        return [directory / name for name, _ in _recorded_at(dir_fd)]
    except OSError:
        return []
    finally:
        os.close(dir_fd)


def _rotate_at(dir_fd: int, rotation: Rotation, keep: str | None) -> list[str]:
    try:
        files = _recorded_at(dir_fd)
    except OSError:
        return []
    sizes = dict(files)
    names = [name for name, _ in files]
    removed = []
    while names and (len(names) > rotation.keep or sum(sizes[n].st_size for n in names) > rotation.max_bytes):
        oldest = names[0]
        if oldest == keep:
            if len(names) == 1:
                break
            oldest = names[1]
        names.remove(oldest)
        try:
            # The same file as listed: the directory is ours alone, but a bundle replaced meanwhile stays.
            st = os.stat(oldest, dir_fd=dir_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != (sizes[oldest].st_dev, sizes[oldest].st_ino):
                continue
            os.unlink(oldest, dir_fd=dir_fd)
            removed.append(oldest)
        except OSError:
            continue
    return removed


def rotate(directory: Path, rotation: Rotation, keep_path: Path | None = None) -> list[Path]:
    """Delete the oldest onset bundles until at most rotation.keep remain and they take at most
    rotation.max_bytes together; the newest (keep_path) stays whatever its size. The deleted paths.
    Only in a directory of ours (open_bundle_dir), only bundles of ours (_recorded_at)."""
    try:
        dir_fd = open_bundle_dir(directory, create=False)
    except UnwritableOutput:
        return []
    try:
        keep = keep_path.name if keep_path is not None else None
        return [directory / name for name in _rotate_at(dir_fd, rotation, keep)]
    finally:
        os.close(dir_fd)


def save_onset(bundle: Bundle, directory: Path, target: str, verdict: str, rotation: Rotation) -> Path:
    """Write the bundle into directory, then rotate. Raises UnwritableOutput (the directory is not
    ours alone: check_bundle_dir) or OSError when it cannot be written."""
    t = bundle.manifest.created or time.time()
    # two episodes of one target within a second: -1, -2 ... after the verdict
    names = itertools.chain([bundle_name(target, verdict, t)],
                            (bundle_name(target, f"{verdict}-{n}", t) for n in itertools.count(1)))
    dir_fd = open_bundle_dir(directory)
    try:
        name = write_archive_at(bundle, dir_fd, names, directory)
        _rotate_at(dir_fd, rotation, keep=name)
    finally:
        os.close(dir_fd)
    return Path(directory) / name
