"""The widgets of `wedgectl top`: each holds one value and redraws in its watch_ method.

The values are `var`s: the watcher redraws what changed (Static.update, DataTable.update_cell),
where a `reactive` would repaint the widget (a container: everything in it) once more."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive, var
from textual.widget import Widget
from textual.widgets import DataTable, Label, Static

from wedgectl.tui.model import CounterRow, ProcessRow, ThreadRow, spark_text
from wedgectl.types import Verdict, VerdictKind

HANG_KINDS = {
    VerdictKind.ADMISSION_WEDGE, VerdictKind.ENGINE_DEADLOCK, VerdictKind.SHUTDOWN_HANG, VerdictKind.ENGINE_DEAD,
    VerdictKind.STARTUP_HANG, VerdictKind.ORPHANED_ENGINE, VerdictKind.LEAKED_CAPACITY, VerdictKind.COLLECTIVE_HANG,
}
FUTEX_COLOURS = ("yellow", "magenta", "cyan", "green", "bright_red", "bright_blue")


class VerdictBanner(Static):
    """The live classifier's verdict, confidence and one-line reason."""

    verdict: reactive[Verdict | None] = var(None)

    def watch_verdict(self, verdict: Verdict | None) -> None:
        self.remove_class("-healthy", "-hang", "-unsure")
        if verdict is None:
            self.update("VERDICT  (waiting for evidence)")
            self.add_class("-unsure")
            return
        kind = verdict.verdict
        self.add_class("-healthy" if kind.is_healthy else "-hang" if kind in HANG_KINDS else "-unsure")
        head = Text.assemble(("VERDICT  ", "bold"), (kind.value, "bold reverse"),
                             f"  (confidence {verdict.confidence:.2f})  rule {verdict.rule}")
        self.update(Text("\n").join([head, Text(verdict.summary)]), layout=False)  # fixed height


class StatusLine(Static):
    """Target, freshness and what could not be reached."""

    status: reactive[tuple[str, bool]] = var(("", True))

    def watch_status(self, status: tuple[str, bool]) -> None:
        text, reachable = status
        self.set_class(not reachable, "-unreachable")
        self.update(text, layout=False)  # one fixed line


class SparkText(Widget):
    """A one-line sparkline, one bar per sample, on a fixed scale (see model.spark_text)."""

    series: reactive[tuple[tuple[float, ...], float]] = reactive(((), 1.0))

    def render(self) -> str:
        values, top = self.series
        return spark_text(values, self.size.width, top)


class CounterLine(Horizontal):
    """A counter's name, its sparkline over the window, and its latest value."""

    row: reactive[CounterRow | None] = var(None)

    def __init__(self, key: str, label: str) -> None:
        super().__init__(id=f"counter-{key}", classes="counter")
        self._name = Label(label, classes="name")
        self._spark = SparkText(classes="spark")
        self._value = Label("-", classes="value")

    def compose(self) -> ComposeResult:
        yield self._name
        yield self._spark
        yield self._value

    def watch_row(self, row: CounterRow | None) -> None:
        if row is None:
            return
        if str(self._name.content) != row.label:
            self._name.update(row.label, layout=False)
        self._spark.series = (row.values, row.top)
        if str(self._value.content) != row.current:
            self._value.update(row.current, layout=False)


class CounterPanel(Vertical):
    """One CounterLine per counter; lines appear as the counters do (the heartbeat's only when the engine has it)."""

    counters: reactive[tuple[CounterRow, ...]] = var(())

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._lines: dict[str, CounterLine] = {}  # by key: a DOM query per counter per refresh costs more

    def watch_counters(self, counters: Sequence[CounterRow]) -> None:
        for row in counters:
            line = self._lines.get(row.key)
            if line is None:
                line = self._lines[row.key] = CounterLine(row.key, row.label)
                self.mount(line)
            line.row = row
        keys = {r.key for r in counters}
        for key in [k for k in self._lines if k not in keys]:
            self._lines.pop(key).remove()


class _KeyedTable(DataTable):
    """A DataTable fed whole rows each refresh that keeps the cursor on the same key.

    When the rows are the same keys in the same order (the usual refresh: numbers change,
    threads do not come and go) only the changed cells are updated; a rebuild would make
    Textual lay the whole screen out again.
    """

    COLUMNS: tuple[str, ...] = ()

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.column_keys = self.add_columns(*self.COLUMNS)

    def set_rows(self, rows: Sequence[tuple[str, Sequence[object]]], keep: str | None) -> None:
        keys = [k for k, _ in rows]
        if keys and keys == [r.key.value for r in self.ordered_rows]:
            for key, new in rows:
                old = self.get_row(key)
                for col, (a, b) in enumerate(zip(old, new)):
                    if not _same(a, b):
                        self.update_cell(key, self.column_keys[col], b)
        else:
            self.clear()
            for key, cells in rows:
                self.add_row(*cells, key=key)
        if keep is not None and keep in keys:
            index = keys.index(keep)
            if index != self.cursor_row:
                self.move_cursor(row=index, animate=False)


class ProcessTable(_KeyedTable):
    """The deployment's processes: role, state, CPU %."""

    COLUMNS = ("PID", "ROLE", "RANK", "S", "CPU%", "THR", "RSS MB", "NAME")
    entries: reactive[tuple[ProcessRow, ...]] = var((), init=False)
    selected: int | None = None

    def watch_entries(self, rows: Sequence[ProcessRow]) -> None:
        self.set_rows(
            [(str(p.pid), (str(p.pid), p.role, p.rank or "-", p.state, _pct(p.cpu_pct), str(p.threads),
                           "-" if p.rss_mb is None else f"{p.rss_mb:.0f}", p.name)) for p in rows],
            None if self.selected is None else str(self.selected),
        )


class ThreadTable(_KeyedTable):
    """The selected process's threads; threads waiting on one futex share a colour."""

    COLUMNS = ("TID", "COMM", "S", "CPU%", "WCHAN", "SYSCALL", "FUTEX", "SHARE")
    entries: reactive[tuple[ThreadRow, ...]] = var((), init=False)
    selected: int | None = None

    def watch_entries(self, rows: Sequence[ThreadRow]) -> None:
        colours: dict[str, str] = {}
        for t in rows:
            if t.sharing > 1 and t.futex not in colours:
                colours[t.futex] = FUTEX_COLOURS[len(colours) % len(FUTEX_COLOURS)]
        out = []
        for t in rows:
            style = f"bold {colours[t.futex]}" if t.futex in colours else ""
            cells = (t.tid, t.comm, t.state, _pct(t.cpu_pct), t.wchan[:22], t.syscall,
                     t.futex, f"x{t.sharing}" if t.sharing > 1 else "")
            out.append((str(t.tid), tuple(Text(str(c), style=style) for c in cells)))
        self.set_rows(out, None if self.selected is None else str(self.selected))


class StackView(Static):
    """The selected thread's Python stack, innermost frame first."""

    lines: reactive[tuple[str, ...]] = var(())
    _height = -1

    def watch_lines(self, lines: Sequence[str]) -> None:
        self._height = _update_sized(self, Text("\n".join(lines)), self._height)


class EvidenceView(Static):
    """What the verdict rests on, and what to do next."""

    verdict: reactive[Verdict | None] = var(None)
    _height = -1

    def watch_verdict(self, verdict: Verdict | None) -> None:
        if verdict is None:
            self._height = _update_sized(self, Text(), self._height)
            return
        out = Text()
        for e in verdict.evidence:
            out.append(f"[{e.source}] ", "bold")
            out.append(e.what + "\n")
        for a in verdict.advice[:2]:
            out.append("next: ", "bold green")
            out.append(a + "\n")
        self._height = _update_sized(self, out, self._height)


def _update_sized(widget: Static, text: Text, height: int) -> int:
    """Update a Static whose height follows its text: the screen is laid out again only when the
    text's height at the widget's width changed (a layout pass renders the whole screen; a
    repaint only the widget). Returns the new height (-1 before the widget has a width)."""
    width = widget.content_region.width
    lines = len(text.wrap(widget.app.console, width)) if width > 0 else -1
    widget.update(text, layout=lines < 0 or lines != height)
    return lines


def _same(a: object, b: object) -> bool:
    """Cell equality; rich's Text.__eq__ ignores the base style, which carries the futex colour."""
    if isinstance(a, Text) and isinstance(b, Text):
        return a.plain == b.plain and a.style == b.style
    return a == b


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
