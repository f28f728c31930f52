"""The flight recorder: an evidence bundle saved at each episode's onset, rotated by count and size."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from wedgectl.bundle import write_bundle
from wedgectl.types import Bundle

PREFIX = "wedgectl-watch-"
SUFFIX = ".tar.gz"
DEFAULT_KEEP = 50  # bundles
DEFAULT_MAX_BYTES = 512 << 20  # all bundles together


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


def recorded(directory: Path) -> list[Path]:
    """The onset bundles in directory, oldest first. Other files there are never touched."""
    try:
        found = [p for p in directory.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX) and p.is_file()]
    except OSError:
        return []
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))


def rotate(directory: Path, rotation: Rotation, keep_path: Path | None = None) -> list[Path]:
    """Delete the oldest onset bundles until at most rotation.keep remain and they take at most
    rotation.max_bytes together; the newest (keep_path) stays whatever its size. The deleted paths."""
    files = recorded(directory)
    sizes = {p: _size(p) for p in files}
    removed = []
    while files and (len(files) > rotation.keep or sum(sizes[p] for p in files) > rotation.max_bytes):
        oldest = files[0]
        if oldest == keep_path:
            if len(files) == 1:
                break
            oldest = files[1]
        files.remove(oldest)
        try:
            oldest.unlink()
            removed.append(oldest)
        except OSError:
            continue
    return removed


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def save_onset(bundle: Bundle, directory: Path, target: str, verdict: str, rotation: Rotation) -> Path:
    """Write the bundle into directory, then rotate. Raises OSError when it cannot be written."""
    t = bundle.manifest.created or time.time()
    path = directory / bundle_name(target, verdict, t)
    n = 1
    while path.exists():  # two episodes of one target within a second
        path = directory / bundle_name(target, f"{verdict}-{n}", t)
        n += 1
    write_bundle(bundle, path)
    rotate(directory, rotation, keep_path=path)
    return path
