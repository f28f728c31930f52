"""One deployment under watch, as diagnose, top and watch all hold it: the live session.

A `LiveSession` keeps what the three would otherwise each keep their own way, and did, until their
copies drifted: the deployment as found (and found again once a late API server listens), its
manifest (the URL redacted), the model it serves, its log tail, the HTTP clients, the rolling window
of samples, and the two ways to look at it: a cheap look (one scrape of the judged series and each
process's CPU: what a healthy server costs a watcher all day) and a full look (the sampler's:
/health, every process and thread, sockets, and when asked a py-spy dump of each). How often each
look comes, and what a verdict makes of the window, stays with each command.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import replace

from wedgectl.capture.discover import (
    VERDICT_LOG_BYTES,
    Deployment,
    deployment_manifest,
    discover,
    served_model,
    tree_roles,
)
from wedgectl.capture.options import SamplerOptions
from wedgectl.capture.sample import take_sample
from wedgectl.capture.tree import TreeCache
from wedgectl.collect import procfs, procread
from wedgectl.collect.scrape import Scraper, failure_kind
from wedgectl.model.errors import WedgectlError
from wedgectl.model.types import CollectorFailure, FailureKind, Manifest, ProcessSample, Sample
from wedgectl.read.metrics import JUDGED_SERIES, MetricsParseError, parse_metrics
from wedgectl.read.redact import redact_text
from wedgectl.store.sources import LogSource, read_log_lines

ROLES_EVERY_S = 60.0  # cheap looks walk the process tree again this often


def model_from_metrics(sample: Sample) -> str | None:
    """The model_name label vLLM puts on its series, redacted as served_model redacts an argv's."""
    if sample.metrics is None or not sample.metrics.ok:
        return None
    try:
        snap = parse_metrics(sample.metrics.text or "")
    except MetricsParseError:
        return None
    for rows in snap.samples.values():
        for labels, _ in rows:
            if labels.get("model_name"):
                return redact_text(labels["model_name"])
    return None


def model_of(deployment: Deployment) -> str | None:
    """The model its API server serves, read from its argv (discover.served_model); None when unread."""
    if deployment.api_pid is None:
        return None
    try:
        return served_model(procread.read_cmdline(deployment.api_pid))
    except OSError:  # read_cmdline: unreadable or blocked past its bound
        return None


class LiveSession:
    """A running deployment and the evidence kept of it. The looks block (HTTP, /proc, py-spy, each
    bounded): top and watch call them from a worker thread.

    `pid`, `url`: as the operator named the target (the manifest's pid; what a late listener is
    looked for again with). `log_path`: a log given by path (diagnose --log), read by that path;
    otherwise the log the server holds is read through its descriptor, never by the path it shows.
    `series`: what the full look asks of /metrics (None: the whole page, as a bundle keeps it).
    `tree`: a TreeCache to walk the process tree every few seconds, not at every look. `keep`,
    `keep_s`: the rolling window's length, in samples and in seconds of sample time."""

    def __init__(self, deployment: Deployment, pid: int | None = None, url: str | None = None, *,
                 notes: tuple[str, ...] = (), log_path: str | os.PathLike[str] | None = None,
                 series: tuple[str, ...] | None = None, tree: TreeCache | None = None,
                 scrape_timeout_s: float = SamplerOptions.scrape_timeout_s,
                 keep: int | None = None, keep_s: float | None = None,
                 startup_quiet_s: float | None = None) -> None:
        self.deployment = deployment
        self.pid = pid
        self.url = url
        self.log_path = str(log_path) if log_path else None
        self.tree = tree
        self.scraper = Scraper(scrape_timeout_s, series=series)
        self._cheap: Scraper | None = None  # the cheap look's, made at the first one
        self.startup_quiet_s = startup_quiet_s
        self._manifest = deployment_manifest(deployment, pid, notes=notes, log_path=self.log_path,
                                             startup_quiet_s=startup_quiet_s)
        self._model: str | None = None
        self._model_asked = False  # the argv read (only when asked: diagnose never names a model)
        self.samples: deque[Sample] = deque()
        self.keep, self.keep_s = keep, keep_s
        self._log: tuple[str, ...] = ()
        self._log_read = float("-inf")
        self._roles_read = time.monotonic()  # discover() has just walked the tree

    @classmethod
    def connect(cls, pid: int | None = None, url: str | None = None, **kwargs: object) -> LiveSession:
        """discover(), then the session; raises NoSuchProcess / NotVllm as diagnose does."""
        return cls(discover(pid=pid, url=url), pid, url, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ what it says about the deployment

    def manifest(self, notes: tuple[str, ...] | None = None, pid: int | None = None) -> Manifest:
        """The session's manifest (made when it began; its target follows a late listener). With
        `notes`, one made now (watch's bundles: this moment's host facts), naming `pid` if given."""
        if notes is None:
            return self._manifest
        return deployment_manifest(self.deployment, self.pid if pid is None else pid, notes=notes,
                                   log_path=self.log_path, startup_quiet_s=self.startup_quiet_s)

    @property
    def model(self) -> str | None:
        """The model it serves, as top's picker and watch name it: its API server's argv (served_model),
        else, once a sample has given it (name_model), its series' model_name label."""
        if not self._model_asked:
            self._model_asked = True
            self._model = self._model or model_of(self.deployment)
        return self._model

    def name_model(self, sample: Sample) -> str | None:
        """The model, from the sample's series when the argv named none."""
        if self.model is None:
            self._model = model_from_metrics(sample)
        return self._model

    def find_late_listener(self) -> bool:
        """An API server that was not listening yet when found: look for its URL again (a pid
        target only). Whether the deployment now has a metrics URL."""
        if self.deployment.metrics_url is not None:
            return True
        if self.pid is None:
            return False
        try:
            dep = discover(pid=self.pid, url=self.url)
        except WedgectlError:
            return False
        self.deployment = dep
        self._manifest = replace(self._manifest, target=deployment_manifest(dep, self.pid,
                                                                             log_path=self.log_path).target)
        return dep.metrics_url is not None

    # ------------------------------------------------------------------ the log

    @property
    def log_source(self) -> str | LogSource | None:
        return self.log_path or self.deployment.log

    def read_log(self, max_bytes: int) -> tuple[tuple[str, ...], list[str]]:
        """The log's last max_bytes, and notes on how it was read (or why it was not)."""
        source = self.log_source
        if not source:
            return (), []
        try:
            return read_log_lines(source, max_bytes=max_bytes)
        except WedgectlError as exc:
            return (), [f"log not read: {exc}"]

    def log_tail(self, max_bytes: int = VERDICT_LOG_BYTES, max_age_s: float = 0.0) -> tuple[str, ...]:
        """The log's tail; the verdict's (VERDICT_LOG_BYTES) read again only once `max_age_s` old."""
        if max_bytes != VERDICT_LOG_BYTES:
            return self.read_log(max_bytes)[0]
        if time.monotonic() - self._log_read >= max_age_s or max_age_s <= 0:
            self._log, self._log_read = self.read_log(max_bytes)[0], time.monotonic()
        return self._log

    # ------------------------------------------------------------------ the looks and the window

    def full_look(self, with_stacks: bool, options: SamplerOptions) -> Sample:
        """The sampler's sample (capture.sample.take_sample) on the session's scraper and tree."""
        self.find_late_listener()
        s = take_sample(self.deployment, with_stacks, options, scraper=self.scraper, tree=self.tree)
        self._roles_read = float("-inf")  # the tree may have changed: walk it again at the next cheap look
        return s

    def cheap_look(self, options: SamplerOptions) -> Sample:
        """/metrics (the judged series) and /proc/PID/stat of the processes known. The process tree is
        walked again every ROLES_EVERY_S; a process gone from it shows as missing."""
        self.find_late_listener()
        d = self.deployment
        t = time.time()
        failures: list[CollectorFailure] = []
        if d.root_pid is not None and time.monotonic() - self._roles_read > ROLES_EVERY_S:
            self.deployment = d = replace(d, roles=tree_roles(d.root_pid) or d.roles)
            self._roles_read = time.monotonic()
        procs = []
        for pid, role in d.roles.items():
            stat, fails = procfs.read_process_stat(pid)
            if stat is None or stat.state in ("Z", "X"):
                failures.extend(f for f in fails if f.kind is not FailureKind.GONE)
                continue
            procs.append(ProcessSample(pid=pid, ppid=stat.ppid, role=role, name=stat.comm, state=stat.state,
                                       cpu_user_s=stat.utime_s, cpu_system_s=stat.stime_s,
                                       num_threads=stat.num_threads))
        metrics = self.cheap_scraper.metrics(d.metrics_url, options.scrape_timeout_s) if d.metrics_url else None
        if metrics is not None and not metrics.ok:
            failures.append(CollectorFailure("metrics", failure_kind(metrics.error),
                                             metrics.error or f"HTTP {metrics.status}", d.metrics_url or ""))
        return Sample(t=t, metrics=metrics, processes=tuple(procs), failures=tuple(failures))

    @property
    def cheap_scraper(self) -> Scraper:
        """A cheap look's client, all day: the series the verdicts read (metrics.JUDGED_SERIES), a
        twentieth of vLLM's page for the server to write and for us to parse."""
        if self._cheap is None:
            self._cheap = Scraper(self.scraper.timeout, series=JUDGED_SERIES, max_bytes=self.scraper.max_bytes)
        return self._cheap

    def set_page_limit(self, max_bytes: int) -> None:
        """The biggest /metrics page either look reads (a bigger one is bad_data)."""
        self.scraper.max_bytes = self.cheap_scraper.max_bytes = max_bytes

    def record(self, sample: Sample) -> list[Sample]:
        """Keep the sample in the window; those it pushed out (past `keep`, or `keep_s` older)."""
        self.samples.append(sample)
        dropped = []
        while self.samples and ((self.keep is not None and len(self.samples) > self.keep)
                                or (self.keep_s is not None and sample.t - self.samples[0].t > self.keep_s)):
            dropped.append(self.samples.popleft())
        return dropped

    def close(self) -> None:
        self.scraper.close()
        if self._cheap is not None:
            self._cheap.close()
