"""Turning what the operator holds (a log file, a bundle) into a Bundle, with clear errors."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path
from typing import BinaryIO, Protocol

from wedgectl import __version__
from wedgectl.model.errors import InputNotFound, NoVllmLines, UnreadableInput
from wedgectl.read.logparse import parse_log
from wedgectl.model.types import Bundle, Manifest, Target

MAX_LOG_BYTES = 64 << 20  # the tail is what matters for a hang; a bigger log is read from its end

_NOT_REGULAR = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _os_error(p: Path, exc: OSError) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return InputNotFound(f"{p}: no such file or directory")
    if isinstance(exc, PermissionError):
        return UnreadableInput(f"{p}: permission denied")
    return UnreadableInput(f"{p}: {exc.strerror or exc}")


def stat_input(path: str | Path) -> os.stat_result:
    """stat() of a path the operator gave, following symlinks; InputNotFound / UnreadableInput."""
    p = Path(path)
    try:
        return os.stat(p)
    except OSError as exc:
        raise _os_error(p, exc) from None


def require_regular(path: str | Path, st: os.stat_result) -> None:
    """UnreadableInput unless st is a regular file: a FIFO would block a read, /dev/zero never ends."""
    if not stat.S_ISREG(st.st_mode):
        kind = _NOT_REGULAR.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise UnreadableInput(f"{path}: is {kind}, not a regular file")


def open_regular(path: str | Path) -> BinaryIO:
    """Open a regular file for reading without ever blocking; anything else is refused with one line.

    stat() first, so a device or FIFO is never opened at all; then open with O_NONBLOCK (a FIFO
    swapped in meanwhile cannot block the open) and check the descriptor itself, so the file read is
    the file checked. Symlinks are followed on purpose: operators hand symlinked logs
    (/var/log/.../current); what matters is that what they lead to is a regular file.
    """
    p = Path(path)
    require_regular(p, stat_input(p))
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise _os_error(p, exc) from None
    try:
        require_regular(p, os.fstat(fd))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class LogSource(Protocol):
    """A log found through a process (processes.HeldLog): shown as path, opened only by open()."""

    @property
    def path(self) -> str: ...

    def open(self) -> BinaryIO: ...


def read_log_lines(path: str | Path | LogSource, max_bytes: int = MAX_LOG_BYTES) -> tuple[tuple[str, ...], list[str]]:
    """The log's lines (its last max_bytes), and notes about what was done to read it.

    path is what the operator gave (a path, opened as open_regular does), or a log found through a
    process (a LogSource), which is read only as its open() allows: the process's own file, never
    whatever its path names in this mount namespace."""
    if not isinstance(path, (str, Path)):
        with path.open() as fh:  # UnreadableInput says why not
            return _read_tail(fh, Path(path.path), max_bytes)
    p = Path(path)
    if stat.S_ISDIR(stat_input(p).st_mode):
        raise UnreadableInput(f"{p}: is a directory, not a log file (use --bundle for a bundle directory)")
    with open_regular(p) as fh:
        return _read_tail(fh, p, max_bytes)


def _read_tail(fh: BinaryIO, p: Path, max_bytes: int) -> tuple[tuple[str, ...], list[str]]:
    notes: list[str] = []
    try:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            fh.seek(size - max_bytes)
            fh.readline(max_bytes)  # drop the partial first line
            notes.append(f"log is {size} bytes; read its last {max_bytes}")
        data = fh.read(max_bytes)  # bounded even when the log grows while we read
    except OSError as exc:
        raise _os_error(p, exc) from None
    if not data.strip():
        raise UnreadableInput(f"{p}: the file is empty")
    head = data[:8192]
    if b"\x00" in head or _mostly_binary(head):
        raise UnreadableInput(f"{p}: looks binary, not a text log")
    text = data.decode("utf-8", errors="replace")
    return tuple(text.splitlines()), notes


def _mostly_binary(chunk: bytes) -> bool:
    text_bytes = bytes(range(32, 127)) + b"\n\r\t\b\f\x1b"
    odd = sum(1 for b in chunk if b not in text_bytes and b < 128)
    return len(chunk) > 0 and odd / len(chunk) > 0.1


def host_facts() -> dict[str, str]:
    """The host a bundle was captured on; with its CPUs and load, so a reader can tell a host too
    busy to run the engine from an engine that stopped."""
    facts = {"hostname": socket.gethostname(), "kernel": os.uname().release, "tz": time.strftime("%z")}
    try:
        facts["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    facts["cpus"] = str(len(os.sched_getaffinity(0)))
    return facts


def steal_facts(before: dict[int, float], after: dict[int, float], span_s: float) -> dict[str, str]:
    """The hypervisor's steal over a capture, as host facts: CPU seconds stolen from the CPUs read
    both times (procfs.cpu_steal_s), the seconds between the reads and how many CPUs. {} where
    nothing was read twice. On a crowded VM the guest's own figures understate what it lost: a
    task's CPU time and clock stop while its vCPU is stolen, and its run delay does not grow."""
    cpus = before.keys() & after.keys()
    if not cpus or not span_s > 0:
        return {}
    stolen = sum(max(0.0, after[c] - before[c]) for c in cpus)
    return {"steal_s": f"{stolen:.2f}", "steal_span_s": f"{span_s:.2f}", "steal_cpus": str(len(cpus))}


def bundle_from_log(path: str | Path) -> Bundle:
    """A log-only bundle; NoVllmLines when nothing in it is a vLLM line."""
    lines, notes = read_log_lines(path)
    parsed = parse_log(lines)
    if parsed.n_recognised == 0:
        raise NoVllmLines(f"{path}: no vLLM log lines found ({parsed.n_lines} lines read)")
    manifest = Manifest(
        created=time.time(),
        wedgectl_version=__version__,
        source="log",
        target=Target(log_path=str(path)),
        host=host_facts(),
        notes=tuple(notes),
    )
    return Bundle(manifest=manifest, log_lines=lines)
