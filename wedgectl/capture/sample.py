"""One sample of a deployment: /proc at its instant, its scrape, /health and stack dumps beside it, each bounded."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from wedgectl.capture.bursts import collect_stacks, stacks_bound_s
from wedgectl.capture.discover import Deployment
from wedgectl.capture.options import ESCALATE_BURST, SamplerOptions
from wedgectl.capture.policy import engine_stepping
from wedgectl.capture.runner import Results, run_in_background
from wedgectl.capture.tree import TreeCache, collect_processes
from wedgectl.collect.enginereport import read_engine_reports
from wedgectl.collect.scrape import Scraper, failure_kind
from wedgectl.model.types import CollectorFailure, FailureKind, MetricsScrape, ProcessSample, Role, Sample
from wedgectl.read.redact import redact_url

REST_GRACE_S = 5.0  # a sample's scrape is abandoned this long after its own timeout (it ends by then)
# The processes whose engine report a sample reads (collect.enginereport): the ones the plugin runs in.
ENGINE_REPORT_ROLES = frozenset({Role.API_SERVER, Role.ENGINE_CORE, Role.WORKER})


def take_sample(dep: Deployment, with_stacks: bool, options: SamplerOptions, burst: int = 1,
                scraper: Scraper | None = None, tree: TreeCache | None = None) -> Sample:
    """One Sample; collectors run side by side so a slow one does not skew the others' clock.
    ``scraper``: the run's HTTP client (one per diagnose or top session); without one, a
    client is built for this sample."""
    if scraper is None:
        with Scraper(options.scrape_timeout_s) as own:
            return take_sample(dep, with_stacks, options, burst, own, tree)
    return begin_sample(dep, scraper, options, burst if with_stacks else 0, tree=tree).sample(dep)


@dataclass
class PendingSample:
    """A sample whose /proc reading is taken and whose scrape and stack dumps may still run, until
    `due` (monotonic): past it, what has not come is abandoned and the sample goes on without it."""

    t: float
    procs: tuple[ProcessSample, ...]
    failures: list[CollectorFailure]
    rest: Results  # {"metrics": MetricsScrape, "health": (status, error), "stacks": (dumps, failures), "engine": ...}
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
        engine = rest.get("engine") or ()
        if "engine" in self.rest.jobs and "engine" not in rest:
            failures.append(CollectorFailure("engine", FailureKind.TIMEOUT, "no engine report read in time", ""))
        if metrics is not None and not metrics.ok:
            failures.append(CollectorFailure("metrics", failure_kind(metrics.error),
                                             metrics.error or f"HTTP {metrics.status}", dep.metrics_url or ""))
        return Sample(t=self.t, metrics=metrics, health_status=health_status, health_error=health_error,
                      processes=self.procs, stacks=stacks, failures=tuple(failures), engine=engine)


def begin_sample(dep: Deployment, scraper: Scraper, options: SamplerOptions, burst: int,
                 early: tuple[Future, int] | None = None, tree: TreeCache | None = None,
                 first: bool = False, others: bool = False) -> PendingSample:
    """Start one sample: /proc now (its instant is the sample's time), then the scrape and the
    stack dumps in the background, so a slow server or py-spy does not hold the sampling clock.
    `first`: a capture's first sample, whose one dump per process is left out when the engine is
    stepping (engine_stepping): the scrapes decide a serving engine, a hang that shows in them
    buys the burst for the next sample (policy.hang_shaped, policy.next_step), and a capture that
    stops on any other verdict with no dump taken takes the left-out one then (capture.window).
    `others`: a burst dumps the other processes once too (the first sample's dump was left out)."""
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
        procs, failures = collect_processes(dep, tree)
        if early is not None:  # a burst begun as soon as it was asked for: this sample carries it
            future, burst = early
            wait_s = stacks_bound_s(burst, options.native, len(procs))
            jobs["stacks"] = lambda: future.result(wait_s)["stacks"]  # a TimeoutError: the sample goes without
        elif burst and procs and not (first and engine_stepping(procs)):
            jobs["stacks"] = lambda: collect_stacks(procs, options.native, burst, others)
        engine_pids = [p.pid for p in procs if p.role in ENGINE_REPORT_ROLES]
        if engine_pids:  # the plugin's own word on each process: a file read apiece, beside the scrape
            jobs["engine"] = lambda: read_engine_reports(engine_pids)
    bound = options.scrape_timeout_s + REST_GRACE_S
    if "stacks" in jobs:
        bound = max(bound, stacks_bound_s(burst or ESCALATE_BURST, options.native, len(procs)))
    return PendingSample(t, procs, list(failures), run_in_background(jobs), burst if "stacks" in jobs else 0,
                         time.monotonic() + bound)
