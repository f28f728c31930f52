"""wedgectl top driven with Textual's Pilot: recorded bundles, and scripted live sources (slow, dead, swappable)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.model import exitcodes
from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.capture.discover import Deployment
from wedgectl.tui import app as top_app
from wedgectl.tui import screens
from wedgectl.tui.app import make_app
from wedgectl.tui.screens import ConfirmSwap, HelpScreen, PickerScreen
from wedgectl.tui.source import BundleSource, LiveSource, ServerInfo
from wedgectl.tui.widgets import EvidenceView, ProcessTable, StackView, StatusLine, ThreadTable, VerdictBanner
from wedgectl.model.types import MetricsScrape, Role, Sample

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
WEDGE = BUNDLES / "admission-wedge.tar.gz"
# `diagnose` as nobody (no ptrace, no py-spy) against a real admission wedge: the engine report decides
UNPRIVILEGED_WEDGE = BUNDLES / "unprivileged" / "admission-wedge.tar.gz"
SIZE = (120, 40)


async def until(pilot, cond, timeout: float = 10.0) -> None:
    """Let the app run until cond() holds (workers post their frames asynchronously)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.05)


def text_of(widget) -> str:
    return str(widget.content)


def cells(table, row: int) -> list[str]:
    return [str(c) for c in table.get_row_at(row)]


def notes_of(app) -> list[str]:
    return [n.message for n in app._notifications]


# ------------------------------------------------------------- recorded bundles


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["admission-wedge", "engine-deadlock", "healthy", "idle", "starved"])
async def test_the_banner_shows_the_verdict_diagnose_gives(name):
    b = read_bundle(BUNDLES / f"{name}.tar.gz")
    expected = classify(b)
    app = make_app(BundleSource(b, BUNDLES / f"{name}.tar.gz"))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.pause()
        banner = text_of(app.query_one(VerdictBanner))
        assert banner.startswith(f"VERDICT  {expected.verdict.value}  (confidence {expected.confidence:.2f})")
        assert expected.summary in banner
        assert f"sample {len(b.samples)}/{len(b.samples)}" in text_of(app.query_one(StatusLine))
        assert expected.evidence[0].what in text_of(app.query_one(EvidenceView))


async def drawn_words(pilot, pane) -> str:
    """Every line the pane draws, scrolled through from its top a pane's height at a time, as one run of words
    (a line wrapped at a space reads as the text it came from)."""
    lines: list[str] = []
    for y in range(0, max(1, pane.virtual_size.height), max(1, pane.size.height)):
        pane.scroll_to(y=y, animate=False)
        await pilot.pause()
        lines += [pane.render_line(row).text for row in range(pane.size.height)]
    return " ".join(" ".join(lines).split())


@pytest.mark.asyncio
@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
async def test_the_evidence_pane_names_the_request_the_engine_report_says_to_abort(live):
    """As nobody, with no ptrace: the engine's own report decides the admission wedge, and the evidence
    pane says what `diagnose` says: the request by id and the blocks it needs against the pool, tagged
    [engine], and the abort to run."""
    b = read_bundle(UNPRIVILEGED_WEDGE)
    expected = classify(b)
    assert expected.rule == "live_engine_report_wedge"
    engine = [e for e in expected.evidence if e.source == "engine"]
    rid, needed, total = (engine[0].values[k] for k in ("request", "blocks_needed", "kv_total"))
    api = b.manifest.target.pid
    app = make_app(ScriptedSource(b), refresh_s=0.2) if live else make_app(BundleSource(b, UNPRIVILEGED_WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None and app.frame.verdict is not None
                    and app.frame.verdict.rule == "live_engine_report_wedge")
        if live:  # no more refreshes: past the recording's end its last sample repeats, and ten refreshes
            app._collect_loop.stop()  # later the first has left the window the verdict rests on
        await pilot.pause()
        assert rid in text_of(app.query_one(VerdictBanner))
        shown = await drawn_words(pilot, app.query_one(EvidenceView))
    assert f"[engine] request {rid} needs {needed} KV blocks; the pool holds {total} in all" in shown
    assert "[engine] the engine stepped" in shown
    assert f"next: Abort request {rid}: `wedgectl remedy --pid {api} --yes`" in shown
    assert shown.index("[engine] request") < shown.index("next: Abort request")


@pytest.mark.asyncio
async def test_the_garbage_collector_runs_less_often_while_top_runs_and_is_given_back():
    """From the first frame, top's short-lived objects are left to refcounting and young collections
    come every 10,000 allocations (at the default 700 they walked the live window each refresh);
    the thresholds the process had come back when the app ends."""
    import gc

    before = gc.get_threshold()
    assert before != top_app.GC_THRESHOLD
    app = make_app(BundleSource(read_bundle(WEDGE), WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        assert gc.get_threshold() == top_app.GC_THRESHOLD
    assert gc.get_threshold() == before


@pytest.mark.asyncio
async def test_tables_show_the_deployment_and_the_engine_threads():
    b = read_bundle(WEDGE)
    last = b.samples[-1]
    engine = next(p for p in last.processes if p.role == Role.ENGINE_CORE)
    app = make_app(BundleSource(b, WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.pause()
        procs = app.query_one(ProcessTable)
        rows = [cells(procs, i) for i in range(procs.row_count)]
        assert {(r[0], r[1]) for r in rows} == {(str(p.pid), p.role.value) for p in last.processes}
        assert rows[0][1] == "api_server"  # API server first, then engine, workers, helpers
        # The engine is selected first; its thread table lists its threads with their wait state.
        assert app.selected_pid == engine.pid
        threads = app.query_one(ThreadTable)
        assert threads.row_count == len(engine.threads)
        assert threads.border_title == f"threads of pid {engine.pid}"
        by_tid = {cells(threads, i)[0]: cells(threads, i) for i in range(threads.row_count)}
        for t in engine.threads:
            row = by_tid[str(t.tid)]
            assert row[2] == t.state
            if t.futex_addr is not None:
                assert row[5] == "futex" and row[6] == f"{t.futex_addr:#x}"
        # The selected thread is the engine's busy loop, and its stack is shown.
        stack = text_of(app.query_one(StackView))
        assert f"thread {app.selected_tid} 'MainThread'" in stack
        assert "run_busy_loop" in stack


@pytest.mark.asyncio
async def test_threads_sharing_a_futex_are_highlighted_in_the_worker():
    b = read_bundle(WEDGE)
    worker = next(p for p in b.samples[-1].processes if p.role == Role.WORKER)
    app = make_app(BundleSource(b, WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        app.query_one(ProcessTable).focus()
        await pilot.press("down")  # api_server, engine_core, worker: the cursor starts on the engine
        await until(pilot, lambda: app.selected_pid == worker.pid)
        table = app.query_one(ThreadTable)
        await until(pilot, lambda: table.row_count == len(worker.threads))
        shared = [t for t in worker.threads if t.futex_addr is not None
                  and sum(1 for o in worker.threads if o.futex_addr == t.futex_addr) > 1]
        assert shared, "the recorded worker has gloo threads pairing on futexes"
        for i in range(table.row_count):
            row = table.get_row_at(i)
            tid = int(str(row[0]))
            if any(t.tid == tid for t in shared):
                assert str(row[7]).startswith("x") and row[0].style.startswith("bold ")
            else:
                assert str(row[7]) == "" and not row[0].style


@pytest.mark.asyncio
async def test_selecting_a_thread_shows_its_stack():
    b = read_bundle(WEDGE)
    app = make_app(BundleSource(b, WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        app.query_one(ThreadTable).focus()
        first = app.selected_tid
        await pilot.press("down")
        await until(pilot, lambda: app.selected_tid != first)
        assert f"thread {app.selected_tid}" in text_of(app.query_one(StackView))


@pytest.mark.asyncio
async def test_replay_steps_back_and_forward_through_the_samples():
    b = read_bundle(WEDGE)
    n = len(b.samples)
    app = make_app(BundleSource(b, WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None and app.frame.n_samples == n)
        await pilot.press("left_square_bracket")
        await until(pilot, lambda: app.frame.n_samples == n - 1)
        assert f"sample {n - 1}/{n}" in text_of(app.query_one(StatusLine))
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: app.frame.n_samples == n)


@pytest.mark.asyncio
async def test_s_saves_a_bundle_that_classifies_the_same(tmp_path):
    b = read_bundle(WEDGE)
    app = make_app(BundleSource(b, WEDGE), save_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("s")
        await until(pilot, lambda: list(tmp_path.glob("wedgectl-top-*.tar.gz")))
        await until(pilot, lambda: any(m.startswith("saved ") for m in notes_of(app)))
    saved = read_bundle(next(tmp_path.glob("wedgectl-top-*.tar.gz")))
    assert len(saved.samples) == len(b.samples)
    assert saved.verdict is not None and saved.verdict.verdict == classify(b).verdict


@pytest.mark.asyncio
async def test_live_only_keys_say_so_in_a_replay():
    app = make_app(BundleSource.load(WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("d")
        await pilot.press("w")
        await pilot.pause()
        assert any("no live target to dump" in m for m in notes_of(app))
        assert any("no live target to swap" in m for m in notes_of(app))


@pytest.mark.asyncio
async def test_help_opens_and_closes_and_q_quits():
    app = make_app(BundleSource.load(WEDGE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "save an evidence bundle" in str(app.screen.query_one("#help").content)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


# ------------------------------------------------------------ scripted live sources


class ScriptedSource(LiveSource):
    """A 'live' target that plays a recorded bundle's samples one per refresh, re-timed to now."""

    def __init__(self, bundle, block: threading.Event | None = None, metrics_down_after: int | None = None):
        t = bundle.manifest.target
        dep = Deployment(t.pid, t.pid, {p: Role.OTHER for p in t.pids}, t.url, f"{t.url}/metrics")
        super().__init__(dep, t.pid, None)
        self.samples = bundle.samples
        self.block = block
        self.metrics_down_after = metrics_down_after
        self.calls: list[tuple[bool, bool]] = []

    def take(self, with_stacks: bool, native: bool = False) -> Sample:
        self.calls.append((with_stacks, native))
        if self.block is not None:
            self.block.wait(30)  # a target whose every read hangs
        n = len(self.calls) - 1
        last = len(self.samples) - 1
        s = self.samples[min(n, last)]
        # The recorded spacing is kept (the rules read how long counters stayed frozen); past the
        # end, the last sample repeats a second apart: a target that stays as it was.
        if n == 0:
            self.shift = time.time() - s.t
        shift = self.shift + max(0, n - last) * 1.0
        metrics = s.metrics
        if self.metrics_down_after is not None and n >= self.metrics_down_after:
            metrics = MetricsScrape(t=time.time(), url=self.deployment.metrics_url, error="unreachable: connection refused")
        elif metrics is not None:
            metrics = type(metrics)(**{**metrics.__dict__, "t": metrics.t + shift})
        return Sample(t=s.t + shift, metrics=metrics, processes=s.processes,
                      stacks=tuple(type(d)(**{**d.__dict__, "t": d.t + shift}) for d in s.stacks) if with_stacks else (),
                      engine=tuple(replace(r, t=r.t + shift) for r in s.engine))  # the report is read every look

    def log_tail(self, max_bytes: int) -> tuple[str, ...]:
        return ()


@pytest.mark.asyncio
async def test_live_view_refreshes_and_the_verdict_arrives():
    src = ScriptedSource(read_bundle(WEDGE))
    app = make_app(src, refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None and app.frame.n_samples >= 6)
        assert text_of(app.query_one(VerdictBanner)).startswith("VERDICT  admission_wedge")
        status = text_of(app.query_one(StatusLine))
        assert "refresh 0.2 s, stacks every 5" in status and "UNREACHABLE" not in status
        # stacks on the first refresh and every 5th after
        assert [w for w, _ in src.calls[:6]] == [True, False, False, False, False, True]


@pytest.mark.asyncio
async def test_d_and_shift_d_take_stacks_at_once_native_on_request():
    src = ScriptedSource(read_bundle(WEDGE))
    app = make_app(src, refresh_s=30)  # no timer tick during the test: only the keys collect
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(src.calls) == 1 and not app.collector.busy)
        await pilot.press("d")
        await until(pilot, lambda: len(src.calls) == 2)
        await pilot.press("D")
        await until(pilot, lambda: len(src.calls) == 3)
        assert src.calls[1:] == [(True, False), (True, True)]


@pytest.mark.asyncio
async def test_a_target_whose_metrics_die_is_shown_unreachable_and_top_keeps_going():
    src = ScriptedSource(read_bundle(WEDGE), metrics_down_after=2)
    app = make_app(src, refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None and not app.frame.reachable)
        status = app.query_one(StatusLine)
        assert "| UNREACHABLE: /metrics: unreachable: connection refused |" in text_of(status)
        assert status.has_class("-unreachable")
        n = app.frame.n_samples
        await until(pilot, lambda: app.frame.n_samples > n + 2)  # still sampling


@pytest.mark.asyncio
async def test_a_hung_target_never_freezes_the_screen():
    block = threading.Event()
    src = ScriptedSource(read_bundle(WEDGE), block=block)
    app = make_app(src, refresh_s=0.5)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "UNREACHABLE" in text_of(app.query_one(StatusLine)), timeout=8)
            assert "has not answered for" in text_of(app.query_one(StatusLine))
            assert len(src.calls) == 1  # ticks do not pile up behind the hung one
            await pilot.press("question_mark")  # the UI still answers keys
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            block.set()  # the target answers again
            await until(pilot, lambda: app.frame is not None and app.frame.reachable)
            assert "UNREACHABLE" not in text_of(app.query_one(StatusLine))
    finally:
        block.set()


@pytest.mark.asyncio
async def test_swap_says_when_this_build_has_no_swap(monkeypatch):
    monkeypatch.setattr(top_app, "swap_available", lambda: False)
    app = make_app(ScriptedSource(read_bundle(WEDGE)), refresh_s=30)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("w")
        await pilot.pause()
        assert "swap not available in this build" in notes_of(app)
        assert not isinstance(app.screen, ConfirmSwap)


@pytest.mark.asyncio
async def test_swap_asks_first_then_calls_swap_deployment(monkeypatch):
    from wedgectl.lab import swap

    called = []
    monkeypatch.setattr(top_app, "swap_plan", lambda pid: (None, [f"swap pid {pid}"], ""))  # the plan read, not made
    monkeypatch.setattr(swap, "swap_deployment", lambda pid, progress=None, plan=None: called.append(pid)
                        or types.SimpleNamespace(ok=True, message="", new_pid=None))
    monkeypatch.setattr(top_app, "swap_available", lambda: True)
    src = ScriptedSource(read_bundle(WEDGE))
    app = make_app(src, refresh_s=30)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmSwap))  # the plan is read first
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmSwap) and called == []
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmSwap))
        await pilot.press("y")
        await until(pilot, lambda: called == [src.deployment.api_pid])
        await until(pilot, lambda: any("swapped to the patched engine" in m for m in notes_of(app)))


@pytest.mark.asyncio
async def test_with_no_target_the_picker_lists_servers_and_watches_the_chosen_one(monkeypatch):
    b = read_bundle(WEDGE)
    pid = b.manifest.target.pid
    monkeypatch.setattr(screens, "find_servers", lambda: [ServerInfo(pid, "http://127.0.0.1:8000", "tiny", time.time() - 60, "vllm serve tiny")])
    monkeypatch.setattr(top_app.LiveSource, "connect", classmethod(lambda cls, pid=None, url=None: ScriptedSource(b)))
    app = make_app(None, refresh_s=30)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: isinstance(app.screen, PickerScreen))
        table = app.screen.query_one("#servers")
        await until(pilot, lambda: table.row_count == 1)
        assert cells(table, 0)[:3] == [str(pid), "http://127.0.0.1:8000", "tiny"]
        # Fixed widths: an auto column sized before its rows came stayed at its header's width
        # on a loaded host, and showed the URL as "htt".
        assert [(c.auto_width, c.width) for c in table.columns.values()] == [
            (False, 7), (False, screens.URL_WIDTH), (False, screens.MODEL_WIDTH), (False, 4), (False, screens.COMMAND_WIDTH)]
        await pilot.press("enter")
        await until(pilot, lambda: app.frame is not None)
        assert not isinstance(app.screen, PickerScreen)
        assert text_of(app.query_one(VerdictBanner)).startswith("VERDICT  ")


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", "top", *args], capture_output=True, text=True, timeout=60)


def test_cli_refuses_bad_targets_with_their_exit_codes(tmp_path):
    assert run_cli("--bundle", str(tmp_path / "nope.tar.gz")).returncode == exitcodes.NO_SUCH_FILE
    assert run_cli("--pid", "1").returncode == exitcodes.NOT_VLLM
    assert run_cli("--bundle", str(WEDGE), "--pid", "1").returncode == exitcodes.USAGE
    refused = run_cli("--pid", "1", "--stacks-quiet", "0")
    assert refused.returncode == exitcodes.USAGE and "--stacks-quiet must be > 0" in refused.stderr


@pytest.mark.asyncio
async def test_the_quiet_stacks_period_reaches_the_collector_and_the_status_line():
    """--stacks-quiet (60 s unless told): how often py-spy runs while the verdict is healthy."""
    from wedgectl.tui.source import STACKS_QUIET_S

    assert STACKS_QUIET_S == 60.0
    app = make_app(ScriptedSource(read_bundle(BUNDLES / "healthy.tar.gz")), refresh_s=0.2, stacks_quiet_s=7.5)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        assert app.collector.stacks_quiet_s == 7.5
        assert "(7.5 s while healthy)" in text_of(app.query_one(StatusLine))


@pytest.mark.asyncio
async def test_a_failed_swap_is_shown_and_top_keeps_watching(monkeypatch):
    from wedgectl.lab import swap

    monkeypatch.setattr(top_app, "swap_plan", lambda pid: (None, [f"swap pid {pid}"], ""))
    monkeypatch.setattr(swap, "swap_deployment", lambda pid, progress=None, plan=None: types.SimpleNamespace(
        ok=False, message="rolled back: new server never healthy", new_pid=None))
    monkeypatch.setattr(top_app, "swap_available", lambda: True)
    app = make_app(ScriptedSource(read_bundle(WEDGE)), refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("w", "y")
        await until(pilot, lambda: any(m.startswith("swap failed: rolled back") for m in notes_of(app)))
        n = app.frame.n_samples
        await until(pilot, lambda: app.frame.n_samples > n)


@pytest.mark.asyncio
async def test_a_row_is_drawn_as_rich_would_draw_it_joined_into_one_text():
    """RowTable._line builds each row's segments itself (Rich's Text.render of the joined row cost
    ~0.4 ms a row): the cells, their padding and alignment must come out as that render's, and every
    character that shows (not a space) in the style Rich gives it. A row of str cells is one segment
    in the row's style: the compositor's work on a line goes segment by segment."""
    from rich.text import Text
    from textual.app import App

    class One(App):
        def compose(self):
            yield ThreadTable(id="t")

    def joined(table, cells) -> Text:  # the row as Rich would draw it: one Text, rendered
        line = Text(" ")
        for i, (cell, width) in enumerate(zip(cells, table._widths)):
            pad = Text(" " * (width - cell.cell_len))
            line.append_text(pad + cell if i in table.RIGHT else cell + pad)
            line.append(" " * table.GAP)
        return line

    def styled(segments) -> list[tuple[str, str]]:  # each character that shows, with its style
        return [(ch, str(s.style or "")) for s in segments for ch in s.text if ch != " "]

    app = One()
    async with app.run_test(size=(100, 10)):
        table = app.query_one(ThreadTable)
        spans = Text.assemble(("fu", "bold"), "tex", style="cyan")  # a cell with spans under its own style
        table.set_rows([
            ("7", ("7", "python", "", "97", spans, "futex", "0x7f", "x2"), "bold yellow"),
            ("8", ("8", "python-long", "S", "3", "ep_poll", "epoll_wait", "", "")),
            ("9", ("9", "py", "R", "100", Text("own", style="magenta"), "", "", "")),
        ], None)
        for row in range(3):
            cells = table.get_row_at(row)
            ours = table._line(*table._rows[row], None)
            theirs = list(joined(table, cells).render(app.console))
            assert ours.text == "".join(s.text for s in theirs)
            assert styled(ours) == styled(theirs)
        assert table._line(*table._rows[0], None).text.startswith(" " + " " * (len("TID") - 1) + "7  python")
        first, second, third = (list(table._line(*table._rows[i], None)) for i in range(3))
        assert ("f", "bold cyan") in styled(first) and ("t", "cyan") in styled(first)
        assert ("9", "bold yellow") in styled(first) and ("x", "bold yellow") in styled(first)
        assert len(second) == 1 and second[0].style is None  # str cells, no row style: one plain segment
        assert [str(s.style or "") for s in third] == ["", "magenta", ""]  # a Text cell of its own style splits it
        assert table.get_row_at(0)[1].style == "bold yellow"  # a str cell reads back in its row's style


@pytest.mark.asyncio
async def test_a_refresh_draws_only_the_rows_that_changed(monkeypatch):
    """RowTable caches each row's line by its cells: one changed CPU figure redraws one row, where
    a DataTable drew every visible cell again (most of top's CPU at 1 Hz)."""
    from textual.app import App

    from wedgectl.tui import widgets

    class One(App):
        def compose(self):
            yield ThreadTable(id="t")

    rows = [(str(tid), (tid, "python", "S", "0", "futex_wait_queue", "futex", "", "")) for tid in range(100, 120)]
    app = One()
    async with app.run_test(size=(100, 30)) as pilot:
        table = app.query_one(ThreadTable)
        table.set_rows(rows, None)
        await pilot.pause(0.1)
        drawn: list[tuple] = []
        lines: list[int] = []
        real, real_line = widgets.RowTable._line, widgets.RowTable.render_line
        monkeypatch.setattr(widgets.RowTable, "_line",
                            lambda self, cells, row_style, style: drawn.append(cells) or real(self, cells, row_style, style))
        monkeypatch.setattr(widgets.RowTable, "render_line", lambda self, y: lines.append(y) or real_line(self, y))
        changed = list(rows)
        changed[5] = ("105", (105, "python", "R", "97", "", "running", "", ""))
        table.set_rows(changed, None)
        await pilot.pause(0.1)
        assert [str(c[0]) for c in drawn if c and str(c[0]) != "TID"] == ["105"]
        assert [str(c) for c in table.get_row_at(5)][3] == "97"
        # Textual styles only that line again (the table's other lines and its header come from its cache)
        assert lines == [6]
        lines.clear()
        table.set_rows(changed, None)  # the same rows again: nothing is drawn
        await pilot.pause(0.1)
        assert lines == []
        wider = list(changed)
        wider[7] = ("107", (107, "python", "S", "0", "a_much_longer_wchan_name", "futex", "", ""))
        table.set_rows(wider, None)  # a column grew: every line moves, the header too
        await pilot.pause(0.1)
        assert 0 in lines and len(lines) >= 21


@pytest.mark.asyncio
async def test_the_banner_and_status_line_draw_changed_lines_in_the_style_their_class_gives(monkeypatch):
    """VerdictBanner and StatusLine draw their lines through the line API (a Static laid out its
    whole content again every refresh): a line too long for the box ends in an ellipsis, a new
    verdict that moves one line draws that line alone, and the base style they keep follows a class
    change (the banner's colour when the verdict turns to a hang, the status line's when the target
    stops answering)."""
    from textual.app import App

    from wedgectl.tui import widgets
    from wedgectl.model.types import Verdict, VerdictKind

    class Two(App):
        CSS = """
        VerdictBanner { height: 2; background: green; }
        VerdictBanner.-hang { background: red; }
        StatusLine { height: 1; color: white; }
        StatusLine.-unreachable { color: red; text-style: bold; }
        """

        def compose(self):
            yield VerdictBanner(id="b")
            yield StatusLine(id="s")

    def verdict(kind, summary):
        return Verdict(verdict=kind, confidence=0.9, rule="r", summary=summary)

    app = Two()
    async with app.run_test(size=(60, 5)) as pilot:
        banner, status = app.query_one(VerdictBanner), app.query_one(StatusLine)
        banner.verdict = verdict(VerdictKind.PROGRESSING, "12.5 tok/s")
        status.status = ("pid 1 | 3 samples " + "x" * 80, True)
        await pilot.pause(0.1)
        assert text_of(banner) == "VERDICT  progressing  (confidence 0.90)  rule r\n12.5 tok/s"
        line = status.render_line(0)
        assert line.cell_length == 60 and line.text.endswith("…") and line.text.startswith("pid 1 | 3 samples")
        green = banner.render_line(1)
        assert {s.style.bgcolor for s in green if s.text.strip()} == {banner.rich_style.bgcolor}

        drawn: list[int] = []
        real = widgets.FixedLines.render_line
        monkeypatch.setattr(widgets.FixedLines, "render_line", lambda self, y: drawn.append((self.id, y)) or real(self, y))
        banner.verdict = verdict(VerdictKind.PROGRESSING, "13.0 tok/s")  # the head line says the same
        await pilot.pause(0.1)
        assert drawn == [("b", 1)] and banner.render_line(1).text.startswith("13.0 tok/s")

        banner.verdict = verdict(VerdictKind.ENGINE_DEADLOCK, "stopped stepping")
        status.status = ("pid 1 | not answering", False)
        await pilot.pause(0.1)
        red = banner.render_line(1)
        assert banner.has_class("-hang") and red.text.startswith("stopped stepping")
        assert {s.style.bgcolor for s in red if s.text.strip()} == {banner.rich_style.bgcolor} != {s.style.bgcolor for s in green if s.text.strip()}
        bold = status.render_line(0)
        assert bold.text.startswith("pid 1 | not answering")
        assert all(s.style.bold and s.style.color == status.rich_style.color for s in bold if s.text.strip())


@pytest.mark.asyncio
async def test_the_counters_are_drawn_as_lines_and_only_a_changed_line_is_drawn_again(monkeypatch):
    """CounterPanel draws each counter as one line (name, model.spark_text's bars, value); a new
    refresh whose counters look the same draws nothing, and one changed counter draws its line
    alone. Three widgets a counter, styled and composited each refresh, were most of a frame's
    drawing after the tables."""
    from textual.app import App

    from wedgectl.tui import model
    from wedgectl.tui.widgets import CounterPanel

    class One(App):
        CSS = "CounterPanel { width: 50; height: 4; }"

        def compose(self):
            yield CounterPanel()

    def rows(kv: float, gen: tuple[float, ...]) -> tuple[model.CounterRow, ...]:
        return (model.CounterRow("gen_tps", "gen tok/s", gen, f"{gen[-1]:.1f}"),
                model.CounterRow("kv", "KV cache %", (kv,), f"{kv:.0f} %", top=100.0))

    app = One()
    async with app.run_test(size=(60, 6)) as pilot:
        panel = app.query_one(CounterPanel)
        panel.counters = rows(40.0, (0.0, 1.0, 4.0))
        await pilot.pause(0.1)
        first = panel.render_line(0).text
        assert first == "gen tok/s        " + model.spark_text([0.0, 1.0, 4.0], 50 - 16 - 18 - 2) + " " + "4.0".rjust(18)
        assert first.endswith("▁▃█" + " " * 16 + "4.0") and len(first) == 50
        assert panel.render_line(1).text.startswith("KV cache %") and panel.render_line(1).text.endswith("40 %")
        assert not panel.render_line(2).text.strip()

        drawn: list[int] = []
        real = CounterPanel.render_line
        monkeypatch.setattr(CounterPanel, "render_line", lambda self, y: drawn.append(y) or real(self, y))
        panel.counters = rows(40.0, (0.0, 1.0, 4.0))  # a new refresh, the same lines: nothing drawn
        await pilot.pause(0.1)
        assert drawn == []
        panel.counters = rows(55.0, (0.0, 1.0, 4.0))  # the KV line alone changed
        await pilot.pause(0.1)
        assert drawn == [1]
        assert panel.render_line(1).text.endswith("55 %")
        drawn.clear()
        panel.counters = (*rows(55.0, (0.0, 1.0, 4.0)), model.CounterRow("waiting", "waiting", (3.0,), "3"))
        await pilot.pause(0.1)
        assert sorted(set(drawn)) == [0, 1, 2, 3]  # a counter appeared: the panel is drawn again
        assert panel.render_line(2).text.startswith("waiting")


@pytest.mark.asyncio
async def test_a_text_pane_wraps_scrolls_and_draws_changed_lines_without_a_layout(monkeypatch):
    """The stack and evidence panes: text wrapped to the pane's width (its scrollbar always
    there, so the width does not move with the text's length), scrolled inside the pane. A new
    text of another length moves only the virtual size: no layout pass of the screen, which a
    Static of auto height cost at every change of its line count. A same-length text draws only
    its changed lines."""
    from rich.segment import Segment
    from rich.text import Text
    from textual.app import App
    from textual.widget import Widget

    from wedgectl.tui.widgets import TextPane

    class One(App):
        CSS = "TextPane { width: 21; height: 4; }"

        def compose(self):
            yield TextPane()

    app = One()
    async with app.run_test(size=(40, 8)) as pilot:
        pane = app.query_one(TextPane)
        width = pane.scrollable_content_region.width
        assert width == 20  # 21 less the scrollbar's column
        pane.show(Text("one two three four five six\nseven\n"))
        await pilot.pause(0.1)
        assert [pane.render_line(y).text.rstrip() for y in range(4)] == ["one two three four", "five six", "seven", ""]
        assert str(pane.content) == "one two three four five six\nseven"  # the trailing newline: no line
        assert pane.virtual_size.height == 3

        layouts: list[Widget] = []
        real_refresh = Widget.refresh

        def refresh(self, *regions, layout=False, **kw):
            if layout:
                layouts.append(self)
            return real_refresh(self, *regions, layout=layout, **kw)

        monkeypatch.setattr(Widget, "refresh", refresh)
        pane.show(Text("\n".join(f"line {i}" for i in range(10))))  # longer than the pane: it scrolls
        await pilot.pause(0.1)
        assert pane.virtual_size.height == 10 and pane.max_scroll_y == 6 and pane.size.height == 4
        pane.scroll_to(y=6, animate=False)
        await pilot.pause(0.1)
        assert pane.render_line(0).text.rstrip() == "line 6"
        pane.show(Text("a\nb"))  # shorter: the scroll comes back within it
        await pilot.pause(0.1)
        assert pane.scroll_y == 0 and pane.render_line(0).text.rstrip() == "a"
        assert layouts == []

        drawn: list[int] = []
        real = TextPane.render_line
        monkeypatch.setattr(TextPane, "render_line", lambda self, y: drawn.append(y) or real(self, y))
        pane.show(Text("a\nb"))  # the same text again: nothing drawn
        await pilot.pause(0.1)
        assert drawn == []
        pane.show(Text("a\nc"))  # the second line alone changed
        await pilot.pause(0.1)
        assert drawn == [1]

        # Paragraphs: only one not shown before at this width is wrapped; the lines are the
        # whole text's, wrapped as one
        wraps: list[str] = []
        real_wrap = Text.wrap
        monkeypatch.setattr(Text, "wrap", lambda self, *a, **kw: wraps.append(self.plain) or real_wrap(self, *a, **kw))
        paras = [Text.assemble(("[metrics] ", "bold"), "running 2, waiting 0, tokens +511 in 1.0 s"),
                 Text("next: a second line long enough to wrap at twenty columns", style="green")]
        pane.show(paras)
        assert wraps == [p.plain for p in paras]
        paras[0] = Text.assemble(("[metrics] ", "bold"), "running 2, waiting 0, tokens +498 in 1.0 s")
        wraps.clear()
        pane.show(paras)
        assert wraps == [paras[0].plain]
        whole = real_wrap(Text("\n").join(paras), app.console, width)

        def drawn_as(lines):
            return [[(seg.text, seg.style) for seg in Segment.simplify(line.render(app.console)) if seg.text]
                    for line in lines]

        assert drawn_as(pane._lines) == drawn_as(whole)
        assert len(pane._lines) > len(paras)  # and wrapped they were


@pytest.mark.parametrize("name,healthy", [("healthy", True), ("admission-wedge", False)])
def test_stacks_are_dumped_less_often_while_the_verdict_is_healthy(name, healthy):
    """py-spy is most of a refresh's cost: every 5th refresh while something may be wrong, every
    stacks_quiet_s while the verdict is idle or progressing."""
    from wedgectl.tui.source import Collector

    source = ScriptedSource(read_bundle(BUNDLES / f"{name}.tar.gz"))
    collector = Collector(source, stacks_every=5, stacks_quiet_s=3600)
    frames = [collector.tick() for _ in range(16)]
    dumped = [i for i, (with_stacks, _native) in enumerate(source.calls) if with_stacks]
    assert frames[-1].verdict.verdict.is_healthy is healthy
    if healthy:
        assert dumped[0] == 0 and len(dumped) <= 2  # the first refresh, then (maybe) once before it was judged healthy
    else:
        assert dumped[-3:] == [5, 10, 15]
    collector.request_stacks()
    collector.tick()
    assert source.calls[-1] == (True, False)  # d takes them at once either way
