"""The watch loop: every target sampled each interval, classified, folded into episodes, recorded and served."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from pathlib import Path

from wedgectl.classify import classify
from wedgectl.collect.procfs import owner_uids
from wedgectl.capture.discover import BUNDLE_LOG_BYTES
from wedgectl.model.errors import WedgectlError
from wedgectl.capture.options import SamplerOptions
from wedgectl.capture.runner import Workers
from wedgectl.capture.window import capture
from wedgectl.read.redact import printable, redact_text
from wedgectl.model.types import Bundle, VerdictKind
from wedgectl.watch.exposition import DEFAULT_LISTEN, Endpoint, Snapshot, WebConfig
from wedgectl.watch.recorder import Rotation, check_bundle_dir, save_onset
from wedgectl.render.text import SCHEMA_VERSION
from wedgectl.watch.remediation import ERROR, GONE, NO_PATH, NOT_GONE, Act, Policy, TargetRemediation
from wedgectl.watch.state import Episode, Escalation, TargetView, Tracker, hang_onset, is_hang, iso, queue_of
from wedgectl.watch.targets import Spec, Watched, host_deployments, node_name

ONSET_WINDOW_S = 6.0  # the onset bundle's own capture (stops early once certain), probes alongside
MAX_WORKERS = 4  # targets sampled side by side; a slow one does not hold the others back
RECORD_WAIT_S = 60.0  # an episode's end line waits this long at most for its onset bundle
# An evaluation still running after this long is abandoned: its worker's slot goes to another target
# (its thread runs on, a daemon, and its target is skipped and shown stale until it ends). Every
# collector an evaluation calls is bounded well within it; this bounds what no collector foresaw.
EVALUATION_BOUND_S = 30.0
RECORD_BOUND_S = 300.0  # the same for an onset recording (its capture, the probes, the save)
# A remedy (its diagnosis, the act, the second diagnosis; a restart waits for /health) past this is abandoned
REMEDY_BOUND_S = 900.0
EXIT_WAIT_S = 2.0  # at exit, the ticks under way get this long to finish (SIGTERM to exit within 5 s)
TARGET_BUDGET_BYTES = 8 << 20  # each target's kept samples (--target-budget-mb)
TOTAL_BUDGET_BYTES = 256 << 20  # all targets' kept samples together (--total-budget-mb)
MAX_TARGETS = 64  # deployments adopted in host mode (--max-targets); named ones are always watched


@dataclass(frozen=True)
class WatchOptions:
    specs: tuple[Spec, ...] = ()  # none: every vLLM deployment on the host, rediscovered
    listen: str = DEFAULT_LISTEN
    web_config: WebConfig | None = None  # --web-config-file: TLS and basic auth on every path
    bundle_dir: Path | None = None
    rotation: Rotation = Rotation()
    grace_s: float = 120.0
    interval_s: float = 5.0
    rediscover_s: float = 30.0
    ebpf: str = "auto"  # probes in the onset capture: the best back-end down to /proc
    as_json: bool = False
    scrape_timeout_s: float = 2.0
    target_budget_bytes: int = TARGET_BUDGET_BYTES
    total_budget_bytes: int = TOTAL_BUDGET_BYTES
    max_targets: int = MAX_TARGETS
    users: frozenset[int] | None = None  # host mode adopts processes of these uids; None: root and our own
    remediate: Policy | None = None  # --remediate: the classes it acts on, and its budget


def json_line(obj: dict) -> str:
    """One event of watch's --json output: compact, with the schema version."""
    return json.dumps({**obj, "schema_version": SCHEMA_VERSION}, separators=(",", ":"), default=str)


def episode_lines(event: str, ep: Episode, as_json: bool, now: float) -> Iterator[str]:
    """One line per transition: 'start' when a target enters a hang class, 'end' when it leaves."""
    if as_json:
        yield json_line({"event": f"episode_{event}", **ep.to_json(now)})
        return
    tail = f"bundle {ep.bundle}" if ep.bundle else "no bundle"
    if event == "start":  # printable: the target's name carries a model_name the server chose
        yield printable(f"{iso(ep.start)} {ep.target}: {ep.verdict.value} began, queue {ep.peak_queue:.0f}, {tail}")
    else:
        yield printable(f"{iso(ep.end)} {ep.target}: {ep.verdict.value} ended after {ep.duration_s(now):.0f}s "
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
        self._workers = Workers(MAX_WORKERS, EVALUATION_BOUND_S)
        self._recorders = Workers(MAX_WORKERS, RECORD_BOUND_S, name="wedgectl-watch-record")
        self._running: dict[object, Future] = {}
        self._started: dict[object, float] = {}  # when each target's last evaluation began (monotonic)
        self._recording: dict[object, Future] = {}
        self.remediations: dict[object, TargetRemediation] = {}
        self._actors = Workers(1, REMEDY_BOUND_S, name="wedgectl-watch-remedy")  # one act at a time, host-wide
        self._discovered = 0.0
        self.users = options.users if options.users is not None else frozenset({0, os.getuid()})
        self._told: set[int] = set()  # host-mode pids whose skipping was said (said once, at first sight)

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
        found = host_deployments()
        self._told &= set(found)  # a pid gone and reused is a new process: said again
        for pid in found:
            if pid in known or pid in self._told:
                continue
            uids = owner_uids(pid)
            if uids is None:
                continue  # gone, or its owner unreadable: looked at again at the next discovery
            why = None
            if not set(uids) <= self.users:
                why = (f"run by uid {'/'.join(str(u) for u in sorted(set(uids)))}, not one of --users "
                       f"{','.join(str(u) for u in sorted(self.users))}")
            elif len(self.watched) >= self.options.max_targets:
                why = f"already watching --max-targets {self.options.max_targets} deployments"
            if why is not None:
                self._told.add(pid)
                with self._lock:
                    self.failures[("discovery", "skipped")] += 1
                self.say(f"skipped pid {pid}: {why}")
                continue
            try:
                self._add(pid, Watched.connect(Spec(pid=pid), self.node))
            except WedgectlError as exc:
                self._told.add(pid)
                self.say(f"skipped pid {pid}: {exc}")

    def _add(self, key: object, w: Watched) -> None:
        with self._lock:
            self.watched[key] = w
            self.escalations[key] = Escalation()
            self.trackers[key] = Tracker(w.name, w.labels)  # shown (stale) even before its first evaluation ends
            self._share_budget()
        self.say(redact_text(f"watching {w.name} (pid {w.pid or '-'}, {w.deployment.base_url or 'no URL yet'})"))

    def _drop(self, key: object, why: str) -> None:
        with self._lock:
            w = self.watched.pop(key)
            tracker = self.trackers.pop(key, None)
            self.escalations.pop(key, None)
            self._share_budget()
        w.close()
        ended = tracker.close(time.time()) if tracker else None
        if tracker is not None and ended is not None:
            self._ended(key, tracker, ended)
        self.say(f"stopped watching {w.name}: {why}")

    # ----------------------------------------------------------- sampling

    def _share_budget(self) -> None:
        """Each target's byte budget: --target-budget-mb, or its share of --total-budget-mb when the
        targets together would pass it (under the lock)."""
        share = min(self.options.target_budget_bytes, self.options.total_budget_bytes // max(1, len(self.watched)))
        for w in self.watched.values():
            w.set_budget(share)

    def tick(self) -> None:
        """Start a tick for every target whose last one is done, the longest-waiting first (a slow
        target skips, never piles up). A target whose last evaluation still runs, or that found
        no free worker, is skipped and shown stale."""
        self.rediscover()
        for key in sorted(self.watched, key=lambda k: self._started.get(k, float("-inf"))):
            fut = self._running.get(key)
            if fut is None or fut.done():
                fut = self._workers.submit(self._tick_one, key)
                if fut is not None:
                    self._running[key] = fut
                    self._started[key] = time.monotonic()
                    continue
            with self._lock:
                tracker = self.trackers.get(key)
                if tracker is not None:
                    tracker.skipped()

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
            tracker = self.trackers.setdefault(key, Tracker(w.name, w.labels))
            before = tracker.verdict.verdict if tracker.verdict is not None else None
        onset = None
        if verdict.verdict is not before and is_hang(verdict.verdict):  # dated once, as it begins
            onset = hang_onset(verdict.verdict, verdict, tuple(w.samples), w.log_tail(fresh=True), sample.t)
        with self._lock:
            if tracker.last_evaluation is None:
                tracker.name, tracker.labels = w.name, w.labels  # named from its first sample's model, never after
            changed = tracker.observe(verdict, sample.t, queue_of(window), onset)
            esc.update(window, verdict.verdict)
            hang_since = tracker.current.start if tracker.current is not None else None
        if self.options.remediate is not None:
            self._maybe_remedy(key, w, verdict.verdict, hang_since, changed)
        if changed is None:
            return
        if changed.open:
            # The onset capture takes seconds: off the tick, so this target's looks go on meanwhile.
            recording = self._recorders.submit(self._onset, w, tracker, changed)
            if recording is None:  # every recorder busy: the start line goes out without a bundle
                self._emit("start", changed)
            else:
                self._recording[key] = recording
        else:
            self._ended(key, tracker, changed)

    # ----------------------------------------------------------- acting (--remediate)

    def _maybe_remedy(self, key: object, w: Watched, kind: VerdictKind, hang_since: float | None,
                      changed: Episode | None) -> None:
        policy = self.options.remediate
        assert policy is not None
        now = time.time()
        with self._lock:
            rem = self.remediations.setdefault(key, TargetRemediation())
            storm = rem.episode_opened(policy, changed.verdict, now) if changed is not None and changed.open else None
            go, _held = rem.due(policy, kind, hang_since, now, self.options.grace_s)
            if go and w.pid is not None:
                rem.begin(now)
        if storm is not None:
            self._emit_event({"event": "remediation_storm", "target": w.name, "verdict": kind.value, "why": storm},
                             f"{iso(now)} {w.name}: remediation storm: {storm}")
        if go and w.pid is not None and self._actors.submit(self._remedy, key, w, kind) is None:
            with self._lock:
                rem.acted(Act(now, kind, "none", ERROR, "no free worker to act"))

    def _remedy(self, key: object, w: Watched, kind: VerdictKind) -> None:
        """Run the remedy for the target's hang (lab.remedy: its own diagnosis, saved with the episode's
        bundles before it acts; the act; a second diagnosis) and record what it came to."""
        from wedgectl.capture.diagnosis import LiveOptions
        from wedgectl.lab.remedy import remedy

        t = time.time()
        assert w.pid is not None
        options = LiveOptions(window_s=ONSET_WINDOW_S, ebpf="off", low_priority=False)  # the whole process's nice
        try:
            out = remedy(w.pid, yes=True, restart=True, save_to=None, options=options,
                         on_evidence=lambda found: self._save_remedy_evidence(w, found.bundle, kind))
            if not out.acted and out.plan.verdict is not kind:  # its closer look disagrees: nothing done or counted
                with self._lock:
                    self.remediations.setdefault(key, TargetRemediation()).cancel()
                self.say(f"{w.name}: the remedy's diagnosis found {out.plan.verdict.value}, not {kind.value}: no act")
                return
            result = GONE if out.gone else NOT_GONE if out.acted else NO_PATH
            detail = out.failed or "; ".join(out.done[:3]) or out.plan.why
            act = Act(t, kind, out.plan.action, result, detail[:500])
        except Exception as exc:  # noqa: BLE001 - an act that failed is recorded, never fatal to the watcher
            act = Act(t, kind, "unknown", ERROR, f"{type(exc).__name__}: {exc}"[:500])
        with self._lock:
            self.remediations.setdefault(key, TargetRemediation()).acted(act)
        self._emit_event({"event": "remediation", "target": w.name, **act.to_json()},
                         f"{iso(act.t)} {w.name}: remedy {act.action} for {kind.value}: {act.result}"
                         + (f" ({act.detail})" if act.detail else ""))

    def _save_remedy_evidence(self, w: Watched, bundle: Bundle, kind: VerdictKind) -> None:
        """The remedy's evidence with the episode's bundles, when its diagnosis confirms the hang it acts on."""
        if self.options.bundle_dir is None or bundle.verdict is None or bundle.verdict.verdict is not kind:
            return
        try:
            save_onset(bundle, self.options.bundle_dir, w.name, "remedy", self.options.rotation)
        except (OSError, WedgectlError) as exc:
            with self._lock:
                self.failures[("recorder", "error")] += 1
            self.say(f"{w.name}: the remedy's evidence was not saved: {exc}")

    def _emit_event(self, obj: dict, text: str) -> None:
        if self.options.as_json:
            self.emit(json_line(obj))
        else:
            self.emit(printable(text))

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
        before = w.bundle("captured by wedgectl watch at an episode's onset", log_bytes=BUNDLE_LOG_BYTES,
                          fresh_log=True)
        try:
            # no log_path: capture finds the log through the process again, and reads it through its fd
            now = capture(pid=w.pid, url=None if w.pid else w.deployment.base_url, options=opts)
            bundle = Bundle(replace(now.manifest, notes=before.manifest.notes + now.manifest.notes),
                            before.samples + now.samples, now.log_lines or before.log_lines)
        except WedgectlError as exc:
            self.say(f"{w.name}: onset capture failed ({exc}); saving the window alone")
            bundle = before
        bundle = replace(bundle, verdict=classify(bundle))
        try:
            return str(save_onset(bundle, self.options.bundle_dir, w.name, ep.verdict.value, self.options.rotation))
        except (OSError, WedgectlError) as exc:  # UnwritableOutput: the directory is no longer ours alone
            with self._lock:
                self.failures[("recorder", "error")] += 1
            self.say(f"{w.name}: bundle not saved: {exc}")
            return None

    def _emit(self, event: str, ep: Episode) -> None:
        for line in episode_lines(event, ep, self.options.as_json, time.time()):
            self.emit(line)

    def shutdown(self) -> None:
        """Nothing is joined: the workers are daemon threads, each abandoned where it is."""
        for w in list(self.watched.values()):
            w.close()

    # ----------------------------------------------------------- serving

    def snapshot(self) -> Snapshot:
        with self._lock:
            views = tuple(self._with_acts(k, self.trackers[k].view(
                w.deployment.base_url, w.pid, self.escalations[k].full, kept_bytes=w.kept_bytes,
                budget_exceeded=w.budget_exceeded, up=w.up)) for k, w in self.watched.items() if k in self.trackers)
            return Snapshot(time.time(), self.options.grace_s, views, dict(self.failures))

    def _with_acts(self, key: object, view: TargetView) -> TargetView:
        rem = self.remediations.get(key)
        return view if rem is None else replace(view, remediations=tuple(rem.acts), remediation_storm=rem.storm)

    def close(self, wait_s: float = EXIT_WAIT_S) -> None:
        """Let the ticks under way finish (each is bounded), for at most wait_s."""
        wait([*self._running.values(), *self._recording.values()], timeout=wait_s)


def run_watch(options: WatchOptions, stop: threading.Event, emit: Callable[[str], None],
              say: Callable[[str], None], max_s: float | None = None) -> int:
    """Serve and watch until stop is set (SIGTERM, SIGINT) or max_s passes. Raises WedgectlError for
    a bad --pid/--url and OSError when --listen cannot be bound."""
    if options.bundle_dir is not None:
        check_bundle_dir(options.bundle_dir)  # UnwritableOutput: refused before anything starts
    watcher = Watcher(options, emit, say)
    watcher.connect_explicit()
    endpoint = Endpoint(options.listen, watcher.snapshot, options.web_config).start()
    say(f"serving {endpoint.url}: {endpoint.paths}; every {options.interval_s:g}s, "
        f"grace {options.grace_s:g}s, bundles {options.bundle_dir or 'not saved (no --bundle-dir)'}")
    if endpoint.exposure is not None:
        say(f"warning: {endpoint.exposure}")
    if options.remediate is not None:
        say(f"acting on {', '.join(sorted(k.value for k in options.remediate.classes))} after the grace, at most "
            f"{options.remediate.budget} act(s) per server per hour")
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
