"""The watch loop: every target sampled each interval, classified, folded into episodes, recorded and served."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from wedgectl.classify import classify
from wedgectl.errors import WedgectlError
from wedgectl.sampler import SamplerOptions, capture
from wedgectl.redact import redact_text
from wedgectl.types import Bundle
from wedgectl.watch.exposition import DEFAULT_LISTEN, Endpoint, Snapshot
from wedgectl.watch.recorder import Rotation, save_onset
from wedgectl.watch.state import Episode, Escalation, Tracker, iso, queue_of
from wedgectl.watch.targets import BUNDLE_LOG_BYTES, Spec, Watched, host_deployments, node_name

ONSET_WINDOW_S = 6.0  # the onset bundle's own capture (stops early once certain), probes alongside
MAX_WORKERS = 4  # targets sampled side by side; a slow one does not hold the others back
RECORD_WAIT_S = 60.0  # an episode's end line waits this long at most for its onset bundle


@dataclass(frozen=True)
class WatchOptions:
    specs: tuple[Spec, ...] = ()  # none: every vLLM deployment on the host, rediscovered
    listen: str = DEFAULT_LISTEN
    bundle_dir: Path | None = None
    rotation: Rotation = Rotation()
    grace_s: float = 120.0
    interval_s: float = 5.0
    rediscover_s: float = 30.0
    ebpf: str = "auto"  # probes in the onset capture: the best back-end down to /proc
    as_json: bool = False
    scrape_timeout_s: float = 2.0


def episode_lines(event: str, ep: Episode, as_json: bool, now: float) -> Iterator[str]:
    """One line per transition: 'start' when a target enters a hang class, 'end' when it leaves."""
    if as_json:
        yield json.dumps({"event": f"episode_{event}", **ep.to_json(now)}, separators=(",", ":"))
        return
    tail = f"bundle {ep.bundle}" if ep.bundle else "no bundle"
    if event == "start":
        yield f"{iso(ep.start)} {ep.target}: {ep.verdict.value} began, queue {ep.peak_queue:.0f}, {tail}"
    else:
        yield (f"{iso(ep.end)} {ep.target}: {ep.verdict.value} ended after {ep.duration_s(now):.0f}s "
               f"(began {iso(ep.start)}, peak queue {ep.peak_queue:.0f}), {tail}")


class Watcher:
    """The targets, their trackers and the failure counts; tick() samples every target once."""

    def __init__(self, options: WatchOptions, emit: Callable[[str], None], say: Callable[[str], None]) -> None:
        self.options = options
        self.emit = emit
        self.say = say
        self.node = node_name()
        self.sampler = SamplerOptions(scrape_timeout_s=options.scrape_timeout_s)
        self.watched: dict[object, Watched] = {}
        self.trackers: dict[object, Tracker] = {}
        self.escalations: dict[object, Escalation] = {}
        self.failures: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="wedgectl-watch")
        self._running: dict[object, Future] = {}
        self._recording: dict[object, Future] = {}
        self._discovered = 0.0

    # ----------------------------------------------------------- targets

    def connect_explicit(self) -> None:
        """Resolve --pid / --url once at start: a bad one is an error the operator sees at once."""
        for spec in self.options.specs:
            self._add(spec, Watched.connect(spec, self.node))

    def rediscover(self) -> None:
        """Host mode: add deployments that appeared; those that went are dropped by their tick."""
        if self.options.specs or time.monotonic() - self._discovered < self.options.rediscover_s:
            return
        self._discovered = time.monotonic()
        known = {w.pid for w in self.watched.values()}
        for pid in host_deployments():
            if pid in known:
                continue
            try:
                self._add(pid, Watched.connect(Spec(pid=pid), self.node))
            except WedgectlError as exc:
                self.say(f"skipped pid {pid}: {exc}")

    def _add(self, key: object, w: Watched) -> None:
        with self._lock:
            self.watched[key] = w
            self.escalations[key] = Escalation()
        self.say(redact_text(f"watching {w.name} (pid {w.pid or '-'}, {w.deployment.base_url or 'no URL yet'})"))

    def _drop(self, key: object, why: str) -> None:
        with self._lock:
            w = self.watched.pop(key)
            tracker = self.trackers.pop(key, None)
            self.escalations.pop(key, None)
        w.close()
        ended = tracker.close(time.time()) if tracker else None
        if ended is not None:
            self._ended(key, tracker, ended)
        self.say(f"stopped watching {w.name}: {why}")

    # ----------------------------------------------------------- sampling

    def tick(self) -> None:
        """Start a tick for every target whose last one is done (a slow target skips, never piles up)."""
        self.rediscover()
        for key in list(self.watched):
            fut = self._running.get(key)
            if fut is not None and not fut.done():
                continue
            self._running[key] = self._pool.submit(self._tick_one, key)

    def _tick_one(self, key: object) -> None:
        try:
            self._evaluate(key)
        except Exception as exc:  # noqa: BLE001 - one target's bug must not stop the others
            with self._lock:
                self.failures[("watch", "error")] += 1
            self.say(f"internal error on a target: {type(exc).__name__}: {exc}")

    def _evaluate(self, key: object) -> None:
        w, esc = self.watched.get(key), self.escalations.get(key)
        if w is None or esc is None:
            return
        if not w.alive:
            self._drop(key, "the process exited")
            return
        sample = w.sample(full=esc.full, stacks=esc.stacks_due, options=self.sampler)
        with self._lock:
            self.failures.update((f.collector, f.kind.value) for f in sample.failures)
        window = w.window()
        verdict = classify(Bundle(w.manifest("captured by wedgectl watch"), window, w.log_tail(fresh=esc.full)))
        with self._lock:
            tracker = self.trackers.setdefault(key, Tracker(w.name))
            changed = tracker.observe(verdict, sample.t, queue_of(window))
            esc.update(window, verdict.verdict)
        if changed is None:
            return
        if changed.open:
            # The onset capture takes seconds: off the tick, so this target's looks go on meanwhile.
            self._recording[key] = self._pool.submit(self._onset, w, tracker, changed)
        else:
            self._ended(key, tracker, changed)

    def _ended(self, key: object, tracker: Tracker, ep: Episode) -> None:
        """The end line, once the onset's recording is done: the start line comes first, and the end
        line carries its bundle."""
        pending = self._recording.pop(key, None)
        if pending is not None:
            wait([pending], timeout=RECORD_WAIT_S)
        with self._lock:
            ep = next((e for e in tracker.episodes if e.start == ep.start), ep)
        self._emit("end", ep)

    def _onset(self, w: Watched, tracker: Tracker, ep: Episode) -> None:
        path = self._record(w, ep)
        if path is not None:
            with self._lock:
                tracker.attach_bundle(ep, path)
            ep = replace(ep, bundle=path)
        self._emit("start", ep)

    def _record(self, w: Watched, ep: Episode) -> str | None:
        """The onset bundle: the samples before it, a fresh capture with stacks and probes, the log tail."""
        if self.options.bundle_dir is None:
            return None
        opts = SamplerOptions(window_s=ONSET_WINDOW_S, interval_s=1.0, ebpf=self.options.ebpf,
                              scrape_timeout_s=self.options.scrape_timeout_s)
        before = w.bundle("captured by wedgectl watch at an episode's onset", log_bytes=BUNDLE_LOG_BYTES, fresh_log=True)
        try:
            now = capture(pid=w.pid, url=None if w.pid else w.deployment.base_url,
                          log_path=w.deployment.log_path, options=opts)
            bundle = Bundle(replace(now.manifest, notes=before.manifest.notes + now.manifest.notes),
                            before.samples + now.samples, now.log_lines or before.log_lines)
        except WedgectlError as exc:
            self.say(f"{w.name}: onset capture failed ({exc}); saving the window alone")
            bundle = before
        bundle = replace(bundle, verdict=classify(bundle))
        try:
            return str(save_onset(bundle, self.options.bundle_dir, w.name, ep.verdict.value, self.options.rotation))
        except OSError as exc:
            with self._lock:
                self.failures[("recorder", "error")] += 1
            self.say(f"{w.name}: bundle not saved: {exc}")
            return None

    def _emit(self, event: str, ep: Episode) -> None:
        for line in episode_lines(event, ep, self.options.as_json, time.time()):
            self.emit(line)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for w in list(self.watched.values()):
            w.close()

    # ----------------------------------------------------------- serving

    def snapshot(self) -> Snapshot:
        with self._lock:
            views = tuple(self.trackers[k].view(w.deployment.base_url, w.pid, self.escalations[k].full)
                          for k, w in self.watched.items() if k in self.trackers)
            return Snapshot(time.time(), self.options.grace_s, views, dict(self.failures))

    def close(self, wait_s: float = 5.0) -> None:
        """Let the ticks under way finish (each is bounded), for at most wait_s."""
        wait([*self._running.values(), *self._recording.values()], timeout=wait_s)


def run_watch(options: WatchOptions, stop: threading.Event, emit: Callable[[str], None],
              say: Callable[[str], None], max_s: float | None = None) -> int:
    """Serve and watch until stop is set (SIGTERM, SIGINT) or max_s passes. Raises WedgectlError for
    a bad --pid/--url and OSError when --listen cannot be bound."""
    watcher = Watcher(options, emit, say)
    watcher.connect_explicit()
    endpoint = Endpoint(options.listen, watcher.snapshot).start()
    say(f"serving http://{endpoint.address}/metrics, /livez and /v1/targets; every {options.interval_s:g}s, "
        f"grace {options.grace_s:g}s, bundles {options.bundle_dir or 'not saved (no --bundle-dir)'}")
    start = time.monotonic()
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            watcher.tick()
            if max_s is not None and time.monotonic() - start >= max_s:
                break
            stop.wait(max(0.0, options.interval_s - (time.monotonic() - t0)))
    finally:
        endpoint.close()
        watcher.close()
        watcher.shutdown()
    return 0
