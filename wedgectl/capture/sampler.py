"""Live capture: samples of metrics, processes, threads and stacks over a window, into a Bundle.

The sampler feeds the same `classify` as a saved bundle (one code path for
live and recorded evidence). It takes the cheapest decisive evidence first and
asks the classifier after every sample, stopping once the verdict is certain;
the escalation order is in docs/design.md ("How a capture escalates").
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

from wedgectl.classify import Facts, classify, classify_facts
from wedgectl.classify.facts import MIN_FROZEN_S, stepless_of
from wedgectl.collect import processes, procfs, pyspy
from wedgectl.collect.scrape import Scraper, failure_kind
from wedgectl.capture.discover import (BUNDLE_LOG_BYTES, VERDICT_LOG_BYTES, Deployment, deployment_manifest, discover,
                                       tree_roles)
from wedgectl.model.errors import BadMetrics, NoSuchProcess, Unreachable, WedgectlError
from wedgectl.classify.judged import judged_sample
from wedgectl.read.metrics import MetricsParseError, parse_metrics
from wedgectl.read.redact import redact_url
from wedgectl.store.sources import LogSource, read_log_lines, steal_facts
from wedgectl.model.types import (
    Bundle,
    CollectorFailure,
    FailureKind,
    MetricsScrape,
    ProcessSample,
    Role,
    Sample,
    StackDump,
    Verdict,
    VerdictKind,
)

CERTAIN = 0.9
EXITED_NOTE = "the deployment exited mid-capture"
BURST_GAP_S = 0.03
DUMP_TIMEOUT_S = 5.0  # pyspy.dump_stacks' own timeout for one non-native dump
ESCALATE_BURST = 3  # dumps of the EngineCore and each Worker once the cheap evidence leaves a hang open
# Verdicts whose certainty can rest on how long a main thread sat parked: what the probes measure.
PARKED_CLASSES = frozenset({VerdictKind.ENGINE_DEADLOCK, VerdictKind.COLLECTIVE_HANG})
# Verdicts whose evidence reads the engine's stack burst (where its loop spends its time, whether a
# rank's frame stays put): one the window ends on uncertain, before its burst, gets the burst then.
BURST_CLASSES = frozenset({VerdictKind.ADMISSION_WEDGE, *PARKED_CLASSES})
PROBE_MIN_S = 2.0  # attach the probes only with at least this much window left: they need a window to see waits
QUICK_LOOK_S = 0.3  # a serving engine steps every few ms: its counters move many times in this
# below a default-priority server in our scheduling group (CFS weight 335 against 1024; docs/design.md) while still
# getting a share on a saturated host
NICE = 5


@dataclass(frozen=True)
class SamplerOptions:
    window_s: float = 6.0  # the longest a capture runs when no verdict becomes certain
    interval_s: float = 1.0
    min_window_s: float = 0.0  # stop no sooner (the classifier's thresholds decide when evidence is enough)
    stacks: bool = True
    native: bool = False
    ebpf: str = "off"
    # A saturated API server answers /metrics in seconds: a scrape has this long, and the
    # sampling clock does not wait for it (the next sample starts on time; see _capture).
    scrape_timeout_s: float = 4.0
    stack_burst: int = ESCALATE_BURST  # dumps of each engine process once a hang is open
    progress: Callable[[str], None] | None = None


def lower_priority(nice: int = NICE) -> list[str]:
    """Run below the server we look at: nice +`nice` and the idle I/O class (py-spy and bpftrace
    inherit both). What could not be lowered is returned, not raised. The capture gives the nice
    back if the kernel then keeps wedgectl off a CPU too long (restore_priority_if_starved)."""
    global _lowered
    problems = []
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.nice(nice)
        _lowered = (before, procfs.own_run_delay_s())
    except OSError as exc:
        problems.append(f"nice: {exc.strerror or exc}")
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is None:
        return problems + ["ioprio: no syscall number for this machine"]
    import ctypes  # only here: its import costs more than the syscall

    libc = ctypes.CDLL(None, use_errno=True)
    # ioprio_set(IOPRIO_WHO_PROCESS, 0 = this process, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)
    if libc.syscall(nr, 1, 0, 3 << 13) != 0:
        problems.append(f"ioprio: {os.strerror(ctypes.get_errno())}")
    return problems


_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30, "ppc64le": 273, "s390x": 282, "riscv64": 30}

# A verdict needs about 0.3 s of wedgectl's CPU. Niced, it can wait far longer than that for a CPU:
# next to a serving vLLM engine (its threads poll their queues, yielding the CPU and taking it back)
# a nice +5 diagnose was measured waiting 9 s of a 10 s run. Once this much waiting has
# piled up, the capture returns to the priority it started at: the server then gives up at most
# those 0.3 s, and the operator gets the verdict.
STARVED_S = 1.0
_lowered: tuple[int, float | None] | None = None  # (the nice before lower_priority, the run delay then)


def restore_priority_if_starved(limit_s: float = STARVED_S) -> str | None:
    """After lower_priority: when the calling (main) thread has waited more than `limit_s` for a CPU
    since, give the nice back (threads and py-spy started later inherit it). What was done, or None."""
    if _lowered is None:
        return None
    before, delay0 = _lowered
    now = procfs.own_run_delay_s()
    if delay0 is None or now is None or now - delay0 <= limit_s:
        return None
    error = restore_priority()
    if error:
        return f"waited {now - delay0:.1f} s for a CPU at low priority; could not return to nice {before}: {error}"
    return f"waited {now - delay0:.1f} s for a CPU at low priority: back at nice {before} for the rest of the capture"


URGENT_NICE = -10  # --urgent: CFS weight 9548 against the server's 1024


def raise_priority(nice: int = URGENT_NICE) -> str:
    """--urgent: rank this capture above the server, to answer fast on a saturated host. It takes
    its ~0.3 CPU s from the server at once instead of waiting for a share. Where autogroup applies
    (procfs.autogroup_applies), the kernel shares the CPUs between sessions and a task's nice
    ranks it only inside its own: the capture goes on in a session of its own
    (control.detach_into_own_session) whose autogroup gets the nice; the operator's session is
    left as it was. Elsewhere (the process in a cgroup: a container, a systemd unit) the task nice
    ranks it against the server when both share the cgroup, and against nothing outside it.
    Says what was done, or why it could not be (then the capture runs at the priority it had)."""
    if procfs.autogroup_applies():
        from wedgectl.collect.control import detach_into_own_session

        detach_into_own_session()
        error = procfs.set_own_autogroup_nice(nice)
        if error:
            return f"--urgent: not raised ({error}); sampling at the priority it started with"
        return f"--urgent: sampling in a session of its own, autogroup nice {nice}"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        return f"--urgent: not raised (nice {nice}: {exc.strerror or exc}); sampling at the priority it started with"
    return f"--urgent: sampling at nice {nice} (this ranks it above the server only in the server's cgroup)"


def restore_priority() -> str | None:
    """Undo lower_priority's nice (the I/O class stays idle); why it could not be, or None."""
    global _lowered
    if _lowered is None:
        return None
    before, _lowered = _lowered[0], None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


class TreeCache:
    """A deployment's processes and their roles, looked at again every `ttl_s` seconds, or at once
    when one of them has gone (exited, or its pid now another process's).

    A walk lists every process on the host (to find children) and reads each one's stat and the
    deployment's cmdlines: on a host with a thousand processes, a thousand reads for an answer
    that changes when a process of the deployment starts or exits. An exit is seen at every
    refresh (each member's start time, `_intact`); a start, at a look every `ttl_s`: the host's
    pid list, and the parent of each process new to it since the last look, a read each. Only
    a new process of the deployment (its parent a member, or a new member) means a walk; and a
    walk every `full_every_s` whatever the looks saw, for a pid reused between two looks. A
    member whose role was `other` (a process before its title was set) is asked again at each
    look. `top`, sampling every second for hours, keeps one; a diagnose capture walks at every
    sample (its samples are few, and a start-up adds processes between them). It also holds
    top's ThreadMemo (a thread that has not run since the last refresh is not read again) and
    the engine's and workers' ports and devices, read again at each look."""

    def __init__(self, ttl_s: float = 5.0, full_every_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self.full_every_s = full_every_s
        self._root: int | None = None
        self._roles: dict[int, Role] = {}
        self._starts: dict[int, int | None] = {}
        self._host: set[int] = set()  # the host's pids at the last walk or look
        self._at = float("-inf")  # the last walk or look
        self._walked_at = float("-inf")
        self.walks = 0
        self.looks = 0
        self.threads = procfs.ThreadMemo()  # and each thread's last sample, for one that has not run since
        self.fds: processes.FdsMemo = {}  # see sample_roles

    def roles(self, root_pid: int) -> dict[int, Role]:
        now = time.monotonic()
        if root_pid != self._root or now - self._walked_at >= self.full_every_s or not self._intact():
            self._walk(root_pid, now)
        elif now - self._at >= self.ttl_s:
            host = self._host_pids()
            if host is None or self._joined(host - self._host):
                self._walk(root_pid, now, host)
            else:
                self._host, self._at = host, now
                self.fds.clear()  # ports, clients and devices: read again, as at a walk
                self._ask_others_again()
                self.looks += 1
        return dict(self._roles)

    def _walk(self, root_pid: int, now: float, host: set[int] | None = None) -> None:
        # the host's pids read before the walk (the look's, where a look led to it): a process
        # started during it is new at the next look
        self._host = host if host is not None else self._host_pids() or set()
        self._roles = tree_roles(root_pid)
        self.fds.clear()
        self._starts = {pid: _start_ticks(pid) for pid in self._roles}
        self._root, self._at, self._walked_at = root_pid, now, now
        self.walks += 1

    def _host_pids(self) -> set[int] | None:
        try:
            return {int(name) for name in os.listdir(procfs.PROC) if name.isdigit()}
        except OSError:
            return None  # cannot tell: walk

    def _joined(self, new: set[int]) -> bool:
        """Whether a process new to the host is a child of the deployment's (a grandchild is
        seen through its parent, new too; one whose parent has exited is not the tree's, to the
        walk either)."""
        members = set(self._roles)
        for pid in new:
            stat, _ = procfs.read_process_stat(pid)
            if stat is not None and stat.ppid in members:
                return True
        return False

    def _ask_others_again(self) -> None:
        for pid, role in list(self._roles.items()):
            if role is not Role.OTHER:
                continue
            now = processes.role_of_pid(pid)
            if now is not None:  # gone: _intact sees it at the next refresh
                self._roles[pid] = now

    def _intact(self) -> bool:
        return all(_start_ticks(pid) == start for pid, start in self._starts.items())


def _start_ticks(pid: int) -> int | None:
    """The process's start time; None once it has exited (a zombie has, too)."""
    stat, _ = procfs.read_process_stat(pid)
    return None if stat is None or stat.state in ("Z", "X") else stat.starttime_ticks


def _collect_processes(dep: Deployment, tree: TreeCache | None = None) -> tuple[tuple[ProcessSample, ...],
                                                                                list[CollectorFailure]]:
    if dep.root_pid is None:
        return processes.sample_roles({})
    if tree is None:
        return processes.sample_roles(tree_roles(dep.root_pid))
    return processes.sample_roles(tree.roles(dep.root_pid), tree.threads, tree.fds)


def _dump_burst(pid: int, native: bool, repeats: int) -> list[StackDump]:
    """Up to `repeats` good dumps of one pid, BURST_GAP_S apart. A non-blocking read of a busy
    process sometimes races its interpreter ("Failed to get stack traces": 6 % of the dumps of a
    vLLM Worker serving 4 streams, measured, and back to back now and then), so a failed dump
    is retried (2 x repeats + 2 attempts at most: a single dump gets four tries); failures are
    kept only if nothing succeeded."""
    good: list[StackDump] = []
    failed: list[StackDump] = []
    for attempt in range(2 * repeats + 2):
        d = pyspy.dump_stacks(pid, native=native, nonblocking=not native)
        (good if d.error is None else failed).append(d)
        if len(good) >= repeats or (d.error is not None and not d.error.startswith(("error", "bad_data"))):
            break  # done, or a failure that will not go away (permission, missing tool, gone)
        time.sleep(BURST_GAP_S)
    return good or failed[-1:]


def _collect_stacks(procs: tuple[ProcessSample, ...], native: bool, burst: int = 1,
                    others: bool = False) -> tuple[tuple[StackDump, ...], list[CollectorFailure]]:
    """One dump of every Python process; or a burst of `burst` dumps of the EngineCore and Workers
    only (a single snapshot of a loop says little about where it spends its time), with one dump
    of each other Python process too when `others` (the first sample took none). multiprocessing's
    helpers (the resource tracker) are never dumped: a py-spy run each, and nothing of the server's
    runs there."""
    targets = [p for p in procs if (p.role != Role.OTHER or "python" in p.name.lower())
               and not processes.is_mp_helper(p.cmdline)]
    if burst > 1 and not others:  # a burst asks where the engine spends its time; the first sample dumped the rest
        targets = [p for p in targets if p.role in (Role.ENGINE_CORE, Role.WORKER)] or targets
    if not targets:
        return (), []
    def run(p: ProcessSample) -> list[StackDump]:
        n = burst if p.role in (Role.ENGINE_CORE, Role.WORKER) else 1
        return _dump_burst(p.pid, native, n)
    got = _map_daemon(run, targets, workers=4, bound_s=stacks_bound_s(burst, native, len(targets)))
    late = f"{FailureKind.TIMEOUT.value}: no dump within the bound"
    dumps = tuple(d for i, p in enumerate(targets)
                  for d in got.get(i) or [StackDump(p.pid, time.time(), native, error=late)])
    failures = list({(f.collector, f.target,
                      f.message): f for d in dumps if (f := pyspy.stack_failure(d)) is not None}.values())
    return dumps, failures


def stacks_bound_s(burst: int, native: bool, n: int = 1) -> float:
    """The longest _collect_stacks may take: every py-spy attempt of a burst (_dump_burst) at its
    own timeout, for n processes on 4 threads, and a margin. Past it the dumps are abandoned."""
    attempts = 2 * max(burst, 1) + 2
    one = pyspy.NATIVE_TIMEOUT_S if native else DUMP_TIMEOUT_S
    return attempts * (one + BURST_GAP_S) * -(-max(n, 1) // 4) + 5.0


def _map_daemon(fn: Callable[[ProcessSample], list[StackDump]], items: list[ProcessSample], workers: int,
                bound_s: float) -> dict[int, list[StackDump]]:
    """fn over items on at most `workers` daemon threads, for at most bound_s: {index: result} of
    those done by then. Daemon threads, not an executor: the interpreter joins an executor's
    workers at exit, and a py-spy stuck past its timeout must not hold wedgectl's exit."""
    results: dict[int, list[StackDump]] = {}
    todo = deque(enumerate(items))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, item = todo.popleft()
            try:
                value = fn(item)
            except Exception:  # noqa: BLE001 - a collector bug: that process goes without a dump
                value = []
            with lock:
                results[i] = value

    threads = [threading.Thread(target=work, daemon=True, name="wedgectl-stacks")
               for _ in range(min(workers, len(items)))]
    for t in threads:
        t.start()
    end = time.monotonic() + bound_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    with lock:
        return dict(results)


def take_sample(dep: Deployment, with_stacks: bool, options: SamplerOptions, burst: int = 1,
                scraper: Scraper | None = None, tree: TreeCache | None = None) -> Sample:
    """One Sample; collectors run side by side so a slow one does not skew the others' clock.
    ``scraper``: the run's HTTP client (one per diagnose or top session); without one, a
    client is built for this sample."""
    if scraper is None:
        with Scraper(options.scrape_timeout_s) as own:
            return take_sample(dep, with_stacks, options, burst, own, tree)
    return _begin(dep, scraper, options, burst if with_stacks else 0, tree=tree).sample(dep)


class _Results(Future):
    """{name: result} of a sample's background jobs, once all are done; abandon() gives those done so far."""

    def __init__(self, jobs: dict[str, Callable[[], object]]) -> None:
        super().__init__()
        self.jobs = tuple(jobs)
        self.got: dict[str, object] = {}
        self.lock = threading.Lock()
        self.abandoned = False

    def abandon(self) -> dict[str, object]:
        """What has come so far; what comes later is dropped (its thread ends on its own bound)."""
        with self.lock:
            self.abandoned = True
            return dict(self.got)


def _background(jobs: dict[str, Callable[[], object]]) -> _Results:
    """Run each job in its own daemon thread; the future gives {name: result} once all are done.

    Daemon threads, not an executor: a scrape still in flight when the capture stops is
    abandoned (it ends within the scrape timeout) and must not hold the exit. The jobs are
    collectors, which never raise; a bug in one still resolves the future, with None."""
    done = _Results(jobs)

    def run(key: str, fn: Callable[[], object]) -> None:
        value = None
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - a collector bug: the sample goes on without that part
            value = None
        finally:
            with done.lock:
                if not done.abandoned:
                    done.got[key] = value
                if len(done.got) == len(jobs) and not done.done():
                    done.set_result(dict(done.got))

    if not jobs:
        done.set_result({})
    for key, fn in jobs.items():
        threading.Thread(target=run, args=(key, fn), daemon=True, name=f"wedgectl-{key}").start()
    return done


def _summarise(s: Sample) -> str:
    parts = []
    if s.metrics is not None and s.metrics.ok:
        try:
            m = parse_metrics(s.metrics.text or "")
            parts.append(f"running={m.running or 0:.0f} waiting={m.waiting or 0:.0f} "
                         f"gen_tokens={m.generation_tokens or 0:.0f}")
        except MetricsParseError:
            parts.append("metrics unparsable")
    elif s.metrics is not None:
        parts.append(f"metrics: {s.metrics.error or s.metrics.status}")
    if s.processes:
        parts.append(f"{len(s.processes)} procs")
    return ", ".join(parts) or "no data"


def _read_log(path: str | LogSource | None, max_bytes: int = BUNDLE_LOG_BYTES) -> tuple[tuple[str, ...], list[str]]:
    if not path:
        return (), []
    try:
        return read_log_lines(path, max_bytes=max_bytes)
    except WedgectlError as exc:
        return (), [f"log not read: {exc}"]


def capture(pid: int | None = None, url: str | None = None, log_path: str | os.PathLike[str] | None = None,
            options: SamplerOptions = SamplerOptions()) -> Bundle:
    """Sample the target until the verdict is certain or the window ends; the bundle (verdict not set)."""
    dep = discover(pid=pid, url=url)
    # --- eBPF probes (wedgectl/collect/ebpf.py): one bounded run, from the start with --ebpf on,
    # from the escalation step with auto; detached in the finally whatever ends the capture; the
    # results go on the last sample.
    probes = _Probes(dep, options)
    try:
        if options.ebpf == "on":
            probes.start(options.window_s)
        with Scraper(options.scrape_timeout_s) as scraper:
            bundle = _capture(dep, pid, url, log_path, options, scraper, probes)
    finally:
        probe_records, probe_failures = probes.stop()
    return _with_probes(bundle, probe_records, probe_failures)


class _Probes:
    """At most one probe run per capture, started when the escalation asks for it."""

    def __init__(self, dep: Deployment, options: SamplerOptions) -> None:
        self.dep, self.options, self.run, self.started = dep, options, None, False

    def start(self, max_s: float) -> None:
        if not self.started:
            self.started = True
            self.run = _start_probes(self.dep, self.options, max_s)
            if self.run is not None and self.run.interrupted:
                raise KeyboardInterrupt  # Ctrl-C came mid-attach: the child is gone; the capture ends as Ctrl-C ends it

    def stop(self) -> tuple[tuple, tuple]:
        return self.run.stop() if self.run is not None else ((), ())


def _start_probes(dep: Deployment, options: SamplerOptions, max_s: float | None = None):
    """options.ebpf "auto"/"on": start the probes on the deployment's pids; None for "off" or no pid."""
    if options.ebpf == "off" or dep.root_pid is None:
        return None
    from wedgectl.collect import ebpf

    run = ebpf.start_probes(dep.pids, options.ebpf, max_s=(options.window_s if max_s is None else max_s) + 10.0)
    if run is not None and options.progress and not run.interrupted:
        options.progress(f"probes: {run.backend.name} ({run.backend.reason})")
    return run


def _with_probes(bundle: Bundle, records: tuple, failures: tuple) -> Bundle:
    if not bundle.samples or not (records or failures):
        return bundle
    last = bundle.samples[-1]
    last = replace(last, probes=tuple(records), failures=last.failures + tuple(failures))
    return replace(bundle, samples=(*bundle.samples[:-1], last))
# --- end eBPF probes


@dataclass(frozen=True)
class Step:
    """What the next sample takes, decided from the verdict so far (see docs/design.md,
    "How a capture escalates"): stop, or sample on with or without a stack burst and probes."""

    stop: bool
    burst: int = 0  # 0: no stacks; 1: one dump per process; more: a burst of the engine's processes
    probes: bool = False
    why: str = ""


EXTEND_FACTOR = 2.0  # a window whose scrapes are thin runs on to this many times its length
SUSPECT_STEPLESS_S = 1.0  # one sample whose engine has taken no step this long with work in flight
STEPPING_QUIET_S = 0.5  # an engine whose main threads have all been on a CPU this recently is stepping


def starved_live(verdict: Verdict) -> bool:
    """A starved queue read from live counters: tokens advance, so the engine steps; the verdict's
    certainty is how long the queue has waited for capacity (MIN_FROZEN_S), and no stack makes it
    more or less certain or shows in its evidence. It buys no burst, and a capture that stops on it
    takes no dump it left out. (An uncertain "progressing" still buys one: read from the log, it
    is what a hang's first samples can look like.)"""
    return verdict.verdict is VerdictKind.STARVED and not verdict.rule.startswith("log_")


def stacks_cannot_help(verdict: Verdict) -> bool:
    """A verdict no stack dump moves: a live starved queue (starved_live), or an engine the host
    gives no CPU (live_engine_waits_for_cpu: where it waits to run is no evidence of a hang, and
    py-spy would take CPU from a host that has none to spare). It buys no burst and no left-out dump."""
    return starved_live(verdict) or verdict.rule == "live_engine_waits_for_cpu"


def hang_shaped(f: Facts) -> bool:
    """Whether the first sample already looks like a hang: requests waiting with none running (a
    wedge's gauges; a healthy server admits a waiting request within a step), or work in flight
    while the engine has taken no step for SUSPECT_STEPLESS_S (Facts.stepless_s). Then the stack
    burst goes with the second sample, where a short window needs it to be certain, instead of
    the third; a busy healthy server shows neither and pays for no burst."""
    if f.last_metrics is None:
        return False
    if f.running == 0 and f.waiting >= 1:
        return True
    return f.running + f.waiting >= 1 and (f.stepless_s or 0.0) >= SUSPECT_STEPLESS_S


def quick_look(f: Facts, suspect: bool, options: SamplerOptions) -> bool:
    """Whether the second sample comes QUICK_LOOK_S after the first answer, ahead of the 1 s grid:
    the first scrape answered and does not look like a hang. A serving engine takes a step every
    few milliseconds, so its counters move within QUICK_LOOK_S, and counters that moved are as
    certain on 0.3 s as on 1 s (as is nothing in flight). What a quick look cannot decide, the
    grid goes on to decide as before: a hang class needs MIN_FROZEN_S however many samples it
    gets. A hang-shaped first sample gets none: its burst goes with the sample on the grid."""
    return bool(f.scrapes) and not suspect and options.interval_s > QUICK_LOOK_S


def thin_scrapes(f: Facts) -> bool:
    """The server answers /metrics, but too seldom to measure anything: fewer than two scrapes
    parsed, or spanning less than MIN_FROZEN_S (a saturated API server, or our own threads waiting
    seconds for a CPU on a loaded host). No scrape parsed at all is not thin: that is unreachable."""
    s = f.scrapes
    return bool(s) and (len(s) < 2 or s[-1][0] - s[0][0] < MIN_FROZEN_S)


def next_step(verdict: Verdict, n_samples: int, elapsed_s: float, options: SamplerOptions,
              burst_taken: bool, probes_started: bool, suspect: bool = False, thin: bool = False) -> Step:
    """The escalation, as a pure function of the verdict so far.

    Cheapest decisive evidence first: two scrapes a second apart, /proc and one dump per
    process decide most states (counters moving, nothing in flight, a closed listener). A
    verdict the classifier is not certain of gets a burst of the EngineCore's and Workers'
    stacks on the next sample (where the engine spends its time); a parked-engine class still
    open after that gets the probes (how long main threads sit parked), with --ebpf auto and
    window left for them to see a wait. The classifier decides certainty; its thresholds
    (MIN_FROZEN_S) keep a slow step, a long prefill or a saturated server from being called
    stuck on a short window. A first sample that is hang_shaped (`suspect`) buys the burst for the
    second sample at once. A window that ends with `thin` scrapes (thin_scrapes) runs on, up to
    EXTEND_FACTOR times its length: a rate from one scrape is no evidence, and a verdict drawn
    without one (a leak, a starved queue) may name the wrong class."""
    if n_samples < 2:  # one scrape says nothing about movement
        if suspect and options.stacks:
            return Step(False, burst=options.stack_burst, why="hang-shaped first sample: stack burst")
        return Step(False)
    certain = verdict.confidence >= CERTAIN
    if certain and elapsed_s >= options.min_window_s:
        return Step(True, why="verdict certain")
    if elapsed_s + options.interval_s > options.window_s:
        if thin and elapsed_s + options.interval_s <= options.window_s * EXTEND_FACTOR:
            return Step(False, why="window extended: too few scrapes answered to measure a rate")
        return Step(True, why="window over")
    if not options.stacks or certain or stacks_cannot_help(verdict):
        return Step(False)
    if not burst_taken:
        return Step(False, burst=options.stack_burst,
                    why=f"{verdict.verdict.value} ({verdict.confidence:.2f}) not certain: stack burst")
    left = options.window_s - elapsed_s
    if (verdict.verdict in PARKED_CLASSES and options.ebpf == "auto" and not probes_started and left >= PROBE_MIN_S):
        return Step(False, probes=True, why=f"{verdict.verdict.value} not certain: probes for the {left:.0f} s left")
    return Step(False)


@dataclass
class _Pending:
    """A sample whose /proc reading is taken and whose scrape and stack dumps may still run, until
    `due` (monotonic): past it, what has not come is abandoned and the sample goes on without it."""

    t: float
    procs: tuple[ProcessSample, ...]
    failures: list[CollectorFailure]
    rest: _Results  # {"metrics": MetricsScrape, "health": (status, error), "stacks": (dumps, failures)}
    burst: int = 0
    due: float = float("inf")

    def ready(self) -> bool:
        return self.rest.done() or time.monotonic() >= self.due

    def sample(self, dep: Deployment) -> Sample:
        try:
            rest = self.rest.result(timeout=max(0.0, self.due - time.monotonic()))
        except FutureTimeout:
            rest = self.rest.abandon()
        failures = list(self.failures)
        metrics = rest.get("metrics")
        if metrics is None and "metrics" in self.rest.jobs:
            metrics = MetricsScrape(t=time.time(), url=redact_url(dep.metrics_url or ""),
                                    error=f"{FailureKind.TIMEOUT.value}: no answer in time (the scrape was abandoned)")
        health_status, health_error = rest.get("health") or (None, None)
        if "health" in self.rest.jobs and "health" not in rest:
            health_error = f"{FailureKind.TIMEOUT.value}: no answer in time (the check was abandoned)"
        stacks, stack_failures = rest.get("stacks") or ((), [])
        if "stacks" in self.rest.jobs and "stacks" not in rest:
            failures.append(CollectorFailure("stacks", FailureKind.TIMEOUT, "no dump in time (abandoned)", ""))
        failures += stack_failures
        if metrics is not None and not metrics.ok:
            failures.append(CollectorFailure("metrics", failure_kind(metrics.error),
                                             metrics.error or f"HTTP {metrics.status}", dep.metrics_url or ""))
        return Sample(t=self.t, metrics=metrics, health_status=health_status, health_error=health_error,
                      processes=self.procs, stacks=stacks, failures=tuple(failures))


def engine_stepping(procs: tuple[ProcessSample, ...]) -> bool:
    """Whether /proc alone shows the engine taking steps: every main thread a step needs (the
    EngineCore's and its Workers') on a CPU, or waiting for one, within STEPPING_QUIET_S
    (facts.stepless_of). False where that was not read."""
    quiet = stepless_of(procs)
    return quiet is not None and quiet < STEPPING_QUIET_S


def _begin(dep: Deployment, scraper: Scraper, options: SamplerOptions, burst: int,
           early: tuple[Future, int] | None = None, tree: TreeCache | None = None,
           first: bool = False, others: bool = False) -> _Pending:
    """Start one sample: /proc now (its instant is the sample's time), then the scrape and the
    stack dumps in the background, so a slow server or py-spy does not hold the sampling clock.
    `first`: a capture's first sample, whose one dump per process is left out when the engine is
    stepping (engine_stepping): the scrapes decide a serving engine, a hang that shows in them
    buys the burst for the next sample (hang_shaped, next_step), and a capture that stops on any
    other verdict with no dump taken takes the left-out one then (_capture). `others`: a burst
    dumps the other processes once too (the first sample's dump was left out)."""
    t = time.time()
    jobs: dict[str, Callable[[], object]] = {}
    metrics_url, base_url = dep.metrics_url, dep.base_url
    if metrics_url:
        jobs["metrics"] = lambda: scraper.metrics(metrics_url, options.scrape_timeout_s)
    if base_url:
        jobs["health"] = lambda: scraper.health(base_url, options.scrape_timeout_s)
    procs: tuple[ProcessSample, ...] = ()
    failures: list[CollectorFailure] = []
    if dep.root_pid is not None:
        procs, failures = _collect_processes(dep, tree)
        if early is not None:  # a burst begun as soon as it was asked for: this sample carries it
            future, burst = early
            wait_s = stacks_bound_s(burst, options.native, len(procs))
            jobs["stacks"] = lambda: future.result(wait_s)["stacks"]  # a TimeoutError: the sample goes without
        elif burst and procs and not (first and engine_stepping(procs)):
            jobs["stacks"] = lambda: _collect_stacks(procs, options.native, burst, others)
    bound = options.scrape_timeout_s + REST_GRACE_S
    if "stacks" in jobs:
        bound = max(bound, stacks_bound_s(burst or ESCALATE_BURST, options.native, len(procs)))
    return _Pending(t, procs, list(failures), _background(jobs), burst if "stacks" in jobs else 0,
                    time.monotonic() + bound)


MAX_IN_FLIGHT = 2  # scrapes of a slow server overlapping on the sampling clock
REST_GRACE_S = 5.0  # a sample's scrape is abandoned this long after its own timeout (it ends by then)


def _capture(dep: Deployment, pid: int | None, url: str | None, log_path: str | os.PathLike[str] | None,
             options: SamplerOptions, scraper: Scraper, probes: _Probes) -> Bundle:
    say = options.progress or (lambda _msg: None)
    if dep.root_pid is not None:
        say(f"deployment: {', '.join(f'{p} {r.value}' for p, r in dep.roles.items())}; "
            f"metrics {dep.metrics_url or 'none (no listening socket)'}")
    # A log given (--log) is read by its path; one found through the process, through its descriptor
    # (processes.open_held_log), never by the path it reads as, which in the target's mount namespace
    # may name another file than in ours.
    log_source: str | LogSource | None = str(log_path) if log_path else dep.log
    log_path = str(log_path) if log_path else dep.log_path
    notes: list[str] = []
    if log_path:
        notes.append(f"log: {log_path}")
    if dep.root_pid is None:
        notes.append("metrics-only evidence: no process was given (--pid)")
    manifest = deployment_manifest(dep, pid, log_path=log_path)
    # The hypervisor's steal over the capture, for a local target (a host fact: steal_facts).
    steal = (procfs.cpu_steal_s(), time.monotonic()) if dep.root_pid is not None else None
    # The in-window verdicts read one tail of the log (VERDICT_LOG_BYTES), read once; the bundle gets the longer tail.
    decide_log = _read_log(log_source, VERDICT_LOG_BYTES)[0]
    samples: list[Sample] = []
    judged: list[Sample] = []  # lean copies: the classifier re-reads every scrape after each sample
    pending: deque[_Pending] = deque()
    start = time.monotonic()
    due = start
    burst = 1 if options.stacks else 0  # the first sample: one dump of every Python process
    burst_asked = burst_taken = stop = False  # the engine's stack burst: asked for, then in the evidence
    early: tuple[Future, int] | None = None  # that burst, begun when asked for, for the next sample to carry
    dumped_all = False  # the first sample dumped every Python process (not when its engine was stepping)
    verdict: Verdict | None = None  # the last in-window verdict
    after_quick: float | None = None  # a quick look is due: when the sample after it is (the 1 s grid)
    while not stop:
        starved = restore_priority_if_starved()
        if starved:
            notes.append(starved)
            say(starved)
        now = time.monotonic()
        if now >= due and len(pending) < MAX_IN_FLIGHT:
            pending.append(_begin(dep, scraper, options, burst, early, first=not samples and not pending,
                                  others=not dumped_all))
            burst, early = 0, None
            if after_quick is not None:  # the quick look begun: back on the grid of the first answer
                due, after_quick = after_quick, None
            else:
                due += options.interval_s
            if due < time.monotonic():  # a slow /proc or py-spy: skip the missed ticks, do not bunch them
                due = time.monotonic() + options.interval_s
        if not pending:
            time.sleep(max(0.0, due - time.monotonic()))
            continue
        # Wait for the oldest scrape, or until the next sample is due when another may start; never
        # past the oldest's own bound (what it has not got by then, it goes without).
        room = len(pending) < MAX_IN_FLIGHT
        until = min(due, pending[0].due) if room else pending[0].due
        wait([pending[0].rest], timeout=max(0.0, until - time.monotonic()))
        while pending and pending[0].ready():
            done = pending.popleft()
            sample = done.sample(dep)
            samples.append(sample)
            burst_taken = burst_taken or done.burst > 1
            dumped_all = dumped_all or done.burst == 1
            if len(samples) == 1 and not pending:
                # Count the interval from the first answer, not the first request: the first scrape
                # also connects, and the span the classifier needs is measured between answers.
                due = time.monotonic() + options.interval_s
            elapsed = sample.t - samples[0].t
            if dep.root_pid is not None and not sample.processes:
                notes.append(EXITED_NOTE)
                say("the deployment exited mid-capture")
                stop = True
                break
            judged.append(judged_sample(sample))
            judged_bundle = Bundle(manifest, tuple(judged), decide_log)
            facts = Facts(judged_bundle)  # one reading for the verdict and the escalation both
            verdict = classify_facts(facts)
            if options.progress:  # the lean copy: classify has just parsed it (parse_metrics caches by text)
                say(f"sample {len(samples)} at {elapsed:4.1f}s: {_summarise(judged[-1])} -> "
                    f"{verdict.verdict.value} ({verdict.confidence:.2f})")
            suspect = len(samples) == 1 and hang_shaped(facts)
            step = next_step(verdict, len(samples), elapsed, options, burst_taken, probes.started, suspect,
                             thin_scrapes(facts))
            if not step.stop and len(samples) == 1 and not pending and quick_look(facts, suspect, options):
                after_quick, due = due, time.monotonic() + QUICK_LOOK_S
                say(f"quick look in {QUICK_LOOK_S:.1f}s: counters that move by then decide it")
            if step.why:
                say(step.why)
            if step.stop:
                stop = True
                break
            if step.burst and not burst_asked:
                # Dumped now, in the interval's wait, not when the next sample begins: that sample
                # then carries stacks already taken, and its verdict does not wait for py-spy.
                burst_asked = True
                if sample.processes:
                    procs, n = sample.processes, step.burst
                    others = not dumped_all
                    early = (_background({"stacks": lambda: _collect_stacks(procs, options.native, n, others)}), n)
                else:
                    burst = step.burst
            if step.probes:
                probes.start(options.window_s - elapsed)
    # A stop leaves at most one scrape in flight: it is abandoned (its thread ends within the
    # scrape timeout), not waited for.
    log_lines, log_notes = _read_log(log_source, BUNDLE_LOG_BYTES)
    notes += log_notes
    if options.stacks and not burst_taken and samples and samples[-1].processes and verdict is not None:
        # No burst was taken. "progressing", a live "starved" and an engine the host starves of
        # CPU need no stacks (stacks_cannot_help). A first dump left out for a stepping engine is
        # taken now, on the last sample, for any other verdict's evidence. "progressing" read from a log that grew in
        # the window (the live rules
        # could not decide: thin scrapes) is read again from the log as it is now, which may say
        # otherwise. Live progressing (counters moving) no log overrules. A hang class the window
        # ended on before its burst (a loaded host's samples came late, or the first did not look
        # hung) gets the burst now: whether a rank's frame stayed put is what its verdict and
        # evidence read.
        final = verdict
        if not dumped_all and verdict.verdict is VerdictKind.PROGRESSING and verdict.rule.startswith("log_"):
            final = classify(Bundle(manifest, tuple(judged), tuple(log_lines)))
            if final.verdict is not VerdictKind.PROGRESSING:
                say(f"the log now reads {final.verdict.value}")
        n = options.stack_burst if final.verdict in BURST_CLASSES and final.confidence < CERTAIN else 1
        if final.verdict is not VerdictKind.PROGRESSING and not stacks_cannot_help(final) and (n > 1 or not dumped_all):
            say("window over before the stack burst: the engine's stacks now" if n > 1 else "stacks of every process")
            dumps, fails = _collect_stacks(samples[-1].processes, options.native, n, others=not dumped_all)
            samples[-1] = replace(samples[-1], stacks=samples[-1].stacks + dumps,
                                  failures=samples[-1].failures + tuple(fails))
    host = manifest.host
    if steal is not None:
        host = {**host, **steal_facts(steal[0], procfs.cpu_steal_s(), time.monotonic() - steal[1])}
    return Bundle(replace(manifest, notes=tuple(notes), host=host), tuple(samples), log_lines)


def _brief(text: str, limit: int = 200) -> str:
    """A message that quotes the target (a parse error quotes its page): cut to `limit` characters,
    each unprintable one escaped, so it stays one short line."""
    cut = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return cut[:limit] + ("..." if len(text) > limit or len(cut) > limit else "")


def fatal_problem(bundle: Bundle) -> WedgectlError | None:
    """Whether a capture found nothing to classify at all: the exit code says why."""
    if EXITED_NOTE in bundle.manifest.notes:
        seen = sum(1 for s in bundle.samples if s.processes)
        if seen <= 1:
            return NoSuchProcess(f"pid {bundle.manifest.target.pid} exited before a second sample could be taken")
        # Whether the exit lands before or after a loaded host's second sample is a race; when the
        # samples before it decide nothing, the exit is the answer either way, not "inconclusive".
        if classify(bundle).verdict is VerdictKind.INCONCLUSIVE:
            return NoSuchProcess(f"pid {bundle.manifest.target.pid} exited mid-capture, after {seen} samples that "
                                 "decide nothing")
    if bundle.manifest.source != "url":
        return None
    scrapes = [s.metrics for s in bundle.samples if s.metrics is not None]
    if scrapes and all(not m.ok for m in scrapes):
        # A server that answered with a page that is not metrics (too big, a charset other than
        # utf-8/ascii/latin-1, not valid text, not text at all) is reachable: exit 33, not 32.
        bad = [m for m in scrapes if m.status is not None and failure_kind(m.error) is FailureKind.BAD_DATA]
        if bad:
            return BadMetrics(f"{bad[-1].url}: {_brief(bad[-1].error or '')}")
        m = scrapes[-1]
        if m.status is not None and m.status != 200:
            return Unreachable(f"{m.url}: HTTP {m.status} on every scrape")
        if m.status is not None:  # it answered, and its page never came whole in time
            return Unreachable(f"{m.url}: HTTP {m.status}, then {_brief(m.error or 'no page')}")
        return Unreachable(f"{m.url}: {_brief(m.error or 'no answer')}")
    parsed = []
    for m in scrapes:
        try:
            parsed.append(parse_metrics(m.text or ""))
        except MetricsParseError as exc:
            last_error = exc
    if scrapes and not parsed:
        return BadMetrics(f"{scrapes[-1].url}: {_brief(str(last_error))}")
    if parsed and not any(p.is_vllm for p in parsed):
        return BadMetrics(f"{scrapes[-1].url}: Prometheus text but no vllm: series (not a vLLM server?)")
    return None
