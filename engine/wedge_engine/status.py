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
60    I     reserved
64    Q     admission_rejections (requests the admission guard failed)
====  ====  =====================================================

Engine and worker pids that can dump their stacks on request are listed one
per line ("pid role") in the companion file ``<path>.pids``.
"""

from __future__ import annotations

import mmap
import os
import struct
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

    @property
    def last_step_age_s(self) -> float:
        return max(0.0, (self.read_ns - self.last_step_ns) / 1e9)

    @property
    def last_model_step_age_s(self) -> float:
        return max(0.0, (self.read_ns - self.last_model_step_ns) / 1e9)

    @property
    def engine_attached(self) -> bool:
        return self.engine_pid != 0


def _map(path: str, size: int = RECORD_SIZE) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < size:
            raise StatusFileError(f"{path} is shorter than a status record")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def create(path: str, now_ns: int | None = None) -> None:
    """Write a fresh record at `path` (mode 0600): no steps yet, ages counted from now."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    data = bytearray(RECORD_SIZE)
    _ALL.pack_into(data, 0, MAGIC, VERSION, 0, 0, 0, now, now, now, 0, 0, 0)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
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
        self.path = path

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

    def count_admission_rejection(self) -> None:
        self._admission += 1
        _COUNTER.pack_into(self._mm, _ADMISSION_OFF, self._admission)

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
        prev = _ALL.unpack_from(self._mm, 0)
        for _ in range(8):
            cur = _ALL.unpack_from(self._mm, 0)
            if cur == prev:
                break
            prev = cur
        _m, _v, _seq, steps, model_steps, last, last_model, created, pid, _r, admission = prev
        return StatusSnapshot(steps, model_steps, last, last_model, created, pid, admission, time.monotonic_ns())

    def close(self) -> None:
        self._mm.close()


def register_pid(path: str, pid: int, role: str) -> None:
    """Append "pid role" to the pid list (O_APPEND: one short write is atomic)."""
    fd = os.open(pids_path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"{pid} {role}\n".encode())
    finally:
        os.close(fd)


def read_pids(path: str) -> list[tuple[int, str]]:
    """The (pid, role) pairs registered so far, oldest first; [] when none."""
    try:
        with open(pids_path(path)) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    out: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1]))
    return out
