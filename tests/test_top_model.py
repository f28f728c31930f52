"""wedgectl top's pure layer: frames from recorded bundles, sparklines, futex sharing, reachability."""

from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.tui import model
from wedgectl.tui.source import BundleSource
from wedgectl.model.types import MetricsScrape, ProcessSample, Role, Sample, ThreadSample

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
RECORDED = sorted(BUNDLES.glob("*.tar.gz"))


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_the_lean_copies_give_the_verdict_diagnose_gives(path):
    # top classifies copies without comments and histogram buckets (a quarter of the parse
    # cost); the verdict, evidence and all, must be the one the full bundle gets.
    b = read_bundle(path)
    frame = BundleSource(b, path).frame_at(len(b.samples))
    assert frame.verdict == classify(b)


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_lean_text_keeps_every_series_but_the_buckets(path):
    b = read_bundle(path)
    for s in b.samples:
        if s.metrics is None or not s.metrics.ok:
            continue
        full = model.parse_metrics(s.metrics.text).samples
        lean = model.parse_metrics(model.lean_metrics_text(s.metrics.text)).samples
        assert {k for k in full if not k.endswith("_bucket")} == set(lean)
        assert all(full[k] == lean[k] for k in lean)


def test_counters_of_a_wedge_show_one_waiting_for_capacity_and_no_tokens():
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    rows = {r.key: r for r in model.counter_rows([model.ScrapedSample.of(s) for s in b.samples])}
    assert rows["waiting"].current == "1" and rows["waiting_capacity"].current == "1"
    assert rows["running"].current == "0"
    assert rows["gen_tps"].current == "0.0"
    assert rows["hb_steps"].current == "n/a (stock engine)"  # the recorded server runs the stock engine


def test_counters_of_a_healthy_server_show_tokens_flowing():
    b = read_bundle(BUNDLES / "healthy.tar.gz")
    rows = {r.key: r for r in model.counter_rows([model.ScrapedSample.of(s) for s in b.samples])}
    assert float(rows["gen_tps"].current) > 10
    assert len(rows["gen_tps"].values) == len(b.samples) - 1  # a rate between each pair of scrapes


HEARTBEAT_TEXT = """\
vllm:num_requests_running{{engine="0"}} 1.0
vllm:generation_tokens_total{{engine="0"}} {gen}
wedge_engine:steps_total {steps}
wedge_engine:model_steps_total {model}
wedge_engine:last_model_step_age_seconds {age}
"""


def test_heartbeat_rows_appear_when_the_patched_engine_publishes_them():
    window = [
        model.ScrapedSample.of(Sample(t=t, metrics=MetricsScrape(t=t, url="u", status=200, text=HEARTBEAT_TEXT.format(gen=g, steps=st, model=m, age=a))))
        for t, g, st, m, a in ((100.0, 0, 10, 5, 0.1), (102.0, 50, 30, 15, 0.1), (104.0, 50, 50, 15, 2.1))
    ]
    rows = {r.key: r for r in model.counter_rows(window)}
    assert rows["hb_steps"].values == (10.0, 10.0)  # 20 steps per 2 s
    assert rows["hb_model_steps"].values == (5.0, 0.0)
    assert rows["hb_age"].current == "2.1 s ago"


def test_spark_text_is_right_aligned_one_bar_per_value_on_a_fixed_floor():
    assert model.spark_text([0, 0, 1], 5) == "  ▁▁█"
    assert model.spark_text([0.3, 0.3], 2, top=100.0) == "▁▁"  # 0.3 % of KV is not a full bar
    assert model.spark_text(list(range(100)), 4)[-1] == "█"
    assert model.spark_text([], 3) == "   "


def _thread(tid, futex=None, state="S", cpu=0.0):
    return ThreadSample(tid=tid, comm=f"t{tid}", state=state, wchan="futex_do_wait" if futex else "",
                        syscall_nr=202 if futex else None, futex_addr=futex, utime_s=cpu)


def test_threads_waiting_on_one_futex_are_counted_together():
    p = ProcessSample(pid=1, ppid=0, role=Role.ENGINE_CORE, name="e",
                      threads=(_thread(1), _thread(2, 0xA0), _thread(3, 0xA0), _thread(4, 0xB0)))
    rows = {r.tid: r for r in model.thread_rows(p, None, 10.0, None)}
    assert (rows[2].sharing, rows[3].sharing, rows[4].sharing, rows[1].sharing) == (2, 2, 1, 0)
    assert rows[2].futex == "0xa0" and rows[2].syscall == "futex"
    assert rows[1].syscall == "-"


def test_cpu_percent_is_a_rate_between_the_last_two_samples():
    before = ProcessSample(pid=1, ppid=0, role=Role.ENGINE_CORE, name="e", cpu_user_s=10.0, threads=(_thread(1, cpu=10.0),))
    after = replace(before, cpu_user_s=12.8, threads=(_thread(1, cpu=12.8),))
    window = [model.ScrapedSample.of(Sample(t=100.0, processes=(before,))), model.ScrapedSample.of(Sample(t=102.0, processes=(after,)))]
    procs, threads = model.process_rows(window)
    assert procs[0].cpu_pct == pytest.approx(140.0)
    assert threads[1][0].cpu_pct == pytest.approx(140.0)


def test_thread_rows_are_made_per_process_when_looked_up(monkeypatch):
    """A frame's thread rows are made for the process the view looks at, when it looks: the same
    rows thread_rows gives, each process's made once, and none for a process never looked up."""
    engine = ProcessSample(pid=1, ppid=0, role=Role.ENGINE_CORE, name="e", cpu_user_s=1.0,
                           threads=(_thread(1, cpu=1.0), _thread(2, cpu=0.5)))
    worker = ProcessSample(pid=2, ppid=1, role=Role.WORKER, name="w", cpu_user_s=3.0, threads=(_thread(3, cpu=3.0),))
    later = (replace(engine, threads=(_thread(1, cpu=2.0), _thread(2, cpu=0.5))), replace(worker, threads=(_thread(3, cpu=3.5),)))
    window = [model.ScrapedSample.of(Sample(t=10.0, processes=(engine, worker))),
              model.ScrapedSample.of(Sample(t=11.0, processes=later))]
    made: list[int] = []
    real = model.thread_rows
    monkeypatch.setattr(model, "thread_rows", lambda p, *a: made.append(p.pid) or real(p, *a))
    procs, threads = model.process_rows(window)
    assert made == [] and sorted(threads) == [1, 2] and len(threads) == 2
    assert threads[1] == real(later[0], engine, 11.0, 10.0)
    assert [r.cpu_pct for r in threads[1]] == [pytest.approx(100.0), pytest.approx(0.0)]
    assert threads.get(1) is threads[1] and made == [1]  # made once
    assert threads.get(99, ()) == () and made == [1]
    assert threads[2][0].cpu_pct == pytest.approx(50.0) and made == [1, 2]


def test_reachability_says_what_failed():
    proc = ProcessSample(pid=1, ppid=0, role=Role.API_SERVER, name="api")
    ok = MetricsScrape(t=1, url="u", status=200, text="x 1\n")
    down = MetricsScrape(t=1, url="u", error="unreachable: connection refused")
    assert model.reachability(Sample(t=1, metrics=ok, processes=(proc,)), has_pid=True) == (True, "")
    assert model.reachability(Sample(t=1, metrics=down, processes=(proc,)), has_pid=True) == (False, "/metrics: unreachable: connection refused")
    reachable, why = model.reachability(Sample(t=1, metrics=down), has_pid=True)
    assert not reachable and "processes are gone" in why


def test_stack_lines_name_the_dump_and_the_thread():
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    stacks = model.window_stacks([model.ScrapedSample.of(s) for s in b.samples])
    engine = next(p.pid for p in b.samples[-1].processes if p.role == Role.ENGINE_CORE)
    tid = model.main_tids(stacks)[engine]
    lines = model.stack_lines(stacks[engine], tid)
    assert lines[0].startswith(f"py-spy dump of pid {engine}") and f"thread {tid}" in lines[0]
    assert any("run_busy_loop" in line for line in lines[1:])
    assert "runs no Python code" in model.stack_lines(stacks[engine], 1)[1]
    # The recorded burst's last dump caught the main thread between frames: an older one is shown.
    assert not model._thread_of(stacks[engine][-1], tid)["frames"]
    assert model.stack_lines(None, 1)[0].startswith("no stack dump yet")


def test_a_stack_dumps_age_moves_in_steps_so_a_refresh_does_not_redraw_the_stack():
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    stacks = model.window_stacks([model.ScrapedSample.of(s) for s in b.samples])
    engine = next(p.pid for p in b.samples[-1].processes if p.role == Role.ENGINE_CORE)
    tid = model.main_tids(stacks)[engine]
    at = model.pick_dump(stacks[engine], tid).t
    heads = {age: model.stack_lines(stacks[engine], tid, now=at + age)[0] for age in (0.5, 4.9, 5.0, 9.9, 12.0, 14.9, 61.0)}
    assert " ago" not in heads[0.5] and heads[0.5] == heads[4.9]  # the time of day alone says it
    assert ", 5 s ago" in heads[5.0] and heads[5.0] == heads[9.9]
    assert ", 10 s ago" in heads[12.0] and heads[12.0] == heads[14.9]
    assert ", 60 s ago" in heads[61.0]


def test_the_resource_tracker_is_marked_and_its_stack_view_says_why_it_has_no_dump():
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    window = [model.ScrapedSample.of(s) for s in b.samples]
    rows, _ = model.process_rows(window)
    helpers = [r for r in rows if r.helper]
    assert [r.role for r in helpers] == [Role.OTHER.value]  # vLLM's resource tracker, as recorded
    assert all(not r.helper for r in rows if r.role != Role.OTHER.value)
    assert "resource tracker" in model.stack_lines(None, None, helper=True)[0]
    assert model.stack_lines(None, None, helper=False)[0].startswith("no stack dump yet")


def test_top_and_the_classifier_share_one_futex_grouping():
    # The deadlock's evidence names the EngineCore's most crowded futex addresses; top's thread
    # rows must show the same groups, since both read ProcessSample.futex_waiters.
    b = read_bundle(BUNDLES / "engine-deadlock.tar.gz")
    ev = next(e for e in classify(b).evidence if "futex_waits" in e.values)
    last = next(s for s in reversed(b.samples) if s.processes)
    proc = next(p for p in last.processes if p.pid == ev.values["pid"])
    rows = {r.tid: r for r in model.thread_rows(proc, None, last.t, None)}
    assert ev.values["futex_waits"]
    for addr, tids in ev.values["futex_waits"].items():
        assert all(rows[t].futex == addr and rows[t].sharing == len(tids) for t in tids)
    assert sum(1 for r in rows.values() if r.futex) == proc.futex_waiters.n_waiting


def test_a_frame_reads_its_counters_from_the_last_samples_and_draws_the_same_bars():
    """build_frame reads the counters from the last SPARK_SAMPLES of the window: every bar the
    counters panel can show (and every value) is the one the whole window gives."""
    from wedgectl.tui.widgets import CounterPanel

    b = read_bundle(BUNDLES / "healthy.tar.gz")
    samples = [s for s in b.samples if s.metrics is not None and s.metrics.ok]
    span = samples[-1].t - samples[0].t + 1.0
    longer = []  # the recorded scrapes again and again, each round later and its counters higher
    for k in range(-(-70 // len(samples))):
        for s in samples:
            text = "\n".join(
                f"{line.rsplit(' ', 1)[0]} {float(line.rsplit(' ', 1)[1]) + k * 1000.0}"
                if line.startswith("vllm:generation_tokens_total") else line
                for line in s.metrics.text.splitlines())
            longer.append(replace(s, t=s.t + k * span, metrics=replace(s.metrics, t=s.metrics.t + k * span, text=text)))
    window = tuple(model.ScrapedSample.of(s) for s in longer[:70])
    assert len(window) == 70 > model.SPARK_SAMPLES
    frame = model.build_frame(b.manifest, window, b.log_lines, 10, "t")
    whole = model.counter_rows(window)
    width = 58 - 4 - CounterPanel.NAME_WIDTH - CounterPanel.VALUE_WIDTH - 2  # the panel's bars (border, padding)
    assert width <= model.SPARK_SAMPLES - 1
    assert [(r.key, r.current) for r in frame.counters] == [(r.key, r.current) for r in whole]
    for mine, theirs in zip(frame.counters, whole):
        assert model.spark_text(mine.values, width, mine.top) == model.spark_text(theirs.values, width, theirs.top)
        assert len(mine.values) < len(theirs.values) or not theirs.values
    assert any(float(r.current) > 0 for r in frame.counters if r.key == "gen_tps")
