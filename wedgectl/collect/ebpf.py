"""eBPF probes of a process tree (futex waits and wakes, off-CPU time), with bcc, bpftrace or /proc as the back-end.

The programs live in probes/ (one file each, bcc tools' style); this module
is the one place that runs them. It picks a back-end at run time and says why
(bcc where it can compile, i.e. kernel headers are present; else bpftrace,
which needs only tracepoints; else the /proc reader), composes one program
from the probes asked for, filters it to the target pids in the kernel, runs
it for a bounded time with bounded maps, and detaches on every exit path
(stop, Ctrl-C, timeout, error): the program also exits by itself after its
window, so even a SIGKILLed wedgectl leaves nothing attached for long.

Why /proc is read as well: a thread parked since before the probe attached
never fires sys_enter_futex in the window. /proc/PID/task/TID/sched's
`se.exec_start` is the scheduler-clock time the thread last ran; for a thread
sleeping in futex(2) that is when its wait began. The scheduler clock
(rq_clock_task) runs behind CLOCK_MONOTONIC by the IRQ and steal time the
CPU has accounted, so it is calibrated per CPU (a thread pinned there reads
its own exec_start right after waking). The result is a lower bound: time
stolen during the wait is not counted.

The result is one header dict (kind "probe": back-end, reason, window, the
FUTEX_WAKE table) and one dict per thread (kind "thread", a `ThreadProbe`),
stored in Sample.probes; probes/README.md documents the fields.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from wedgectl.collect import procfs
from wedgectl.types import CollectorFailure, Evidence, FailureKind, Role, Sample

COLLECTOR = "ebpf"
PROBES_DIR = Path(__file__).resolve().parents[2] / "probes"
BACKENDS = ("bcc", "bpftrace", "procfs")
EBPF_BACKENDS = ("bcc", "bpftrace")
DEFAULT_PROBES = ("futexwait", "offcpu")
ALL_PROBES = ("futexwait", "offcpu", "pylockwait")
DISABLE_ENV = "WEDGECTL_PROBES_DISABLE"  # e.g. "bcc,bpftrace": force the fallback order in tests

MAX_ENTRIES = 4096  # per BPF map
MAX_PIDS = 64
MAX_SEED_TIDS = 2048
MAX_WINDOW_S = 300.0
MAX_THREADS_REPORTED = 2048
MAX_WAKES_REPORTED = 256
READY_TIMEOUT_S = 20.0  # compile + attach; bpftrace takes ~0.4 s here, bcc's clang several seconds
STOP_TIMEOUT_S = 20.0  # SIGINT to exit is < 1 s here; once, under ~400k futex calls/s on a loaded host, > 10 s
READY_MARK = "wedgectl-probe-ready"
EXIT_OK, EXIT_USAGE, EXIT_NO_BACKEND, EXIT_PERMISSION, EXIT_GONE, EXIT_FAILED = 0, 2, 3, 4, 5, 6

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39
PROC = Path("/proc")


# ---------------------------------------------------------------------------
# the programs


_loaded: dict[str, ModuleType] = {}


def load_probe(name: str) -> ModuleType:
    """probes/NAME.py as a module (probes/ is not a package: each file is also a runnable tool)."""
    if name in _loaded:
        return _loaded[name]
    path = PROBES_DIR / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"probe program {path} not found (wedgectl runs its probes from a checkout)")
    spec = importlib.util.spec_from_file_location(f"wedgectl_probe_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded[name] = module
    return module


def pid_predicate(pids: Iterable[int]) -> str:
    """The in-kernel filter: 'pid == 4101 || pid == 4102' (pid is the tgid in bpftrace and in our C)."""
    pids = sorted(set(int(p) for p in pids))
    if not pids:
        raise ValueError("no pids to filter on")
    return " || ".join(f"pid == {p}" for p in pids)


def bpftrace_program(probes: Sequence[str], pids: Iterable[int], max_s: float,
                     seed_tids: Iterable[int] = (), libs: Sequence[str] = ()) -> str:
    """One bpftrace program from the probes' sections: one BEGIN, their probes, one exit timer, one END."""
    pred = pid_predicate(pids)
    seeds = "".join(f"  @oc_tgt[{int(t)}] = 1;\n" for t in list(seed_tids)[:MAX_SEED_TIDS])
    begins, bodies, ends = [], [], []
    for name in probes:
        mod = load_probe(name)
        begins.append(mod.BPFTRACE_BEGIN.replace("__SEED__", seeds))
        if "__LIB__" in mod.BPFTRACE_PROBES:
            if not libs:
                continue
            bodies += [mod.BPFTRACE_PROBES.replace("__LIB__", lib) for lib in libs]
        else:
            bodies.append(mod.BPFTRACE_PROBES)
        ends.append(mod.BPFTRACE_END)
    ms = max(1, int(min(max_s, MAX_WINDOW_S) * 1000))
    text = (
        f"// wedgectl probes: {', '.join(probes)}; pids {sorted(set(pids))}; exits after {ms} ms\n"
        "BEGIN\n{\n" + "".join(begins) +
        f"  @t_begin = nsecs;\n  @t_live = 1;\n  printf(\"{READY_MARK}\\n\");\n}}\n"
        + "".join(bodies)
        # the timer ends the window in the kernel, to the millisecond; END (user space, later) reports
        + f"\ninterval:ms:{ms}\n{{\n  @t_end = nsecs;\n  delete(@t_live);\n  exit();\n}}\n"
        + "\nEND\n{\n  if (@t_live) {\n    @t_end = nsecs;\n  }\n  delete(@t_live);\n" + "".join(ends) + "}\n"
    )
    return text.replace("__FILTER__", pred)


BCC_PRELUDE = """
BPF_ARRAY(t_begin, u64, 1);
static inline u64 t_begin_ns(void)
{
    int k = 0;
    u64 *v = t_begin.lookup(&k);
    return v ? *v : 0;
}
"""


def bcc_program(probes: Sequence[str], pids: Iterable[int], max_entries: int | None = None) -> str:
    """The BPF C text for bcc: a shared window start (t_begin, set from user space once attached) and each probe's maps and functions."""
    pred = pid_predicate(pids)
    text = f"// wedgectl probes: {', '.join(probes)}; pids {sorted(set(pids))}\n" + BCC_PRELUDE
    for name in probes:
        text += load_probe(name).BCC_TEXT
    return text.replace("__FILTER__", pred).replace("__MAX_ENTRIES__", str(int(max_entries or MAX_ENTRIES)))


# ---------------------------------------------------------------------------
# what this host supports


@dataclass(frozen=True)
class Host:
    """The seam for back-end detection: a root to look for /sys, /lib/modules and bcc under, and the tools."""

    root: Path = Path("/")
    which: Callable[[str], str | None] = shutil.which
    euid: Callable[[], int] = os.geteuid
    release: str = field(default_factory=platform.release)
    cap_eff: Callable[[], int | None] = lambda: _cap_eff()
    mount_tracefs: bool = True  # try `mount -t tracefs` when it is missing (live hosts only)


def _cap_eff() -> int | None:
    try:
        for line in (PROC / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str


def _tracefs_dirs(host: Host) -> tuple[Path, ...]:
    return (host.root / "sys/kernel/tracing", host.root / "sys/kernel/debug/tracing")


def find_tracefs(host: Host = Host()) -> Path | None:
    for d in _tracefs_dirs(host):
        if (d / "events").is_dir():
            return d
    return None


def ensure_tracefs(host: Host = Host(), timeout: float = 5.0) -> tuple[Path | None, str]:
    """The tracefs mount with the tracepoints, mounting it once if needed; (None, why) when there is none."""
    found = find_tracefs(host)
    if found is not None:
        return found, f"tracefs at {found}"
    target = _tracefs_dirs(host)[0]
    if not host.mount_tracefs or host.root != Path("/"):
        return None, f"tracefs is not mounted at {target}"
    if not target.is_dir():
        return None, f"{target} does not exist (kernel without CONFIG_TRACEFS?)"
    try:
        r = subprocess.run(["mount", "-t", "tracefs", "nodev", str(target)], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"tracefs is not mounted at {target} and `mount -t tracefs` failed: {exc}"
    if r.returncode != 0 or find_tracefs(host) is None:
        why = (r.stderr or r.stdout).strip() or f"exit {r.returncode}"
        return None, f"tracefs is not mounted at {target} and `mount -t tracefs nodev {target}` failed: {why}"
    return target, f"tracefs mounted at {target} by wedgectl"


def _privileged(host: Host) -> str | None:
    """None when we may load BPF programs and attach tracepoints, else why not."""
    if host.euid() == 0:
        return None
    caps = host.cap_eff()
    if caps is not None and (caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1)):
        return None
    return "needs root, or CAP_BPF + CAP_PERFMON (CAP_SYS_ADMIN on kernels before 5.8)"


def _missing_tracepoints(tracefs: Path, probes: Sequence[str]) -> list[str]:
    missing = []
    for name in probes:
        for tp in load_probe(name).TRACEPOINTS:
            group, event = tp.split(":")
            if not (tracefs / "events" / group / event).is_dir():
                missing.append(tp)
    return missing


def bcc_python_path(host: Host = Host()) -> Path | None:
    """Where Debian's python3-bpfcc put the bcc module (pure Python over libbcc: any python3 can import it)."""
    spec = importlib.util.find_spec("bcc") if host.root == Path("/") else None
    if spec is not None and spec.origin:
        return Path(spec.origin).parent.parent
    for d in sorted((host.root / "usr/lib").glob("python3*/*-packages")) + [host.root / "usr/lib/python3/dist-packages"]:
        if (d / "bcc" / "__init__.py").exists():
            return d
    return None


def kernel_headers(host: Host = Host()) -> str | None:
    """Where bcc would find this kernel's headers, or None."""
    mods = host.root / "lib/modules" / host.release
    if (mods / "build" / "include").is_dir() or (mods / "source" / "include").is_dir():
        return str(mods / "build")
    if (host.root / "sys/kernel/kheaders.tar.xz").exists():
        return str(host.root / "sys/kernel/kheaders.tar.xz")
    if any(mods.glob("kernel/kernel/kheaders.ko*")):
        return f"{mods}/kernel/kernel/kheaders.ko (loaded by bcc on demand)"
    return None


def check_bcc(host: Host, probes: Sequence[str], tracefs: Path | None, tracefs_why: str,
              verify: bool = False) -> BackendStatus:
    where = bcc_python_path(host)
    if where is None:
        return BackendStatus("bcc", False, "the bcc Python module is not installed (Debian: python3-bpfcc)")
    headers = kernel_headers(host)
    if headers is None:
        mods = host.root / "lib/modules" / host.release
        return BackendStatus("bcc", False, f"bcc cannot compile: no kernel headers for {host.release} "
                             f"({mods}/build missing, no /sys/kernel/kheaders.tar.xz: CONFIG_IKHEADERS off)")
    if (why := _privileged(host)) is not None:
        return BackendStatus("bcc", False, why)
    if tracefs is None:
        return BackendStatus("bcc", False, tracefs_why)
    if missing := _missing_tracepoints(tracefs, probes):
        return BackendStatus("bcc", False, f"tracepoints missing: {', '.join(missing)}")
    if verify:
        ok, why = _trial_bcc(where)
        if not ok:
            return BackendStatus("bcc", False, f"bcc could not compile a tracepoint program: {why}")
    return BackendStatus("bcc", True, f"bcc from {where}; kernel headers at {headers}")


def _bpftrace_version(path: str) -> str:
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "bpftrace (version unknown)"


def check_bpftrace(host: Host, probes: Sequence[str], tracefs: Path | None, tracefs_why: str,
                   verify: bool = False) -> BackendStatus:
    path = host.which("bpftrace")
    if path is None:
        return BackendStatus("bpftrace", False, "bpftrace is not installed (Debian: apt-get install bpftrace)")
    if (why := _privileged(host)) is not None:
        return BackendStatus("bpftrace", False, why)
    if tracefs is None:
        return BackendStatus("bpftrace", False, tracefs_why)
    if missing := _missing_tracepoints(tracefs, probes):
        return BackendStatus("bpftrace", False, f"tracepoints missing: {', '.join(missing)}")
    version = _bpftrace_version(path) if host.root == Path("/") else "bpftrace"
    tps = sorted({tp for n in probes for tp in load_probe(n).TRACEPOINTS})
    btf = host.root / "sys/kernel/btf/vmlinux"
    reason = f"{version}; " + (f"tracepoints {', '.join(tps)}" if tps else "uprobes") + f"; {tracefs_why}"
    reason += f"; BTF at {btf}" if btf.exists() else "; no BTF (tracepoints need none)"
    if verify:
        ok, why = _trial_bpftrace(path, probes)
        if not ok:
            return BackendStatus("bpftrace", False, f"bpftrace could not attach: {why}")
    return BackendStatus("bpftrace", True, reason)


def check_procfs(host: Host, proc_root: Path = PROC) -> BackendStatus:
    sched = proc_root / "self" / "sched"
    try:
        text = sched.read_text()
    except OSError:
        return BackendStatus("procfs", True, "futex addresses from /proc/PID/task/TID/syscall only: no "
                             "/proc/PID/sched (CONFIG_SCHED_DEBUG off), so no wait durations")
    if parse_exec_start(text) is None:
        return BackendStatus("procfs", True, "futex addresses from /proc; /proc/PID/sched has no se.exec_start")
    return BackendStatus("procfs", True, "futex addresses from /proc/PID/task/TID/syscall, wait durations from "
                         "se.exec_start in .../sched (CONFIG_SCHED_DEBUG); no wake tracing")


def disabled_backends(disable: Iterable[str] | None = None) -> frozenset[str]:
    names = set(disable or ())
    names |= {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    return frozenset(names)


def detect_backends(probes: Sequence[str] = DEFAULT_PROBES, host: Host = Host(), *,
                    disable: Iterable[str] | None = None, verify: bool = False,
                    proc_root: Path = PROC) -> tuple[BackendStatus, ...]:
    """Every back-end in preference order, each with whether it can run here and why (not)."""
    off = disabled_backends(disable)
    tracefs, tracefs_why = (None, "")
    if not {"bcc", "bpftrace"} <= off:
        tracefs, tracefs_why = ensure_tracefs(host)
    out = []
    for name in BACKENDS:
        if name in off:
            out.append(BackendStatus(name, False, f"disabled ({DISABLE_ENV} or --backend)"))
        elif name == "bcc":
            out.append(check_bcc(host, probes, tracefs, tracefs_why, verify))
        elif name == "bpftrace":
            out.append(check_bpftrace(host, probes, tracefs, tracefs_why, verify))
        else:
            out.append(check_procfs(host, proc_root))
    return tuple(out)


def choose_backend(statuses: Sequence[BackendStatus]) -> BackendStatus | None:
    return next((s for s in statuses if s.available), None)


def _trial_bpftrace(path: str, probes: Sequence[str]) -> tuple[bool, str]:
    tps = sorted({tp for n in probes for tp in load_probe(n).TRACEPOINTS})
    text = "".join(f"tracepoint:{tp} /pid == 0/ {{ }}\n" for tp in tps) + "BEGIN { exit(); }\n"
    try:
        r = subprocess.run([path, "-e", text], capture_output=True, text=True, timeout=20,
                           env=_bpftrace_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return r.returncode == 0, _stderr_summary(r.stderr) or f"exit {r.returncode}"


def _trial_bcc(where: Path) -> tuple[bool, str]:
    code = "from bcc import BPF; BPF(text='TRACEPOINT_PROBE(sched, sched_switch) { return 0; }')"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=_bcc_env(where))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return r.returncode == 0, _stderr_summary(r.stderr) or f"exit {r.returncode}"


def _bpftrace_env(max_entries: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # both spellings: bpftrace <= 0.18 reads the first, later ones the second
    env["BPFTRACE_MAP_KEYS_MAX"] = str(max_entries or MAX_ENTRIES)
    env["BPFTRACE_MAX_MAP_KEYS"] = str(max_entries or MAX_ENTRIES)
    return env


def _bcc_env(where: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if where is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(where)) if p)
    return env


_NOISE = ("couldn't set RLIMIT_MEMLOCK",)  # no CAP_SYS_RESOURCE; memcg accounting makes it harmless


def _stderr_summary(text: str, most: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not any(n in ln for n in _NOISE)]
    return " | ".join(lines[-most:])[:400]


# ---------------------------------------------------------------------------
# /proc: what the threads look like at the edges of the window


@dataclass(frozen=True)
class ThreadState:
    """One thread at one instant, as far as the probes' results need it."""

    tid: int
    pid: int
    comm: str
    state: str
    cpu: int | None  # the CPU it last ran on (stat field 39)
    futex_addr: int | None
    futex_op: int | None
    exec_start_s: float | None  # se.exec_start: last ran at, on that CPU's scheduler clock
    oncpu_ns: int | None  # schedstat: time on CPU
    runq_ns: int | None  # schedstat: time runnable, waiting for a CPU

    @property
    def in_futex_wait(self) -> bool:
        return self.futex_addr is not None and procfs.is_futex_wait_op(self.futex_op)


def parse_exec_start(text: str) -> float | None:
    """se.exec_start from a sched file, in seconds (the file prints milliseconds)."""
    for line in text.splitlines():
        if line.startswith("se.exec_start"):
            try:
                return float(line.split(":", 1)[1]) / 1000.0
            except (ValueError, IndexError):
                return None
    return None


def parse_schedstat(text: str) -> tuple[int, int, int] | None:
    """(ns on CPU, ns waiting on a run queue, timeslices) from a schedstat file."""
    try:
        a, b, c = text.split()[:3]
        return int(a), int(b), int(c)
    except ValueError:
        return None


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read(65536).decode("utf-8", "replace")
    except OSError:
        return None


def thread_state_from_texts(pid: int, tid: int, stat: str, syscall: str | None, wchan: str | None,
                            sched: str | None, schedstat: str | None, machine: str | None = None) -> ThreadState:
    close = stat.rindex(")")
    comm = stat[stat.index("(") + 1 : close]
    rest = stat[close + 2 :].split()
    nr, args = procfs.parse_syscall(syscall) if syscall else (None, ())
    addr, op, _timed = procfs.futex_from_syscall(nr, args, procfs.parse_wchan(wchan or ""), machine)
    ss = parse_schedstat(schedstat) if schedstat else None
    return ThreadState(
        tid=tid, pid=pid, comm=comm, state=rest[0],
        cpu=int(rest[36]) if len(rest) > 36 else None,
        futex_addr=addr, futex_op=op,
        exec_start_s=parse_exec_start(sched) if sched else None,
        oncpu_ns=ss[0] if ss else None, runq_ns=ss[1] if ss else None,
    )


def read_thread_states(pids: Iterable[int], proc_root: Path = PROC,
                       timeout: float = 3.0) -> tuple[dict[int, ThreadState], tuple[CollectorFailure, ...]]:
    """tid -> ThreadState for every thread of the pids; threads that exit mid-read are skipped."""
    deadline = time.monotonic() + timeout
    out: dict[int, ThreadState] = {}
    failures: list[CollectorFailure] = []
    for pid in pids:
        task = proc_root / str(pid) / "task"
        try:
            tids = sorted(int(t) for t in os.listdir(task) if t.isdigit())
        except OSError as exc:
            failures.append(CollectorFailure(COLLECTOR, FailureKind.GONE if isinstance(exc, FileNotFoundError)
                                             else FailureKind.PERMISSION, f"/proc/{pid}/task: {exc}", str(pid)))
            continue
        for tid in tids:
            if time.monotonic() > deadline:
                failures.append(CollectorFailure(COLLECTOR, FailureKind.TIMEOUT,
                                                 f"read threads for {timeout:.0f} s; the rest skipped", str(pid)))
                return out, tuple(failures)
            d = task / str(tid)
            stat = _read(d / "stat")
            if stat is None:
                continue  # exited
            try:
                out[tid] = thread_state_from_texts(pid, tid, stat, _read(d / "syscall"), _read(d / "wchan"),
                                                   _read(d / "sched"), _read(d / "schedstat"))
            except (ValueError, IndexError) as exc:
                failures.append(CollectorFailure(COLLECTOR, FailureKind.BAD_DATA, f"{d}: {exc}", str(tid)))
    return out, tuple(failures)


def sched_clock_offsets(cpus: Iterable[int], proc_root: Path = PROC) -> dict[int, float]:
    """CLOCK_MONOTONIC minus each CPU's scheduler task clock, in seconds.

    A helper thread pins itself to the CPU, sleeps a moment (the wake-up stamps
    its exec_start with that CPU's clock, now) and reads its own sched file.
    CPUs it may not run on get the median of the others.
    """
    out: dict[int, float] = {}

    def measure(cpu: int) -> None:
        try:
            os.sched_setaffinity(0, {cpu})
            time.sleep(0.0005)
            now = time.monotonic()
            es = parse_exec_start(_read(proc_root / "thread-self" / "sched") or "")
        except OSError:
            return
        if es is not None:
            out[cpu] = now - es

    wanted = sorted(set(cpus))
    for cpu in wanted:
        t = threading.Thread(target=measure, args=(cpu,), name=f"wedgectl-clock-{cpu}", daemon=True)
        t.start()
        t.join(timeout=2.0)
    if out:
        median = sorted(out.values())[len(out) // 2]
        for cpu in wanted:
            out.setdefault(cpu, median)
    return out


# ---------------------------------------------------------------------------
# the result


@dataclass(frozen=True)
class ThreadProbe:
    """One thread over the probe's window. Times in seconds; None where the back-end cannot tell."""

    tid: int
    pid: int
    comm: str
    backend: str
    futex_addr: int | None  # the futex it waits on at the end of the window (None: not in a futex wait)
    wait_s: float | None  # how long that wait has lasted, at the end of the window
    wait_started: float | None  # unix time that wait began
    wait_source: str  # "tracepoint" (began in the window), "sched" (se.exec_start), "window" (>= window), ""
    parked_throughout: bool  # in that same wait for the whole window (never ran)
    waits: int | None  # futex waits begun in the window
    total_wait_s: float | None  # time spent in futex waits within the window
    wakes_on_addr: int | None  # FUTEX_WAKE-family calls on futex_addr (same process) in the window
    wakers: tuple[int, ...]  # tids that made those calls
    oncpu_s: float | None
    offcpu_s: float | None  # blocked (sleeping) off the CPU
    runq_s: float | None  # runnable but waiting for a CPU
    window_s: float
    pylock_addr: int | None = None  # pylockwait: the Python lock it blocks on now
    pylock_waits: int | None = None
    pylock_wait_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": "thread", **asdict(self)}
        d["wakers"] = list(self.wakers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ThreadProbe:
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in names}
        kw["wakers"] = tuple(kw.get("wakers") or ())
        return cls(**kw)


def _key(k: str) -> int | tuple[int, ...]:
    parts = k.split(",")
    return int(parts[0], 0) if len(parts) == 1 else tuple(int(p, 0) for p in parts)


def parse_bpftrace_output(lines: Iterable[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """(maps, printf lines, other lines) from `bpftrace -f json` (the bcc runner prints the same shape).

    Map keys become ints, or tuples of ints for multi-key maps ("0x7f..,4101" too).
    """
    maps: dict[str, Any] = {}
    printed: list[str] = []
    other: list[str] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            other.append(line)
            continue
        kind = obj.get("type")
        if kind == "map":
            for name, value in obj.get("data", {}).items():
                name = name.lstrip("@")
                if isinstance(value, dict):
                    try:
                        maps[name] = {_key(k): v for k, v in value.items()}
                    except ValueError:
                        other.append(line)
                else:
                    maps[name] = value
        elif kind == "printf":
            printed.append(str(obj.get("data", "")).rstrip("\n"))
        elif kind not in ("attached_probes",):
            other.append(line)
    return maps, printed, other


@dataclass(frozen=True)
class Window:
    """The probe's window on CLOCK_MONOTONIC, and the /proc reads at its edges."""

    begin: float
    end: float
    start_states: dict[int, ThreadState]
    end_states: dict[int, ThreadState]
    end_read_at: float  # monotonic time of the end read
    offsets: dict[int, float]  # per CPU: monotonic - scheduler clock
    wall_offset: float  # time.time() - time.monotonic()

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.begin)


def _exec_start_mono(st: ThreadState, offsets: dict[int, float]) -> float | None:
    if st.exec_start_s is None or st.exec_start_s <= 0:
        return None
    off = offsets.get(st.cpu) if st.cpu is not None else None
    if off is None and offsets:
        off = sorted(offsets.values())[len(offsets) // 2]
    return st.exec_start_s + (off or 0.0)


def combine(backend: str, probes: Sequence[str], maps: dict[str, Any], w: Window) -> list[ThreadProbe]:
    """Per-thread results from the probe's maps (empty for procfs) and the /proc reads around them."""
    m = lambda name: maps.get(name) or {}  # noqa: E731
    traced_futex = "futexwait" in probes and backend != "procfs"
    traced_sched = "offcpu" in probes and backend != "procfs"
    traced_pylock = "pylockwait" in probes and backend != "procfs"
    wakes: dict[tuple[int, int], dict[int, int]] = {}
    for key, calls in m("fw_wakes").items():
        if isinstance(key, tuple) and len(key) == 3:
            wakes.setdefault((key[0], key[1]), {})[key[2]] = int(calls)
    window = w.seconds
    out = []
    for tid, st in sorted(w.end_states.items()):
        st0 = w.start_states.get(tid)
        # --- the current futex wait
        addr = start = None
        source = ""
        since = m("fw_wait_since").get(tid) if traced_futex else None
        if since:
            addr, start, source = int(m("fw_wait_addr").get(tid, 0)) or st.futex_addr, since / 1e9, "tracepoint"
            ref = w.end
        elif st.in_futex_wait:
            addr, ref = st.futex_addr, w.end_read_at
            es = _exec_start_mono(st, w.offsets)
            if es is not None:
                start, source = es, "sched"
            elif st0 is not None and st0.in_futex_wait and st0.futex_addr == addr:
                start, source = w.begin, "window"
        ran = None
        if st0 is not None and st0.exec_start_s is not None and st.exec_start_s is not None:
            ran = st0.exec_start_s != st.exec_start_s
        events = traced_futex and (tid in m("fw_nwaits") or tid in m("fw_carried"))
        parked = bool(addr is not None and source in ("sched", "window") and st0 is not None
                      and st0.in_futex_wait and st0.futex_addr == addr and ran is not True and not events)
        wait_s = max(0.0, ref - start) if start is not None else None
        # --- counts and totals over the window
        waits = total = None
        wake_calls: int | None = None
        wakers: tuple[int, ...] = ()
        if traced_futex:
            waits = int(m("fw_nwaits").get(tid, 0))
            total = m("fw_wait_ns").get(tid, 0) / 1e9
            if start is not None:
                total += max(0.0, min(w.end, ref) - max(start, w.begin))
            total = min(total, window)
            if addr is not None:
                by = wakes.get((st.pid, addr), {})
                wake_calls, wakers = sum(by.values()), tuple(sorted(by))
        # --- on/off CPU
        on = off = rq = None
        d_on = d_rq = None
        if st.oncpu_ns is not None and st.runq_ns is not None:
            base_on, base_rq = (st0.oncpu_ns or 0, st0.runq_ns or 0) if st0 is not None else (0, 0)
            d_on = min(window, max(0.0, (st.oncpu_ns - base_on) / 1e9))
            d_rq = min(window, max(0.0, (st.runq_ns - base_rq) / 1e9))
        seen = traced_sched and any(tid in m(n) for n in ("oc_oncpu_ns", "oc_offcpu_ns", "oc_runq_ns",
                                                           "oc_on_since", "oc_off_since"))
        if seen:
            on = m("oc_oncpu_ns").get(tid, 0) / 1e9
            off = m("oc_offcpu_ns").get(tid, 0) / 1e9
            rq = m("oc_runq_ns").get(tid, 0) / 1e9
            if tid in m("oc_on_since"):
                on += max(0.0, w.end - m("oc_on_since")[tid] / 1e9)
            if tid in m("oc_off_since"):
                rest = max(0.0, w.end - m("oc_off_since")[tid] / 1e9)
                if tid in m("oc_preempted"):
                    rq += rest
                else:
                    off += rest
            # Lost events (a program run the kernel skipped) leave the sums short, never long;
            # where they do not add up to the window, schedstat's exact counters take over.
            if d_on is not None and d_rq is not None and (
                    tid in m("oc_lost") or abs(on + off + rq - window) > max(0.1, 0.1 * window)):
                on, rq = d_on, d_rq
                off = max(0.0, window - on - rq)
        elif d_on is not None and d_rq is not None:
            # no switch in the window (or no tracing): schedstat says whether it was on the CPU
            on, rq = d_on, d_rq
            off = max(0.0, window - on - rq)
        # --- Python locks
        pl_addr = pl_n = pl_s = None
        if traced_pylock:
            pl_n = int(m("pl_n").get(tid, 0))
            pl_s = m("pl_ns").get(tid, 0) / 1e9
            if tid in m("pl_since"):
                pl_addr = int(m("pl_lock").get(tid, 0)) or None
                pl_s += max(0.0, w.end - max(m("pl_since")[tid] / 1e9, w.begin))
        out.append(ThreadProbe(
            tid=tid, pid=st.pid, comm=st.comm, backend=backend,
            futex_addr=addr, wait_s=_r(wait_s),
            wait_started=_r(start + w.wall_offset, 3) if start is not None else None,
            wait_source=source, parked_throughout=parked,
            waits=waits, total_wait_s=_r(total), wakes_on_addr=wake_calls, wakers=wakers,
            oncpu_s=_r(on), offcpu_s=_r(off), runq_s=_r(rq), window_s=_r(window) or 0.0,
            pylock_addr=pl_addr, pylock_waits=pl_n, pylock_wait_s=_r(pl_s),
        ))
    return out[:MAX_THREADS_REPORTED]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def wake_table(maps: dict[str, Any], most: int = MAX_WAKES_REPORTED) -> list[dict[str, Any]]:
    """Who called a wake op on which address: [{pid, addr, waker, calls, woken}], most calls first."""
    woken = maps.get("fw_woken") or {}
    rows = []
    for key, calls in (maps.get("fw_wakes") or {}).items():
        if isinstance(key, tuple) and len(key) == 3:
            pid, addr, waker = key
            rows.append({"pid": pid, "addr": addr, "waker": waker, "calls": int(calls),
                         "woken": int(woken.get((pid, addr), 0))})
    rows.sort(key=lambda r: (-r["calls"], r["pid"], r["addr"], r["waker"]))
    return rows[:most]


def full_maps(maps: dict[str, Any], limit: int = MAX_ENTRIES) -> list[str]:
    return sorted(n for n, v in maps.items() if isinstance(v, dict) and len(v) >= limit)


# ---------------------------------------------------------------------------
# running


def _expand_tree(pids: Iterable[int]) -> list[int]:
    import psutil

    out: list[int] = []
    for pid in pids:
        if pid not in out:
            out.append(pid)
        with contextlib.suppress(psutil.Error):
            out += [c.pid for c in psutil.Process(pid).children(recursive=True) if c.pid not in out]
    return out


def python_libraries(pids: Iterable[int], proc_root: Path = PROC) -> list[str]:
    """The libpython (or static python executable) each pid runs, for the pylockwait uprobe."""
    libs: list[str] = []
    for pid in pids:
        found = None
        try:  # maps is longer than one seq_file page: read it whole
            text = (proc_root / str(pid) / "maps").read_text(errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
            if "/libpython3" in path and ".so" in path:
                found = path.strip()
                break
        if found is None:
            with contextlib.suppress(OSError):
                exe = os.readlink(proc_root / str(pid) / "exe")
                if "python" in Path(exe).name:
                    found = exe
        if found and found not in libs and os.path.exists(found):
            libs.append(found)
    return libs


class ProbeRun:
    """One bounded run of the probes on a set of pids: start(), then stop() returns the records.

    Use it as a context manager, or call stop() in a finally: it detaches
    (SIGINT, then SIGKILL after STOP_TIMEOUT_S) whatever happened meanwhile.
    """

    def __init__(self, pids: Sequence[int], probes: Sequence[str] = DEFAULT_PROBES, *,
                 backend: BackendStatus, statuses: Sequence[BackendStatus] = (), max_s: float = 60.0,
                 mode: str = "auto", proc_root: Path = PROC, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max(64, min(int(max_entries), 1 << 20))
        self.pids = list(dict.fromkeys(int(p) for p in pids))[:MAX_PIDS]
        self.probes = tuple(probes)
        self.backend = backend
        self.statuses = tuple(statuses)
        self.max_s = min(max(0.5, max_s), MAX_WINDOW_S)
        self.mode = mode
        self.proc_root = proc_root
        self.failures: list[CollectorFailure] = []
        self.fallback_from: list[dict[str, str]] = []
        self.libs: list[str] = []
        self.program = ""
        self._proc: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._stderr: Any = None
        self._tmp: Path | None = None
        self._start_states: dict[int, ThreadState] = {}
        self._begin = 0.0
        self._ready_at: float | None = None
        self._started_wall = 0.0
        self._stopped: tuple[tuple[dict[str, Any], ...], tuple[CollectorFailure, ...]] | None = None

    # -- start
    def start(self) -> ProbeRun:
        self._start_states, fails = read_thread_states(self.pids, self.proc_root)
        self.failures += fails
        if not self._start_states:
            self.failures.append(CollectorFailure(COLLECTOR, FailureKind.GONE, "no thread of the target pids "
                                                  "could be read", ",".join(map(str, self.pids))))
        if "pylockwait" in self.probes:
            self.libs = python_libraries(self.pids, self.proc_root)
        if self.backend.name in EBPF_BACKENDS and self._start_states:
            try:
                self._launch()
            except Exception as exc:  # noqa: BLE001 - any launch failure means: fall back, say why
                self._teardown()
                self._fall_back(f"{self.backend.name} could not start: {exc}")
        self._begin = time.monotonic() if self.backend.name == "procfs" else self._begin
        self._started_wall = time.time()
        return self

    def _fall_back(self, why: str) -> None:
        self.fallback_from.append({"backend": self.backend.name, "reason": why})
        kind = FailureKind.MISSING_TOOL if "not installed" in why else FailureKind.ERROR
        self.failures.append(CollectorFailure(COLLECTOR, kind, why, ",".join(map(str, self.pids))))
        procfs_status = next((s for s in self.statuses if s.name == "procfs" and s.available), None)
        if procfs_status is None:
            procfs_status = BackendStatus("procfs", True, "fallback")
        self.backend = BackendStatus("procfs", True, f"{procfs_status.reason} (fell back: {why})")
        self._begin = time.monotonic()

    def _launch(self) -> None:
        seed = sorted(self._start_states)
        probes = tuple(p for p in self.probes if p != "pylockwait" or self.libs)
        if "pylockwait" in self.probes and not self.libs:
            self.failures.append(CollectorFailure(COLLECTOR, FailureKind.MISSING_TOOL,
                                                  "pylockwait: no libpython found in the target pids' maps"))
        self.probes = probes
        self._stderr = tempfile.TemporaryFile(mode="w+")
        if self.backend.name == "bpftrace":
            self.program = bpftrace_program(probes, self.pids, self.max_s, seed, self.libs)
            fd, name = tempfile.mkstemp(prefix="wedgectl-", suffix=".bt")
            with os.fdopen(fd, "w") as f:
                f.write(self.program)
            self._tmp = Path(name)
            path = shutil.which("bpftrace") or "bpftrace"
            cmd, env = [path, "-f", "json", name], _bpftrace_env(self.max_entries)
        else:
            self.program = bcc_program(probes, self.pids, self.max_entries)
            spec = {"text": self.program, "seed": seed, "max_s": self.max_s, "libs": self.libs,
                    "maps": [n for p in probes for n in load_probe(p).MAPS],
                    "uprobes": [list(u) for p in probes for u in getattr(load_probe(p), "BCC_UPROBES", ())]}
            fd, name = tempfile.mkstemp(prefix="wedgectl-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f)
            self._tmp = Path(name)
            code = "import sys; from wedgectl.collect.ebpf import bcc_child; sys.exit(bcc_child(sys.argv[1]))"
            cmd, env = [sys.executable, "-c", code, name], _bcc_env(bcc_python_path())
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=self._stderr, env=env, text=True)
        self._reader = threading.Thread(target=self._read_stdout, name="wedgectl-probe-reader", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready.wait(0.05):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                code_ = self._proc.poll()
                self._teardown()
                why = self._stderr_text() or ("exit %s" % code_ if code_ is not None
                                              else f"not attached within {READY_TIMEOUT_S:.0f} s")
                raise RuntimeError(why)
        self._begin = self._ready_at = time.monotonic()
        # read at start-up: remove it now, so nothing is left behind even if stop() never runs
        with contextlib.suppress(OSError):
            self._tmp.unlink()
        self._tmp = None

    def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.append(line)
            if READY_MARK in line:
                self._ready.set()

    def _stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            return _stderr_summary(self._stderr.read())
        return ""

    def _teardown(self, grace: float | None = None) -> bool:
        """Detach: SIGINT (bpftrace and the bcc runner print their maps and exit), SIGKILL after grace. True if clean."""
        grace = STOP_TIMEOUT_S if grace is None else grace
        clean = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                clean = False
                with contextlib.suppress(OSError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._tmp = None
        return clean

    # -- stop
    def stop(self) -> tuple[tuple[dict[str, Any], ...], tuple[CollectorFailure, ...]]:
        """Detach, read /proc once more and return (header + thread dicts, failures). Idempotent."""
        if self._stopped is not None:
            return self._stopped
        maps: dict[str, Any] = {}
        end = time.monotonic()
        if self._proc is not None:
            clean = self._teardown()
            maps, _printed, other = parse_bpftrace_output(self._lines)
            if not clean:
                self.failures.append(CollectorFailure(COLLECTOR, FailureKind.TIMEOUT,
                                                      f"{self.backend.name} did not exit within "
                                                      f"{STOP_TIMEOUT_S:.0f} s of SIGINT; killed"))
            t_begin, t_end = maps.get("t_begin"), maps.get("t_end")
            if "t_end" not in maps:
                # No maps: nothing from the probe can be trusted (an empty wake table would read
                # as "no wake"), so the results are /proc's, and say so.
                why = self._stderr_text() or "; ".join(other[-3:]) or f"exit {self._proc.returncode}"
                self._fall_back(f"{self.backend.name} reported no results: {why}")
                self._begin = self._ready_at or self._begin
                maps, t_begin, t_end = {}, None, None
            if isinstance(t_begin, int) and t_begin > 0:
                self._begin = t_begin / 1e9
            if isinstance(t_end, int) and t_end > 0:
                end = t_end / 1e9
            else:
                end = min(end, self._begin + self.max_s)
        end_states, fails = read_thread_states(self.pids, self.proc_root)
        end_read_at = time.monotonic()
        self.failures += [f for f in fails if f.kind is not FailureKind.GONE or not end_states]
        if self._stderr is not None:
            with contextlib.suppress(OSError):
                self._stderr.close()
        offsets = sched_clock_offsets({s.cpu for s in end_states.values() if s.cpu is not None}, self.proc_root) \
            if self.proc_root == PROC else {}
        w = Window(begin=self._begin, end=end, start_states=self._start_states, end_states=end_states,
                   end_read_at=end_read_at, offsets=offsets, wall_offset=time.time() - time.monotonic())
        threads = combine(self.backend.name, self.probes, maps, w)
        header = {
            "kind": "probe",
            "backend": self.backend.name,
            "reason": self.backend.reason,
            "skipped": [{"backend": s.name, "reason": s.reason} for s in self.statuses
                        if not s.available and BACKENDS.index(s.name) < BACKENDS.index(self.backend.name)]
            + self.fallback_from,
            "probes": list(self.probes) if self.backend.name != "procfs" else [],
            "pids": self.pids,
            "window_s": round(w.seconds, 4),
            "started": round(self._begin + w.wall_offset, 3),
            "ended": round(end + w.wall_offset, 3),
            "wakes": wake_table(maps),
            "maps_full": full_maps(maps, self.max_entries),
            "clock_offsets_s": {str(k): round(v, 6) for k, v in sorted(offsets.items())},
            "overhead": {p: load_probe(p).OVERHEAD for p in self.probes} if self.backend.name != "procfs" else {},
        }
        self._stopped = ((header, *(t.to_dict() for t in threads)), tuple(self.failures))
        return self._stopped

    def wait(self, seconds: float) -> None:
        """Until the window of `seconds` is over: the program exits by itself then (bounded by STOP_TIMEOUT_S more)."""
        if self._proc is None or self._proc.poll() is not None:
            time.sleep(max(0.0, seconds - (time.monotonic() - self._begin)))
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.0, seconds - (time.monotonic() - self._begin)) + STOP_TIMEOUT_S)

    def __enter__(self) -> ProbeRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_probes(pids: Sequence[int], mode: str = "auto", *, probes: Sequence[str] = DEFAULT_PROBES,
                 backend: str = "auto", max_s: float = 60.0, host: Host = Host(),
                 disable: Iterable[str] | None = None, proc_root: Path = PROC,
                 max_entries: int = MAX_ENTRIES) -> ProbeRun | None:
    """Detect, pick and start a back-end on the pids; None when mode is "off".

    mode "auto": the best back-end, down to /proc. mode "on": the same data,
    and a MISSING_TOOL failure when no eBPF back-end can run. backend forces
    one ("bcc", "bpftrace", "procfs"): the others count as disabled.
    """
    if mode == "off":
        return None
    try:
        return _start_probes(pids, mode, probes, backend, max_s, host, disable, proc_root, max_entries)
    except Exception as exc:  # noqa: BLE001 - a collector never raises: report, fall back to /proc
        run = ProbeRun(pids, probes, backend=BackendStatus("procfs", True, f"probe start failed: {exc!r}"),
                       max_s=max_s, mode=mode, proc_root=proc_root)
        run.failures.append(CollectorFailure(COLLECTOR, FailureKind.ERROR, f"probe start failed: {exc!r}"))
        return run.start()


def _start_probes(pids: Sequence[int], mode: str, probes: Sequence[str], backend: str, max_s: float, host: Host,
                  disable: Iterable[str] | None, proc_root: Path, max_entries: int) -> ProbeRun:
    off = set(disabled_backends(disable))
    if backend != "auto":
        off |= set(BACKENDS) - {backend}
    statuses = detect_backends(probes, host, disable=off, proc_root=proc_root)
    chosen = choose_backend(statuses)
    if chosen is None:
        chosen = BackendStatus("procfs", True, "every back-end is disabled; /proc read anyway")
    run = ProbeRun(pids, probes, backend=chosen, statuses=statuses, max_s=max_s, mode=mode, proc_root=proc_root,
                   max_entries=max_entries)
    if mode == "on" and chosen.name not in EBPF_BACKENDS:
        why = "; ".join(f"{s.name}: {s.reason}" for s in statuses if s.name in EBPF_BACKENDS)
        run.failures.append(CollectorFailure(COLLECTOR, FailureKind.MISSING_TOOL,
                                             f"--ebpf on but no eBPF back-end can run: {why}"))
    return run.start()


def run_probes(pids: Sequence[int], seconds: float, mode: str = "auto", **kw: Any
               ) -> tuple[tuple[dict[str, Any], ...], tuple[CollectorFailure, ...]]:
    """Start the probes, wait `seconds`, stop: (header + thread dicts, failures). Ctrl-C stops early and still reports."""
    run = start_probes(pids, mode, max_s=seconds, **kw)  # the program's own timer ends the window
    if run is None:
        return (), ()
    try:
        run.wait(seconds)
    except KeyboardInterrupt:
        pass  # as bcc's tools do: Ctrl-C ends the window early and the results still print
    finally:
        result = run.stop()
    return result


# ---------------------------------------------------------------------------
# the bcc runner (a child process, so its clang and its attachments go with it)


def bcc_child(spec_path: str) -> int:
    """Load the composed C text with bcc, report 'ready', wait for SIGINT or max_s, print the maps as bpftrace does."""
    import ctypes as ct

    from bcc import BPF  # type: ignore[import-not-found]

    spec = json.loads(Path(spec_path).read_text())
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    b = BPF(text=spec["text"])
    for lib in spec.get("libs", ()):
        for sym, enter, ret in spec.get("uprobes", ()):
            b.attach_uprobe(name=lib, sym=sym, fn_name=enter)
            b.attach_uretprobe(name=lib, sym=sym, fn_name=ret)
    if "oc_tgt" in spec["text"]:
        tgt = b["oc_tgt"]
        for tid in spec.get("seed", ())[:MAX_SEED_TIDS]:
            tgt[ct.c_uint64(tid)] = ct.c_uint64(1)
    begin = time.monotonic_ns()  # CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns
    b["t_begin"][ct.c_int(0)] = ct.c_uint64(begin)
    emit = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    emit({"type": "printf", "data": READY_MARK + "\n"})
    stop.wait(float(spec.get("max_s", 60)))
    end = time.monotonic_ns()
    b["t_begin"][ct.c_int(0)] = ct.c_uint64(0)  # probes go quiet while the maps are read

    def key_text(k: Any) -> str:
        if hasattr(k, "_fields_"):
            return ",".join(str(getattr(k, f)) for f, _ in k._fields_)
        return str(k.value)

    for name in spec["maps"]:
        data = {key_text(k): int(v.value) for k, v in b[name].items()}
        if data:
            emit({"type": "map", "data": {"@" + name: data}})
    emit({"type": "map", "data": {"@t_begin": begin}})
    emit({"type": "map", "data": {"@t_end": end}})
    b.cleanup()
    return 0


# ---------------------------------------------------------------------------
# the `probes` command and the probe tools' entry


def render_backends(statuses: Sequence[BackendStatus], probes: Sequence[str] = ALL_PROBES) -> Iterator[str]:
    """What this host supports, and why not, in 80 columns."""
    import textwrap

    chosen = choose_backend(statuses)
    yield f"probe back-ends on this host (kernel {platform.release()}, {platform.machine()}), best first:"
    for s in statuses:
        mark = "<- used" if chosen is not None and s.name == chosen.name else ""
        head = f"  {s.name:<9} {'yes' if s.available else 'no ':<4}{mark}"
        yield head
        yield from textwrap.wrap(s.reason, 80, initial_indent="      ", subsequent_indent="      ")
    tracefs = find_tracefs()
    if tracefs is not None:
        if not (tracefs / "kprobe_events").exists():
            yield "  kprobes: not in this kernel (CONFIG_KPROBES off); the probes need none"
        if not (tracefs / "uprobe_events").exists():
            yield "  uprobes: not in this kernel (CONFIG_UPROBE_EVENTS off): no pylockwait"
    yield ""
    yield "programs (probes/):"
    for name in probes:
        mod = load_probe(name)
        yield from textwrap.wrap(mod.SUMMARY, 80, initial_indent=f"  {name:<11} ", subsequent_indent=" " * 14)
        yield from textwrap.wrap(f"overhead: {mod.OVERHEAD}", 80, initial_indent=" " * 14,
                                 subsequent_indent=" " * 14)


def render_threads(records: Sequence[dict[str, Any]], most: int = 40) -> Iterator[str]:
    """Header line, then the threads that waited or ran, longest wait first."""
    header = next((r for r in records if r.get("kind") == "probe"), None)
    threads = [ThreadProbe.from_dict(r) for r in records if r.get("kind") == "thread"]
    if header is not None:
        yield f"back-end {header['backend']}: {header['reason']}"[:200]
        yield f"window {header['window_s']:.1f} s, pids {header['pids']}"
    yield f"{'TID':>7} {'PID':>7} {'COMM':<15} {'FUTEX':>14} {'WAIT_S':>8} {'WAITS':>6} {'WAKES':>5} {'ON_S':>5} {'OFF_S':>6}"
    threads.sort(key=lambda t: (-(t.wait_s or -1), t.tid))
    for t in threads[:most]:
        fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
        yield (f"{t.tid:>7} {t.pid:>7} {t.comm[:15]:<15} {fmt(t.futex_addr, '#x'):>14} {fmt(t.wait_s, '.1f'):>8} "
               f"{fmt(t.waits, 'd'):>6} {fmt(t.wakes_on_addr, 'd'):>5} {fmt(t.oncpu_s, '.1f'):>5} "
               f"{fmt(t.offcpu_s, '.1f'):>6}")
    if len(threads) > most:
        yield f"... {len(threads) - most} more threads"


def tool_main(args: Any, probes: Sequence[str]) -> int:
    """The body of every probes/*.py tool: parse pids, print the program (--ebpf) or run and print results."""
    try:
        pids = [int(p) for p in str(args.pid).split(",") if p.strip()]
    except ValueError:
        print(f"bad pid list: {args.pid!r}", file=sys.stderr)
        return EXIT_USAGE
    if not pids or args.duration <= 0 or args.duration > MAX_WINDOW_S:
        print(f"need pids and 0 < duration <= {MAX_WINDOW_S:.0f}", file=sys.stderr)
        return EXIT_USAGE
    if not args.no_children and not args.ebpf:
        pids = _expand_tree(pids)
    if args.ebpf:  # no root needed: text only, nothing attached
        if args.backend == "bcc":
            print(bcc_program(probes, pids, args.max_entries))
        else:
            libs = python_libraries(pids) if "pylockwait" in probes else []
            if "pylockwait" in probes and not libs:
                libs = ["/path/to/libpython3.X.so"]
            print(bpftrace_program(probes, pids, args.duration, (), libs), end="")
        return EXIT_OK
    if not any((PROC / str(p)).exists() for p in pids):
        print(f"no such process: {pids}", file=sys.stderr)
        return EXIT_GONE
    mode = "auto"
    if args.backend in EBPF_BACKENDS:
        statuses = detect_backends(probes, disable=set(BACKENDS) - {args.backend})
        chosen = choose_backend(statuses)
        if chosen is None or chosen.name != args.backend:
            st = next(s for s in statuses if s.name == args.backend)
            print(f"{args.backend} cannot run here: {st.reason}", file=sys.stderr)
            return EXIT_PERMISSION if "root" in st.reason else EXIT_NO_BACKEND
    records, failures = run_probes(pids, args.duration, mode, probes=probes, backend=args.backend,
                                   max_entries=args.max_entries)
    if args.json:
        for r in records:
            print(json.dumps(r))
    else:
        for line in render_threads(records):
            print(line)
    for f in failures:
        print(f"{f.kind.value}: {f.message}", file=sys.stderr)
    header = next((r for r in records if r.get("kind") == "probe"), None)
    if header is None:
        return EXIT_FAILED
    if args.backend in EBPF_BACKENDS and header["backend"] != args.backend:
        return EXIT_FAILED
    return EXIT_OK


# ---------------------------------------------------------------------------
# for the classifier


ROLE_LABELS = {Role.ENGINE_CORE: "EngineCore", Role.WORKER: "Worker", Role.API_SERVER: "API server",
               Role.OTHER: "process"}
_ROLE_ORDER = {Role.ENGINE_CORE: 0, Role.WORKER: 1, Role.API_SERVER: 2, Role.OTHER: 3}


def probe_header(samples: Sequence[Sample]) -> dict[str, Any] | None:
    for s in reversed(samples):
        for r in s.probes:
            if r.get("kind") == "probe":
                return r
    return None


def probe_threads(samples: Sequence[Sample]) -> list[ThreadProbe]:
    """The per-thread results of the latest sample that carries probe results."""
    for s in reversed(samples):
        threads = [ThreadProbe.from_dict(r) for r in s.probes if r.get("kind") == "thread"]
        if threads:
            return threads
    return []


def _roles(samples: Sequence[Sample]) -> dict[int, Role]:
    roles: dict[int, Role] = {}
    for s in samples:
        for p in s.processes:
            roles[p.pid] = p.role
    return roles


def parked_threads(samples: Sequence[Sample], min_s: float | None = None, main_only: bool = True
                   ) -> list[tuple[ThreadProbe, Role]]:
    """Threads in a futex wait that lasted the whole window (or min_s) with no wake on that address.

    main_only: only each process's main thread (tid == pid): vLLM's EngineCore
    busy loop and the Worker's execute loop run there; pools of idle helper
    threads park forever in a healthy server too.
    """
    roles = _roles(samples)
    out = []
    for t in probe_threads(samples):
        if t.futex_addr is None or t.wait_s is None or (main_only and t.tid != t.pid):
            continue
        need = min_s if min_s is not None else max(1.0, 0.9 * t.window_s)
        if t.wait_s >= need and not t.wakes_on_addr:
            out.append((t, roles.get(t.pid, Role.OTHER)))
    out.sort(key=lambda tr: (_ROLE_ORDER[tr[1]], -(tr[0].wait_s or 0), tr[0].tid))
    return out


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def probe_evidence(samples: Sequence[Sample], most: int = 4) -> list[Evidence]:
    """Evidence lines from the probe results: which main threads sat parked on one futex with no wake
    on that address, which ones spun on the CPU, and which back-end measured it."""
    header = probe_header(samples)
    threads = probe_threads(samples)
    if header is None and not threads:
        return []
    roles = _roles(samples)
    out: list[Evidence] = []
    for t, role in parked_threads(samples)[:most]:
        who = f"{ROLE_LABELS[role]} main thread" if t.tid == t.pid else f"{ROLE_LABELS[role]} thread {t.comm}"
        if t.wakes_on_addr is None:
            wake = "wakes not traced (procfs)"
        else:
            wake = f"no wake on that address in the {t.window_s:.1f} s window"
        out.append(Evidence(
            source="probe",
            what=f"{who} (tid {t.tid}) parked {t.wait_s:.0f} s on one futex ({t.futex_addr:#x}), {wake}",
            t=_iso(t.wait_started),
            values={"tid": t.tid, "pid": t.pid, "comm": t.comm, "role": role.value,
                    "futex_addr": hex(t.futex_addr or 0), "wait_s": round(t.wait_s or 0, 1),
                    "wait_source": t.wait_source, "parked_throughout": t.parked_throughout,
                    "wakes_on_addr": t.wakes_on_addr, "oncpu_s": t.oncpu_s, "backend": t.backend},
        ))
    spinning = [t for t in threads if t.tid == t.pid and t.oncpu_s is not None and t.window_s > 0
                and t.oncpu_s >= 0.8 * t.window_s]
    for t in sorted(spinning, key=lambda t: (_ROLE_ORDER[roles.get(t.pid, Role.OTHER)], -(t.oncpu_s or 0)))[:2]:
        role = roles.get(t.pid, Role.OTHER)
        out.append(Evidence(
            source="probe",
            what=f"{ROLE_LABELS[role]} main thread (tid {t.tid}) on the CPU {100 * (t.oncpu_s or 0) / t.window_s:.0f}% "
                 f"of the {t.window_s:.1f} s window, {t.waits if t.waits is not None else '?'} futex waits: spinning, not parked",
            values={"tid": t.tid, "pid": t.pid, "role": role.value, "oncpu_s": t.oncpu_s, "offcpu_s": t.offcpu_s,
                    "runq_s": t.runq_s, "waits": t.waits, "backend": t.backend},
        ))
    if header is not None:
        out.append(Evidence(
            source="probe",
            what=f"probes: {header['backend']} over {header['window_s']:.1f} s on pids {header['pids']}",
            values={"backend": header["backend"], "reason": header["reason"], "threads": len(threads),
                    "parked_main_threads": len(parked_threads(samples))},
        ))
    return out


__all__ = [
    "BackendStatus", "Host", "ProbeRun", "ThreadProbe", "ThreadState", "Window", "bcc_program",
    "bpftrace_program", "choose_backend", "combine", "detect_backends", "ensure_tracefs", "load_probe",
    "parked_threads", "parse_bpftrace_output", "probe_evidence", "probe_header", "probe_threads",
    "read_thread_states", "render_backends", "render_threads", "run_probes", "sched_clock_offsets",
    "start_probes",
]
