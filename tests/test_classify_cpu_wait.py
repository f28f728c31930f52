"""An engine the host gives no CPU is not a hung engine, on a recorded capture and recorded /proc texts.

tests/fixtures/bundles/engine-starved-of-cpu.tar.gz is `wedgectl diagnose --pid` of a real
vLLM 0.32 server serving the `healthy` repro's stream, its EngineCore and Worker moved into a
CPU cgroup limited to 1 ms a second (what a container's CPU limit does when set far too low),
on a 2-core host at load ~15. For five seconds no token came: the Worker's main thread was
runnable all along, queued for a CPU it was not given. Then a token, and the capture stopped
on `progressing`. Before the run delay was read, the first four samples read as an engine
deadlock at 0.95: a certain verdict, and a capture that would have stopped on it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.classify.facts import CPU_WAIT_SHARE, STEAL_SHARE, Facts, mostly_throttled
from wedgectl.collect import procfs
from wedgectl.capture.options import SamplerOptions
from wedgectl.capture.policy import CERTAIN, next_step, stacks_cannot_help
from wedgectl.model.types import Bundle, CpuLimit, Role, VerdictKind
from wedgectl.watch.targets import MIN_CLASSIFY, verdict_window

from test_probes import _FixedClock  # noqa: E402  (a scheduler clock with given offsets; same folder)

BUNDLE = Path(__file__).parent / "fixtures" / "bundles" / "engine-starved-of-cpu.tar.gz"
HANGS = {VerdictKind.ENGINE_DEADLOCK, VerdictKind.ADMISSION_WEDGE, VerdictKind.COLLECTIVE_HANG,
         VerdictKind.SHUTDOWN_HANG, VerdictKind.ENGINE_DEAD}


def load() -> Bundle:
    return replace(read_bundle(BUNDLE), verdict=None)


def prefix(b: Bundle, k: int) -> Bundle:
    return replace(b, samples=b.samples[:k])


def blind(b: Bundle) -> Bundle:
    """The same capture without the run delay: what wedgectl read before it collected one."""
    return replace(b, samples=tuple(replace(s, processes=tuple(replace(p, main_runq_s=None) for p in s.processes))
                                    for s in b.samples))


def test_no_prefix_of_the_capture_names_a_hang():
    b = load()
    verdicts = [classify(prefix(b, k)) for k in range(2, len(b.samples) + 1)]
    assert not [v.verdict for v in verdicts if v.verdict in HANGS]
    assert [v.rule for v in verdicts].count("live_engine_waits_for_cpu") == 3  # the three frozen samples
    assert verdicts[-1].verdict is VerdictKind.PROGRESSING  # the token came: what the capture stopped on


def test_without_the_run_delay_the_same_samples_read_as_a_certain_deadlock():
    """The evidence the rule leans on, taken away: the frozen samples are a deadlock at 0.95 again."""
    b = blind(load())
    v = classify(prefix(b, 4))
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK and v.confidence >= CERTAIN


def test_the_frozen_samples_say_the_engine_waited_for_a_cpu():
    b = prefix(load(), 6)
    f = Facts(b)
    p, waited, span = f.engine_cpu_wait
    assert p.role is Role.WORKER and p.pid == 10416
    assert waited >= CPU_WAIT_SHARE * span and span > 4.0
    assert f.engine_waits_for_cpu and f.engine_cores is not None and f.engine_cores < 0.05
    v = classify(b)
    assert (v.verdict, v.confidence, v.rule) == (VerdictKind.INCONCLUSIVE, 0.0, "live_engine_waits_for_cpu")
    assert v.facts["runq_s"] == round(waited, 2) and v.facts["running"] == 1  # one request in flight then
    line = next(e for e in v.evidence if "waited for a CPU" in e.what)
    assert line.values["pid"] == 10416 and line.values["cpus"] == "2"
    assert "load 15.77 on 2 CPUs" in line.what
    assert any("runnable, given no CPU" in e.what for e in v.evidence)  # not "parked"


def test_a_slow_but_progressing_engine_says_why_it_is_slow():
    v = classify(load())
    assert v.verdict is VerdictKind.PROGRESSING
    assert any("waited for a CPU" in e.what for e in v.evidence)


def test_the_verdict_buys_no_stacks_and_the_capture_runs_to_its_window():
    b = prefix(load(), 4)
    v = classify(b)
    assert stacks_cannot_help(v)
    elapsed = b.samples[-1].t - b.samples[0].t
    step = next_step(v, 4, elapsed, SamplerOptions(window_s=6.0), False, False)
    assert not step.stop and step.burst == 0 and not step.probes
    assert next_step(v, 4, 5.6, SamplerOptions(window_s=6.0), False, False).stop  # the window still bounds it


def test_a_parked_deadlock_is_untouched_by_the_rule():
    """A real deadlock's main threads park: their run delay stands still, so the rule stays out."""
    b = read_bundle(Path(__file__).parent / "fixtures" / "bundles" / "engine-deadlock.tar.gz")
    still = replace(b, samples=tuple(replace(s, processes=tuple(
        replace(p, main_runq_s=1.5 if p.role in (Role.ENGINE_CORE, Role.WORKER) else None) for p in s.processes))
        for s in b.samples))
    f = Facts(still)
    assert f.engine_cpu_wait is not None and f.engine_cpu_wait[1] == 0.0 and not f.engine_waits_for_cpu
    assert classify(still).verdict is VerdictKind.ENGINE_DEADLOCK


# --- the /proc side: recorded texts of a main thread queued for a CPU ------------------

STAT_R = ("10416 (VLLM::Worker) R 10396 10309 10309 0 -1 4194368 21 0 0 0 3 1 0 0 20 0 46 0 123456 0 0 "
          "18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0")
SCHED = """VLLM::Worker (10416, #threads: 46)
-------------------------------------------------------------------
se.exec_start                                :       2022667.010839
se.vruntime                                  :           115.061254
"""


def _tree(tmp_path: Path, stat: str, sched: str | None, schedstat: str | None) -> None:
    d = tmp_path / "10416"
    d.mkdir(exist_ok=True)
    for name, text in (("stat", stat), ("sched", sched), ("schedstat", schedstat)):
        if text is None:
            (d / name).unlink(missing_ok=True)
        else:
            (d / name).write_text(text)


def test_a_queued_main_thread_counts_the_wait_under_way(tmp_path: Path, monkeypatch) -> None:
    """Runnable (R) and last on a CPU at 2027.667 s of the monotonic clock: at 2040 s it has queued
    12.3 s, which the run delay (waits that ended: 120.1 s) does not hold yet."""
    monkeypatch.setattr(time, "monotonic", lambda: 2040.0)
    clock = _FixedClock({1: 5.0})
    _tree(tmp_path, STAT_R, SCHED, "35212899093 120110000000 48499")
    quiet, runq = procfs.main_thread_sched(10416, tmp_path, clock)
    assert quiet == 0.0  # runnable: not a step it skipped by choice
    assert runq == pytest.approx(120.11 + (2040.0 - 2027.667010839))
    # asleep (S): its own quiet, and the run delay as it stands
    _tree(tmp_path, STAT_R.replace(") R ", ") S ", 1), SCHED, "35212899093 120110000000 48499")
    quiet, runq = procfs.main_thread_sched(10416, tmp_path, clock)
    assert quiet == pytest.approx(2040.0 - 2027.667010839) and runq == pytest.approx(120.11)
    # runnable with its last run unknown (a CPU out of reach): the wait under way is unknown too
    _tree(tmp_path, STAT_R, SCHED, "35212899093 120110000000 48499")
    assert procfs.main_thread_sched(10416, tmp_path, _FixedClock({0: 5.0})) == (0.0, None)
    # no schedstat: no run delay; no sched either: the quiet is unknown, the run delay of a sleeper is not
    _tree(tmp_path, STAT_R.replace(") R ", ") S ", 1), None, None)
    assert procfs.main_thread_sched(10416, tmp_path, clock) == (None, None)
    _tree(tmp_path, STAT_R.replace(") R ", ") S ", 1), None, "35212899093 120110000000 48499")
    assert procfs.main_thread_sched(10416, tmp_path, clock) == (None, pytest.approx(120.11))
    _tree(tmp_path, STAT_R, None, "35212899093 120110000000 48499")
    assert procfs.main_thread_sched(10416, tmp_path, clock) == (None, None)  # queued since when: unknown
    assert procfs.main_thread_sched(999, tmp_path, clock) == (None, None)  # gone


# --- a container's CPU limit: the cgroup's quota and throttling counters -------------------

V1_STAT = "nr_periods 4\nnr_throttled 4\nthrottled_time 1300385579\nnr_bursts 0\nburst_time 0\n"  # read here, v1
V2_STAT = ("usage_usec 8123456\nuser_usec 7000000\nsystem_usec 1123456\nnr_periods 120\nnr_throttled 90\n"
           "throttled_usec 41000000\nnr_bursts 0\nburst_usec 0\n")


def _cgroup_tree(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "10416").mkdir(parents=True, exist_ok=True)
    (proc / "10416" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_a_v1_cpu_limit_and_its_throttling(tmp_path: Path) -> None:
    proc, root = _cgroup_tree(tmp_path, "11:cpuacct:/\n3:cpu:/wedgectl-test-42\n0::/\n", {
        "cpu/wedgectl-test-42/cpu.stat": V1_STAT, "cpu/wedgectl-test-42/cpu.cfs_quota_us": "1000\n",
        "cpu/wedgectl-test-42/cpu.cfs_period_us": "1000000\n"})
    lim = procfs.read_cpu_limit(10416, proc, root)
    assert (lim.quota_us, lim.period_us, lim.periods, lim.throttled) == (1000, 1000000, 4, 4)
    assert lim.cpus == pytest.approx(0.001)
    (root / "cpu/wedgectl-test-42/cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert procfs.read_cpu_limit(10416, proc, root) is None


def test_a_v2_cpu_limit_and_what_is_not_one(tmp_path: Path) -> None:
    proc, root = _cgroup_tree(tmp_path, "0::/kubepods/pod7/ctr\n", {
        "kubepods/pod7/ctr/cpu.max": "50000 100000\n", "kubepods/pod7/ctr/cpu.stat": V2_STAT})
    lim = procfs.read_cpu_limit(10416, proc, root)
    assert (lim.quota_us, lim.period_us, lim.periods, lim.throttled, lim.cpus) == (50000, 100000, 120, 90, 0.5)
    (root / "kubepods/pod7/ctr/cpu.max").write_text("max 100000\n")
    assert procfs.read_cpu_limit(10416, proc, root) is None
    (root / "kubepods/pod7/ctr/cpu.max").write_text("lots 100000\n")  # garbage: no reading, no error
    assert procfs.read_cpu_limit(10416, proc, root) is None
    (proc / "10416" / "cgroup").write_text("0::/another/namespace\n")  # a path not under this mount
    assert procfs.read_cpu_limit(10416, proc, root) is None
    assert procfs.read_cpu_limit(999, proc, root) is None  # gone


def test_a_throttled_engine_names_its_cpu_limit():
    """The recorded capture with the limit's counters as the cgroup gave them (the limit, 1 ms a
    second, ran out in every period): the evidence names the limit, the advice says raise it."""
    b = prefix(load(), 6)
    samples = []
    for i, s in enumerate(b.samples):
        samples.append(replace(s, processes=tuple(
            replace(p, cpu_limit=CpuLimit(1000, 1_000_000, 40 + i, 40 + i)) if p.main_runq_s is not None else p
            for p in s.processes)))
    v = classify(replace(b, samples=tuple(samples)))
    assert v.rule == "live_engine_waits_for_cpu"
    line = next(e for e in v.evidence if "waited for a CPU" in e.what)
    assert "CPU limit (0.001 CPUs: 1000 µs of every 1000000 µs) throttled it in 5 of 5 periods" in line.what
    assert (line.values["throttled_periods"], line.values["periods"]) == (5, 5)
    assert v.advice[0].startswith("Raise the engine's CPU limit")
    assert classify(b).advice[0].startswith("Find what holds the CPUs")  # no limit read: the host's other work


# --- the hypervisor's steal ------------------------------------------------------------------

# Two readings of a 2-vCPU VM's /proc/stat 20 s apart under three CPU hogs (the first three lines);
# steal is the 8th number: cpu0 grew by 5 ticks, cpu1 by 6. A quiet VM loses that little.
STAT_BEFORE = ("cpu  9837730 37365 548853 5283310 4355 0 26581 236876 0 0\n"
               "cpu0 4508138 17621 247172 3076279 2869 0 15464 124742 0 0\n"
               "cpu1 5329591 19743 301681 2207031 1486 0 11116 112134 0 0\n")
STAT_AFTER = ("cpu  9841526 37365 549058 5283310 4355 0 26582 236888 0 0\n"
              "cpu0 4510030 17621 247281 3076279 2869 0 15465 124747 0 0\n"
              "cpu1 5331495 19743 301776 2207031 1486 0 11116 112140 0 0\n")


def _steal_between(tmp_path: Path, before: str, after: str, span_s: float) -> dict[str, str]:
    from wedgectl.store.sources import steal_facts

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "stat").write_text(before)
    (tmp_path / "b" / "stat").write_text(after)
    return steal_facts(procfs.cpu_steal_s(tmp_path / "a"), procfs.cpu_steal_s(tmp_path / "b"), span_s)


def test_steal_over_a_capture_from_recorded_stat(tmp_path: Path) -> None:
    facts = _steal_between(tmp_path, STAT_BEFORE, STAT_AFTER, 20.0)
    assert facts == {"steal_s": f"{11 / procfs.CLK_TCK:.2f}", "steal_span_s": "20.00", "steal_cpus": "2"}
    b = load()
    stolen, span, share = Facts(replace(b, manifest=replace(b.manifest, host={**b.manifest.host, **facts}))).host_steal
    assert (stolen, span) == (pytest.approx(11 / procfs.CLK_TCK, abs=0.005), 20.0)
    assert share == pytest.approx(stolen / 40.0) and share < STEAL_SHARE  # under 1 %: not worth naming


def test_steal_facts_need_two_readings_of_the_same_cpus(tmp_path: Path) -> None:
    from wedgectl.store.sources import steal_facts

    assert steal_facts({}, {0: 5.0}, 10.0) == {}
    assert steal_facts({0: 5.0}, {1: 6.0}, 10.0) == {}  # no CPU read both times
    assert steal_facts({0: 5.0}, {0: 6.0}, 0.0) == {}
    assert steal_facts({0: 5.0, 1: 3.0}, {0: 4.0, 1: 4.5}, 10.0)["steal_s"] == "1.50"  # a counter that went back counts 0


@pytest.mark.parametrize("host", [{}, {"steal_s": "x", "steal_span_s": "1", "steal_cpus": "2"},
                                  {"steal_s": "nan", "steal_span_s": "1", "steal_cpus": "2"},
                                  {"steal_s": "-1", "steal_span_s": "1", "steal_cpus": "2"},
                                  {"steal_s": "1", "steal_span_s": "0", "steal_cpus": "2"},
                                  {"steal_s": "1", "steal_span_s": "1", "steal_cpus": "0"},
                                  {"steal_s": "1", "steal_span_s": "inf", "steal_cpus": "2"}])
def test_steal_facts_from_a_hostile_bundle_are_left_out(host: dict[str, str]) -> None:
    b = load()
    assert Facts(replace(b, manifest=replace(b.manifest, host=host))).host_steal is None


def _with_steal(b: Bundle, stolen: float, span: float = 10.0) -> Bundle:
    host = {**b.manifest.host, "steal_s": f"{stolen:.2f}", "steal_span_s": f"{span:.2f}", "steal_cpus": "2"}
    return replace(b, manifest=replace(b.manifest, host=host))


def test_a_host_whose_hypervisor_steals_names_it_in_evidence_and_advice():
    """The recorded capture with a third of the VM's CPU time stolen: the CPU-wait line says so and
    the advice points at the VM's host; with 2 % stolen (a quiet VM) neither mentions it."""
    b = prefix(load(), 6)
    v = classify(_with_steal(b, 6.6))
    assert v.rule == "live_engine_waits_for_cpu"
    line = next(e for e in v.evidence if "waited for a CPU" in e.what)
    assert "the hypervisor took 33% of this VM's CPU time over the capture (steal: 6.6 CPU s in 10.0 s)" in line.what
    assert (line.values["steal_share"], line.values["steal_s"]) == (0.33, 6.6)
    assert v.advice[0].startswith("The hypervisor took 33% of this VM's CPU time")
    quiet = classify(_with_steal(b, 0.4))
    line = next(e for e in quiet.evidence if "waited for a CPU" in e.what)
    assert "hypervisor" not in line.what and "steal_share" not in line.values
    assert quiet.advice[0].startswith("Find what holds the CPUs")


# --- an engine queued for a CPU behind gauges that say idle ---------------------------------

QUEUED = Path(__file__).parent / "fixtures" / "bundles" / "engine-queued-behind-idle-gauges.tar.gz"
# `wedgectl diagnose --pid` of a real idle vLLM 0.32 server under two CPU hogs (load ~3.4 on 2 CPUs)
IDLE_LOADED = Path(__file__).parent / "fixtures" / "bundles" / "idle-loaded-host.tar.gz"


def test_an_engine_queued_behind_idle_gauges_is_not_called_idle():
    """Recorded in a hogged CI run of the live CPU-limit test: the healthy stream's EngineCore and
    Worker held to 1 ms of CPU a second. The limit stopped the engine after it had published 0
    running, 0 waiting, and before it published the request it was handed. The quick look's two
    samples, 0.41 s apart: both main threads in state R, their run delay up 0.40 s and 0.39 s.
    That read as a certain `idle` and the capture stopped; now it is not idle, and goes on."""
    b = replace(read_bundle(QUEUED), verdict=None)
    f = Facts(b)
    assert len(b.samples) == 2 and not f.running and not f.waiting
    assert f.engine_queued and all(p.state == "R" for p in f.last_processes if p.main_runq_s is not None)
    assert f.engine_cpu_wait is None  # too short a span for the CPU-wait rule's own reading
    v = classify(b)
    assert v.verdict is not VerdictKind.IDLE and v.verdict not in HANGS and v.confidence < CERTAIN
    step = next_step(v, 2, b.samples[-1].t - b.samples[0].t, SamplerOptions(window_s=8.0), False, False)
    assert not step.stop


def test_queued_behind_idle_gauges_for_a_second_names_the_wait():
    """The same capture a second on, the engine still queued (a third sample: the second's readings,
    1 s later, each main thread's run delay 0.95 s higher and one more 1 s period of its CPU limit
    throttled): the CPU-wait verdict, not idle."""
    b = replace(read_bundle(QUEUED), verdict=None)
    last = b.samples[-1]
    later = replace(last, t=last.t + 1.0, processes=tuple(
        replace(p, main_runq_s=p.main_runq_s + 0.95,
                cpu_limit=replace(p.cpu_limit, periods=p.cpu_limit.periods + 1, throttled=p.cpu_limit.throttled + 1))
        if p.main_runq_s is not None and p.cpu_limit is not None else p for p in last.processes))
    v = classify(replace(b, samples=(*b.samples, later)))
    assert (v.verdict, v.rule) == (VerdictKind.INCONCLUSIVE, "live_engine_waits_for_cpu")
    assert any("waited for a CPU" in e.what for e in v.evidence)
    assert v.advice[0].startswith("Raise the engine's CPU limit")  # its cgroup ran out of quota in 3 of 3 periods


def test_an_idle_engine_on_a_loaded_host_is_still_idle():
    """An idle engine sleeps on its queues: under two CPU hogs its main threads' run delay stood
    still over the quick look (0.00 s in 0.47 s), so it is not queued and the verdict is idle."""
    b = replace(read_bundle(IDLE_LOADED), verdict=None)
    f = Facts(b)
    assert any(p.main_runq_s is not None for p in f.last_processes)
    assert not f.engine_queued
    v = classify(b)
    assert v.verdict is VerdictKind.IDLE and v.confidence >= CERTAIN


THROTTLED = Path(__file__).parent / "fixtures" / "bundles" / "engine-throttled-overloaded-host.tar.gz"


def test_a_throttled_runnable_engine_is_not_a_deadlock_though_its_run_delay_understates_it():
    """Recorded on an overloaded host (two CI runs and two CPU hogs on 2 CPUs): the live CPU-limit
    test's engine, held to 1 ms of CPU a second, 1 running, frozen counters, 0.00 cores. The samples
    came 10.5 s and 2.4 s apart; between the first and last the EngineCore queued only 4.3 s of
    12.9 s (under CPU_WAIT_SHARE), and that read as a certain engine deadlock. Its cgroup ran out
    of quota in 5 of 5 periods with both main threads runnable (state R): its limit holds it."""
    b = replace(read_bundle(THROTTLED), verdict=None)
    f = Facts(b)
    _, waited, span = f.engine_cpu_wait
    assert waited < CPU_WAIT_SHARE * span  # the run delay alone would not tell it
    p, throttled, periods = f.engine_throttling
    assert (throttled, periods) == (5, 5) and p.state == "R"
    assert f.engine_throttled and f.engine_waits_for_cpu
    v = classify(b)
    assert (v.verdict, v.rule) == (VerdictKind.INCONCLUSIVE, "live_engine_waits_for_cpu")
    assert "CPU limit ran out in 5 of 5 periods while it was runnable" in v.summary
    line = next(e for e in v.evidence if "waited for a CPU" in e.what)
    assert "given none" not in line.what and "throttled it in 5 of 5 periods" in line.what
    assert v.advice[0].startswith("Raise the engine's CPU limit")
    assert not [k for k in range(2, len(b.samples) + 1) if classify(prefix(b, k)).verdict in HANGS]


ZERO_INTERVAL = Path(__file__).parent / "fixtures" / "bundles" / "engine-throttled-log-zero-interval.tar.gz"


def test_a_log_stats_interval_at_zero_is_not_a_deadlock_while_the_live_engine_waits_for_a_cpu():
    """Recorded in CI (a fresh clone, two CPU hogs on 2 CPUs): the live CPU-limit test's engine,
    held to 1 ms of CPU a second, logged a whole stats interval at 0 tokens/s with 2 running. Its
    first two samples, too close together for the live rules, read the log's zero interval as a
    certain engine deadlock, though the engine's threads were runnable and its quota spent in
    the one period between them. No prefix names a hang now, and the whole window still says the
    engine waits for a CPU."""
    b = replace(read_bundle(ZERO_INTERVAL), verdict=None)
    s = Facts(b).last_stats
    assert s is not None and s.running == 2 and s.gen_tps == 0 and s.prompt_tps == 0
    first = Facts(prefix(b, 2))
    assert first.is_live and first.engine_queued and first.engine_throttled and first.engine_parked
    verdicts = [classify(prefix(b, k)) for k in range(2, len(b.samples) + 1)]
    assert not [(v.verdict, v.rule) for v in verdicts if v.verdict in HANGS]
    assert verdicts[0].rule != "log_engine_deadlock"
    assert (verdicts[-1].verdict, verdicts[-1].rule) == (VerdictKind.INCONCLUSIVE, "live_engine_waits_for_cpu")
    # the log alone (no live capture) still reads the zero interval as a stop
    log_only = replace(b, samples=())
    assert not Facts(log_only).is_live and classify(log_only).rule == "log_engine_deadlock"


def _asleep(b, runnable: str | None = None):
    """b with every thread of its CPU-limited processes asleep (state S), but the Worker's threads
    named `runnable`, which are runnable (state R, in no system call)."""
    def thread(p, t):
        if p.role is Role.WORKER and t.comm == runnable:
            return replace(t, state="R", syscall_nr=None, syscall_args=())
        return replace(t, state="S")
    return replace(b, samples=tuple(replace(s, processes=tuple(
        replace(p, state="S", threads=tuple(thread(p, t) for t in p.threads)) if p.cpu_limit is not None else p
        for p in s.processes)) for s in b.samples))


def test_throttling_of_a_sleeping_engine_is_no_excuse():
    """The same capture with every thread of the engine asleep (state S) at every reading: a blocked
    engine spends no quota of its own, so throttling then comes from something else in its cgroup,
    and a frozen engine is still read as a hang."""
    asleep = _asleep(replace(read_bundle(THROTTLED), verdict=None))
    f = Facts(asleep)
    assert mostly_throttled(f.engine_throttling)
    assert not f.engine_runnable and not f.engine_throttled and not f.engine_waits_for_cpu
    assert classify(asleep).verdict in HANGS


def test_a_throttled_engine_whose_main_threads_wait_on_a_runnable_sibling_is_not_a_deadlock():
    """Seen in the live CPU-limit test: the limit caught the engine with both main threads asleep on
    their queues while the Worker's ZMQ I/O thread, which feeds them, sat runnable under the spent
    quota. The same capture with only ZMQbg/IO/0 threads left runnable reads as waiting for a CPU on
    every prefix, never as a hang; with none left, it is a hang (above)."""
    b = _asleep(replace(read_bundle(THROTTLED), verdict=None), runnable="ZMQbg/IO/0")
    last = [p for p in Facts(b).last_processes if p.cpu_limit is not None]
    assert {p.state for p in last} == {"S"}
    assert {t.comm for p in last for t in p.threads if t.state == "R"} == {"ZMQbg/IO/0"}
    f = Facts(b)
    assert f.engine_runnable and f.engine_throttled and f.engine_waits_for_cpu
    v = classify(b)
    assert (v.verdict, v.rule) == (VerdictKind.INCONCLUSIVE, "live_engine_waits_for_cpu")
    assert v.advice[0].startswith("Raise the engine's CPU limit")
    assert not [k for k in range(2, len(b.samples) + 1) if classify(prefix(b, k)).verdict in HANGS]


LIMITED_QUICK = Path(__file__).parent / "fixtures" / "bundles" / "engine-limited-quick-look-zero-gauges.tar.gz"


def test_zero_gauges_with_a_runnable_thread_under_a_cpu_limit_are_not_a_certain_idle():
    """Recorded in a CI run of the live CPU-limit test on a loaded host (a third test worker beside the two): the
    same limit, but this time the main threads asleep over the quick look (their run delay still), two Worker
    threads runnable, the gauges at 0 running, 0 waiting. That read as a certain `idle` and the capture stopped
    at 0.4 s; a thread of a CPU-limited engine runnable is not an idle engine's, so idle is no longer certain and
    the capture runs its window, where the limit's throttling decides."""
    b = replace(read_bundle(LIMITED_QUICK), verdict=None)
    f = Facts(b)
    assert len(b.samples) == 2 and not f.running and not f.waiting and not f.engine_queued
    assert f.engine_runnable and f.engine_throttling is None  # too short a span to read the limit's periods
    v = classify(b)
    assert v.verdict is VerdictKind.IDLE and v.confidence < CERTAIN
    step = next_step(v, 2, b.samples[-1].t - b.samples[0].t, SamplerOptions(window_s=8.0), False, False)
    assert not step.stop


LIGHT_LOAD = Path(__file__).parent / "fixtures" / "bundles" / "engine-queued-light-load.tar.gz"


def test_tokens_made_in_the_window_are_progress_however_queued_the_engine():
    """Recorded by tests/fixtures/bundles/record_queued_light_load.py: `watch`'s own looks (cheap and full, one a
    second) of a real vLLM 0.32 server held to 0.05 cores by a CPU limit, serving one 8-token completion every
    2 s from a client process of its own (the healthy control of test_watch_prometheus, which read `inconclusive`
    when both cores were hogged). Its window at look 10 made tokens, its last scrape fell between two requests (0
    running, 0 waiting) and its main thread waited for a CPU: that read as `the engine is waiting for a CPU ...
    counters frozen`, beside a counter that had just moved. Replayed window by window as the watch takes them,
    no window names a hang, and that one says the engine is serving, and why it is slow."""
    b = replace(read_bundle(LIGHT_LOAD), verdict=None)
    windows = [verdict_window(b.samples[:k]) for k in range(1, len(b.samples) + 1)]
    verdicts = [classify(replace(b, samples=w)) for w in windows]
    assert not [(k, v.verdict) for k, v in enumerate(verdicts, 1) if v.verdict in HANGS]
    sought = next(k for k, w in enumerate(windows, 1) if len(w) >= 10 and (f := Facts(replace(b, samples=w)))
                  .tokens_advance and not f.running and not f.waiting and f.engine_waits_for_cpu)
    v = verdicts[sought - 1]
    assert (sought, v.verdict, v.rule) == (10, VerdictKind.PROGRESSING, "live_progressing")
    assert any("waited for a CPU" in e.what for e in v.evidence)
    # and once the window has slid past the start, still serving at every look
    assert {v.verdict for v in verdicts[MIN_CLASSIFY:]} == {VerdictKind.PROGRESSING}
