"""The evidence model: frozen dataclasses for bundles, samples and verdicts, with no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

BUNDLE_FORMAT = "wedgectl-bundle"
BUNDLE_VERSION = 1


class VerdictKind(str, enum.Enum):
    """What a deployment is doing. The values are the exact JSON strings."""

    IDLE = "idle"
    PROGRESSING = "progressing"
    STARVED = "starved"
    ADMISSION_WEDGE = "admission_wedge"
    ENGINE_DEADLOCK = "engine_deadlock"
    SHUTDOWN_HANG = "shutdown_hang"
    ENGINE_DEAD = "engine_dead"
    INCONCLUSIVE = "inconclusive"

    @property
    def is_healthy(self) -> bool:
        return self in (VerdictKind.IDLE, VerdictKind.PROGRESSING)


class Role(str, enum.Enum):
    """The part a process plays in a vLLM deployment."""

    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    OTHER = "other"


class FailureKind(str, enum.Enum):
    """Why a collector could not deliver (part of) its data."""

    PERMISSION = "permission"
    TIMEOUT = "timeout"
    MISSING_TOOL = "missing_tool"
    GONE = "gone"  # the process or thread exited mid-capture
    UNREACHABLE = "unreachable"
    BAD_DATA = "bad_data"
    ERROR = "error"


@dataclass(frozen=True)
class CollectorFailure:
    """One thing a collector could not read, and why."""

    collector: str  # "metrics", "procfs", "psutil", "pyspy", "ebpf", ...
    kind: FailureKind
    message: str
    target: str = ""  # pid, tid or URL the failure is about


@dataclass(frozen=True)
class MetricsScrape:
    """One GET of /metrics: the raw text is kept so newer parsers can re-read it."""

    t: float  # unix time the response arrived (or the request gave up)
    url: str
    status: int | None = None
    text: str | None = None
    elapsed_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.text is not None


@dataclass(frozen=True)
class ThreadSample:
    """One thread as /proc/PID/task/TID shows it at one instant."""

    tid: int
    comm: str
    state: str  # one letter from stat: R, S, D, T, Z, ...
    wchan: str = ""
    syscall_nr: int | None = None  # None: running in user space, or unreadable
    syscall_args: tuple[int, ...] = ()
    futex_addr: int | None = None  # set when syscall_nr is futex (202) or restart (219)
    futex_op: int | None = None
    futex_timed: bool | None = None
    utime_s: float = 0.0
    stime_s: float = 0.0
    voluntary_switches: int | None = None
    nonvoluntary_switches: int | None = None

    @property
    def cpu_s(self) -> float:
        return self.utime_s + self.stime_s

    @property
    def in_futex_wait(self) -> bool:
        return self.futex_addr is not None


@dataclass(frozen=True)
class ProcessSample:
    """One process of the deployment at one instant."""

    pid: int
    ppid: int
    role: Role
    name: str
    cmdline: tuple[str, ...] = ()
    state: str = ""
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    num_threads: int = 0
    rss_bytes: int | None = None
    listening: tuple[str, ...] = ()  # "127.0.0.1:8000"
    connections: int | None = None  # established TCP connections
    threads: tuple[ThreadSample, ...] = ()

    @property
    def cpu_s(self) -> float:
        return self.cpu_user_s + self.cpu_system_s


@dataclass(frozen=True)
class StackDump:
    """The raw `py-spy dump --json` output for one process (a list of threads)."""

    pid: int
    t: float
    native: bool = False
    threads: tuple[dict[str, Any], ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class Sample:
    """Everything collected at one point of the sampling window."""

    t: float
    metrics: MetricsScrape | None = None
    health_status: int | None = None  # GET /health status; None when it did not answer
    health_error: str | None = None
    processes: tuple[ProcessSample, ...] = ()
    stacks: tuple[StackDump, ...] = ()
    probes: tuple[dict[str, Any], ...] = ()  # per-thread eBPF results, raw
    failures: tuple[CollectorFailure, ...] = ()


@dataclass(frozen=True)
class Target:
    """What was looked at."""

    pid: int | None = None
    url: str | None = None
    log_path: str | None = None
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """The versioned header of a bundle."""

    format: str = BUNDLE_FORMAT
    version: int = BUNDLE_VERSION
    created: float = 0.0
    wedgectl_version: str = ""
    source: str = "log"  # "log", "live", "url"
    target: Target = field(default_factory=Target)
    host: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Evidence:
    """One fact a verdict rests on: where it came from, when, and the numbers."""

    source: str  # "log", "metrics", "proc", "stack", "probe"
    what: str
    t: str | None = None  # human time label: a log timestamp or an ISO time
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """The classifier's answer."""

    verdict: VerdictKind
    confidence: float
    summary: str
    rule: str
    evidence: tuple[Evidence, ...] = ()
    advice: tuple[str, ...] = ()
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Bundle:
    """An evidence bundle: what was captured, and what was concluded at the time."""

    manifest: Manifest
    samples: tuple[Sample, ...] = ()
    log_lines: tuple[str, ...] = ()
    verdict: Verdict | None = None
