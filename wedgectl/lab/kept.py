"""Kept repros (`repro NAME --keep`): each recorded when it is kept, so that `repro --stop NAME` (or
`--stop-all`) can end it later, by the pids and start times it had then (a pid reused since is never
signalled).

The records live in a directory of the wedgectl cache that only its owner may enter (0700, checked, never
followed through a link); each is a small JSON file, written whole (a temporary file renamed over it).
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from wedgectl.collect.control import Stopped, stop_tree
from wedgectl.collect.procfs.stat import start_ticks
from wedgectl.lab.runtime.install import cache_dir
from wedgectl.model.errors import WedgectlError
from wedgectl.model import exitcodes

KEPT_DIRNAME = "kept"
RECORD_MAX_BYTES = 64 << 10
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class KeptRepro:
    name: str
    pid: int  # the API server (its own session: its EngineCore and Workers are in its tree)
    pid_ticks: int  # /proc/PID/stat start time: names this process for good
    url: str
    holder_pid: int | None  # the detached clients holding its requests open
    holder_ticks: int | None
    out_dir: str
    kept_at: float
    lasts_s: float  # how long the clients hold the requests, and vLLM's own step timeout was set to

    @property
    def record_name(self) -> str:
        return f"{self.name}-{self.pid}.json"

    def running(self) -> bool:
        return start_ticks(self.pid) == self.pid_ticks


def kept_dir(create: bool = False) -> Path:
    """The records' directory: refused (exit 24) if it is a link, not ours, or open to others."""
    path = cache_dir() / KEPT_DIRNAME
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise WedgectlError(f"{path}: not a private directory of this user's (a link, another owner, or open "
                            f"to others): kept repros are not recorded or read there", exitcodes.UNWRITABLE_OUTPUT)
    return path


def record(kept: KeptRepro) -> Path:
    """Write the record of a repro just kept; returns its path."""
    directory = kept_dir(create=True)
    final = directory / kept.record_name
    tmp = directory / f".{kept.record_name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(kept), f)
    os.replace(tmp, final)
    return final


def _read(path: Path) -> KeptRepro | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(RECORD_MAX_BYTES + 1)
    if len(data) > RECORD_MAX_BYTES:
        return None
    try:
        raw = json.loads(data)
        kept = KeptRepro(**raw)
    except (ValueError, TypeError):
        return None
    ints = (kept.pid, kept.pid_ticks) + tuple(x for x in (kept.holder_pid, kept.holder_ticks) if x is not None)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ints):
        return None
    if not isinstance(kept.name, str) or not isinstance(kept.url, str):
        return None
    return kept


def list_kept() -> list[tuple[Path, KeptRepro]]:
    """The recorded kept repros, oldest first (a record that does not read is skipped)."""
    directory = kept_dir()
    if not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("*.json")):
        kept = _read(path)
        if kept is not None:
            out.append((path, kept))
    return sorted(out, key=lambda pk: pk[1].kept_at)


def stop(path: Path, kept: KeptRepro, progress: Callable[[str], None] = lambda _m: None) -> Stopped | None:
    """Stop a kept repro's clients and server (SIGTERM, SIGKILL after STOP_GRACE_S), each only if it is still
    the process that was kept; remove its record. None when its server had already gone."""
    stopped = None
    if kept.holder_pid is not None and kept.holder_ticks is not None \
            and start_ticks(kept.holder_pid) == kept.holder_ticks:
        stop_tree(kept.holder_pid, grace=2.0, planned={kept.holder_pid: kept.holder_ticks})
    if kept.running():
        progress(f"stopping {kept.name}: pid {kept.pid} ({kept.url})")
        stopped = stop_tree(kept.pid, grace=STOP_GRACE_S, planned={kept.pid: kept.pid_ticks})
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return stopped


def new_record(name: str, pid: int, url: str, holder_pid: int | None, out_dir: Path, lasts_s: float) -> KeptRepro:
    ticks = start_ticks(pid)
    if ticks is None:
        raise WedgectlError(f"the kept server pid {pid} is already gone", exitcodes.REPRO_FAILED)
    holder_ticks = start_ticks(holder_pid) if holder_pid is not None else None
    return KeptRepro(name, pid, ticks, url, holder_pid if holder_ticks is not None else None, holder_ticks,
                     str(out_dir), time.time(), lasts_s)
