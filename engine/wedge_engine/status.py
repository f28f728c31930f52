"""The engine status record: a small shared file the EngineCore writes on every step and the API server reads.

Pure Python, no vLLM. The API-server process creates the file (``create``)
before vLLM spawns the EngineCore and names it in ``WEDGE_ENGINE_STATUS_FILE``,
which the spawned processes inherit; the EngineCore maps it (``attach``) and
records each step; the API server reads it for ``/metrics`` and the watchdog.
A read never waits on the engine, so the ages it yields keep growing while the
EngineCore is blocked (nothing it sends over ZMQ is involved).

Layout (little-endian, ``RECORD_SIZE`` bytes; times are CLOCK_MONOTONIC
nanoseconds, one clock for every process on the host):

====  ====  =====================================================
off   type  field
====  ====  =====================================================
0     4s    magic ``b"WEHB"``
4     I     layout version (1)
8     Q     seq: bumped by every step write (readers re-read until stable)
16    Q     steps: engine steps (``EngineCoreProc._process_engine_step``)
24    Q     model_steps: steps that scheduled tokens (ran the model)
32    q     last_step_ns
40    q     last_model_step_ns
48    q     created_ns (the record's birth; ages start from it)
56    I     engine_pid (0 until an EngineCore attaches)
60    I     flags: 1 the scheduler is paused, 2 the engine sleeps (was reserved, 0)
64    Q     admission_rejections (requests the admission guard failed)
72    Q     tokens: tokens the scheduler has completed (``Scheduler.update_from_output``)
80    Q     max_model_len the admission guard made honest (0: not lowered); the API server
            adopts it where its vLLM does not pass the engine's figure on (before 0.2x)
====  ====  =====================================================

Engine and worker pids that can dump their stacks on request are listed one
per line ("pid role") in the companion file ``<path>.pids``.

Where it lives: a private runtime directory (``runtime_dir``): the user's
``$XDG_RUNTIME_DIR/wedge-engine`` or ``$TMPDIR/wedge-engine-UID``, mode 0700 and
owned by the server's uid, checked with lstat before use. Every open is
``O_NOFOLLOW`` and the record is created with ``O_EXCL``, so a link planted in
a shared directory can never make the server write somewhere else.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import tempfile
import time
from dataclasses import dataclass

STATUS_FILE_ENV = "WEDGE_ENGINE_STATUS_FILE"
MAGIC = b"WEHB"
VERSION = 1
RECORD_SIZE = 128

_HEAD = struct.Struct("<4sI")
_STEP = struct.Struct("<QQQqq")  # seq, steps, model_steps, last_step_ns, last_model_step_ns
_ALL = struct.Struct("<4sIQQQqqqIIQ")
_CREATED_OFF = 48
_PID = struct.Struct("<I")
_PID_OFF = 56
_COUNTER = struct.Struct("<Q")
_ADMISSION_OFF = 64
_FLAGS = struct.Struct("<I")
_FLAGS_OFF = 60
_TOKENS_OFF = 72
_MAX_LEN_OFF = 80
PAUSED = 1
SLEEPING = 2


class StatusFileError(OSError):
    """The status file is missing, too short, or not a wedge_engine record."""


@dataclass(frozen=True)
class StatusSnapshot:
    """One consistent read of the record, with ages as of the read."""

    steps: int
    model_steps: int
    last_step_ns: int
    last_model_step_ns: int
    created_ns: int
    engine_pid: int
    admission_rejections: int
    read_ns: int
    flags: int = 0
    tokens: int = 0

    @property
    def paused(self) -> bool:
        """The scheduler is paused (vLLM's pause_generation, /pause, or sleep): no progress is expected."""
        return bool(self.flags & PAUSED)

    @property
    def sleeping(self) -> bool:
        """The engine sleeps (/sleep, AsyncLLM.sleep): no progress is expected."""
        return bool(self.flags & SLEEPING)

    @property
    def progress(self) -> tuple[int, int]:
        """What moves when the engine gets work done: model steps and tokens completed."""
        return self.model_steps, self.tokens

    @property
    def last_step_age_s(self) -> float:
        return max(0.0, (self.read_ns - self.last_step_ns) / 1e9)

    @property
    def last_model_step_age_s(self) -> float:
        return max(0.0, (self.read_ns - self.last_model_step_ns) / 1e9)

    @property
    def engine_attached(self) -> bool:
        return self.engine_pid != 0


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _check_own_file(fd: int, path: str) -> os.stat_result:
    """A regular file of ours (the server's uid) or refuse: never map or append to someone else's file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise StatusFileError(f"{path} is not a regular file owned by uid {os.geteuid()}")
    return st


def _map(path: str, size: int = RECORD_SIZE) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    try:
        if _check_own_file(fd, path).st_size < size:
            raise StatusFileError(f"{path} is shorter than a status record")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _private_dir(path: str) -> str | None:
    """path as a directory only we can use (made 0700 if missing); None when it is anything else."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None  # a link, someone else's, or open to others: not ours to write in
    return path


def runtime_dir(environ: dict[str, str] | None = None) -> str:
    """The private directory for status records: $XDG_RUNTIME_DIR/wedge-engine, else $TMPDIR/wedge-engine-UID,
    else a fresh mkdtemp (0700, unguessable) when either is not safely ours."""
    environ = os.environ if environ is None else environ
    xdg = environ.get("XDG_RUNTIME_DIR")
    candidates = [os.path.join(xdg, "wedge-engine")] if xdg and os.path.isabs(xdg) else []
    candidates.append(os.path.join(tempfile.gettempdir(), f"wedge-engine-{os.geteuid()}"))
    for candidate in candidates:
        found = _private_dir(candidate)
        if found is not None:
            return found
    return tempfile.mkdtemp(prefix="wedge-engine-")


def default_path(pid: int, environ: dict[str, str] | None = None) -> str:
    """Where the API server with this pid keeps its status record."""
    return os.path.join(runtime_dir(environ), f"wedge-engine-{pid}.status")


def create(path: str, now_ns: int | None = None) -> None:
    """Write a fresh record at `path` (mode 0600): no steps yet, ages counted from now.

    O_EXCL|O_NOFOLLOW: a file (or link) already there is removed first, never written through."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    data = bytearray(RECORD_SIZE)
    _ALL.pack_into(data, 0, MAGIC, VERSION, 0, 0, 0, now, now, now, 0, 0, 0)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)  # a stale record of a dead server with our pid (unlink removes a link, not its target)
        fd = os.open(path, flags, 0o600)
    try:
        os.write(fd, bytes(data))
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Delete the record and its pid list; missing files are fine."""
    for p in (path, pids_path(path)):
        try:
            os.unlink(p)
        except OSError:
            pass


def pids_path(path: str) -> str:
    return f"{path}.pids"


class StatusWriter:
    """The EngineCore's side: records steps. Keeps its own counters, so a step costs one pack_into."""

    def __init__(self, path: str) -> None:
        self._mm = _map(path)
        if _HEAD.unpack_from(self._mm, 0) != (MAGIC, VERSION):
            raise StatusFileError(f"{path} is not a wedge_engine status record")
        seq, steps, model_steps, last, last_model = _STEP.unpack_from(self._mm, 8)
        self._seq, self._steps, self._model_steps = seq, steps, model_steps
        self._last_model_ns = last_model
        (self._admission,) = _COUNTER.unpack_from(self._mm, _ADMISSION_OFF)
        (self._tokens,) = _COUNTER.unpack_from(self._mm, _TOKENS_OFF)
        self.path = path

    @property
    def steps(self) -> int:
        """Engine steps recorded so far (this writer's own count: no read of the shared map)."""
        return self._steps

    @property
    def model_steps(self) -> int:
        return self._model_steps

    @property
    def last_model_step_ns(self) -> int | None:
        """When the last step that ran the model finished; None before the first."""
        return self._last_model_ns if self._model_steps else None

    def attach_engine(self, pid: int) -> None:
        _PID.pack_into(self._mm, _PID_OFF, pid)

    def record_step(self, model_executed: bool) -> None:
        now = time.monotonic_ns()
        self._seq += 1
        self._steps += 1
        if model_executed:
            self._model_steps += 1
            self._last_model_ns = now
        _STEP.pack_into(self._mm, 8, self._seq, self._steps, self._model_steps, now, self._last_model_ns)

    def add_tokens(self, n: int) -> None:
        """Tokens completed by one scheduler step."""
        if n > 0:
            self._tokens += n
            _COUNTER.pack_into(self._mm, _TOKENS_OFF, self._tokens)

    def set_flag(self, flag: int, on: bool) -> None:
        """Set or clear PAUSED or SLEEPING."""
        (flags,) = _FLAGS.unpack_from(self._mm, _FLAGS_OFF)
        _FLAGS.pack_into(self._mm, _FLAGS_OFF, (flags | flag) if on else (flags & ~flag))

    def count_admission_rejection(self) -> None:
        self._admission += 1
        _COUNTER.pack_into(self._mm, _ADMISSION_OFF, self._admission)

    def set_max_model_len(self, n: int) -> None:
        """The context the engine serves to one request, once the admission guard lowered it."""
        _COUNTER.pack_into(self._mm, _MAX_LEN_OFF, max(0, int(n)))

    def close(self) -> None:
        self._mm.close()


class StatusReader:
    """The API server's side: consistent snapshots, never blocking on the writer."""

    def __init__(self, path: str) -> None:
        self._mm = _map(path)
        if _HEAD.unpack_from(self._mm, 0) != (MAGIC, VERSION):
            raise StatusFileError(f"{path} is not a wedge_engine status record")
        self.path = path

    def read(self) -> StatusSnapshot:
        # The writer updates the step fields with one memcpy; two equal reads in a
        # row are a consistent record (a torn read differs from its successor).
        prev = self._raw()
        for _ in range(8):
            cur = self._raw()
            if cur == prev:
                break
            prev = cur
        (_m, _v, _seq, steps, model_steps, last, last_model, created, pid, flags, admission), tokens = prev
        return StatusSnapshot(steps, model_steps, last, last_model, created, pid, admission, time.monotonic_ns(),
                              flags, tokens)

    def _raw(self) -> tuple[tuple, int]:
        return _ALL.unpack_from(self._mm, 0), _COUNTER.unpack_from(self._mm, _TOKENS_OFF)[0]

    def max_model_len(self) -> int | None:
        """The honest max_model_len the EngineCore's admission guard published; None when it lowered none."""
        (n,) = _COUNTER.unpack_from(self._mm, _MAX_LEN_OFF)
        return n or None

    def close(self) -> None:
        self._mm.close()


def register_pid(path: str, pid: int, role: str) -> None:
    """Append "pid role" to the pid list (O_APPEND: one short write is atomic)."""
    fd = os.open(pids_path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW, 0o600)
    try:
        _check_own_file(fd, pids_path(path))
        os.write(fd, f"{pid} {role}\n".encode())
    finally:
        os.close(fd)


def read_pids(path: str) -> list[tuple[int, str]]:
    """The (pid, role) pairs registered so far, oldest first; [] when none."""
    try:
        fd = os.open(pids_path(path), os.O_RDONLY | _NOFOLLOW)
        with os.fdopen(fd) as handle:
            _check_own_file(fd, pids_path(path))
            lines = handle.read(1 << 16).splitlines()  # a pid list is a few lines; never read without bound
    except OSError:
        return []
    out: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1]))
    return out
