"""What `wedgectl top` shows, derived from a window of Samples: pure functions, no I/O, no Textual.

A `Frame` is one refresh's worth of screen content (verdict, counter series,
process and thread rows, stacks). It is built off the UI thread and handed to
the app whole, so the UI thread only lays it out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from wedgectl.read import stacks as stk
from wedgectl.classify import classify
from wedgectl.collect.processes import is_mp_helper
from wedgectl.classify.judged import judged_sample, lean_metrics_text  # noqa: F401 - lean_metrics_text re-exported
from wedgectl.read.metrics import MetricsParseError, MetricsSnapshot, parse_metrics
from wedgectl.read.redact import redact_url
from wedgectl.model.types import Bundle, Manifest, ProcessSample, Role, Sample, StackDump, Verdict

# x86_64 numbers of the syscalls a blocked vLLM thread is usually in (/proc/TID/syscall nr).
SYSCALL_NAMES = {
    0: "read", 1: "write", 7: "poll", 23: "select", 35: "nanosleep", 45: "recvfrom", 47: "recvmsg",
    61: "wait4", 202: "futex", 219: "restart_syscall", 230: "clock_nanosleep", 232: "epoll_wait",
    270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 441: "epoll_pwait2",
}
ROLE_ORDER = {Role.API_SERVER: 0, Role.ENGINE_CORE: 1, Role.WORKER: 2, Role.OTHER: 3}


@dataclass(frozen=True)
class ScrapedSample:
    """A Sample as captured, the lean copy the verdict is computed from, and its metrics parsed once."""

    sample: Sample
    judged: Sample
    metrics: MetricsSnapshot | None

    @classmethod
    def of(cls, sample: Sample) -> ScrapedSample:
        snap = None
        judged = judged_sample(sample)  # the classifier re-reads the window each refresh: lean copies parse 4x faster
        if judged.metrics is not None and judged.metrics.ok:
            try:
                snap = parse_metrics(judged.metrics.text or "")
            except MetricsParseError:
                snap = None
        return cls(sample, judged, snap)


@dataclass(frozen=True)
class CounterRow:
    """One line of the counters panel: a series for the sparkline and the latest value."""

    key: str
    label: str
    values: tuple[float, ...]
    current: str
    top: float = 1.0  # the sparkline's scale reaches at least this (KV: 100 %), so noise stays flat


@dataclass(frozen=True)
class ProcessRow:
    pid: int
    role: str
    name: str
    state: str
    cpu_pct: float | None
    threads: int
    rss_mb: float | None
    rank: str = ""  # a Worker's parallel rank from its vLLM title ("TP1", "PP0_TP1")
    helper: bool = False  # multiprocessing's resource tracker (or forkserver): never stack-dumped


@dataclass(frozen=True)
class ThreadRow:
    tid: int
    comm: str
    state: str
    cpu_pct: float | None
    wchan: str
    syscall: str
    futex: str  # hex address, or ""
    sharing: int  # threads of this process waiting on the same futex (this one included); 0 if none


@dataclass(frozen=True, eq=False)
class Frame:
    """Everything one refresh puts on screen. eq=False: a new frame is always news."""

    target: str
    verdict: Verdict
    counters: tuple[CounterRow, ...]
    processes: tuple[ProcessRow, ...]
    threads: Mapping[int, tuple[ThreadRow, ...]]  # made per process when looked up (ThreadRows)
    stacks: dict[int, tuple[StackDump, ...]]  # every dump of each pid in the window, oldest first
    reachable: bool
    status: str
    sample_t: float | None
    n_samples: int
    main_tids: dict[int, int] = field(default_factory=dict)  # pid -> the thread to select first


def _rates(points: Sequence[tuple[float, float]]) -> tuple[float, ...]:
    """Per-second change between consecutive points; a counter reset counts as 0."""
    out = []
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        out.append(max(0.0, (v1 - v0) / (t1 - t0)) if t1 > t0 else 0.0)
    return tuple(out)


def _deltas(points: Sequence[tuple[float, float]]) -> tuple[float, ...]:
    return tuple(max(0.0, v1 - v0) for (_, v0), (_, v1) in zip(points, points[1:]))


def _points(window: Sequence[ScrapedSample],
            get: Callable[[MetricsSnapshot], float | None]) -> list[tuple[float, float]]:
    out = []
    for s in window:
        if s.metrics is None:
            continue
        v = get(s.metrics)
        if v is not None:
            out.append((s.sample.metrics.t if s.sample.metrics else s.sample.t, v))
    return out


def _num(v: float | None, fmt: str = "{:.0f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def counter_rows(window: Sequence[ScrapedSample]) -> tuple[CounterRow, ...]:
    """The counters panel: gauges as sampled, counters as rates between samples."""
    rows: list[CounterRow] = []

    def gauge(key: str, label: str, get: Callable[[MetricsSnapshot], float | None], fmt: str = "{:.0f}",
              scale: float = 1.0, top: float = 1.0) -> None:
        pts = _points(window, get)
        vals = tuple(v * scale for _, v in pts)
        rows.append(CounterRow(key, label, vals, _num(vals[-1] if vals else None, fmt), top))

    gauge("running", "running", lambda m: m.running)
    gauge("waiting", "waiting", lambda m: m.waiting)
    gauge("waiting_capacity", " for capacity", lambda m: m.waiting_capacity)
    gauge("waiting_deferred", " deferred", lambda m: m.waiting_deferred)
    gauge("kv", "KV cache %", lambda m: m.kv_usage, "{:.1f}", 100.0, 100.0)

    gen = _points(window, lambda m: m.generation_tokens)
    gen_rates = _rates(gen)
    rows.append(CounterRow("gen_tps", "gen tokens/s", gen_rates, _num(gen_rates[-1] if gen_rates else None, "{:.1f}")))

    pre = _points(window, lambda m: m.preemptions)
    pre_d = _deltas(pre)
    total = f" ({pre[-1][1]:.0f} total)" if pre else ""
    rows.append(CounterRow("preemptions", "preemptions", pre_d,
                           (_num(pre_d[-1] if pre_d else None, "+{:.0f}") + total).strip()))

    if any(s.metrics is not None and s.metrics.has_heartbeat for s in window):
        steps = _rates(_points(window, lambda m: m.heartbeat_steps))
        model = _rates(_points(window, lambda m: m.heartbeat_model_steps))
        age = tuple(v for _, v in _points(window, lambda m: m.heartbeat_model_step_age))
        rows.append(CounterRow("hb_steps", "engine steps/s", steps, _num(steps[-1] if steps else None, "{:.1f}")))
        rows.append(CounterRow("hb_model_steps", "model steps/s", model, _num(model[-1] if model else None, "{:.1f}")))
        rows.append(CounterRow("hb_age", "last model step", age, _num(age[-1] if age else None, "{:.1f} s ago")))
    else:
        rows.append(CounterRow("hb_steps", "engine heartbeat", (), "n/a (stock engine)"))
    return tuple(rows)


SPARK_BARS = "▁▂▃▄▅▆▇█"
# The samples a frame's counters are read from: the counters panel is 58 cells wide (top.tcss),
# so a sparkline has at most 20 bars, and a rate one sample more. The window holds 60 (a saved
# bundle gets them all); reading each counter out of all of them every refresh was a third of
# building a frame.
SPARK_SAMPLES = 32


def spark_text(values: Sequence[float], width: int, top: float = 1.0) -> str:
    """One bar per value, newest at the right, scaled 0..max(values, top); blank where there is no data yet."""
    if width <= 0:
        return ""
    vals = list(values)[-width:]
    hi = max([top, *vals]) or 1.0
    bars = "".join(SPARK_BARS[min(len(SPARK_BARS) - 1, max(0, round(v / hi * (len(SPARK_BARS) - 1))))] for v in vals)
    return bars.rjust(width)


def _cpu_pct(now: tuple[float, float] | None, before: tuple[float, float] | None) -> float | None:
    """Percent of one core between two (time, cumulative cpu seconds) readings."""
    if now is None or before is None or now[0] <= before[0]:
        return None
    return max(0.0, 100.0 * (now[1] - before[1]) / (now[0] - before[0]))


def _previous_processes(window: Sequence[ScrapedSample]) -> tuple[float, tuple[ProcessSample, ...]] | None:
    """The sample before the last one that saw processes (CPU % is a rate between the two)."""
    seen = 0
    for s in reversed(window):
        if s.sample.processes:
            seen += 1
            if seen == 2:
                return s.sample.t, s.sample.processes
    return None


class ThreadRows(Mapping[int, tuple[ThreadRow, ...]]):
    """pid -> its thread rows, each process's made when first looked up. The view shows one
    process's threads; making every process's each refresh (a Worker's dozens) was half of
    build_frame, for rows nobody looks at unless the selection moves to them."""

    def __init__(self, procs: Sequence[tuple[ProcessSample, ProcessSample | None]], t: float,
                 prev_t: float | None) -> None:
        self._procs = {p.pid: (p, before) for p, before in procs}
        self._t, self._prev_t = t, prev_t
        self._made: dict[int, tuple[ThreadRow, ...]] = {}

    def __getitem__(self, pid: int) -> tuple[ThreadRow, ...]:
        rows = self._made.get(pid)
        if rows is None:
            p, before = self._procs[pid]  # KeyError for a pid not in the sample, as a dict's
            rows = self._made[pid] = thread_rows(p, before, self._t, self._prev_t)
        return rows

    def __iter__(self) -> Iterator[int]:
        return iter(self._procs)

    def __len__(self) -> int:
        return len(self._procs)


def process_rows(window: Sequence[ScrapedSample]) -> tuple[tuple[ProcessRow, ...], Mapping[int, tuple[ThreadRow, ...]]]:
    last = next((s.sample for s in reversed(window) if s.sample.processes), None)
    if last is None:
        return (), {}
    prev = _previous_processes(window)
    prev_procs = {p.pid: p for p in prev[1]} if prev else {}
    prev_t = prev[0] if prev else None
    rows, procs = [], []
    for p in sorted(last.processes, key=lambda p: (ROLE_ORDER.get(p.role, 9), p.pid)):
        before = prev_procs.get(p.pid)
        cpu = _cpu_pct((last.t, p.cpu_s), (prev_t, before.cpu_s) if before and prev_t is not None else None)
        rows.append(ProcessRow(p.pid, p.role.value, p.name, p.state, cpu, p.num_threads,
                               None if p.rss_bytes is None else p.rss_bytes / 1e6,
                               "_".join(f"{k}{v}" for k, v in p.parallel_rank.items()), is_mp_helper(p.cmdline)))
        procs.append((p, before))
    return tuple(rows), ThreadRows(procs, last.t, prev_t)


def thread_rows(p: ProcessSample, before: ProcessSample | None, t: float, prev_t: float | None) -> tuple[ThreadRow,
                                                                                                         ...]:
    """One row per thread; threads that wait on the same futex address share a lock or condition."""
    waiters = p.futex_waiters
    prev = {th.tid: th for th in before.threads} if before else {}
    rows = []
    for th in p.threads:
        b = prev.get(th.tid)
        cpu = _cpu_pct((t, th.cpu_s), (prev_t, b.cpu_s) if b is not None and prev_t is not None else None)
        if th.syscall_nr is None:
            syscall = "-"
        else:
            syscall = SYSCALL_NAMES.get(th.syscall_nr, f"nr {th.syscall_nr}")
        futex = f"{th.futex_addr:#x}" if th.futex_addr is not None else ""
        rows.append(ThreadRow(th.tid, th.comm, th.state, cpu, th.wchan or "-", syscall, futex,
                              waiters.sharing(th.futex_addr)))
    return tuple(rows)


def window_stacks(window: Sequence[ScrapedSample]) -> dict[int, tuple[StackDump, ...]]:
    """Every stack dump of each pid in the window, oldest first."""
    out: dict[int, list[StackDump]] = {}
    for s in window:
        for d in s.sample.stacks:
            out.setdefault(d.pid, []).append(d)
    return {pid: tuple(ds) for pid, ds in out.items()}


def main_tids(stacks: dict[int, tuple[StackDump, ...]]) -> dict[int, int]:
    """The thread worth looking at first in each process: the engine's busy loop, else MainThread."""
    out = {}
    for pid, dumps in stacks.items():
        good = [d for d in dumps if d.error is None and d.threads]
        t = stk.engine_main_thread(good[-1]) if good else None
        if t is not None and isinstance(t.get("os_thread_id"), int):
            out[pid] = t["os_thread_id"]
    return out


def _thread_of(dump: StackDump, tid: int | None) -> dict | None:
    return next((t for t in dump.threads if t.get("os_thread_id") == tid), None)


def pick_dump(dumps: Sequence[StackDump], tid: int | None) -> StackDump | None:
    """The newest dump that caught the thread in Python code. A --nonblocking read sometimes
    catches a thread between frames (no frames, or a failed dump); an older good one says more."""
    for d in reversed(dumps):
        t = _thread_of(d, tid) if d.error is None else None
        if t is not None and t.get("frames"):
            return d
    pool = [d for d in dumps if d.error is None] or list(dumps)
    return pool[-1] if pool else None


def reachability(sample: Sample | None, has_pid: bool) -> tuple[bool, str]:
    """Whether the last sample reached the target (its processes and its /metrics), and what failed."""
    if sample is None:
        return False, "no sample yet"
    problems = []
    if has_pid and not sample.processes:
        problems.append("the deployment's processes are gone")
    if sample.metrics is not None and not sample.metrics.ok:
        problems.append(f"/metrics: {sample.metrics.error or f'HTTP {sample.metrics.status}'}")
    elif sample.metrics is None and not has_pid:
        problems.append("no metrics URL")
    elif sample.metrics is None and sample.processes:
        problems.append("the API server is not listening (no /metrics)")
    return not problems, "; ".join(problems)


def build_frame(
    manifest: Manifest,
    window: Sequence[ScrapedSample],
    log_lines: Sequence[str] = (),
    classify_last: int | None = None,
    target: str = "",
    verdict: Verdict | None = None,
    live: bool = True,
) -> Frame:
    """One refresh: classify the (last `classify_last`) samples plus the log, and lay out the rest."""
    samples = tuple(s.sample for s in window)
    if verdict is None:
        judged = tuple(s.judged for s in window)
        judged = judged[-classify_last:] if classify_last else judged
        verdict = classify(Bundle(manifest, judged, tuple(log_lines)))
    procs, threads = process_rows(window)
    stacks = window_stacks(window)
    last = samples[-1] if samples else None
    reachable, problem = reachability(last, manifest.target.pid is not None or bool(manifest.target.pids))
    if last is None:
        status = "waiting for the first sample"
    else:
        age = max(0.0, time.time() - last.t) if live else None
        when = time.strftime("%H:%M:%S", time.localtime(last.t))
        status = f"{len(samples)} samples, last at {when}"
        if age is not None and age > 1:
            status += f" ({age:.0f} s ago)"
        if problem:
            status = f"UNREACHABLE: {problem} | {status}"
    return Frame(
        target=target or describe_target(manifest),
        verdict=verdict,
        counters=counter_rows(window[-SPARK_SAMPLES:]),
        processes=procs,
        threads=threads,
        stacks=stacks,
        reachable=reachable,
        status=status,
        sample_t=last.t if last else None,
        n_samples=len(samples),
        main_tids=main_tids(stacks),
    )


def describe_target(manifest: Manifest) -> str:
    t = manifest.target
    parts = []
    if t.pid is not None:
        parts.append(f"pid {t.pid}")
    if t.url:
        parts.append(redact_url(t.url) or "")  # a bundle from an older writer may hold user:password
    return " ".join(parts) or "(no target)"


AGE_STEP_S = 5  # a stack dump's age is shown in these steps


def stack_lines(dumps: Sequence[StackDump] | StackDump | None, tid: int | None, now: float | None = None,
                helper: bool = False) -> list[str]:
    """The selected thread's Python stack, innermost first, with what dump it comes from.
    `helper`: the process is multiprocessing's own helper, which no dump covers."""
    if isinstance(dumps, StackDump):
        dumps = (dumps,)
    dump = pick_dump(dumps or (), tid)
    if dump is None:
        if helper:
            return ["multiprocessing's helper process (the resource tracker): it runs none of the server's code,",
                    "so no stack dump covers it"]
        return ["no stack dump yet: press d (Python) or D (native, pauses the target while it unwinds)"]
    when = time.strftime("%H:%M:%S", time.localtime(dump.t))
    # The age in AGE_STEP_S steps: a line that changed every second redrew the whole stack view
    # every refresh (its time of day is exact).
    age = (f", {(now - dump.t) // AGE_STEP_S * AGE_STEP_S:.0f} s ago"
           if now is not None and now - dump.t >= AGE_STEP_S else "")
    head = f"py-spy{' --native' if dump.native else ''} dump of pid {dump.pid} at {when}{age}"
    if dump.error is not None:
        return [head, f"failed: {dump.error}"]
    thread = _thread_of(dump, tid)
    if thread is None:
        return [head, f"thread {tid} runs no Python code (not in the dump)"]
    flags = [f for f, on in (("active", thread.get("active")), ("holds the GIL", thread.get("owns_gil"))) if on]
    name = thread.get("thread_name") or "?"
    lines = [f"{head}: thread {tid} {name!r}" + (f" ({', '.join(flags)})" if flags else "")]
    lines += [f"  {f}" for f in stk.frame_names(thread)] or ["  (no frames: caught between frames; press d)"]
    return lines
