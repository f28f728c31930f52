"""The diagnose window: samples until the verdict is certain or the window ends, escalating as policy says.

The sampler feeds the same `classify` as a saved bundle (one code path for live and recorded
evidence). It takes the cheapest decisive evidence first and asks the classifier after every
sample, stopping once the verdict is certain; the escalation order is in docs/design.md ("How a
capture escalates") and its rules in capture.policy. The deployment, its manifest and its log are
the live session's (capture.session), as top's and watch's are.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import replace

from wedgectl.capture.bursts import collect_stacks
from wedgectl.capture.discover import BUNDLE_LOG_BYTES, VERDICT_LOG_BYTES, discover
from wedgectl.capture.options import INTERRUPTED_NOTE, SamplerOptions
from wedgectl.capture.policy import (
    BURST_CLASSES,
    CERTAIN,
    QUICK_LOOK_S,
    Step,
    hang_shaped,
    next_step,
    quick_look,
    stacks_cannot_help,
    thin_scrapes,
)
from wedgectl.capture.probing import Probes, with_probes
from wedgectl.capture.runner import run_in_background
from wedgectl.capture.sample import PendingSample, begin_sample
from wedgectl.capture.session import LiveSession
from wedgectl.classify import Facts, classify, classify_facts
from wedgectl.classify.judged import judged_sample
from wedgectl.collect import procfs
from wedgectl.collect.priority import restore_priority_if_starved
from wedgectl.collect.scrape import failure_kind
from wedgectl.model.errors import BadMetrics, NoSuchProcess, Unreachable, WedgectlError
from wedgectl.model.types import Bundle, FailureKind, Sample, Verdict, VerdictKind
from wedgectl.read.metrics import MetricsParseError, parse_metrics
from wedgectl.store.sources import steal_facts

EXITED_NOTE = "the deployment exited mid-capture"
MAX_IN_FLIGHT = 2  # scrapes of a slow server overlapping on the sampling clock


def capture(pid: int | None = None, url: str | None = None, log_path: str | os.PathLike[str] | None = None,
            options: SamplerOptions = SamplerOptions()) -> Bundle:
    """Sample the target until the verdict is certain or the window ends; the bundle (verdict not set).

    The eBPF probes (capture.probing) run at most once: from the start with --ebpf on, from the
    escalation step with auto; stopped whatever ends the capture; their results go on the last sample."""
    dep = discover(pid=pid, url=url)
    probes = Probes(dep, options)
    try:
        if options.ebpf == "on":
            probes.start(options.window_s)
        session = LiveSession(dep, pid, url, log_path=log_path, scrape_timeout_s=options.scrape_timeout_s,
                              startup_quiet_s=options.startup_quiet_s)
        try:
            bundle = Window(session, options, probes).run()
        finally:
            session.close()
    finally:
        probe_records, probe_failures = probes.stop()
    return with_probes(bundle, probe_records, probe_failures)


class Window:
    """One diagnose window over a live session: the sampling clock, the samples in flight (at most
    MAX_IN_FLIGHT: a slow scrape does not hold the clock), the verdict after each sample taken, and
    the engine's stack burst, from asked for to in the evidence. run() gives the bundle."""

    def __init__(self, session: LiveSession, options: SamplerOptions, probes: Probes) -> None:
        self.session, self.options, self.probes = session, options, probes
        self.dep = dep = session.deployment
        self.say = options.progress or (lambda _msg: None)
        self.notes: list[str] = []
        self.samples = session.samples
        self.judged: list[Sample] = []  # lean copies: the classifier re-reads every scrape after each sample
        self.pending: deque[PendingSample] = deque()
        self.verdict: Verdict | None = None  # the last in-window verdict
        self.over = False  # stopped: a certain verdict, the window's end, or the deployment gone
        self.interrupted = False  # Ctrl-C ended it: the bundle is what was sampled by then
        # The sampling clock: when the next sample is due; while a quick look is due, the grid's
        # next tick it replaced.
        self.due = time.monotonic()
        self.after_quick: float | None = None
        # Stacks: what the next sample to begin dumps (the first: one dump of every Python
        # process); the engine's burst asked for, begun early for the next sample to carry, and
        # in the evidence; whether every Python process has been dumped once.
        self.burst = 1 if options.stacks else 0
        self.burst_asked = self.burst_taken = self.dumped_all = False
        self.early: tuple[Future, int] | None = None
        if dep.root_pid is not None:
            self.say(f"deployment: {', '.join(f'{p} {r.value}' for p, r in dep.roles.items())}; "
                     f"metrics {dep.metrics_url or 'none (no listening socket)'}")
        log_path = session.log_path or dep.log_path
        if log_path:
            self.notes.append(f"log: {log_path}")
        if dep.root_pid is None:
            self.notes.append("metrics-only evidence: no process was given (--pid)")
        # The hypervisor's steal over the capture, for a local target (a host fact: steal_facts).
        self.steal = (procfs.cpu_steal_s(), time.monotonic()) if dep.root_pid is not None else None
        # The in-window verdicts read one tail of the log, read once; the bundle gets the longer tail.
        self.decide_log = session.read_log(VERDICT_LOG_BYTES)[0]

    def run(self) -> Bundle:
        try:
            self._sample_until_over()
        except KeyboardInterrupt:
            # Ctrl-C: what was sampled so far is the evidence, marked partial (INTERRUPTED_NOTE); with no
            # sample at all there is nothing to say, and the interrupt goes on.
            if not self.samples or not self.options.partial_on_interrupt:
                raise
            self.interrupted = True
            self.notes.append(f"{INTERRUPTED_NOTE} after {len(self.samples)} sample(s)")
        return self._bundle()

    def _sample_until_over(self) -> None:
        while not self.over:
            starved = restore_priority_if_starved()
            if starved:
                self.notes.append(starved)
                self.say(starved)
            self._begin_when_due()
            if not self.pending:
                time.sleep(max(0.0, self.due - time.monotonic()))
                continue
            # Wait for the oldest scrape, or until the next sample is due when another may start;
            # never past the oldest's own bound (what it has not got by then, it goes without).
            room = len(self.pending) < MAX_IN_FLIGHT
            until = min(self.due, self.pending[0].due) if room else self.pending[0].due
            wait([self.pending[0].rest], timeout=max(0.0, until - time.monotonic()))
            while not self.over and self.pending and self.pending[0].ready():
                self._take(self.pending.popleft())
        # A stop leaves at most one scrape in flight: it is abandoned (its thread ends within the
        # scrape timeout), not waited for.

    def _begin_when_due(self) -> None:
        if time.monotonic() < self.due or len(self.pending) >= MAX_IN_FLIGHT:
            return
        self.pending.append(begin_sample(self.dep, self.session.scraper, self.options, self.burst, self.early,
                                         first=not self.samples and not self.pending, others=not self.dumped_all))
        self.burst, self.early = 0, None
        if self.after_quick is not None:  # the quick look begun: back on the grid of the first answer
            self.due, self.after_quick = self.after_quick, None
        else:
            self.due += self.options.interval_s
        if self.due < time.monotonic():  # a slow /proc or py-spy: skip the missed ticks, do not bunch them
            self.due = time.monotonic() + self.options.interval_s

    def _take(self, done: PendingSample) -> None:
        """One sample in: the verdict so far, and what the escalation makes of it."""
        sample = done.sample(self.dep)
        self.samples.append(sample)
        self.burst_taken = self.burst_taken or done.burst > 1
        self.dumped_all = self.dumped_all or done.burst == 1
        first = len(self.samples) == 1
        if first and not self.pending:
            # Count the interval from the first answer, not the first request: the first scrape
            # also connects, and the span the classifier needs is measured between answers.
            self.due = time.monotonic() + self.options.interval_s
        if self.dep.root_pid is not None and not sample.processes:
            self.notes.append(EXITED_NOTE)
            self.say(EXITED_NOTE)
            self.over = True
            return
        elapsed = sample.t - self.samples[0].t
        self.judged.append(judged_sample(sample))
        facts = Facts(Bundle(self.session.manifest(), tuple(self.judged), self.decide_log))  # verdict and escalation
        self.verdict = verdict = classify_facts(facts)
        if self.options.progress:  # the lean copy: classify has just parsed it (parse_metrics caches by text)
            self.say(f"sample {len(self.samples)} at {elapsed:4.1f}s: {summarise(self.judged[-1])} -> "
                     f"{verdict.verdict.value} ({verdict.confidence:.2f})")
        suspect = first and hang_shaped(facts)
        answered = sample.t - facts.scrapes[0][0] if facts.scrapes else None
        step = next_step(verdict, len(self.samples), elapsed, self.options, self.burst_taken, self.probes.started,
                         suspect, thin_scrapes(facts), answered)
        if not step.stop and first and not self.pending and quick_look(facts, suspect, self.options):
            self.after_quick, self.due = self.due, time.monotonic() + QUICK_LOOK_S
            self.say(f"quick look in {QUICK_LOOK_S:.1f}s: counters that move by then decide it")
        if step.why:
            self.say(step.why)
        if step.stop:
            self.over = True
            return
        self._escalate(step, sample, elapsed)

    def _escalate(self, step: Step, sample: Sample, elapsed: float) -> None:
        if step.burst and not self.burst_asked:
            # Dumped now, in the interval's wait, not when the next sample begins: that sample
            # then carries stacks already taken, and its verdict does not wait for py-spy.
            self.burst_asked = True
            if sample.processes:
                procs, n, native, others = sample.processes, step.burst, self.options.native, not self.dumped_all
                self.early = (run_in_background({"stacks": lambda: collect_stacks(procs, native, n, others)}), n)
            else:
                self.burst = step.burst
        if step.probes:
            self.probes.start(self.options.window_s - elapsed)

    def _bundle(self) -> Bundle:
        log_lines, log_notes = self.session.read_log(BUNDLE_LOG_BYTES)
        self.notes += log_notes
        self._dump_at_the_end(log_lines)
        manifest = self.session.manifest()
        host = manifest.host
        if self.steal is not None:
            cpu_steal, t0 = self.steal
            host = {**host, **steal_facts(cpu_steal, procfs.cpu_steal_s(), time.monotonic() - t0)}
        return Bundle(replace(manifest, notes=tuple(self.notes), host=host), tuple(self.samples), log_lines)

    def _dump_at_the_end(self, log_lines: tuple[str, ...]) -> None:
        """Stacks the window stopped before taking, onto its last sample, for the verdict's evidence:
        the engine's burst for a hang class it ended on uncertain (a loaded host's samples came
        late, or the first did not look hung: whether a rank's frame stayed put is what that
        verdict reads), else the one dump of every process a stepping engine's first sample left
        out. None when a burst was taken, or for a verdict stacks cannot move (stacks_cannot_help)
        or "progressing" (live counters moving; none is taken for it)."""
        last = self.samples[-1] if self.samples else None
        if (not self.options.stacks or self.burst_taken or last is None or not last.processes
                or self.verdict is None or self.interrupted):  # interrupted: no py-spy after the Ctrl-C
            return
        final = self._final_verdict(log_lines)
        n = self.options.stack_burst if final.verdict in BURST_CLASSES and final.confidence < CERTAIN else 1
        if final.verdict is VerdictKind.PROGRESSING or stacks_cannot_help(final) or (n <= 1 and self.dumped_all):
            return
        self.say("window over before the stack burst: the engine's stacks now" if n > 1 else "stacks of every process")
        dumps, fails = collect_stacks(last.processes, self.options.native, n, others=not self.dumped_all)
        self.samples[-1] = replace(last, stacks=last.stacks + dumps, failures=last.failures + tuple(fails))

    def _final_verdict(self, log_lines: tuple[str, ...]) -> Verdict:
        """The window's last verdict; but "progressing" read from the log alone (the live rules could
        not decide: thin scrapes), with no dump taken yet, is read again from the log as it is now,
        which may have grown to say otherwise. Live counters that moved no log overrules."""
        verdict = self.verdict
        assert verdict is not None
        if self.dumped_all or verdict.verdict is not VerdictKind.PROGRESSING or not verdict.rule.startswith("log_"):
            return verdict
        final = classify(Bundle(self.session.manifest(), tuple(self.judged), log_lines))
        if final.verdict is not VerdictKind.PROGRESSING:
            self.say(f"the log now reads {final.verdict.value}")
        return final


def summarise(s: Sample) -> str:
    """One line on a sample for the progress output: the queue, tokens generated, processes read."""
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
