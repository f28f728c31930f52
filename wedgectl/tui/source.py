"""Where `wedgectl top` gets its evidence: a live deployment (a capture.session.LiveSession) or a saved bundle.

`Collector` takes a full look at each refresh into the session's rolling window
and turns it into a `Frame`; it blocks (HTTP, /proc, py-spy), so the app calls it
from a worker thread and the headless driver from its own loop. Live and replayed evidence
go through the same `build_frame` and `classify` as `wedgectl diagnose`.
"""

from __future__ import annotations

import itertools
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from wedgectl.capture.discover import (
    BUNDLE_LOG_BYTES,
    VERDICT_LOG_BYTES,
    Deployment,
    ServerInfo,
    discover,
    find_servers,
)
from wedgectl.capture.options import SamplerOptions
from wedgectl.capture.session import LiveSession
from wedgectl.capture.tree import TreeCache
from wedgectl.classify import classify
from wedgectl.model.types import Bundle, Manifest, Sample
from wedgectl.read.metrics import JUDGED_SERIES
from wedgectl.store.bundle import read_bundle, write_bundle_in
from wedgectl.tui.model import Frame, ScrapedSample, build_frame, describe_target

if TYPE_CHECKING:
    from wedgectl.lab.swap import SwapPlan

__all__ = ["BundleSource", "Collector", "CpuMeter", "LiveSource", "ServerInfo", "find_servers", "save_bundle",
           "swap_available", "swap_target"]  # ServerInfo, find_servers: discover's, where top's picker finds them

TOP_NOTE = "captured by wedgectl top"
WINDOW = 60  # samples kept for the sparklines: 2 min at the default refresh
CLASSIFY_LAST = 10  # samples the live verdict rests on: 20 s at 2 s, longer than any rule's frozen threshold
STACKS_EVERY = 5  # py-spy on every 5th refresh (and on request): it costs wedgectl CPU, not the target's
STACKS_QUIET_S = 60.0  # while the verdict is healthy (idle, progressing): py-spy every 60 s instead
LOG_EVERY = 5  # re-read the log tail every 5th refresh (VERDICT_LOG_BYTES of it; a saved bundle, BUNDLE_LOG_BYTES)


class LiveSource:
    """A running deployment, found by pid or URL exactly as `diagnose` finds it, held in a live session."""

    live = True

    def __init__(self, deployment: Deployment, pid: int | None, url: str | None,
                 options: SamplerOptions = SamplerOptions(), window: int = WINDOW) -> None:
        self.options = options
        # The session's full look asks for the series the verdict and the view read: a twentieth of
        # vLLM's page, for the server to write and for top to parse every refresh. A saved bundle
        # holds those series. The process tree is walked every few seconds, not every refresh.
        self.session = LiveSession(deployment, pid, url, notes=(TOP_NOTE,), series=JUDGED_SERIES, tree=TreeCache(),
                                   scrape_timeout_s=options.scrape_timeout_s, keep=window)

    @classmethod
    def connect(cls, pid: int | None = None, url: str | None = None) -> LiveSource:
        """discover(); raises NoSuchProcess / NotVllm like diagnose does."""
        return cls(discover(pid=pid, url=url), pid, url)

    @property
    def deployment(self) -> Deployment:
        return self.session.deployment

    @property
    def pid(self) -> int | None:
        return self.session.pid

    @property
    def url(self) -> str | None:
        return self.session.url

    @property
    def label(self) -> str:
        return describe_target(self.session.manifest())

    @property
    def model(self) -> str:
        """The model it serves, named as top's picker and watch name it (discover.served_model)."""
        return self.session.model or "?"

    def manifest(self) -> Manifest:
        return self.session.manifest()

    def take(self, with_stacks: bool, native: bool = False) -> Sample:
        """A full look (one looks again first for an API server not listening yet)."""
        return self.session.full_look(with_stacks, replace(self.options, native=native))

    def close(self) -> None:
        self.session.close()

    def log_tail(self, max_bytes: int) -> tuple[str, ...]:
        return self.session.read_log(max_bytes)[0]


class BundleSource:
    """A saved bundle, replayed: the cursor picks how much of it the view has 'seen'."""

    live = False

    def __init__(self, bundle: Bundle, path: str | Path = "") -> None:
        self.bundle = bundle
        self.path = str(path)
        self.scraped = tuple(ScrapedSample.of(s) for s in bundle.samples)

    @classmethod
    def load(cls, path: str | Path) -> BundleSource:
        return cls(read_bundle(path), path)

    @property
    def label(self) -> str:
        return f"{Path(self.path).name or 'bundle'} ({describe_target(self.bundle.manifest)})"

    def manifest(self) -> Manifest:
        return self.bundle.manifest

    def frame_at(self, n: int) -> Frame:
        """The view after the first n samples; at the end, the verdict `diagnose --bundle` gives."""
        n = max(1, min(n, len(self.scraped))) if self.scraped else 0
        label = f"replay {self.label}, sample {n}/{len(self.scraped)}"
        return build_frame(self.bundle.manifest, self.scraped[:n], self.bundle.log_lines, target=label, live=False)


class Collector:
    """Refreshes of a LiveSource: a full look each, kept in its session's rolling window (the last
    `window` samples), and each sample's parsed copy beside it for the frames. tick() blocks; call
    it off the UI thread."""

    def __init__(self, source: LiveSource, window: int = WINDOW, stacks_every: int = STACKS_EVERY,
                 classify_last: int = CLASSIFY_LAST, log_every: int = LOG_EVERY,
                 stacks_quiet_s: float = STACKS_QUIET_S) -> None:
        self.source = source
        self.stacks_every = max(1, stacks_every)
        # A dump of every process is most of what a refresh costs. While the verdict is healthy
        # the stacks say little new: one every stacks_quiet_s; once it is not, every Nth refresh.
        self.stacks_quiet_s = stacks_quiet_s
        self._healthy = False
        self._stacks_at = float("-inf")
        self.classify_last = classify_last
        self.log_every = max(1, log_every)
        self.ticks = 0
        source.session.keep = window
        self._window: deque[ScrapedSample] = deque(maxlen=window)  # the session's samples, parsed once each
        self._log: tuple[str, ...] = ()
        self._lock = threading.Lock()  # guards the window
        self._running = threading.Lock()  # held for one tick: ticks never overlap
        self._want_stacks: bool | None = None  # None: no request; else native or not
        self.busy_since: float | None = None

    @property
    def busy(self) -> bool:
        return self._running.locked()

    def request_stacks(self, native: bool = False) -> None:
        """The next tick dumps stacks (natively if asked; a native request wins over a plain one)."""
        self._want_stacks = bool(native or self._want_stacks)

    def tick(self) -> Frame | None:
        """Take one sample and build the frame; None if a tick is already running."""
        if not self._running.acquire(blocking=False):
            return None
        self.busy_since = time.monotonic()
        try:
            native = bool(self._want_stacks)
            if self._healthy:
                due = time.monotonic() - self._stacks_at >= self.stacks_quiet_s
            else:
                due = self.ticks % self.stacks_every == 0
            with_stacks = self._want_stacks is not None or due
            self._want_stacks = None
            if with_stacks:
                self._stacks_at = time.monotonic()
            sample = self.source.take(with_stacks, native)
            if self.ticks % self.log_every == 0:
                self._log = self.source.log_tail(VERDICT_LOG_BYTES)
            self.ticks += 1
            with self._lock:
                self.source.session.record(sample)
                self._window.append(ScrapedSample.of(sample))
                window = tuple(self._window)
            frame = build_frame(self.source.manifest(), window, self._log, self.classify_last, self.source.label)
            self._healthy = frame.verdict is not None and frame.verdict.verdict.is_healthy
            return frame
        finally:
            self.busy_since = None
            self._running.release()

    def bundle(self) -> Bundle:
        """The window as an evidence bundle (full log tail), with the verdict over all of it."""
        with self._lock:
            samples = tuple(self.source.session.samples)
        log = self.source.log_tail(BUNDLE_LOG_BYTES)
        b = Bundle(self.source.manifest(), samples, log)
        return replace(b, verdict=classify(b))


class CpuMeter:
    """This process's CPU, its waited-for children's (py-spy) included, as a share of one core
    since the meter started: what top costs the machine it watches (the help screen shows it)."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.monotonic(), _cpu_s()

    def reading(self) -> tuple[float, float]:
        """(percent of one core, seconds measured)."""
        wall = time.monotonic() - self.t0
        return (100 * (_cpu_s() - self.c0) / wall if wall > 0 else 0.0), wall


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def save_bundle(bundle: Bundle, directory: Path) -> Path:
    """Write the bundle as a new wedgectl-top-YYYYmmdd-HHMMSS[-N].tar.gz in directory: made 0700, or
    an existing one of ours that no one else may write (bundle.open_bundle_dir; UnwritableOutput)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if bundle.verdict is None:
        bundle = replace(bundle, verdict=classify(bundle))
    names = itertools.chain([f"wedgectl-top-{stamp}.tar.gz"],
                            (f"wedgectl-top-{stamp}-{n}.tar.gz" for n in itertools.count(1)))
    return write_bundle_in(bundle, directory, names)


# ----------------------------------------------------------------- the swap


def swap_available() -> bool:
    """Whether this build has `wedgectl swap` (wedgectl.lab.swap.swap_deployment): it always has."""
    return True


def swap_target(pid: int, say: Callable[[str], object], plan: SwapPlan | None = None) -> tuple[str, int | None, bool]:
    """Run wedgectl.lab.swap.swap_deployment(pid) (on the `plan` shown, if any): (what happened, the new API server
    pid, ok)."""
    from wedgectl.lab.swap import swap_deployment  # only when asked: top starts without the lab

    def progress(message: str) -> None:
        say(message)

    result = swap_deployment(pid, progress=progress, plan=plan)
    new_pid, message = result.new_pid, result.message or ""
    if not result.ok:
        return f"swap failed: {message or 'see wedgectl swap --pid ' + str(pid)}", None, False
    return f"swapped to the patched engine{f': new pid {new_pid}' if new_pid else ''}" + (f" ({message})" if message
                                                                                          else ""), new_pid, True
