"""The evidence model: frozen dataclasses for bundles, samples and verdicts, with no I/O."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from wedgectl.model.engine import EngineReading

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
    STARTUP_HANG = "startup_hang"
    ORPHANED_ENGINE = "orphaned_engine"
    LEAKED_CAPACITY = "leaked_capacity"
    COLLECTIVE_HANG = "collective_hang"

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
class FutexGroup:
    """The threads of one process in a futex wait on one address: one lock.

    Threads contending for the same threading.Lock share an address. threading.Condition
    (hence Event, Queue, Thread.join) parks each waiter on a fresh lock of its own, so the
    waiters of one Condition show *distinct* addresses."""

    addr: int
    tids: tuple[int, ...]  # in the order the threads were read


@dataclass(frozen=True)
class FutexWaiters:
    """The threads of one process in a futex wait, grouped by address: the one grouping the
    classifier, `top` and the collectors share. A thread counts whatever its futex op (a
    thread caught inside FUTEX_WAKE is grouped too); in a parked process nearly every one
    is a wait, and the classifier has always counted them so."""

    groups: tuple[FutexGroup, ...]  # most waiters first; ties in the order first seen
    n_threads: int  # threads looked at, waiting or not

    @classmethod
    def of(cls, threads: Sequence[ThreadSample]) -> FutexWaiters:
        by_addr: dict[int, list[int]] = {}
        for t in threads:
            if t.in_futex_wait:
                by_addr.setdefault(t.futex_addr or 0, []).append(t.tid)
        ranked = sorted(by_addr.items(), key=lambda kv: -len(kv[1]))
        return cls(tuple(FutexGroup(a, tuple(tids)) for a, tids in ranked), len(threads))

    @property
    def n_waiting(self) -> int:
        return sum(len(g.tids) for g in self.groups)

    @property
    def by_addr(self) -> dict[int, tuple[int, ...]]:
        """futex address -> tids parked on it."""
        return {g.addr: g.tids for g in self.groups}

    def sharing(self, addr: int | None) -> int:
        """Threads waiting on addr (0 for None or an address nobody waits on)."""
        return len(self.by_addr.get(addr, ())) if addr is not None else 0


# vLLM's worker title: Worker, then _DP<n>, _PP<n>, _PCP<n>, _TP<n>, _DCP<n>, _EP<n> for each group larger than one.
_WORKER_TITLE = re.compile(r"::Worker((?:_[A-Z]+\d+)+)\b")
_RANK_PART = re.compile(r"_([A-Z]+)(\d+)")


@dataclass(frozen=True)
class CpuLimit:
    """The CPU limit of a process's cgroup (a container's `resources.limits.cpu`) and its throttling
    counters, as read at one sample: cgroup v2's cpu.max and cpu.stat, or v1's cfs_quota_us,
    cfs_period_us and cpu.stat."""

    quota_us: int  # CPU time the cgroup may use in each period
    period_us: int
    periods: int  # enforcement periods so far (nr_periods)
    throttled: int  # of those, the ones in which it ran out of quota and waited (nr_throttled)

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us if self.period_us else 0.0


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
    started: float | None = None  # unix create time: how long a start-up or an orphan has lasted
    devices: tuple[str, ...] = ()  # accelerator device nodes it holds open (/dev/nvidia0, /dev/dri/...)
    # Seconds its main thread had gone without a CPU at this sample (0: running or runnable); read
    # for the EngineCore and Workers, whose main threads take every step. None: not read.
    main_quiet_s: float | None = None
    # Seconds its main thread has spent runnable, waiting for a CPU, since it started (schedstat's run
    # delay); read for the same processes. None: not read.
    main_runq_s: float | None = None
    cpu_limit: CpuLimit | None = None  # its cgroup's CPU limit, read for the same processes; None: no limit (or unread)
    # In its exit (PF_EXITING in its stat flags): killed or returned, being torn down by the kernel,
    # not yet a zombie; its state reads R, D or S meanwhile (procfs.ProcessStat.exiting). For the
    # EngineCore and Workers also a SIGKILL pending that no thread has run yet (procfs.kill_pending).
    exiting: bool = False
    # Bytes it has read, from /proc/PID/io (read for its own processes, or with ptrace access over
    # it): rchar counts every read(2)-family call's bytes (page cache, pipes and sockets included),
    # read_bytes what it had the block layer fetch from storage (a load through mmap shows here).
    # Start-up progress in weight loading and compile, where the CPU can idle. None: not readable
    # (another user's process without CAP_SYS_PTRACE), or an older bundle.
    io_rchar: int | None = None
    io_read_bytes: int | None = None

    @property
    def cpu_s(self) -> float:
        return self.cpu_user_s + self.cpu_system_s

    @property
    def futex_waiters(self) -> FutexWaiters:
        """Its threads in a futex wait, grouped by address."""
        return FutexWaiters.of(self.threads)

    @property
    def parallel_rank(self) -> dict[str, int]:
        """A Worker's ranks from its vLLM title: "VLLM::Worker_PP1_TP3" -> {"PP": 1, "TP": 3}; {} untitled
        (or a world of one). vLLM titles a worker once its parallel groups exist
        (WorkerProc.setup_proc_title_and_log_prefix). comm keeps 15 characters ("VLLM::Worker_TP"),
        so argv[0], which setproctitle rewrites, is read first."""
        for text in (self.cmdline[0] if self.cmdline else "", self.name):
            m = _WORKER_TITLE.search(text)
            if m:
                return {k: int(v) for k, v in _RANK_PART.findall(m.group(1))}
        return {}


@dataclass(frozen=True)
class StackDump:
    """The raw `py-spy dump --json` output for one process (a list of threads)."""

    pid: int
    t: float
    native: bool = False
    threads: tuple[dict[str, Any], ...] = ()
    error: str | None = None


class ProbeMode(str, enum.Enum):
    """`diagnose --ebpf`: the best back-end down to /proc (auto), the same but an eBPF one is wanted (on), none."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class ProbeBackend(str, enum.Enum):
    """A probe back-end to force, or AUTO: the collector then takes the first that can run here, in
    ebpfhost.BACKENDS's order (rawtp, bcc, bpftrace, then procfs: /proc alone, no eBPF)."""

    AUTO = "auto"
    BCC = "bcc"
    BPFTRACE = "bpftrace"
    RAWTP = "rawtp"
    PROCFS = "procfs"


@dataclass(frozen=True)
class BackendStatus:
    """One probe back-end on this host: whether it can run, and why (not)."""

    name: str
    available: bool
    reason: str


@dataclass(frozen=True)
class ProbeSkip:
    """A better back-end that could not run (or failed to start), and why."""

    backend: str
    reason: str


@dataclass(frozen=True)
class WakeCall:
    """Calls of a FUTEX_WAKE-family op on one address by one thread over a probe window."""

    pid: int
    addr: int
    waker: int  # the calling tid
    calls: int
    woken: int  # waiters those calls woke (all wakers of the address together)


# kind first and keyword-only: the JSON record keeps "kind" as its first key, as bundles always had
@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """The header of one probe run: which back-end measured, over which window, and the wake table."""

    kind: str = "probe"
    backend: str
    reason: str
    skipped: tuple[ProbeSkip, ...] = ()
    probes: tuple[str, ...] = ()  # the programs that ran (none for procfs)
    pids: tuple[int, ...] = ()
    window_s: float = 0.0
    started: float = 0.0  # unix times
    ended: float = 0.0
    wakes: tuple[WakeCall, ...] = ()  # most calls first
    maps_full: tuple[str, ...] = ()  # maps that hit their size limit (new keys were dropped)
    clock_offsets_s: dict[str, float] = field(default_factory=dict)  # per CPU: monotonic - scheduler clock
    overhead: dict[str, str] = field(default_factory=dict)  # each probe's measured cost


@dataclass(frozen=True, kw_only=True)
class ThreadProbe:
    """One thread over a probe window. Times in seconds; None where the back-end cannot tell."""

    kind: str = "thread"
    tid: int
    pid: int
    comm: str
    backend: str
    futex_addr: int | None = None  # the futex it waits on at the end of the window (None: not in a wait)
    wait_s: float | None = None  # how long that wait has lasted, at the end of the window
    wait_started: float | None = None  # unix time that wait began
    wait_source: str = ""  # "tracepoint" (began in the window), "sched" (se.exec_start), "window" (>= window)
    parked_throughout: bool = False  # in that same wait for the whole window (never ran)
    waits: int | None = None  # futex waits begun in the window
    total_wait_s: float | None = None  # time spent in futex waits within the window
    wakes_on_addr: int | None = None  # wake-op calls on futex_addr (same process) in the window
    wakers: tuple[int, ...] = ()  # tids that made those calls
    oncpu_s: float | None = None
    offcpu_s: float | None = None  # blocked (sleeping) off the CPU
    runq_s: float | None = None  # runnable but waiting for a CPU
    window_s: float = 0.0
    pylock_addr: int | None = None  # pylockwait: the Python lock it blocks on now
    pylock_waits: int | None = None
    pylock_wait_s: float | None = None

    @property
    def is_main(self) -> bool:
        """The process's main thread (tid == pid): where vLLM's busy loops run."""
        return self.tid == self.pid


ProbeRecord = ProbeResult | ThreadProbe


@dataclass(frozen=True)
class Sample:
    """Everything collected at one point of the sampling window."""

    t: float
    metrics: MetricsScrape | None = None
    health_status: int | None = None  # GET /health status; None when it did not answer
    health_error: str | None = None
    processes: tuple[ProcessSample, ...] = ()
    stacks: tuple[StackDump, ...] = ()
    probes: tuple[ProbeRecord, ...] = ()  # one ProbeResult, then one ThreadProbe per thread (probes/README.md)
    failures: tuple[CollectorFailure, ...] = ()
    # The engine reports of the deployment's processes (model/engine.py), one reading per process looked at;
    # () in bundles from before them, and where none was looked for.
    engine: tuple[EngineReading, ...] = ()


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
    # The start-up bound the capture was judged with (diagnose --startup-quiet): seconds with no start-up
    # progress after which a start is hung. None: the classifier's default (classify.startup.STARTUP_QUIET_S).
    startup_quiet_s: float | None = None


@dataclass(frozen=True)
class Evidence:
    """One fact a verdict rests on: where it came from, when, and the numbers."""

    source: str  # "log", "metrics", "proc", "stack", "probe", "engine"
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
