"""The sampler's escalation (capture.policy.next_step) and the short-window certainty it relies on, on recorded bundles.

Each recorded bundle (tests/fixtures/bundles) is a real capture, one sample a
second. Replaying its samples one by one shows what a live capture decides after
each: stop, sample on, take a stack burst, attach the probes. The classifier
decides certainty; these tests hold that a short window is never enough for a hang
unless the evidence agrees, and that a healthy server is released after two scrapes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.classify.corroboration import starved_for_capacity, wedge_refused_for_capacity
from wedgectl.classify.facts import MIN_FROZEN_S, Facts
from wedgectl.read.metrics import parse_metrics
from wedgectl.capture.options import ESCALATE_BURST, SamplerOptions
from wedgectl.capture.policy import CERTAIN, hang_shaped, next_step
from wedgectl.model.types import Bundle, Role, VerdictKind

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


def load(name: str) -> Bundle:
    return replace(read_bundle(BUNDLES / f"{name}.tar.gz"), verdict=None)


def replay(b: Bundle, options: SamplerOptions = SamplerOptions(ebpf="auto")) -> list[tuple[int, VerdictKind, float, object]]:
    """(samples seen, verdict, confidence, step) after each sample, as the live loop decides, until it stops."""
    out = []
    burst_taken = probes = False
    for k in range(1, len(b.samples) + 1):
        prefix = replace(b, samples=b.samples[:k])
        v = classify(prefix)
        elapsed = b.samples[k - 1].t - b.samples[0].t
        step = next_step(v, k, elapsed, options, burst_taken, probes, k == 1 and hang_shaped(Facts(prefix)))
        out.append((k, v.verdict, v.confidence, step))
        burst_taken = burst_taken or step.burst > 1
        probes = probes or step.probes
        if step.stop:
            break
    return out


@pytest.mark.parametrize("name, kind", [("healthy", VerdictKind.PROGRESSING), ("idle", VerdictKind.IDLE),
                                        ("shutdown-hang", VerdictKind.SHUTDOWN_HANG)])
def test_two_scrapes_decide_the_cheap_states(name, kind):
    steps = replay(load(name))
    k, verdict, confidence, step = steps[-1]
    assert (k, verdict, step.stop) == (2, kind, True)  # one second of evidence, no burst, no probes
    assert confidence >= CERTAIN
    assert not any(s.burst > 1 or s.probes for *_, s in steps)


def test_one_sample_never_decides():
    b = load("healthy")
    v = classify(replace(b, samples=b.samples[:1]))
    step = next_step(v, 1, 0.0, SamplerOptions(), False, False)
    assert not step.stop and step.burst == 0


def test_a_hang_shaped_first_sample_buys_the_burst_for_the_second():
    b = load("admission-wedge")  # 1 waiting, 0 running: a wedge's gauges
    first = replace(b, samples=b.samples[:1])
    assert hang_shaped(Facts(first))
    step = next_step(classify(first), 1, 0.0, SamplerOptions(), False, False, suspect=True)
    assert not step.stop and step.burst == ESCALATE_BURST
    assert next_step(classify(first), 1, 0.0, SamplerOptions(stacks=False), False, False, suspect=True).burst == 0
    # A deadlock's first sample is hang-shaped only with the kernel's record of a stepless engine.
    d = load("engine-deadlock")
    assert not hang_shaped(Facts(replace(d, samples=d.samples[:1])))
    assert hang_shaped(Facts(replace(d, samples=(with_quiet(d.samples[0], 1.5),))))
    # A healthy server's first sample is not: it pays for no burst.
    h = load("healthy")
    assert not hang_shaped(Facts(replace(h, samples=h.samples[:1])))
    assert not hang_shaped(Facts(replace(h, samples=(with_quiet(h.samples[0], 0.0),))))


def with_quiet(sample, quiet_s: float, roles=(Role.ENGINE_CORE, Role.WORKER)):
    """A recorded sample whose engine processes' main threads had gone quiet_s without a CPU."""
    return replace(sample, processes=tuple(replace(p, main_quiet_s=quiet_s if p.role in roles else None)
                                            for p in sample.processes))


@pytest.mark.parametrize("name", ["admission-wedge", "engine-deadlock"])
def test_a_hang_is_not_certain_on_a_short_window(name):
    """Counters frozen for less than MIN_FROZEN_S, with no burst and no record of how long the engine
    has been still: a slow step looks the same. Not certain, so the capture samples on, and the
    first uncertain verdict buys a burst of the engine's stacks."""
    b = load(name)
    short = replace(b, samples=b.samples[:2])
    assert Facts(short).gen_tokens.span_s < MIN_FROZEN_S
    v = classify(short)
    assert v.confidence < CERTAIN
    step = next_step(v, 2, short.samples[-1].t - short.samples[0].t, SamplerOptions(), False, False)
    assert not step.stop and step.burst == ESCALATE_BURST


def test_wedge_is_certain_once_the_burst_agrees():
    """Refused for capacity at every scrape, empty KV pool, engine spinning and the Workers outside
    the model in the burst: certain after MIN_FROZEN_S, long before CERTAIN_FROZEN_S."""
    b = load("admission-wedge")
    # The first three samples (2 s) plus the recorded burst: what the escalating sampler takes.
    window = replace(b, samples=(*b.samples[:2], replace(b.samples[2], stacks=b.samples[-1].stacks)))
    f = Facts(window)
    assert f.gen_tokens.span_s >= MIN_FROZEN_S and f.engine_spinning
    assert wedge_refused_for_capacity(f)
    v = classify(window)
    assert v.verdict is VerdictKind.ADMISSION_WEDGE and v.confidence >= CERTAIN
    # Without the burst the Workers' whereabouts are unknown: not certain yet.
    no_burst = replace(window, samples=(*window.samples[:2], replace(window.samples[2], stacks=())))
    assert not wedge_refused_for_capacity(Facts(no_burst))
    assert classify(no_burst).confidence < CERTAIN


def test_wedge_refused_for_capacity_is_certain_on_two_scrapes_with_the_burst():
    """Two scrapes a second apart, each refusing the request for capacity with nothing running and
    the KV pool empty, the counter still, the engine spinning and the Workers' burst outside the
    model: no healthy server reads so even once a second, so the wedge is certain at the second sample."""
    b = load("admission-wedge")
    window = replace(b, samples=(b.samples[0], replace(b.samples[1], stacks=b.samples[-1].stacks)))
    f = Facts(window)
    assert f.gen_tokens.span_s < MIN_FROZEN_S and not f.tokens_frozen
    assert wedge_refused_for_capacity(f)
    v = classify(window)
    assert (v.verdict, v.confidence) == (VerdictKind.ADMISSION_WEDGE, CERTAIN)
    assert next_step(v, 2, f.window_s, SamplerOptions(), True, False).stop
    # One request running in either scrape (a step in progress): not the wedge's reading.
    running = replace(b.samples[1].metrics, text=b.samples[1].metrics.text.replace(
        "vllm:num_requests_running{", "vllm:num_requests_running_was{", 1) + _running_line(b, 1))
    other = replace(window, samples=(window.samples[0], replace(window.samples[1], metrics=running)))
    assert not wedge_refused_for_capacity(Facts(other))


def _running_line(b: Bundle, value: int) -> str:
    line = next(x for x in b.samples[1].metrics.text.splitlines() if x.startswith("vllm:num_requests_running{"))
    return "\n" + line.rsplit(" ", 1)[0] + f" {value}.0\n"


def test_the_deferred_wedge_still_needs_min_frozen_s():
    """Sessions deferred for their client's next input may pause a second by design: with any deferred
    the capacity-refused reading must hold MIN_FROZEN_S, as before."""
    b = load("deferred-wedge")
    f = Facts(replace(b, samples=b.samples[:2]))
    assert f.gen_tokens.span_s >= MIN_FROZEN_S and wedge_refused_for_capacity(f)
    squeezed = replace(b, samples=(b.samples[0], replace(b.samples[1], t=b.samples[0].t + 1.0,
                                                         metrics=replace(b.samples[1].metrics, t=b.samples[0].metrics.t + 1.0))))
    assert not wedge_refused_for_capacity(Facts(squeezed))


def test_a_stepless_engine_extends_the_frozen_window_back():
    """The kernel's record of the engine's main threads (ProcessSample.main_quiet_s): no step for q
    seconds means no token for q seconds, so two frozen scrapes a second apart are frozen for q."""
    b = load("engine-deadlock")
    two = (b.samples[0], b.samples[1])
    assert not Facts(replace(b, samples=two)).tokens_frozen
    quiet = replace(b, samples=(with_quiet(two[0], 11.0), with_quiet(two[1], 12.0)))
    f = Facts(quiet)
    assert f.stepless_s == 12.0 and f.tokens_frozen and f.tokens_frozen_s == 12.0
    v = classify(quiet)
    assert (v.verdict, v.confidence) == (VerdictKind.ENGINE_DEADLOCK, 0.95)  # past CERTAIN_FROZEN_S
    assert v.facts["frozen_s"] == 12.0
    assert any(e.what.startswith("no engine step for 12 s: the main thread of EngineCore pid") for e in v.evidence)
    # Two seconds of record: frozen, not yet certain without the burst.
    v2 = classify(replace(b, samples=(with_quiet(two[0], 1.0), with_quiet(two[1], 2.0))))
    assert v2.verdict is VerdictKind.ENGINE_DEADLOCK and v2.confidence < CERTAIN
    # One stepping thread that ran (the EngineCore) does not undo a Worker's quiet: a step needs both.
    mixed = replace(b, samples=(two[0], with_quiet(with_quiet(two[1], 12.0, (Role.WORKER,)), 12.0, (Role.WORKER,))))
    assert Facts(mixed).stepless_s == 12.0


def test_the_stepless_record_is_not_read_while_tokens_move():
    b = load("healthy")
    moving = replace(b, samples=(with_quiet(b.samples[0], 30.0), with_quiet(b.samples[1], 31.0)))
    f = Facts(moving)
    assert f.tokens_advance and not f.tokens_frozen and f.tokens_frozen_s == 0.0
    assert classify(moving).verdict is VerdictKind.PROGRESSING


def test_a_slow_step_is_not_a_certain_wedge_or_deadlock():
    """A step slower than the window (a long prefill): counters frozen with a request running and
    the Worker inside the model, burning CPU. Built from the starved bundle (a runaway decoding) by
    holding its metrics still: whatever the rules say, they must not be certain, so the capture
    keeps sampling."""
    b = load("starved")
    first = b.samples[0].metrics
    assert (parse_metrics(first.text).running or 0) >= 1
    frozen = replace(b, samples=tuple(replace(s, metrics=replace(first, t=s.t)) for s in b.samples[:3]))
    f = Facts(frozen)
    assert f.tokens_frozen and f.running >= 1 and not f.engine_parked
    v = classify(frozen)
    assert v.confidence < CERTAIN, (v.verdict, v.confidence)
    step = next_step(v, 3, frozen.samples[-1].t - frozen.samples[0].t, SamplerOptions(), False, False)
    assert not step.stop


def test_deadlock_left_open_after_the_burst_attaches_the_probes():
    """The engine parked with work in flight, but no Worker stack to say where: the burst is spent,
    so a parked-engine class asks the probes how long the main threads have waited (auto only)."""
    b = load("engine-deadlock")
    no_stacks = replace(b, samples=tuple(replace(s, stacks=()) for s in b.samples[:4]))
    v = classify(no_stacks)
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK and v.confidence < CERTAIN
    elapsed = no_stacks.samples[-1].t - no_stacks.samples[0].t
    assert next_step(v, 4, elapsed, SamplerOptions(ebpf="auto"), True, False).probes
    assert not next_step(v, 4, elapsed, SamplerOptions(ebpf="off"), True, False).probes
    assert not next_step(v, 4, elapsed, SamplerOptions(ebpf="auto"), True, True).probes  # once
    # With too little window left the probes could not see a wait: not attached.
    assert not next_step(v, 4, 4.5, SamplerOptions(ebpf="auto", window_s=6.0), True, False).probes


def test_deadlock_is_certain_with_the_worker_burst():
    b = load("engine-deadlock")
    window = replace(b, samples=(*b.samples[:4], replace(b.samples[4], stacks=b.samples[-1].stacks)))
    v = classify(window)
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK and v.confidence >= CERTAIN
    assert v.facts["worker_model_share"] >= 0.9 and v.facts["engine_cores"] <= 0.2


def test_starved_is_certain_when_vllm_names_capacity():
    b = load("starved")
    window = replace(b, samples=b.samples[:3])
    f = Facts(window)
    assert f.gen_tokens.span_s >= MIN_FROZEN_S and starved_for_capacity(f)
    v = classify(window)
    assert v.verdict is VerdictKind.STARVED and v.confidence >= CERTAIN
    assert not starved_for_capacity(Facts(replace(b, samples=b.samples[:2])))  # 1.2 s: too short


def test_a_live_starved_queue_buys_no_burst_until_it_is_certain():
    """Tokens advance while the queue waits: the engine steps, and the verdict waits MIN_FROZEN_S of
    scrapes for its certainty, which no stack dump hastens. The replay of a recorded starved capture
    asks for no burst on the way; a starved verdict read from the log alone still does."""
    b = load("starved")
    steps = replay(b)
    assert [k for k, *_ in steps][-1] == 3 and steps[-1][3].why == "verdict certain"
    assert [(kind, s.burst) for _, kind, _, s in steps[1:-1]] == [(VerdictKind.STARVED, 0)]
    uncertain = classify(replace(b, samples=b.samples[:2]))
    assert uncertain.verdict is VerdictKind.STARVED and uncertain.confidence < CERTAIN
    from_log = replace(uncertain, rule="log_starved")
    assert next_step(from_log, 2, 1.2, SamplerOptions(), False, False).burst == ESCALATE_BURST


def test_the_window_bounds_an_uncertain_capture():
    b = load("admission-wedge")
    v = classify(replace(b, samples=b.samples[:2]))
    step = next_step(v, 5, 5.5, SamplerOptions(window_s=6.0), True, True)
    assert step.stop and step.why == "window over"


def test_a_window_whose_scrapes_are_thin_runs_on_up_to_twice_its_length():
    """The leaked-capacity repro on a loaded host: the first scrape answered, the next one (5.4 s
    later: our own threads had waited for a CPU) timed out. One scrape measures no rate and no
    held excess, so the window runs on; at twice its length it stops whatever it has."""
    from wedgectl.capture.policy import EXTEND_FACTOR, thin_scrapes

    b = load("leaked-capacity")
    failed = replace(b.samples[1].metrics, text=None, status=None, error="timeout: body not complete within 4.0s")
    late = replace(b.samples[1], t=b.samples[0].t + 5.4, metrics=replace(failed, t=b.samples[0].metrics.t + 5.4))
    thin = replace(b, samples=(b.samples[0], late))
    f = Facts(thin)
    assert thin_scrapes(f) and len(f.scrapes) == 1
    v = classify(thin)
    assert v.verdict is not VerdictKind.LEAKED_CAPACITY  # what stopping here would have said
    opts = SamplerOptions(window_s=6.0)
    step = next_step(v, 2, 5.4, opts, True, True, thin=True)
    assert not step.stop and step.why.startswith("window extended")
    assert next_step(v, 2, 5.4, opts, True, True, thin=False).why == "window over"
    assert next_step(v, 9, opts.window_s * EXTEND_FACTOR - 0.5, opts, True, True, thin=True).why == "window over"
    # Answered scrapes over MIN_FROZEN_S are not thin, and the recorded capture names the leak.
    assert not thin_scrapes(Facts(b)) and classify(b).verdict is VerdictKind.LEAKED_CAPACITY
    # Nothing answered at all is unreachable, not thin: the window is not stretched for it.
    dead = replace(b, samples=tuple(replace(s, metrics=replace(failed, t=s.t)) for s in b.samples))
    assert not thin_scrapes(Facts(dead))


def test_a_window_whose_first_answer_came_late_runs_on_from_that_answer():
    """The leaked-capacity repro at load ~12: wedgectl was off a CPU for 10 s after its first /proc reading,
    so its three scrapes answered 10.0-11.1 s into an 11.2 s capture, 1.05 s apart: thin. Counted from the
    window's start it was over, and the verdict named a starved queue; counted from the first answer, it
    runs on, up to MAX_FACTOR times the window whatever happens. The recorded capture, with its sample
    times moved as that run's were."""
    from wedgectl.capture.policy import EXTEND_FACTOR, MAX_FACTOR, thin_scrapes

    b = load("leaked-capacity")
    t0, m0 = b.samples[0].t, b.samples[0].metrics.t
    moved = tuple(replace(smp, t=t0 + (0.0, 10.49, 11.18)[i], metrics=replace(smp.metrics, t=m0 + 10.0 + (0.0, 0.57, 1.05)[i]))
                  for i, smp in enumerate(b.samples[:3]))
    stalled = replace(b, samples=moved)
    f = Facts(stalled)
    elapsed = moved[-1].t - moved[0].t
    answered = moved[-1].t - f.scrapes[0][0]
    assert elapsed > 10 and answered < 2 and thin_scrapes(f)
    v = classify(stalled)
    assert v.verdict is not VerdictKind.LEAKED_CAPACITY  # what stopping there said
    opts = SamplerOptions(window_s=6.0)
    assert next_step(v, 3, elapsed, opts, True, True, thin=True).why == "window over"  # from the start: over
    step = next_step(v, 3, elapsed, opts, True, True, thin=True, answered_s=answered)
    assert not step.stop and step.why.startswith("window extended")
    late = opts.window_s * MAX_FACTOR - 0.2
    assert next_step(v, 40, late, opts, True, True, thin=True, answered_s=1.0).why == "window over"  # bounded
    assert next_step(v, 9, 20.0, opts, True, True, thin=True,
                     answered_s=opts.window_s * EXTEND_FACTOR).why == "window over"


def test_saturated_server_slow_first_scrape_still_progressing():
    """A saturated API server: the first scrape timed out, the next two moved. Two answered scrapes a
    second apart with the counter rising are enough; the failed one costs no certainty."""
    b = load("healthy")
    failed = replace(b.samples[0].metrics, text=None, status=None, error="timeout: body not complete within 4.0s")
    samples = (replace(b.samples[0], metrics=failed), *b.samples[1:3])
    v = classify(replace(b, samples=samples))
    assert v.verdict is VerdictKind.PROGRESSING and v.confidence >= CERTAIN
    assert next_step(v, 3, samples[-1].t - samples[0].t, SamplerOptions(), False, False).stop


def test_no_stacks_means_no_burst():
    b = load("admission-wedge")
    v = classify(replace(b, samples=b.samples[:2]))
    assert next_step(v, 2, 1.0, SamplerOptions(stacks=False), False, False).burst == 0


def test_engine_roles_present_in_recorded_bursts():
    # The burst the sampler takes is of the EngineCore and Workers only (one dump of the others).
    b = load("engine-deadlock")
    pids = {p.pid: p.role for p in b.samples[-1].processes}
    burst_roles = {pids[d.pid] for d in b.samples[-1].stacks if pids.get(d.pid)}
    assert {Role.ENGINE_CORE, Role.WORKER} <= burst_roles


# Captures recorded by the escalating sampler itself (repro runs on a loaded 2-core host): each
# stopped where the replay stops, on a certain verdict, with a burst only where a hang was open.
ESCALATED = {
    "healthy-loaded": (VerdictKind.PROGRESSING, 2, False),  # 8 streams saturating the host
    "admission-wedge-escalated": (VerdictKind.ADMISSION_WEDGE, 3, True),
    "engine-deadlock-escalated": (VerdictKind.ENGINE_DEADLOCK, 3, True),
    # Recorded with the hang-shaped first sample buying the burst for the second: certain at 1 s.
    "engine-deadlock-stepless": (VerdictKind.ENGINE_DEADLOCK, 2, True),  # the Worker off CPU 3.9 s
    "admission-wedge-short": (VerdictKind.ADMISSION_WEDGE, 2, True),  # refused for capacity at both scrapes
}


@pytest.mark.parametrize("name", sorted(ESCALATED))
def test_recorded_escalated_capture_stops_where_the_replay_stops(name):
    kind, n, burst = ESCALATED[name]
    b = load(name)
    assert len(b.samples) == n
    v = classify(b)
    assert v.verdict is kind and v.confidence >= CERTAIN
    steps = replay(b)
    assert len(steps) == n and steps[-1][3].stop and steps[-1][3].why == "verdict certain"
    assert any(s.burst > 1 for *_, s in steps) is burst
    assert max(len(s.stacks) for s in b.samples[1:]) > 0 if burst else all(not s.stacks for s in b.samples[1:])
    if kind is not VerdictKind.PROGRESSING and not wedge_refused_for_capacity(Facts(b)):
        assert v.facts["frozen_s"] >= MIN_FROZEN_S  # earned: frozen over the classifier's threshold


def test_recorded_stepless_deadlock_reads_the_workers_quiet():
    b = load("engine-deadlock-stepless")
    f = Facts(b)
    assert f.gen_tokens.span_s < MIN_FROZEN_S  # two scrapes about a second apart
    worker = next(p for p in b.samples[-1].processes if p.role is Role.WORKER)
    assert f.stepless_s == worker.main_quiet_s and f.stepless_s >= MIN_FROZEN_S  # the stalled Worker
    first = replace(b, samples=b.samples[:1])
    assert hang_shaped(Facts(first)) and classify(first).verdict is VerdictKind.INCONCLUSIVE
    v = classify(b)
    assert v.facts["frozen_s"] == round(f.stepless_s, 2) and v.facts["worker_model_share"] == 1.0
    # Without the kernel's record the same two samples are not a deadlock yet.
    blind = replace(b, samples=tuple(replace(s, processes=tuple(replace(p, main_quiet_s=None) for p in s.processes))
                                     for s in b.samples))
    assert classify(blind).verdict is not VerdictKind.ENGINE_DEADLOCK


def test_saturated_server_scrapes_answered_and_counters_moved():
    b = load("healthy-loaded")
    f = Facts(b)
    assert len(f.scrapes) == 2 and f.tokens_advance and f.gen_tokens.rate > 50


def test_a_stepping_engine_is_read_from_proc_alone():
    from wedgectl.capture.policy import STEPPING_QUIET_S, engine_stepping

    h = load("healthy").samples[0]
    assert engine_stepping(with_quiet(h, 0.0).processes)
    assert not engine_stepping(with_quiet(h, STEPPING_QUIET_S + 0.1).processes)
    assert not engine_stepping(h.processes)  # recorded before main_quiet_s was read: unknown is not stepping
    stalled = load("engine-deadlock-stepless").samples[0]
    assert not engine_stepping(stalled.processes)  # its Workers' main threads sat off a CPU for seconds
    wedge = load("admission-wedge-short").samples[0]
    assert engine_stepping(wedge.processes)  # a wedge spins: the dump waits for its hang-shaped gauges


def python_pids(procs) -> list[int]:
    """The processes a full dump covers: every Python process of the deployment but
    multiprocessing's resource tracker, which each recorded vLLM deployment has."""
    tracker = [p.pid for p in procs if "multiprocessing.resource_tracker" in " ".join(p.cmdline)]
    assert len(tracker) == 1
    return sorted(p.pid for p in procs if (p.role is not Role.OTHER or "python" in p.name.lower()) and p.pid not in tracker)


@pytest.mark.parametrize("quiet, dumped", [(0.0, False), (2.0, True), (None, True)])
def test_the_first_sample_dumps_every_process_unless_the_engine_is_stepping(monkeypatch, quiet, dumped):
    """A serving engine's first sample takes no py-spy dump (the scrapes decide it); a parked or
    unread engine's does. A later burst then dumps the other processes once too."""
    from wedgectl.capture import bursts, sample
    from wedgectl.capture.discover import Deployment

    first = load("healthy").samples[0]
    procs = with_quiet(first, quiet).processes if quiet is not None else first.processes
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url=None, metrics_url=None)
    dumps: list[tuple[int, int]] = []
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (procs, []))
    monkeypatch.setattr(bursts, "dump_burst", lambda pid, native, n: dumps.append((pid, n)) or [])
    pending = sample.begin_sample(dep, None, SamplerOptions(), burst=1, first=True)
    pending.sample(dep)
    assert (pending.burst == 1, bool(dumps)) == (dumped, dumped)
    assert sorted(pid for pid, _ in dumps) == (python_pids(procs) if dumped else [])
    # The escalation's burst: the engine's processes ESCALATE_BURST times; the rest once when the
    # first sample dumped nothing, not at all when it did.
    for others in (False, True):
        dumps.clear()
        bursts.collect_stacks(procs, False, ESCALATE_BURST, others=others)
        engine = {p.pid for p in procs if p.role in (Role.ENGINE_CORE, Role.WORKER)}
        assert {pid for pid, n in dumps if n == ESCALATE_BURST} == engine
        assert bool({pid for pid, n in dumps if n == 1}) is others


def run_window(dep, options, scraper, log_path=None, probe_options=None):
    """diagnose's window (capture.window.Window) over `dep`, its scrapes answered by `scraper`."""
    from wedgectl.capture.probing import Probes
    from wedgectl.capture.session import LiveSession
    from wedgectl.capture.window import Window

    session = LiveSession(dep, dep.root_pid, log_path=log_path)
    session.scraper = scraper
    return Window(session, options, Probes(dep, probe_options or options)).run()


class RecordedScraper:
    """A recorded capture's scrapes, answered in order with fresh times: the sampler's seam."""

    def __init__(self, b):
        self.scrapes = [s.metrics for s in b.samples if s.metrics is not None]
        self.n = 0

    def metrics(self, url, timeout=None):
        m = self.scrapes[min(self.n, len(self.scrapes) - 1)]
        self.n += 1
        return replace(m, t=__import__("time").time())

    def health(self, base_url, timeout=None):
        return 200, None


@pytest.mark.parametrize("name, kind", [("healthy", VerdictKind.PROGRESSING), ("idle", VerdictKind.IDLE)])
def test_a_capture_without_its_first_dump_takes_it_before_any_verdict_but_progressing(monkeypatch, name, kind):
    """The first sample leaves the dump out for an engine /proc shows stepping. A capture that
    stops on "progressing" never dumps (its counters decided it); one that stops on anything else
    dumps every Python process once, onto its last sample, as the first sample would have."""
    from wedgectl.capture import bursts, sample
    from wedgectl.capture.discover import Deployment

    b = load(name)
    procs = with_quiet(b.samples[0], 0.0).processes
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url="http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics")
    dumps: list[tuple[int, int]] = []
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (procs, []))
    monkeypatch.setattr(bursts, "dump_burst", lambda pid, native, n: dumps.append((pid, n)) or [])
    options = SamplerOptions(window_s=4.0, interval_s=0.3)
    out = run_window(dep, options, RecordedScraper(b))
    assert classify(out).verdict is kind and len(out.samples) == 2
    python = python_pids(procs)
    assert sorted(pid for pid, n in dumps if n == 1) == ([] if kind is VerdictKind.PROGRESSING else python)
    assert len(dumps) == (0 if kind is VerdictKind.PROGRESSING else len(python))


def test_the_quick_look_is_for_a_first_sample_that_answered_and_does_not_look_hung():
    from wedgectl.capture.policy import QUICK_LOOK_S, quick_look

    def first(name):
        b = load(name)
        return Facts(replace(b, samples=b.samples[:1]))

    default = SamplerOptions()
    for name in ("healthy", "idle", "healthy-loaded", "starved"):
        f = first(name)
        assert quick_look(f, hang_shaped(f), default), name
    wedge = first("admission-wedge")  # waiting with none running: its burst goes on the grid
    assert hang_shaped(wedge) and not quick_look(wedge, True, default)
    assert not quick_look(first("shutdown-hang"), False, default)  # no scrape answered
    assert not quick_look(first("healthy"), False, SamplerOptions(interval_s=QUICK_LOOK_S))  # no sooner than asked


@pytest.mark.parametrize("name, kind, quick", [("healthy", VerdictKind.PROGRESSING, True),
                                               ("idle", VerdictKind.IDLE, True),
                                               ("admission-wedge-short", VerdictKind.ADMISSION_WEDGE, False)])
def test_a_quick_look_decides_a_serving_or_idle_server_and_leaves_the_grid_to_a_hang(monkeypatch, name, kind, quick):
    """After the first answer, a serving or idle server's second sample comes QUICK_LOOK_S later, not
    a second: counters that moved (or nothing in flight) decide it there. A hang-shaped first sample
    gets no quick look: its second sample waits the interval, and its verdict MIN_FROZEN_S."""
    import time

    from wedgectl.capture import bursts, sample, window
    from wedgectl.capture.discover import Deployment

    b = load(name)
    procs = b.samples[0].processes
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url="http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics")
    recorded = [s.processes for s in b.samples]  # in order, the last repeated: the CPU each burned
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (recorded.pop(0) if len(recorded) > 1 else recorded[0], []))
    monkeypatch.setattr(bursts, "dump_burst", lambda pid, native, n: [])
    begun: list[float] = []
    real_begin = window.begin_sample
    monkeypatch.setattr(window, "begin_sample", lambda *a, **k: begun.append(time.monotonic()) or real_begin(*a, **k))
    said: list[str] = []
    options = SamplerOptions(window_s=3.0, progress=said.append)
    out = run_window(dep, options, RecordedScraper(b))
    assert any("quick look" in m for m in said) is quick
    v = classify(out)
    if quick:
        assert (v.verdict, len(out.samples)) == (kind, 2)
    else:
        assert v.verdict is kind and len(out.samples) >= 3
    # The samples after a quick look are on the first answer's grid: the third (when there is one)
    # is never due sooner than a whole interval after the first.
    if len(begun) >= 3:
        assert begun[2] - begun[0] >= options.interval_s - 0.05


@pytest.mark.parametrize("log_grows", [True, False])
def test_a_log_that_grew_past_progressing_gets_the_stacks_the_stop_skipped(monkeypatch, tmp_path, log_grows):
    """A leaked-capacity capture on a loaded host (recorded, tests/fixtures/capacity/README.md):
    one scrape answered, the next timed out, so only the log decided in the window, and its tail
    as read at the start said "progressing"; no dump was taken. By the end the server had logged
    two more stats lines, and the log as read then says "starved": that verdict's evidence gets
    one dump of every Python process. A log that did not grow leaves "progressing", undumped."""
    from wedgectl.capture import bursts, sample
    from wedgectl.capture.discover import Deployment

    b = read_bundle(Path(__file__).parent / "fixtures" / "capacity" / "leaked-capacity-loaded.tar.gz")
    log = tmp_path / "server.log"
    log.write_text("".join(line + "\n" for line in b.log_lines[:125]))

    class Growing(RecordedScraper):
        def metrics(self, url, timeout=None):
            if self.n == 1 and log_grows:
                with log.open("a") as f:
                    f.write("".join(line + "\n" for line in b.log_lines[125:]))
            return super().metrics(url, timeout)

    procs = with_quiet(b.samples[0], 0.0).processes  # stepping: the first sample takes no dump
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url="http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics")
    dumps: list[tuple[int, int]] = []
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (procs, []))
    monkeypatch.setattr(bursts, "dump_burst", lambda pid, native, n: dumps.append((pid, n)) or [])
    # The log's stamps are the recorded run's clock: the capture runs on that clock too, or the
    # log would read as silent since then.
    import time

    real, shift = time.time, time.time() - b.samples[0].t
    monkeypatch.setattr(time, "time", lambda: real() - shift)
    # r2's shape: its second sample began 5.4 s into a 6 s window (the host kept wedgectl off a
    # CPU), so the window was over before any burst: here an interval past twice the window.
    options = SamplerOptions(window_s=1.0, interval_s=2.0)
    out = run_window(dep, options, Growing(b), log_path=str(log))
    assert len(out.samples) == 2
    v = classify(out)
    assert v.verdict is (VerdictKind.STARVED if log_grows else VerdictKind.PROGRESSING), v.rule
    assert v.rule.startswith("log_")  # one answered scrape: no live rule could decide
    python = python_pids(procs)
    assert sorted(pid for pid, n in dumps if n == 1) == (python if log_grows else [])


RACED = ("error: py-spy exited 1: Error: Failed to get stack traces | Caused by: | "
         "0: Failed to call get_stack_trace for thread 140051759912896")  # recorded: a busy Worker


@pytest.mark.parametrize("outcomes, tries, good", [
    ([RACED, RACED, RACED, None], 4, True),  # a single dump survives three races in a row
    ([RACED] * 6, 4, False),  # and gives up after four, keeping the last failure
    (["permission: py-spy was refused ptrace access", None], 1, False),  # a lasting failure is not retried
    ([None], 1, True),
])
def test_a_raced_dump_is_retried(monkeypatch, outcomes, tries, good):
    from wedgectl.capture import bursts
    from wedgectl.model.types import StackDump

    calls: list[int] = []

    def fake(pid, native=False, nonblocking=True):
        err = outcomes[len(calls)]
        calls.append(pid)
        return StackDump(pid, 0.0, native, threads=() if err else ({"thread_id": 1, "frames": []},), error=err)

    monkeypatch.setattr(bursts.pyspy, "dump_stacks", fake)
    monkeypatch.setattr(bursts, "BURST_GAP_S", 0.0)
    out = bursts.dump_burst(7, False, 1)
    assert len(calls) == tries and len(out) == 1
    assert (out[0].error is None) is good
    if not good:
        assert out[0].error == outcomes[tries - 1]


@pytest.mark.parametrize("name, kind", [("collective-hang", VerdictKind.COLLECTIVE_HANG),
                                        ("admission-wedge", VerdictKind.ADMISSION_WEDGE)])
def test_a_hang_the_window_ends_on_before_its_burst_gets_the_burst_then(monkeypatch, name, kind):
    """On a loaded host the samples come late and the scrapes thin: the window can end, uncertain,
    before the burst the escalation would have asked for next. A hang class then gets the burst of
    its engine's processes on the last sample (whether a rank's frame stayed put is what a
    collective hang's ranks read), and the verdict is drawn with it."""
    from wedgectl.capture import bursts, policy, sample, window
    from wedgectl.capture.discover import Deployment

    b = load(name)
    procs = b.samples[0].processes
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url="http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics")
    burst_sample = max(b.samples[1:], key=lambda s: len(s.stacks))  # the recorded capture's burst

    def recorded_dumps(sample, pid):
        return [d for d in sample.stacks if d.pid == pid and d.error is None]
    dumps: list[tuple[int, int]] = []
    recorded = [s.processes for s in b.samples]  # each sample's /proc in turn: the engine's CPU moves as recorded
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (recorded.pop(0) if len(recorded) > 1 else recorded[0], []))
    monkeypatch.setattr(bursts, "dump_burst", lambda pid, native, n: dumps.append((pid, n))
                        or recorded_dumps(b.samples[0] if n == 1 else burst_sample, pid)[:n])
    monkeypatch.setattr(window, "hang_shaped", lambda f: False)  # the first sample did not look hung
    # The window is over at the second sample (a quick look, 0.3 s in), before the escalation's burst;
    # its thin scrapes stretch it, which asks for no burst. Stretched to 3 times its length, 3.6 s,
    # the capture ends once the scrapes span MIN_FROZEN_S (the 4th sample, ~2 s in, or the 5th): a
    # hang can be named, not yet certain. (Stretched to twice, it always ended on the 4th, where
    # whether the scrapes spanned MIN_FROZEN_S, and a hang could be named at all, turned on a
    # loaded host's timing.)
    monkeypatch.setattr(policy, "EXTEND_FACTOR", 3.0)
    options = SamplerOptions(window_s=1.2, interval_s=1.0)
    said: list[str] = []
    out = run_window(dep, replace(options, progress=said.append), RecordedScraper(b), probe_options=options)
    assert not any("stack burst" in line and "not certain" in line for line in said), said  # the escalation asked for none
    engine = sorted(p.pid for p in procs if p.role in (Role.ENGINE_CORE, Role.WORKER))
    assert sorted(pid for pid, n in dumps if n == ESCALATE_BURST) == engine
    v = classify(out)
    assert v.verdict is kind, v.summary
    if kind is VerdictKind.COLLECTIVE_HANG:
        assert all(r["stuck"] for r in v.facts["ranks"]), v.facts["ranks"]


# --- a certain verdict from the engine's own report: the first sample decides ---------------------------

def _reported_wedge(pid: int, t: float):
    """The EngineCore's report of an admission wedge: its last five writes' steps rising, nothing running, a
    waiting request that needs more KV blocks than the pool holds (tests/engine_reports.py's schema)."""
    from engine_reports import reading

    sched = {"running": 0, "waiting": 1, "waiting_by_reason": {"capacity": 1, "deferred": 0}, "paused": False,
             "kv_blocks": {"free": 4, "total": 4, "block_size": 32}}
    req = [{"id": "cmpl-big-0", "state": "waiting", "age_s": 30.0, "prompt_tokens": 6, "output_tokens": 0,
            "blocks_held": 0, "blocks_needed": 5, "client_connected": True}]
    s = 10**9
    return reading(pid, t, 0.2, 0.001, stage={"name": "scheduling", "since_mono_ns": 10 * s, "phase": None},
                   steps=5000, model_steps=0, written_mono_ns=10 * s, scheduler=sched, requests=req,
                   requests_total=1, history=[[k * s, 1000 * (k - 5), 0] for k in range(6, 11)])


def test_a_certain_verdict_from_the_report_stops_at_the_first_sample():
    b = load("admission-wedge")
    pid = next(p.pid for p in b.samples[0].processes if p.role is Role.ENGINE_CORE)
    first = replace(b, samples=(replace(b.samples[0], engine=(_reported_wedge(pid, b.samples[0].t),)),))
    v = classify(first)
    assert (v.verdict, v.rule, v.facts["source"]) == (VerdictKind.ADMISSION_WEDGE, "live_engine_report_wedge", "engine")
    assert v.confidence >= CERTAIN
    step = next_step(v, 1, 0.0, SamplerOptions(), False, False, suspect=True)
    assert step.stop and step.why == "verdict certain from the engine's own report"
    assert not next_step(v, 1, 0.0, SamplerOptions(min_window_s=2.0), False, False).stop  # --min-window still holds
    unsure = replace(v, confidence=CERTAIN - 0.05)
    assert not next_step(unsure, 1, 0.0, SamplerOptions(), False, False).stop


def test_a_certain_verdict_from_elsewhere_still_waits_for_a_second_sample():
    b = load("shutdown-hang")  # a closed listener and the log: certain on one sample, and no report behind it
    v = classify(replace(b, samples=b.samples[:1]))
    assert v.verdict is VerdictKind.SHUTDOWN_HANG and v.confidence >= CERTAIN and "source" not in v.facts
    assert not next_step(v, 1, 0.0, SamplerOptions(), False, False).stop


def test_the_window_ends_on_the_reports_certain_verdict_at_once(monkeypatch):
    """diagnose's window over a wedge whose engine report decides it: one sample, then the stop, with no
    quick look and no burst bought; the one dump a stepping engine's first sample left out is taken then."""
    import time

    from wedgectl.capture import bursts, sample
    from wedgectl.capture.discover import Deployment

    b = load("admission-wedge")
    procs = b.samples[0].processes
    core = next(p.pid for p in procs if p.role is Role.ENGINE_CORE)
    dep = Deployment(root_pid=procs[0].pid, api_pid=procs[0].pid, roles={p.pid: p.role for p in procs},
                     base_url="http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics")
    monkeypatch.setattr(sample, "collect_processes", lambda dep, tree=None: (procs, []))
    monkeypatch.setattr(sample, "read_engine_reports", lambda pids: (_reported_wedge(core, time.time()),))
    dumps: list[tuple[int, int]] = []
    monkeypatch.setattr(bursts, "dump_burst", lambda pid, native, n: dumps.append((pid, n)) or [])
    said: list[str] = []
    out = run_window(dep, SamplerOptions(window_s=6.0, progress=said.append), RecordedScraper(b))
    assert len(out.samples) == 1
    assert classify(out).rule == "live_engine_report_wedge"
    assert "verdict certain from the engine's own report" in said
    assert not any(n > 1 for _, n in dumps)  # no burst: the report decided
