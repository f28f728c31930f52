"""Live capture: samples of metrics, processes, threads and stacks over a window, into a Bundle.

The sampler feeds the same `classify` as a saved bundle (one code path for
live and recorded evidence) and stops early once the verdict is certain.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from wedgectl import __version__
from wedgectl.classify import classify
from wedgectl.collect import processes, pyspy
from wedgectl.collect.scrape import probe_health, scrape_metrics
from wedgectl.discover import Deployment, discover, tree_roles
from wedgectl.errors import BadMetrics, NoSuchProcess, Unreachable, WedgectlError
from wedgectl.metrics import MetricsParseError, parse_metrics
from wedgectl.redact import redact_url
from wedgectl.sources import host_facts, read_log_lines
from wedgectl.types import (
    Bundle,
    CollectorFailure,
    FailureKind,
    Manifest,
    ProcessSample,
    Role,
    Sample,
    StackDump,
    Target,
    VerdictKind,
)

CERTAIN = 0.9
EXITED_NOTE = "the deployment exited mid-capture"
LOG_TAIL_BYTES = 4 << 20
BURST_GAP_S = 0.03


@dataclass(frozen=True)
class SamplerOptions:
    window_s: float = 6.0
    interval_s: float = 1.0
    min_window_s: float = 3.0  # never decide on less: counter deltas need time
    stacks: bool = True
    native: bool = False
    ebpf: str = "off"
    scrape_timeout_s: float = 2.0
    stack_burst: int = 8  # dumps of each engine process at the end of the window
    progress: Callable[[str], None] | None = None


def _collect_processes(dep: Deployment) -> tuple[tuple[ProcessSample, ...], list[CollectorFailure]]:
    return processes.sample_roles(tree_roles(dep.root_pid) if dep.root_pid is not None else {})


def _dump_burst(pid: int, native: bool, repeats: int) -> list[StackDump]:
    """Up to `repeats` good dumps of one pid, BURST_GAP_S apart. A non-blocking read of a busy
    process sometimes races its interpreter ("Failed to get stack traces"), so a failed dump
    is retried (2 x repeats attempts at most); failures are kept only if nothing succeeded."""
    good: list[StackDump] = []
    failed: list[StackDump] = []
    for attempt in range(2 * repeats):
        d = pyspy.dump_stacks(pid, native=native, nonblocking=not native)
        (good if d.error is None else failed).append(d)
        if len(good) >= repeats or (d.error is not None and not d.error.startswith(("error", "bad_data"))):
            break  # done, or a failure that will not go away (permission, missing tool, gone)
        time.sleep(BURST_GAP_S)
    return good or failed[-1:]


def _collect_stacks(procs: tuple[ProcessSample, ...], native: bool, burst: int = 1) -> tuple[tuple[StackDump, ...], list[CollectorFailure]]:
    """One dump of every Python process; a burst of `burst` dumps of the EngineCore and Workers
    (a single snapshot of a loop says little about where it spends its time)."""
    targets = [p for p in procs if p.role != Role.OTHER or "python" in p.name.lower()]
    if not targets:
        return (), []
    def run(p: ProcessSample) -> list[StackDump]:
        n = burst if p.role in (Role.ENGINE_CORE, Role.WORKER) else 1
        return _dump_burst(p.pid, native, n)
    with ThreadPoolExecutor(max_workers=min(4, len(targets))) as pool:
        dumps = tuple(d for ds in pool.map(run, targets) for d in ds)
    failures = list({(f.collector, f.target, f.message): f for d in dumps if (f := pyspy.stack_failure(d)) is not None}.values())
    return dumps, failures


def take_sample(dep: Deployment, with_stacks: bool, options: SamplerOptions, burst: int = 1) -> Sample:
    """One Sample; collectors run side by side so a slow one does not skew the others' clock."""
    t = time.time()
    failures: list[CollectorFailure] = []
    with ThreadPoolExecutor(max_workers=3) as pool:
        fut_metrics = pool.submit(scrape_metrics, dep.metrics_url, options.scrape_timeout_s) if dep.metrics_url else None
        fut_health = pool.submit(probe_health, dep.base_url, options.scrape_timeout_s) if dep.base_url else None
        procs, proc_failures = _collect_processes(dep) if dep.root_pid is not None else ((), [])
        metrics = fut_metrics.result() if fut_metrics else None
        health_status, health_error = fut_health.result() if fut_health else (None, None)
    failures.extend(proc_failures)
    if metrics is not None and not metrics.ok:
        failures.append(CollectorFailure("metrics", FailureKind.UNREACHABLE, metrics.error or f"HTTP {metrics.status}", dep.metrics_url or ""))
    stacks: tuple[StackDump, ...] = ()
    if with_stacks and procs:
        stacks, stack_failures = _collect_stacks(procs, options.native, burst)
        failures.extend(stack_failures)
    return Sample(
        t=t,
        metrics=metrics,
        health_status=health_status,
        health_error=health_error,
        processes=procs,
        stacks=stacks,
        failures=tuple(failures),
    )


def _summarise(s: Sample) -> str:
    parts = []
    if s.metrics is not None and s.metrics.ok:
        try:
            m = parse_metrics(s.metrics.text or "")
            parts.append(f"running={m.running or 0:.0f} waiting={m.waiting or 0:.0f} gen_tokens={m.generation_tokens or 0:.0f}")
        except MetricsParseError:
            parts.append("metrics unparsable")
    elif s.metrics is not None:
        parts.append(f"metrics: {s.metrics.error or s.metrics.status}")
    if s.processes:
        parts.append(f"{len(s.processes)} procs")
    return ", ".join(parts) or "no data"


def _read_log(path: str | None) -> tuple[tuple[str, ...], list[str]]:
    if not path:
        return (), []
    try:
        return read_log_lines(path, max_bytes=LOG_TAIL_BYTES)
    except WedgectlError as exc:
        return (), [f"log not read: {exc}"]


def capture(pid: int | None = None, url: str | None = None, log_path: str | None = None,
            options: SamplerOptions = SamplerOptions()) -> Bundle:
    """Sample the target over the window and return the bundle (verdict not set)."""
    dep = discover(pid=pid, url=url)
    # --- eBPF probes (wedgectl/collect/ebpf.py): one bounded run across the whole window,
    # detached in the finally whatever ends the capture; the results go on the last sample.
    probe_run = _start_probes(dep, options)
    try:
        bundle = _capture(dep, pid, url, log_path, options)
    finally:
        probe_records, probe_failures = probe_run.stop() if probe_run is not None else ((), ())
    return _with_probes(bundle, probe_records, probe_failures)


def _start_probes(dep: Deployment, options: SamplerOptions):
    """options.ebpf "auto"/"on": start the probes on the deployment's pids; None for "off" or no pid."""
    if options.ebpf == "off" or dep.root_pid is None:
        return None
    from wedgectl.collect import ebpf

    run = ebpf.start_probes(dep.pids, options.ebpf, max_s=options.window_s + 10.0)
    if run is not None and options.progress:
        options.progress(f"probes: {run.backend.name} ({run.backend.reason})")
    return run


def _with_probes(bundle: Bundle, records: tuple, failures: tuple) -> Bundle:
    if not bundle.samples or not (records or failures):
        return bundle
    last = bundle.samples[-1]
    last = replace(last, probes=tuple(records), failures=last.failures + tuple(failures))
    return replace(bundle, samples=(*bundle.samples[:-1], last))
# --- end eBPF probes


def _capture(dep: Deployment, pid: int | None, url: str | None, log_path: str | None,
             options: SamplerOptions) -> Bundle:
    say = options.progress or (lambda _msg: None)
    if dep.root_pid is not None:
        say(f"deployment: {', '.join(f'{p} {r.value}' for p, r in dep.roles.items())}; "
            f"metrics {dep.metrics_url or 'none (no listening socket)'}")
    log_path = str(log_path) if log_path else dep.log_path
    notes: list[str] = []
    if log_path:
        notes.append(f"log: {log_path}")
    if dep.root_pid is None:
        notes.append("metrics-only evidence: no process was given (--pid)")
    manifest = Manifest(
        created=time.time(),
        wedgectl_version=__version__,
        source="live" if dep.root_pid is not None else "url",
        target=Target(pid=pid, url=redact_url(dep.base_url), log_path=log_path, pids=dep.pids),
        host=host_facts(),
    )
    samples: list[Sample] = []
    start = time.monotonic()
    n = 0
    while True:
        elapsed = time.monotonic() - start
        last = elapsed + options.interval_s > options.window_s
        # Stacks on the first and the final sample: enough to see where threads sit, cheap on the target.
        with_stacks = options.stacks and (n == 0 or last)
        sample = take_sample(dep, with_stacks, options, burst=options.stack_burst if last else 1)
        samples.append(sample)
        n += 1
        if dep.root_pid is not None and not sample.processes:
            notes.append(EXITED_NOTE)
            say("the deployment exited mid-capture")
            break
        log_lines, _ = _read_log(log_path) if log_path else ((), [])
        verdict = classify(Bundle(manifest, tuple(samples), log_lines))
        say(f"sample {n} at {elapsed:4.1f}s: {_summarise(sample)} -> {verdict.verdict.value} ({verdict.confidence:.2f})")
        if last:
            break
        if elapsed >= options.min_window_s and verdict.confidence >= CERTAIN:
            if options.stacks:
                samples.append(take_sample(dep, True, options, burst=options.stack_burst))
            say("verdict certain; stopping early")
            break
        time.sleep(max(0.0, options.interval_s - (time.monotonic() - start - elapsed)))
    log_lines, log_notes = _read_log(log_path)
    notes += log_notes
    return Bundle(replace(manifest, notes=tuple(notes)), tuple(samples), log_lines)


def fatal_problem(bundle: Bundle) -> WedgectlError | None:
    """Whether a capture found nothing to classify at all: the exit code says why."""
    if EXITED_NOTE in bundle.manifest.notes:
        seen = sum(1 for s in bundle.samples if s.processes)
        if seen <= 1:
            return NoSuchProcess(f"pid {bundle.manifest.target.pid} exited before a second sample could be taken")
        # Whether the exit lands before or after a loaded host's second sample is a race; when the
        # samples before it decide nothing, the exit is the answer either way, not "inconclusive".
        if classify(bundle).verdict is VerdictKind.INCONCLUSIVE:
            return NoSuchProcess(f"pid {bundle.manifest.target.pid} exited mid-capture, after {seen} samples that decide nothing")
    if bundle.manifest.source != "url":
        return None
    scrapes = [s.metrics for s in bundle.samples if s.metrics is not None]
    if scrapes and all(not m.ok for m in scrapes):
        m = scrapes[-1]
        if m.status is not None:
            return Unreachable(f"{m.url}: HTTP {m.status} on every scrape")
        return Unreachable(f"{m.url}: {m.error or 'no answer'}")
    parsed = []
    for m in scrapes:
        try:
            parsed.append(parse_metrics(m.text or ""))
        except MetricsParseError as exc:
            last_error = exc
    if scrapes and not parsed:
        return BadMetrics(f"{scrapes[-1].url}: {last_error}")
    if parsed and not any(p.is_vllm for p in parsed):
        return BadMetrics(f"{scrapes[-1].url}: Prometheus text but no vllm: series (not a vLLM server?)")
    return None
