"""The deployments `watch` looks at: found by pid, URL or on the whole host, each named stably and sampled."""

from __future__ import annotations

import os
import socket
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from wedgectl.capture.discover import VERDICT_LOG_BYTES, Deployment, discover, find_servers
from wedgectl.capture.options import SamplerOptions
from wedgectl.capture.session import LiveSession
from wedgectl.classify.judged import judged_sample
from wedgectl.collect import processes
from wedgectl.model.types import Bundle, FailureKind, Manifest, MetricsScrape, Sample
from wedgectl.watch.state import TargetLabels

KEEP_S = 120.0  # evidence kept per target: the "before" of an onset bundle
CLASSIFY_S = 30.0  # the verdict rests on the last 30 s: longer than any rule's frozen threshold
MIN_CLASSIFY = 3  # samples, whatever the cadence: counter deltas need a few
LOG_EVERY_S = 30.0  # re-read the log tail (VERDICT_LOG_BYTES) this often while healthy; every tick when escalated
_LOOPBACK = {"127.0.0.1", "::1", "localhost", "0.0.0.0", "::", ""}
DEFAULT_BUDGET = 8 << 20  # a target's kept samples, in bytes, until the watcher shares out its own
SAMPLE_OVERHEAD = 1024  # a kept sample's own objects, beside its page text (an estimate)
MIN_KEPT = 1  # the newest sample is always kept (its page text may not be)


@dataclass(frozen=True)
class Spec:
    """What the operator named: a pid, a URL, or (both None) a deployment found on the host."""

    pid: int | None = None
    url: str | None = None


def node_name() -> str:
    """The pod's name in Kubernetes (POD_NAME from the downward API, else HOSTNAME), else the host's."""
    return os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()


def target_name(node: str, base_url: str | None, model: str | None, pid: int | None = None) -> str:
    """'NODE:PORT/MODEL': stable across restarts of the same server, readable in an alert. A URL on
    another host keeps that host's name instead of ours."""
    labels = target_labels(node, base_url, model, pid)
    where = f"{labels.node}:{labels.port}" if labels.port else (f"{labels.node}:pid{pid}" if pid else labels.node)
    return f"{where}/{labels.model_name}"


def target_labels(node: str, base_url: str | None, model: str | None, pid: int | None = None) -> TargetLabels:
    """The labels of target_name's parts: a URL on another host gives that host as the node."""
    host, port = node, None
    if base_url:
        parts = urlsplit(base_url)
        port = parts.port
        if parts.hostname and parts.hostname not in _LOOPBACK:
            host = parts.hostname
    return TargetLabels(host, str(port) if port else "", model or "unknown", "" if port or pid is None else str(pid))


def host_deployments() -> list[int]:
    """The API server pid of every vLLM deployment on this host (or in this pod), oldest first."""
    return [s.pid for s in find_servers()]


def parse_users(text: str) -> frozenset[int]:
    """--users: 'root,alice,1000' -> their uids. ValueError for an unknown name or a bad uid."""
    import pwd

    uids = set()
    for item in text.split(","):
        item = item.strip()
        if item.isdigit() and item.isascii() and len(item) <= 10 and int(item) < 2**32 - 1:
            uids.add(int(item))
            continue
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except (KeyError, ValueError):
            raise ValueError(f"--users: no such user {item[:40]!r}") from None
    return frozenset(uids)


def verdict_window(samples: Sequence[Sample]) -> tuple[Sample, ...]:
    """The kept samples a verdict rests on: the last CLASSIFY_S, and at least MIN_CLASSIFY."""
    if not samples:
        return ()
    end = samples[-1].t
    recent = [s for s in samples if end - s.t <= CLASSIFY_S]
    if len(recent) < MIN_CLASSIFY:
        recent = list(samples)[-MIN_CLASSIFY:]
    return tuple(recent)


def sample_bytes(sample: Sample) -> int:
    """What a kept sample takes, estimated: its page text (the bulk: up to a whole /metrics page)
    and a fixed allowance for the rest, a few hundred bytes per process and stack dump, and per engine
    report a kilobyte and its request samples and frames (a report's stacks are up to 64 x 48 frames)."""
    text = sample.metrics.text if sample.metrics is not None else None
    n = SAMPLE_OVERHEAD + (sys.getsizeof(text) if text else 0)
    for r in sample.engine:
        stacks = r.report.stacks if r.report is not None else None
        frames = sum(len(t.frames) for t in stacks.threads) if stacks is not None else 0
        n += 1024 + 256 * (len(r.report.requests) + frames) if r.report is not None else 256
    return n + 256 * len(sample.processes) + 4096 * len(sample.stacks)


class Watched:
    """One deployment under watch: a live session (capture.session), its window kept for KEEP_S and
    within a byte budget, and its stable name. Its sample() blocks (HTTP, /proc, py-spy, each
    bounded); the daemon calls it from a worker thread."""

    def __init__(self, spec: Spec, deployment: Deployment, node: str) -> None:
        self.spec = spec
        self.node = node
        # The full look's scraper reads the whole page, as a bundle keeps it; the cheap look's, the
        # judged series. The manifest names the root pid: a re-found deployment is named anew.
        self.session = LiveSession(deployment, spec.pid, spec.url, keep_s=KEEP_S)
        self.name = target_name(node, deployment.base_url, self.session.model, deployment.root_pid)
        self.labels = target_labels(node, deployment.base_url, self.session.model, deployment.root_pid)
        self.budget_bytes = 0
        self.kept_bytes = 0  # sample_bytes of the kept samples
        self.budget_exceeded = 0  # times the kept samples went over the budget and were trimmed
        self.set_budget(DEFAULT_BUDGET)

    @classmethod
    def connect(cls, spec: Spec, node: str) -> Watched:
        """discover(); raises NoSuchProcess / NotVllm like diagnose does."""
        return cls(spec, discover(pid=spec.pid, url=spec.url), node)

    @property
    def deployment(self) -> Deployment:
        return self.session.deployment

    @property
    def samples(self) -> deque[Sample]:
        return self.session.samples

    @property
    def model(self) -> str | None:
        return self.session.model

    @property
    def pid(self) -> int | None:
        return self.deployment.root_pid

    @property
    def up(self) -> bool:
        """Its last look read it: /metrics answered 200 where it has a URL, else its processes were read."""
        if not self.samples:
            return False
        last = self.samples[-1]
        if self.deployment.base_url:
            return last.metrics is not None and last.metrics.ok
        return bool(last.processes)

    @property
    def alive(self) -> bool:
        """False once a pid-watched deployment's root process is gone (a URL is always watched)."""
        pid = self.deployment.root_pid
        if pid is None:
            return True
        return processes.is_alive(pid)

    def manifest(self, note: str) -> Manifest:
        """As diagnose and top write it (discover.deployment_manifest): the URL without its user:password."""
        return self.session.manifest((note,), pid=self.deployment.root_pid)

    def sample(self, full: bool, stacks: bool, options: SamplerOptions) -> Sample:
        """Take one sample and keep it: a cheap look (one /metrics scrape and each process's CPU), or
        a full one (the sampler's: /health, every process and thread, sockets, and when asked a
        py-spy dump of each)."""
        s = self.session.full_look(stacks, options) if full else self.session.cheap_look(options)
        if self.model is None and self.session.name_model(s) and not self.samples:
            # named before its first evaluation, never after
            self.name = target_name(self.node, self.deployment.base_url, self.model, self.deployment.root_pid)
            self.labels = target_labels(self.node, self.deployment.base_url, self.model, self.deployment.root_pid)
        self.kept_bytes += sample_bytes(s)
        for gone in self.session.record(s):
            self.kept_bytes -= sample_bytes(gone)
        if self.kept_bytes > self.budget_bytes:
            self.budget_exceeded += 1
            self._trim()
        return self.samples[-1]

    def set_budget(self, budget_bytes: int) -> None:
        """The bytes its kept samples may take; a page bigger than that is not even read (bad_data)."""
        self.budget_bytes = budget_bytes
        self.session.set_page_limit(max(0, budget_bytes - SAMPLE_OVERHEAD - 4096))

    def _trim(self) -> None:
        """Back within the budget: the older samples' pages made lean (what the classifier reads:
        no comments, no histogram buckets), then the oldest samples dropped, then the newest
        sample's page itself, made lean and, if it is still too big, let go."""
        for i in range(len(self.samples) - 1):
            if self.kept_bytes <= self.budget_bytes:
                return
            self._replace(i, judged_sample(self.samples[i]))
        while len(self.samples) > MIN_KEPT and self.kept_bytes > self.budget_bytes:
            self.kept_bytes -= sample_bytes(self.samples.popleft())
        if self.kept_bytes > self.budget_bytes:
            self._replace(-1, judged_sample(self.samples[-1]))
        if self.kept_bytes > self.budget_bytes:
            m = self.samples[-1].metrics
            if m is not None and m.text is not None:
                self._replace(-1, replace(self.samples[-1], metrics=MetricsScrape(
                    t=m.t, url=m.url, status=m.status, elapsed_s=m.elapsed_s,
                    error=f"{FailureKind.BAD_DATA.value}: a page of {len(m.text)} characters is over the "
                          f"{self.budget_bytes}-byte budget of the target's kept samples")))

    def _replace(self, i: int, sample: Sample) -> None:
        self.kept_bytes += sample_bytes(sample) - sample_bytes(self.samples[i])
        self.samples[i] = sample

    def close(self) -> None:
        self.session.close()

    def log_tail(self, fresh: bool = False, max_bytes: int = VERDICT_LOG_BYTES) -> tuple[str, ...]:
        """The server log's tail, re-read at most every LOG_EVERY_S unless fresh."""
        return self.session.log_tail(max_bytes, max_age_s=0.0 if fresh else LOG_EVERY_S)

    def window(self) -> tuple[Sample, ...]:
        """The samples the verdict rests on (verdict_window)."""
        return verdict_window(self.samples)

    def bundle(self, note: str, full_window: bool = True, log_bytes: int = VERDICT_LOG_BYTES,
               fresh_log: bool = False) -> Bundle:
        samples = tuple(self.samples) if full_window else self.window()
        return Bundle(self.manifest(note), samples, self.log_tail(fresh_log, log_bytes))
