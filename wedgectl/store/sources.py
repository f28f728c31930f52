"""Turning what the operator holds (a log file, a bundle) into a Bundle, with clear errors."""

from __future__ import annotations

import gzip
import os
import select
import socket
import stat
import sys
import time
import zlib
from pathlib import Path
from typing import BinaryIO, Protocol

from wedgectl import __version__
from wedgectl.model.errors import InputNotFound, NoVllmLines, UnreadableInput
from wedgectl.read.logparse import parse_log
from wedgectl.read.logwrap import unwrap
from wedgectl.model.types import Bundle, Manifest, Target

MAX_LOG_BYTES = 64 << 20  # the tail is what matters for a hang; a bigger log is read from its end
# A rotated log (vllm.log.1.gz) is unpacked to its end, for its tail; never past this many bytes (a gzip
# bomb unpacks a thousand times its size).
MAX_UNPACKED_BYTES = 1 << 30
STDIN = ("-", "/dev/stdin")  # `--log -`: `kubectl logs POD | wedgectl diagnose --log -`
# stdin is read to its end. A pipe that stays open (`kubectl logs -f`, `tail -f`) has no end: it is read
# until nothing came for STDIN_IDLE_S once lines began, or for STDIN_WAIT_S at all.
STDIN_IDLE_S = 5.0
STDIN_WAIT_S = 60.0
_CHUNK = 1 << 20

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
    if is_stdin(path):
        return read_stdin_lines(max_bytes)
    p = Path(path)
    if stat.S_ISDIR(stat_input(p).st_mode):
        raise UnreadableInput(f"{p}: is a directory, not a log file (use --bundle for a bundle directory)")
    with open_regular(p) as fh:
        try:
            gzipped = fh.read(2) == b"\x1f\x8b"
            fh.seek(0)
        except OSError as exc:
            raise _os_error(p, exc) from None
        if gzipped:
            return _read_gzip(fh, p, max_bytes)
        return _read_tail(fh, p, max_bytes)


def is_stdin(path: str | Path) -> bool:
    return str(path) in STDIN


def read_stdin_lines(max_bytes: int = MAX_LOG_BYTES, stream: BinaryIO | None = None,
                     idle_s: float = STDIN_IDLE_S, wait_s: float = STDIN_WAIT_S) -> tuple[tuple[str, ...], list[str]]:
    """A log piped to stdin: its last max_bytes, read to the pipe's end, or until it went quiet (a follow)."""
    fh = stream if stream is not None else sys.stdin.buffer
    name = Path("stdin")
    try:
        fd = fh.fileno()
        if os.isatty(fd):
            raise UnreadableInput("stdin is a terminal: pipe a log in (kubectl logs POD | wedgectl diagnose --log -)")
    except (OSError, ValueError):
        raise UnreadableInput("stdin is closed: pipe a log in (kubectl logs POD | wedgectl diagnose --log -)") from None
    notes: list[str] = []
    tail = _Tail(max_bytes)
    start = last = time.monotonic()
    while True:
        now = time.monotonic()
        limit = (last + idle_s) if tail.total else (start + wait_s)
        if now >= limit:
            waited = idle_s if tail.total else wait_s
            notes.append(f"stdin still open after {waited:.0f} s with nothing new: read what had come "
                         f"(a follow, like `kubectl logs -f`, has no end)")
            break
        try:
            ready, _, _ = select.select([fd], [], [], limit - now)
        except (OSError, ValueError) as exc:
            raise UnreadableInput(f"stdin: {exc}") from None
        if not ready:
            continue
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise UnreadableInput(f"stdin: {exc.strerror or exc}") from None
        if not chunk:
            break
        tail.add(chunk)
        last = time.monotonic()
    if tail.total > max_bytes:
        notes.append(f"stdin gave {tail.total} bytes; read its last {max_bytes}")
    return _lines_of(tail.data(), name, notes), notes


class _Tail:
    """The last `keep` bytes of a stream, starting at a line, in memory bounded by about twice that."""

    def __init__(self, keep: int) -> None:
        self.keep, self.total, self.buf = keep, 0, bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > 2 * self.keep:
            del self.buf[: len(self.buf) - self.keep]

    def data(self) -> bytes:
        if len(self.buf) <= self.keep and self.total <= self.keep:
            return bytes(self.buf)
        data = bytes(self.buf[-self.keep:])
        cut = data.find(b"\n")
        return data[cut + 1:] if cut >= 0 else data  # drop the partial first line


def _read_gzip(fh: BinaryIO, p: Path, max_bytes: int) -> tuple[tuple[str, ...], list[str]]:
    """A gzipped log (logrotate's vllm.log.1.gz): unpacked to its end for the tail, never past MAX_UNPACKED_BYTES."""
    notes: list[str] = []
    tail = _Tail(max_bytes)
    try:
        with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
            while tail.total < MAX_UNPACKED_BYTES:
                chunk = gz.read(min(_CHUNK, MAX_UNPACKED_BYTES - tail.total))
                if not chunk:
                    break
                tail.add(chunk)
            else:
                notes.append(f"gzip log unpacks past {MAX_UNPACKED_BYTES} bytes: read up to there only")
    except (OSError, EOFError, zlib.error) as exc:
        if not tail.total:
            raise UnreadableInput(f"{p}: a damaged gzip file ({exc})") from None
        notes.append(f"gzip log damaged after {tail.total} bytes unpacked ({exc}): read up to there")
    notes.append(f"gzip log: {tail.total} bytes unpacked" + (f"; read the last {max_bytes}" if tail.total > max_bytes
                                                                 else ""))
    return _lines_of(tail.data(), p, notes), notes


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
    return _lines_of(data, p, notes), notes


def _lines_of(data: bytes, p: Path, notes: list[str]) -> tuple[str, ...]:
    if not data.strip():
        raise UnreadableInput(f"{p}: the file is empty")
    head = data[:8192]
    if b"\x00" in head or _mostly_binary(head):
        raise UnreadableInput(f"{p}: looks binary, not a text log")
    text = data.decode("utf-8", errors="replace")
    lines, kind = unwrap(text.splitlines())
    if kind is not None:
        notes.append(f"a {kind} log: read the lines inside, timed by its stamps")
    return tuple(lines)


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
    if parsed.n_recognised == 0 or parsed.n_vllm == 0:
        raise NoVllmLines(f"{path}: not a vLLM log: none of its {parsed.n_lines} lines is in vLLM's own format "
                          f"('INFO MM-DD HH:MM:SS [file.py:N] ...' or '(APIServer pid=N) ...')")
    manifest = Manifest(
        created=time.time(),
        wedgectl_version=__version__,
        source="log",
        target=Target(log_path=str(path)),
        host=host_facts(),
        notes=tuple(notes),
    )
    return Bundle(manifest=manifest, log_lines=lines)
