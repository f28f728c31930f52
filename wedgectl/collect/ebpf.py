"""The eBPF collector: runs the probes (wedgectl.probes) on a process tree, bounded in time, with rawtp, bcc,
bpftrace or /proc.

It picks a back-end at run time and says why (collect/ebpfhost.py), composes
one program from the probes asked for, filters it to the target pids in the
kernel, runs it for a bounded time with bounded maps, and detaches on every
exit path (stop, Ctrl-C, timeout, error): the program also exits by itself
after its window, so even a SIGKILLed wedgectl leaves nothing attached for long.

/proc is read at both edges of the window (collect/procfs/sched.py): a thread parked
since before the attach fires no tracepoint, and its wait began at its
`se.exec_start`, calibrated per CPU against CLOCK_MONOTONIC. Each probe's
parser turns its maps and those reads into its ThreadProbe fields; the result
is one ProbeResult and one ThreadProbe per thread (types.py), for Sample.probes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from wedgectl.collect import procfs, procread
from wedgectl.collect.ebpfhost import (
    BACKENDS, EBPF_BACKENDS, MAX_ENTRIES, Host, bcc_env, bcc_python_path, bpftrace_env, choose_backend,
    detect_backends, disabled_backends, stderr_summary,
)
from wedgectl.collect.ebpfbcc import READY_MARK
from wedgectl.collect.control import signal_child
from wedgectl.probes import ALL_PROBES, DEFAULT_MIN_WAIT_MS, DEFAULT_PROBES, load_probe
from wedgectl.probes._window import Maps, Window, parse_bpftrace_output, rounded
from wedgectl.model.types import (
    BackendStatus, CollectorFailure, FailureKind, ProbeBackend, ProbeMode, ProbeRecord, ProbeResult, ProbeSkip,
    ThreadProbe,
)

COLLECTOR = "ebpf"
MAX_PIDS = 64
MAX_WINDOW_S = 300.0
MAX_THREADS_REPORTED = 2048
READY_TIMEOUT_S = 20.0  # compile + attach; bpftrace takes ~0.4 s here, bcc's clang several seconds
STOP_TIMEOUT_S = 20.0  # SIGINT to exit is < 1 s here; once, under ~400k futex calls/s on a loaded host, > 10 s
PROC = procfs.PROC


# ---------------------------------------------------------------------------
# one program from the probes' sections


MIN_WAIT_S = DEFAULT_MIN_WAIT_MS / 1000


def pid_predicate(pids: Iterable[int]) -> str:
    """The in-kernel filter: 'pid == 4101 || pid == 4102' (pid is the tgid in bpftrace and in our C).

    Every probe tests it before anything else, so another process's event costs one compare per pid.
    """
    pids = sorted(set(int(p) for p in pids))
    if not pids:
        raise ValueError("no pids to filter on")
    return " || ".join(f"pid == {p}" for p in pids)


def min_wait_ns(min_wait_s: float) -> str:
    return str(max(0, int(round(min_wait_s * 1e9))))


def bpftrace_program(probes: Sequence[str], pids: Iterable[int], max_s: float, libs: Sequence[str] = (), *,
                     min_wait_s: float = MIN_WAIT_S) -> str:
    """One bpftrace program from the probes' sections: one BEGIN, their probes, one exit timer, one END.

    Waits shorter than min_wait_s are not recorded (each probe compares with __MIN_NS__).
    """
    pred = pid_predicate(pids)
    begins, bodies, ends = [], [], []
    for name in probes:
        mod = load_probe(name)
        begins.append(mod.BPFTRACE_BEGIN)
        if "__LIB__" in mod.BPFTRACE_PROBES:
            if not libs:
                continue
            bodies += [mod.BPFTRACE_PROBES.replace("__LIB__", lib) for lib in libs]
        else:
            bodies.append(mod.BPFTRACE_PROBES)
        ends.append(mod.BPFTRACE_END)
    ms = max(1, int(min(max_s, MAX_WINDOW_S) * 1000))
    text = (
        f"// wedgectl probes: {', '.join(probes)}; pids {sorted(set(pids))}; exits after {ms} ms; "
        f"waits under {min_wait_s * 1000:g} ms not recorded\n"
        "BEGIN\n{\n" + "".join(begins) +
        f"  @t_begin = nsecs;\n  printf(\"{READY_MARK}\\n\");\n}}\n"
        + "".join(bodies)
        # the timer ends the window in the kernel, to the millisecond; END (user space, later) reports.
        # Its first firing only: on a loaded host bpftrace may act on exit() after the timer has fired again
        + f"\ninterval:ms:{ms}\n{{\n  if (@t_end == 0) {{\n    @t_end = nsecs;\n  }}\n  exit();\n}}\n"
        + "\nEND\n{\n  if (@t_end == 0) {\n    @t_end = nsecs;\n  }\n" + "".join(ends) + "}\n"
    )
    return text.replace("__FILTER__", pred).replace("__MIN_NS__", min_wait_ns(min_wait_s))


BCC_PRELUDE = """
BPF_ARRAY(t_begin, u64, 1);
static inline u64 t_begin_ns(void)
{
    int k = 0;
    u64 *v = t_begin.lookup(&k);
    return v ? *v : 0;
}
"""


def bcc_program(probes: Sequence[str], pids: Iterable[int], max_entries: int | None = None, *,
                min_wait_s: float = MIN_WAIT_S) -> str:
    """The BPF C text for bcc: a shared window start (t_begin, set from user space once attached) and each probe's
    maps and functions."""
    pred = pid_predicate(pids)
    text = f"// wedgectl probes: {', '.join(probes)}; pids {sorted(set(pids))}\n" + BCC_PRELUDE
    for name in probes:
        text += load_probe(name).BCC_TEXT
    return (text.replace("__FILTER__", pred).replace("__MAX_ENTRIES__", str(int(max_entries or MAX_ENTRIES)))
            .replace("__MIN_NS__", min_wait_ns(min_wait_s)))


# ---------------------------------------------------------------------------
# the result: each probe's parser, merged per thread


def combine(backend: str, probes: Sequence[str], maps: Maps, w: Window) -> list[ThreadProbe]:
    """Per-thread results from the program's maps (empty for procfs) and the /proc reads around them.

    futexwait's and offcpu's parsers run on every back-end (they fall back to
    /proc's view); pylockwait's only where its uprobe ran.
    """
    parts = [load_probe(name).thread_fields(maps, w, traced=name in probes and backend != "procfs")
             for name in ALL_PROBES]
    out = []
    for tid, st in sorted(w.end_states.items())[:MAX_THREADS_REPORTED]:
        fields: dict[str, Any] = {}
        for part in parts:
            fields.update(part.get(tid, {}))
        out.append(ThreadProbe(tid=tid, pid=st.pid, comm=st.comm, backend=backend,
                               window_s=rounded(w.seconds) or 0.0, **fields))
    return out


def full_maps(maps: Maps, limit: int = MAX_ENTRIES) -> tuple[str, ...]:
    return tuple(sorted(n for n, v in maps.items() if isinstance(v, dict) and len(v) >= limit))


# ---------------------------------------------------------------------------
# the targets


def expand_tree(pids: Iterable[int]) -> list[int]:
    """The pids and all their descendants, each once, in that order."""
    import psutil

    out: list[int] = []
    for pid in pids:
        if pid not in out:
            out.append(pid)
        with contextlib.suppress(psutil.Error):
            out += [c.pid for c in psutil.Process(pid).children(recursive=True) if c.pid not in out]
    return out


def pids_exist(pids: Iterable[int], proc_root: Path = PROC) -> bool:
    return any((proc_root / str(p)).exists() for p in pids)


def python_libraries(pids: Iterable[int], proc_root: Path = PROC) -> list[str]:
    """The libpython (or static python executable) each pid runs, for the pylockwait uprobe."""
    libs: list[str] = []
    for pid in pids:
        found = None
        try:  # bounded: maps is read under the target's mmap lock
            text = procread.read_maps(pid, proc_root)
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
                 mode: str = "auto", proc_root: Path = PROC, max_entries: int = MAX_ENTRIES,
                 min_wait_s: float = MIN_WAIT_S) -> None:
        self.max_entries = max(64, min(int(max_entries), 1 << 20))
        self.pids = list(dict.fromkeys(int(p) for p in pids))[:MAX_PIDS]
        self.probes = tuple(probes)
        self.backend = backend
        self.statuses = tuple(statuses)
        self.max_s = min(max(0.5, max_s), MAX_WINDOW_S)
        self.min_wait_s = min(max(0.0, min_wait_s), MAX_WINDOW_S)
        self.mode = mode
        self.proc_root = proc_root
        self.failures: list[CollectorFailure] = []
        self.fallback_from: list[ProbeSkip] = []
        self.libs: list[str] = []
        self.program = ""
        self._proc: subprocess.Popen | None = None
        self._raw: Any = None  # the rawtp back-end's ebpfraw.SchedProbe, in-process
        self._raw_timer: threading.Timer | None = None
        self._lines: list[str] = []
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._stderr: Any = None
        self._tmp: Path | None = None
        self._start_states: dict[int, procfs.ThreadSched] = {}
        self._begin = 0.0
        self._ready_at: float | None = None
        self._started_wall = 0.0
        self._stopped: tuple[tuple[ProbeRecord, ...], tuple[CollectorFailure, ...]] | None = None
        self.interrupted = False  # Ctrl-C came while the program attached: /proc's window, caller decides

    # -- start
    def start(self) -> ProbeRun:
        """Read /proc, then launch and attach the back-end (or fall back to /proc, saying why).

        Ctrl-C while the program compiles and attaches does not escape: the
        child is detached at once (killed on a second Ctrl-C), the window is
        /proc's from the first reading on, and `interrupted` is set so the
        caller can end the window there (run_probes) or pass the interrupt on
        (a capture).
        """
        states_at = time.monotonic()
        self._start_states, fails = procfs.read_thread_scheds(self.pids, self.proc_root)
        self.failures += [f for f in fails if f.kind is not FailureKind.GONE or not self._start_states]
        if not self._start_states:
            self.failures.append(CollectorFailure(COLLECTOR, FailureKind.GONE, "no thread of the target pids "
                                                  "could be read", ",".join(map(str, self.pids))))
        if "pylockwait" in self.probes:
            self.libs = python_libraries(self.pids, self.proc_root)
        if self.backend.name in EBPF_BACKENDS and self._start_states:
            try:
                self._launch()
            except KeyboardInterrupt:
                self._abort()
                self._fall_back(f"{self.backend.name} interrupted while attaching (Ctrl-C)")
                self._begin, self.interrupted = states_at, True
            except Exception as exc:  # noqa: BLE001 - any launch failure means: fall back, say why
                self._teardown()
                self._fall_back(f"{self.backend.name} could not start: {exc}")
        self._begin = time.monotonic() if self.backend.name == "procfs" else self._begin
        self._started_wall = time.time()
        return self

    def _fall_back(self, why: str) -> None:
        if (raw := self._raw) is not None:  # rawtp's program and map go with it: /proc alone from here
            self._raw = None
            if self._raw_timer is not None:
                self._raw_timer.cancel()
            raw.close()
        self.fallback_from.append(ProbeSkip(self.backend.name, why))
        kind = FailureKind.MISSING_TOOL if "not installed" in why else FailureKind.ERROR
        self.failures.append(CollectorFailure(COLLECTOR, kind, why, ",".join(map(str, self.pids))))
        procfs_status = next((s for s in self.statuses if s.name == "procfs" and s.available), None)
        if procfs_status is None:
            procfs_status = BackendStatus("procfs", True, "fallback")
        self.backend = BackendStatus("procfs", True, f"{procfs_status.reason} (fell back: {why})")
        self._begin = time.monotonic()

    def _launch(self) -> None:
        probes = tuple(p for p in self.probes if p != "pylockwait" or self.libs)
        if "pylockwait" in self.probes and not self.libs:
            self.failures.append(CollectorFailure(COLLECTOR, FailureKind.MISSING_TOOL,
                                                  "pylockwait: no libpython found in the target pids' maps"))
        self.probes = probes
        if self.backend.name == "rawtp":
            self._launch_raw()
            return
        self._stderr = tempfile.TemporaryFile(mode="w+")
        if self.backend.name == "bpftrace":
            self.program = bpftrace_program(probes, self.pids, self.max_s, self.libs, min_wait_s=self.min_wait_s)
            fd, name = tempfile.mkstemp(prefix="wedgectl-", suffix=".bt")
            with os.fdopen(fd, "w") as f:
                f.write(self.program)
            self._tmp = Path(name)
            path = shutil.which("bpftrace") or "bpftrace"
            cmd, env = [path, "-f", "json", name], bpftrace_env(self.max_entries)
        else:
            self.program = bcc_program(probes, self.pids, self.max_entries, min_wait_s=self.min_wait_s)
            spec = {"text": self.program, "max_s": self.max_s, "libs": self.libs,
                    "maps": [n for p in probes for n in load_probe(p).MAPS],
                    "uprobes": [list(u) for p in probes for u in getattr(load_probe(p), "BCC_UPROBES", ())]}
            fd, name = tempfile.mkstemp(prefix="wedgectl-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f)
            self._tmp = Path(name)
            cmd, env = [sys.executable, "-P", "-m", "wedgectl.collect.ebpfbcc", name], bcc_env(bcc_python_path())
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
        # the window's first edge: read again now that the program is attached (compiling took a while)
        states, _ = procfs.read_thread_scheds(self.pids, self.proc_root)
        if states:
            self._start_states = states
        # read at start-up: remove it now, so nothing is left behind even if stop() never runs
        with contextlib.suppress(OSError):
            self._tmp.unlink()
        self._tmp = None

    def _launch_raw(self) -> None:
        """The rawtp back-end: the program loaded and attached in this process, threads already in a
        futex wait seeded (their waits are carried), and a timer that detaches it at max_s, as the
        other back-ends' programs end themselves."""
        from wedgectl.collect import ebpfraw

        seeds = {tid: (st.futex_addr or 0, st.oncpu_ns or 0) for tid, st in self._start_states.items()
                 if st.in_futex_wait and procfs.is_futex_wait_op(st.thread.futex_op)}
        self._raw = ebpfraw.SchedProbe(self.pids, self.probes, int(round(self.min_wait_s * 1e9)), seeds,
                                       tids=self._start_states)
        try:
            self.program = self._raw.describe()
            self._raw_timer = threading.Timer(self.max_s, self._raw.detach)
            self._raw_timer.daemon = True
            self._raw_timer.start()
        except BaseException:
            self._raw.close()
            self._raw = None
            raise
        self._begin = self._ready_at = self._raw.t_begin / 1e9
        states, _ = procfs.read_thread_scheds(self.pids, self.proc_root)
        if states:
            self._start_states = states

    def _abort(self) -> None:
        """Detach after Ctrl-C mid-attach: as _teardown, but a second Ctrl-C kills the child at once.
        Nothing of the program's output is kept (it never reported a window)."""
        try:
            self._teardown()
        except KeyboardInterrupt:
            if self._proc is not None:
                with contextlib.suppress(OSError):
                    signal_child(self._proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
                    self._proc.wait(timeout=5)
            with contextlib.suppress(KeyboardInterrupt):
                self._teardown(grace=0.0)
        self._proc = None

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
            return stderr_summary(self._stderr.read())
        return ""

    def _teardown(self, grace: float | None = None) -> bool:
        """Detach: SIGINT (bpftrace and the bcc runner print their maps and exit), SIGKILL after grace. True if
        clean."""
        grace = STOP_TIMEOUT_S if grace is None else grace
        clean = True
        if self._raw is not None:
            if self._raw_timer is not None:
                self._raw_timer.cancel()
            self._raw.detach()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # SIGINT again each second: one that lands between bpftrace's check of its exit flag
            # and its epoll_wait is lost (seen on a loaded host: bpftrace sat in epoll_wait for
            # the whole grace); the next one interrupts the wait.
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    signal_child(proc, signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if proc.poll() is None:
                clean = False
                with contextlib.suppress(OSError):
                    signal_child(proc, signal.SIGKILL)
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
    def stop(self) -> tuple[tuple[ProbeRecord, ...], tuple[CollectorFailure, ...]]:
        """Detach, read /proc once more and return (the ProbeResult, then a ThreadProbe per thread; failures).

        Idempotent.
        """
        if self._stopped is not None:
            return self._stopped
        maps: Maps = {}
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
        elif self._raw is not None:
            self._teardown()
            end = (self._raw.t_end or time.monotonic_ns()) / 1e9
        end_states, fails = procfs.read_thread_scheds(self.pids, self.proc_root)
        end_read_at = time.monotonic()
        if (raw := self._raw) is not None:
            try:
                ends = {tid: (st.futex_addr if st.in_futex_wait else None,
                              st.oncpu_ns) for tid, st in end_states.items()}
                maps = raw.read(ends)
            except OSError as exc:
                self._fall_back(f"rawtp's counts could not be read: {exc}")
                self._begin, maps = self._ready_at or self._begin, {}
            finally:
                raw.close()
            if lost := maps.get("slot_lost"):
                self.failures.append(CollectorFailure(
                    COLLECTOR, FailureKind.ERROR, f"rawtp: {len(lost)} threads found their map slot held by "
                    f"another thread; their waits are unknown: {', '.join(map(str, lost[:8]))}"))
        self.failures += [f for f in fails if f.kind is not FailureKind.GONE or not end_states]
        if self._stderr is not None:
            with contextlib.suppress(OSError):
                self._stderr.close()
        offsets = procfs.sched_clock_offsets({s.cpu for s in end_states.values() if s.cpu is not None},
                                             self.proc_root) \
            if self.proc_root == PROC else {}
        w = Window(begin=self._begin, end=end, start_states=self._start_states, end_states=end_states,
                   end_read_at=end_read_at, offsets=offsets, wall_offset=time.time() - time.monotonic(),
                   min_wait_s=self.min_wait_s)
        threads = combine(self.backend.name, self.probes, maps, w)
        skipped = [ProbeSkip(s.name, s.reason) for s in self.statuses
                   if not s.available and BACKENDS.index(s.name) < BACKENDS.index(self.backend.name)]
        ran = self.probes if self.backend.name != "procfs" else ()
        header = ProbeResult(
            backend=self.backend.name,
            reason=self.backend.reason + (f"; waits under {self.min_wait_s * 1000:g} ms not recorded" if ran else ""),
            skipped=(*skipped, *self.fallback_from),
            probes=tuple(ran),
            pids=tuple(self.pids),
            window_s=round(w.seconds, 4),
            started=round(self._begin + w.wall_offset, 3),
            ended=round(end + w.wall_offset, 3),
            wakes=load_probe("futexwait").wake_table(maps),
            maps_full=full_maps(maps, self.max_entries),
            clock_offsets_s={str(k): round(v, 6) for k, v in sorted(offsets.items())},
            overhead={p: load_probe(p).OVERHEAD for p in ran},
        )
        self._stopped = ((header, *threads), tuple(self.failures))
        return self._stopped

    def wait(self, seconds: float) -> None:
        """Until the window of `seconds` is over: the program exits by itself then (bounded by STOP_TIMEOUT_S more)."""
        if self._proc is None or self._proc.poll() is not None:  # rawtp too: its timer detaches it
            time.sleep(max(0.0, seconds - (time.monotonic() - self._begin)))
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.0, seconds - (time.monotonic() - self._begin)) + STOP_TIMEOUT_S)

    def __enter__(self) -> ProbeRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_probes(pids: Sequence[int], mode: ProbeMode | str = "auto", *, probes: Sequence[str] = DEFAULT_PROBES,
                 backend: ProbeBackend | str = "auto", max_s: float = 60.0, host: Host = Host(),
                 disable: Iterable[str] | None = None, proc_root: Path = PROC,
                 max_entries: int = MAX_ENTRIES, min_wait_s: float = MIN_WAIT_S) -> ProbeRun | None:
    """Detect, pick and start a back-end on the pids; None when mode is "off".

    mode "auto": the best back-end, down to /proc. mode "on": the same data,
    and a MISSING_TOOL failure when no eBPF back-end can run. backend forces
    one ("bcc", "bpftrace", "procfs"): the others count as disabled.
    """
    mode, backend = ProbeMode(mode).value, ProbeBackend(backend).value
    if mode == "off":
        return None
    try:
        return _start_probes(pids, mode, probes, backend, max_s, host, disable, proc_root, max_entries, min_wait_s)
    except Exception as exc:  # noqa: BLE001 - a collector never raises: report, fall back to /proc
        run = ProbeRun(pids, probes, backend=BackendStatus("procfs", True, f"probe start failed: {exc!r}"),
                       max_s=max_s, mode=mode, proc_root=proc_root)
        run.failures.append(CollectorFailure(COLLECTOR, FailureKind.ERROR, f"probe start failed: {exc!r}"))
        return run.start()


def _start_probes(pids: Sequence[int], mode: str, probes: Sequence[str], backend: str, max_s: float, host: Host,
                  disable: Iterable[str] | None, proc_root: Path, max_entries: int,
                  min_wait_s: float = MIN_WAIT_S) -> ProbeRun:
    off = set(disabled_backends(disable))
    if backend != "auto":
        off |= set(BACKENDS) - {backend}
    statuses = detect_backends(probes, host, disable=off, proc_root=proc_root)
    chosen = choose_backend(statuses)
    if chosen is None:
        chosen = BackendStatus("procfs", True, "every back-end is disabled; /proc read anyway")
    run = ProbeRun(pids, probes, backend=chosen, statuses=statuses, max_s=max_s, mode=mode, proc_root=proc_root,
                   max_entries=max_entries, min_wait_s=min_wait_s)
    if mode == "on" and chosen.name not in EBPF_BACKENDS:
        why = "; ".join(f"{s.name}: {s.reason}" for s in statuses if s.name in EBPF_BACKENDS)
        run.failures.append(CollectorFailure(COLLECTOR, FailureKind.MISSING_TOOL,
                                             f"--ebpf on but no eBPF back-end can run: {why}"))
    return run.start()


def run_probes(pids: Sequence[int], seconds: float, mode: ProbeMode | str = "auto", *,
               progress: Callable[[str], None] | None = None, **kw: Any
               ) -> tuple[tuple[ProbeRecord, ...], tuple[CollectorFailure, ...]]:
    """Start the probes, wait `seconds`, stop: (ProbeResult + ThreadProbes, failures).

    Ctrl-C ends the window early and the results still come back, also while the program is
    still attaching (then they are /proc's, and a failure says so). progress hears when the
    window begins.
    """
    run = start_probes(pids, mode, max_s=seconds, **kw)  # the program's own timer ends the window
    if run is None:
        return (), ()
    try:
        if not run.interrupted:  # Ctrl-C during the attach has ended the window already
            if progress is not None:
                progress(f"tracing {len(run.pids)} processes with {run.backend.name} for {seconds:g} s "
                         f"(Ctrl-C ends the window early)")
            run.wait(seconds)
    except KeyboardInterrupt:
        pass  # as bcc's tools do: Ctrl-C ends the window early and the results still print
    finally:
        result = run.stop()
    return result


