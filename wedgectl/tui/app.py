"""The `wedgectl top` Textual app: built by make_app(source) from a live target, a bundle, or nothing (the picker).

Every collection runs in a worker thread and comes back as a Message; the UI
thread only lays out Frames. A tick that is still running when the next is
due is not doubled up: the status line says how long the target has not
answered, and the screen keeps working.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import var
from textual.timer import Timer
from textual.widgets import Footer

from wedgectl.model.errors import WedgectlError
from wedgectl.tui import model
from wedgectl.tui.screens import ConfirmSwap, HelpScreen, PickerScreen
from wedgectl.tui.source import (
    STACKS_QUIET_S,
    BundleSource,
    Collector,
    CpuMeter,
    LiveSource,
    save_bundle,
    swap_available,
    swap_target,
)
from wedgectl.tui.widgets import (
    CounterPanel,
    EvidenceView,
    ProcessTable,
    RowTable,
    StackView,
    StatusLine,
    ThreadTable,
    VerdictBanner,
)
from wedgectl.model.types import Role

if TYPE_CHECKING:
    from wedgectl.lab.swap import SwapPlan

DEFAULT_REFRESH_S = 2.0
SWAP_UNAVAILABLE = "swap not available in this build"
GC_THRESHOLD = (10_000, 10, 10)  # the garbage collector's thresholds while top runs (see on_frame_ready)


class FrameReady(Message):
    def __init__(self, frame: model.Frame) -> None:
        super().__init__()
        self.frame = frame


class CollectFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class Connected(Message):
    def __init__(self, source: LiveSource | None, error: str | None = None) -> None:
        super().__init__()
        self.source = source
        self.error = error


class Notice(Message):
    def __init__(self, text: str, severity: str = "information", new_pid: int | None = None) -> None:
        super().__init__()
        self.text = text
        self.severity = severity
        self.new_pid = new_pid


class SwapPlanned(Message):
    def __init__(self, pid: int, plan: SwapPlan, lines: list[str], refused: str = "") -> None:
        super().__init__()
        self.pid, self.plan, self.lines, self.refused = pid, plan, lines, refused


class TopApp(App):
    """The live (or replayed) view. Build it with make_app()."""

    CSS_PATH = "top.tcss"
    TITLE = "wedgectl top"
    BINDINGS = [
        Binding("s", "save", "save bundle"),
        Binding("d", "dump(False)", "stacks"),
        Binding("D", "dump(True)", "native stacks"),
        Binding("w", "swap", "swap engine"),
        Binding("p", "pin", "pin stack"),
        Binding("left_square_bracket", "step(-1)", "older", show=False),
        Binding("right_square_bracket", "step(1)", "newer", show=False),
        Binding("question_mark,h", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    # var, not reactive: a change is drawn by the watchers into the widgets it touches; an App
    # reactive would also repaint the whole screen, every refresh (most of top's CPU).
    frame: var[model.Frame | None] = var(None)
    selected_pid: var[int | None] = var(None)
    selected_tid: var[int | None] = var(None)

    def __init__(self, source: LiveSource | BundleSource | None, refresh_s: float = DEFAULT_REFRESH_S,
                 stacks_every: int = 5, save_dir: Path = Path("."), quit_after_s: float | None = None,
                 stacks_quiet_s: float = STACKS_QUIET_S) -> None:
        super().__init__()
        self.source = source
        self.refresh_s = refresh_s
        self.stacks_every = stacks_every
        self.stacks_quiet_s = stacks_quiet_s
        self.save_dir = Path(save_dir)
        self.quit_after_s = quit_after_s
        self.collector: Collector | None = None
        self.cursor = 0  # replay position (samples seen)
        self.last_frame_at: float | None = None  # monotonic time the last frame arrived
        self.last_error: str | None = None
        self._collect_loop: CollectLoop | None = None
        self._watch: Timer | None = None  # the watchdog timer: reset by every frame, so it fires only when none comes
        self.cpu = CpuMeter()
        self.pinned_pid: int | None = None  # a rank's stack kept beside the selected one's
        self._gc_threshold: tuple[int, ...] | None = None  # the collector's thresholds before the first frame

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        # The widgets are kept by reference: frames also arrive while a modal screen is on top.
        self.w_banner = VerdictBanner(id="banner")
        self.w_status_line = StatusLine(id="status")
        self.w_counters = CounterPanel(id="counters")
        self.w_procs = ProcessTable(id="procs")
        self.w_threads = ThreadTable(id="threads")
        self.w_stack = StackView(id="stack")
        self.w_pinned = StackView(id="pinned")
        self.w_evidence = EvidenceView(id="evidence")
        yield self.w_banner
        yield self.w_status_line
        with Horizontal(id="top-row"):
            yield self.w_counters
            yield self.w_procs
        yield self.w_threads
        with Horizontal(id="bottom-row"):
            with Vertical(id="stack-box"):
                yield self.w_stack
            with Vertical(id="pinned-box"):
                yield self.w_pinned
            with Vertical(id="evidence-box"):
                yield self.w_evidence
        yield Footer()

    def on_mount(self) -> None:
        self.w_counters.border_title = "counters"
        self.w_procs.border_title = "processes"
        self.w_threads.border_title = "threads"
        self.query_one("#stack-box").border_title = "stack"
        self.query_one("#evidence-box").border_title = "evidence"
        if self.quit_after_s is not None:
            self.set_timer(self.quit_after_s, self.exit)
        if self.source is None:
            self.w_status_line.status = ("pick a server", True)
            self.push_screen(PickerScreen(), self._picked)
        else:
            self._start(self.source)

    def _start(self, source: LiveSource | BundleSource) -> None:
        self.source = source
        self.sub_title = source.label
        self.w_status_line.status = (f"{source.label} | connecting...", True)
        if isinstance(source, BundleSource):
            self.cursor = len(source.scraped)
            self.replay()
        else:
            self.collector = Collector(source, stacks_every=self.stacks_every, stacks_quiet_s=self.stacks_quiet_s)
            self.selected_pid = None
            if self._collect_loop is None:
                self._collect_loop = CollectLoop(self, self.refresh_s)
                self._collect_loop.start()
                self._watch = self.set_interval(self.stuck_after_s, self._watchdog)
            else:
                self._collect_loop.now()

    @property
    def stuck_after_s(self) -> float:
        return max(2 * self.refresh_s, 3.0)

    def on_unmount(self) -> None:
        if self._collect_loop is not None:
            self._collect_loop.stop()
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)  # the host process's own, where top ran inside one

    def _picked(self, pid: int | None) -> None:
        if pid is not None:
            self.w_status_line.status = (f"pid {pid} | connecting...", True)
            self.connect(pid)

    @work(thread=True, exclusive=True, group="connect")
    def connect(self, pid: int) -> None:
        try:
            self.post_message(Connected(LiveSource.connect(pid=pid)))
        except WedgectlError as exc:
            self.post_message(Connected(None, str(exc)))

    def on_connected(self, msg: Connected) -> None:
        if msg.source is None:
            self.notify(msg.error or "cannot watch that process", severity="error")
            self.push_screen(PickerScreen(), self._picked)
            return
        self._start(msg.source)

    # ------------------------------------------------------- collection

    @work(thread=True, exclusive=True, group="collect")
    def replay(self) -> None:
        assert isinstance(self.source, BundleSource)
        self.post_message(FrameReady(self.source.frame_at(self.cursor)))

    def on_frame_ready(self, msg: FrameReady) -> None:
        if self.last_frame_at is None:
            # Everything alive now (the modules, Textual's app and screen, the first frame) lives as
            # long as top: out of the collector's reach, its full collections no longer walk it
            # each time (~100k objects, tens of ms a time). Refcounting still frees what goes; the
            # one collection first keeps the garbage of start-up from being frozen with it.
            # Each refresh makes a few thousand short-lived objects; at the default threshold (700)
            # that was a young collection or more a refresh, each walking the live window, 0.4-0.5
            # ms of CPU a second in all; at 10,000, one collection in 45 s (bench/top_breakdown.py).
            # Refcounting frees nearly all of it: only cycles wait longer, 10,000 allocations at most.
            gc.collect()
            gc.freeze()
            self._gc_threshold = gc.get_threshold()
            gc.set_threshold(*GC_THRESHOLD)
        if self._watch is not None:
            self._watch.reset()  # a frame came: the watchdog's countdown starts again
        self.last_frame_at = time.monotonic()
        self.last_error = None
        self.frame = msg.frame

    def on_collect_failed(self, msg: CollectFailed) -> None:
        self.last_error = msg.error
        self.w_status_line.status = (f"collection failed: {msg.error}", False)

    def _watchdog(self) -> None:
        """Say so when the target stops answering: a tick running far longer than the refresh. Its
        timer fires only when no frame has come for stuck_after_s, then every stuck_after_s."""
        c = self.collector
        if c is None or c.busy_since is None:
            return
        stuck = time.monotonic() - c.busy_since
        if stuck > self.stuck_after_s:
            self.w_status_line.status = (
                f"UNREACHABLE: {self.source.label if self.source else ''} has not answered for {stuck:.0f} s "
                "(still trying; the last frame stays on screen)", False)

    # ------------------------------------------------------------ drawing

    def watch_frame(self, frame: model.Frame | None) -> None:
        if frame is None:
            return
        self.w_banner.verdict = frame.verdict
        self.w_evidence.verdict = frame.verdict
        extra = ""
        if self.collector is not None:
            extra = (f" | refresh {self.refresh_s:g} s, stacks every {self.collector.stacks_every}"
                     f" ({self.collector.stacks_quiet_s:g} s while healthy)")
        self.w_status_line.status = (f"{frame.target} | {frame.status}{extra}", frame.reachable)
        self.w_counters.counters = frame.counters
        pids = [p.pid for p in frame.processes]
        if self.selected_pid not in pids and pids:
            # First frame, or the selected process exited: look at the engine first.
            engine = next((p.pid for p in frame.processes if p.role == Role.ENGINE_CORE.value), pids[0])
            self.set_reactive(TopApp.selected_pid, engine)
            self.set_reactive(TopApp.selected_tid, None)
        procs = self.w_procs
        procs.selected = self.selected_pid
        procs.entries = frame.processes
        self._draw_threads()

    def _draw_threads(self) -> None:
        frame = self.frame
        if frame is None:
            return
        rows = frame.threads.get(self.selected_pid, ()) if self.selected_pid is not None else ()
        tids = [t.tid for t in rows]
        if self.selected_tid not in tids and tids:
            main = frame.main_tids.get(self.selected_pid) if self.selected_pid is not None else None
            self.selected_tid = main if main in tids else (self.selected_pid if self.selected_pid in tids else tids[0])
        table = self.w_threads
        table.selected = self.selected_tid
        title = f"threads of pid {self.selected_pid}" if self.selected_pid else "threads"
        if str(table.border_title) != title:  # setting a border title repaints the whole table, even the same title
            table.border_title = title
        table.entries = rows
        self._draw_stack()

    def _draw_stack(self) -> None:
        frame = self.frame
        if frame is None or self.selected_pid is None:
            return
        dumps = frame.stacks.get(self.selected_pid, ())
        now = time.time() if self.collector is not None else None
        helpers = {p.pid for p in frame.processes if p.helper}
        self.w_stack.lines = tuple(model.stack_lines(dumps, self.selected_tid, now, self.selected_pid in helpers))
        if self.pinned_pid is not None:
            pinned = frame.stacks.get(self.pinned_pid, ())
            self.w_pinned.lines = tuple(model.stack_lines(pinned, frame.main_tids.get(self.pinned_pid), now,
                                                          self.pinned_pid in helpers))

    def watch_selected_pid(self, pid: int | None) -> None:
        self.selected_tid = None
        self._draw_threads()

    def watch_selected_tid(self, tid: int | None) -> None:
        self._draw_stack()

    def on_row_table_highlighted(self, event: RowTable.Highlighted) -> None:
        key = int(event.key)
        if isinstance(event.table, ProcessTable) and key != self.selected_pid:
            self.selected_pid = key
        elif isinstance(event.table, ThreadTable) and key != self.selected_tid:
            self.selected_tid = key

    # ------------------------------------------------------------- keys

    def action_help(self) -> None:
        pct, secs = self.cpu.reading()
        self.push_screen(HelpScreen(f"wedgectl top itself: {pct:.1f} % of one core over the last {secs:.0f} s "
                                    "(py-spy included; the goal is under 1 % at 1 s refresh)"))

    def action_save(self) -> None:
        if self.source is None:
            self.notify("no target yet", severity="warning")
            return
        self.notify("saving the evidence bundle...")
        self.save()

    @work(thread=True, exclusive=True, group="save")
    def save(self) -> None:
        try:
            if self.collector is not None:
                bundle = self.collector.bundle()
            else:
                assert isinstance(self.source, BundleSource)
                bundle = self.source.bundle
            path = save_bundle(bundle, self.save_dir)
        except (OSError, WedgectlError) as exc:
            self.post_message(Notice(f"could not save the bundle: {exc}", "error"))
            return
        self.post_message(Notice(f"saved {path} ({len(bundle.samples)} samples, verdict "
                                 f"{bundle.verdict.verdict.value if bundle.verdict else 'none'})"))

    def action_pin(self) -> None:
        """Keep the selected process's main-thread stack on screen beside the live selection: two ranks side by side."""
        self.pinned_pid = None if self.pinned_pid == self.selected_pid else self.selected_pid
        box = self.query_one("#pinned-box")
        box.display = self.pinned_pid is not None
        rank = next((p.rank for p in (self.frame.processes if self.frame else ()) if p.pid == self.pinned_pid), "")
        box.border_title = f"pinned: pid {self.pinned_pid}" + (f" {rank}" if rank else "")
        self._draw_stack()

    def action_dump(self, native: bool) -> None:
        if self.collector is None:
            self.notify("replaying a bundle: there is no live target to dump", severity="warning")
            return
        self.collector.request_stacks(native)
        self.notify("native stack dump requested (pauses each process while py-spy unwinds it)" if native
                    else "stack dump requested")
        if self._collect_loop is not None:
            self._collect_loop.now()

    def action_swap(self) -> None:
        if self.collector is None or not isinstance(self.source, LiveSource):
            self.notify("replaying a bundle: there is no live target to swap", severity="warning")
            return
        if not swap_available():
            self.notify(SWAP_UNAVAILABLE, severity="warning")
            return
        pid = self.source.deployment.api_pid or self.source.deployment.root_pid or self.source.pid
        if pid is None:
            self.notify("swap needs a process (--pid), not just a URL", severity="warning")
            return

        self.notify(f"planning the swap of pid {pid}...")
        self.plan_swap(pid)

    @work(thread=True, exclusive=True, group="swap")
    def plan_swap(self, pid: int) -> None:
        """Read the plan off the UI thread (it reads /proc; it runs nothing of the target's)."""
        try:
            plan, lines, refused = swap_plan(pid)
        except WedgectlError as exc:
            self.post_message(Notice(f"swap refused: {exc}", "error"))
            return
        except Exception as exc:  # noqa: BLE001 - another module's failure is shown, not fatal
            self.post_message(Notice(f"swap plan failed: {type(exc).__name__}: {exc}", "error"))
            return
        self.post_message(SwapPlanned(pid, plan, lines, refused))

    def on_swap_planned(self, msg: SwapPlanned) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.notify(f"swapping pid {msg.pid} to the patched engine...")
                self.swap(msg.pid, msg.plan)

        self.push_screen(ConfirmSwap(msg.pid, msg.lines, msg.refused), answered)

    @work(thread=True, exclusive=True, group="swap")
    def swap(self, pid: int, plan: SwapPlan | None = None) -> None:
        try:
            text, new_pid, ok = swap_target(pid, lambda m: self.post_message(Notice(m)), plan=plan)
        except Exception as exc:  # noqa: BLE001 - another module's failure is shown, not fatal
            self.post_message(Notice(f"swap failed: {type(exc).__name__}: {exc}", "error"))
            return
        self.post_message(Notice(text, "information" if ok else "error", new_pid=new_pid))

    def on_notice(self, msg: Notice) -> None:
        self.notify(msg.text, severity=msg.severity)  # type: ignore[arg-type]
        if msg.new_pid is not None:
            self.connect(msg.new_pid)

    def action_step(self, delta: int) -> None:
        if not isinstance(self.source, BundleSource):
            return
        n = len(self.source.scraped)
        new = max(1, min(n, self.cursor + delta))
        if new != self.cursor:
            self.cursor = new
            self.replay()


class CollectLoop(threading.Thread):
    """top's one collection thread: a tick of the app's Collector every refresh (or at once when
    asked), each frame posted to the app. A Textual thread worker per refresh cost a new thread,
    a Worker and its state messages, and the interval timer one more wake-up of the app, each
    refresh; now a refresh wakes the app once, with its frame. A late tick (a slow target) is
    skipped, not made up. It reads `app.collector` at each tick: a swap's new target is picked up."""

    def __init__(self, app: TopApp, refresh_s: float) -> None:
        super().__init__(daemon=True, name="wedgectl-top-collect")
        self.app, self.refresh_s = app, refresh_s
        self._wake, self._stopped = threading.Event(), threading.Event()

    def now(self) -> None:
        """Tick at once (a stack dump asked for, a new target)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def run(self) -> None:
        due = time.monotonic()
        while not self._stopped.is_set():
            collector = self.app.collector
            if collector is not None:
                try:
                    frame = collector.tick()
                except Exception as exc:  # noqa: BLE001 - a collector bug must not take the screen down
                    self.app.post_message(CollectFailed(f"{type(exc).__name__}: {exc}"))
                else:
                    if frame is not None:
                        self.app.post_message(FrameReady(frame))
            due = max(due + self.refresh_s, time.monotonic())
            if self._wake.wait(max(0.0, due - time.monotonic())):
                self._wake.clear()
                due = time.monotonic()


def swap_plan(pid: int) -> tuple[SwapPlan, list[str], str]:
    """(the plan, its lines, why swap refuses it or ""): what top's `w` shows before it asks."""
    from wedgectl.lab.swap import plan_swap  # only when asked: top starts without the lab
    from wedgectl.render.text import render_swap_plan

    plan = plan_swap(pid)
    supervisor = plan.supervisor
    refused = f"{supervisor.line} (from a shell: wedgectl swap --pid {pid} --force)" if supervisor else ""
    return plan, list(render_swap_plan(plan)), refused


def make_app(source: LiveSource | BundleSource | None, refresh_s: float = DEFAULT_REFRESH_S,
             stacks_every: int = 5, save_dir: Path | str = ".", quit_after_s: float | None = None,
             stacks_quiet_s: float = STACKS_QUIET_S) -> TopApp:
    """The app for a live target, a bundle replay, or (None) the server picker."""
    return TopApp(source, refresh_s=refresh_s, stacks_every=stacks_every, save_dir=Path(save_dir),
                  quit_after_s=quit_after_s,
                  stacks_quiet_s=stacks_quiet_s)
