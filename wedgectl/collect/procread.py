"""Bounded reads of another process's cmdline, environ and maps, and of the /dev/shm files it holds.

cmdline, environ and maps are read from the target's address space under its
mmap lock, which a thread stuck in a driver (state D: the hang wedgectl is for)
can hold for ever. Each read runs in a daemon thread and is abandoned after its
timeout; while one read of a process is still stuck, the next fails at once
instead of stranding another thread. Each is capped in bytes too.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from wedgectl.collect.shm import SHM

PROC = Path("/proc")

CMDLINE_CAP = 256 * 1024
ENVIRON_CAP = 4 * 1024 * 1024  # argv + envp together fit in a quarter of the 8 MiB stack limit
MAPS_CAP = 32 * 1024 * 1024
READ_TIMEOUT_S = 2.0
_STUCK_MAX = 32  # abandoned reads (threads still blocked) before every new read fails at once
_stuck: set[Path] = set()  # process directories with a read still blocked
_stuck_lock = threading.Lock()


def read_bounded(path: Path, cap: int, timeout: float = READ_TIMEOUT_S) -> tuple[bytes, bool]:
    """(up to `cap` bytes of `path`, whether there was more), within `timeout` seconds.

    Raises what open/read raise, and TimeoutError (an OSError) when the read
    blocked past `timeout` or an earlier read of the same process still blocks.
    """
    key = path.parent
    with _stuck_lock:
        if key in _stuck or len(_stuck) >= _STUCK_MAX:
            raise TimeoutError(f"{path}: an earlier read of it is still blocked (mmap lock held?)")
    box: list[object] = []

    def run() -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                chunks, size = [], 0
                while size <= cap:
                    chunk = f.read(min(65536, cap + 1 - size))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
            data = b"".join(chunks)
            result: object = (data[:cap], len(data) > cap)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            result = exc
        with _stuck_lock:
            box.append(result)
            _stuck.discard(key)  # a read abandoned earlier has come back

    thread = threading.Thread(target=run, name="wedgectl-proc-read", daemon=True)
    thread.start()
    thread.join(timeout)
    with _stuck_lock:
        if not box:
            _stuck.add(key)
            raise TimeoutError(f"{path}: read blocked > {timeout:.1f}s (mmap lock held: a thread in state D?)")
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result  # type: ignore[return-value]


def split_cmdline(data: bytes) -> list[str]:
    """A cmdline file as argv, as psutil splits it: a title set by setproctitle (one string with
    spaces, or space-separated) becomes its words."""
    text = data.decode(errors="surrogateescape")
    if not text:
        return []  # a zombie or kernel thread
    sep = "\x00" if text.endswith("\x00") else " "
    if text.endswith(sep):
        text = text[:-1]
    argv = text.split(sep)
    if sep == "\x00" and len(argv) == 1 and " " in text:
        argv = text.split(" ")
    return argv


def read_cmdline(pid: int, proc_root: Path = PROC, timeout: float = READ_TIMEOUT_S) -> list[str]:
    """A process's argv (bounded in time and bytes; a longer one is cut)."""
    data, _ = read_bounded(proc_root / str(pid) / "cmdline", CMDLINE_CAP, timeout)
    return split_cmdline(data)


def read_environ(pid: int, proc_root: Path = PROC, timeout: float = READ_TIMEOUT_S) -> tuple[dict[str, str], bool]:
    """(a process's environment, whether it was cut at ENVIRON_CAP), bounded in time."""
    data, cut = read_bounded(proc_root / str(pid) / "environ", ENVIRON_CAP, timeout)
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="surrogateescape")] = v.decode(errors="surrogateescape")
    return env, cut


def read_maps(pid: int, proc_root: Path = PROC, timeout: float = READ_TIMEOUT_S) -> str:
    """A process's /proc/PID/maps (bounded in time and bytes)."""
    data, _ = read_bounded(proc_root / str(pid) / "maps", MAPS_CAP, timeout)
    return data.decode(errors="replace")


def mapped_paths(maps_text: str, under: str = "/") -> set[str]:
    """The files a maps text maps from under the folder `under` (unlinked ones left out)."""
    prefix = under.rstrip("/") + "/"
    out = set()
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(prefix) and not fields[5].endswith(" (deleted)"):
            out.add(fields[5])
    return out


# ---------------------------------------------------------------------------
# /dev/shm files a process tree holds
#
# A SIGKILLed vLLM tree leaves its shared-memory segments (psm_*, 160-250 MB
# each) behind: the multiprocessing resource tracker that would unlink them
# dies with it. lifecycle records them before it signals and removes, once the
# tree is gone, the ones no live process holds.


def _shm_fds(pid: int, proc_root: Path, under: str) -> set[str]:
    # fd links need no mmap lock: a process in state D still answers
    fd_dir = proc_root / str(pid) / "fd"
    out = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith(under.rstrip("/") + "/") and not target.endswith(" (deleted)"):
            out.add(target)
    return out


def shm_files_of(pids: list[int], proc_root: Path = PROC, under: str = SHM,
                 timeout: float = READ_TIMEOUT_S) -> set[str]:
    """The files under `under` that any of `pids` maps or holds open, read within `timeout` in all.

    A process whose maps could not be read (gone, blocked) gives its open files only.
    """
    deadline = time.monotonic() + timeout
    out: set[str] = set()
    for pid in pids:
        try:
            out |= _shm_fds(pid, proc_root, under)
            out |= mapped_paths(read_maps(pid, proc_root, max(0.05, deadline - time.monotonic())), under)
        except OSError:
            continue
    return out

