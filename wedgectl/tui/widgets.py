"""The widgets of `wedgectl top`: each holds one value and redraws in its watch_ method.

The values are `var`s: the watcher redraws what changed (FixedLines.set_lines, RowTable.set_rows, TextPane.show),
where a `reactive` would repaint the widget (a container: everything in it) once more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from wedgectl.tui.model import CounterRow, ProcessRow, ThreadRow, spark_text
from wedgectl.model.types import Verdict, VerdictKind

HANG_KINDS = {
    VerdictKind.ADMISSION_WEDGE, VerdictKind.ENGINE_DEADLOCK, VerdictKind.SHUTDOWN_HANG, VerdictKind.ENGINE_DEAD,
    VerdictKind.STARTUP_HANG, VerdictKind.ORPHANED_ENGINE, VerdictKind.LEAKED_CAPACITY, VerdictKind.COLLECTIVE_HANG,
}
FUTEX_COLOURS = ("yellow", "magenta", "cyan", "green", "bright_red", "bright_blue")


class BaseStyled(Widget):
    """A line-API widget's base style (its colours and text style from the stylesheet), kept.

    Widget.rich_style walks the widget's ancestors and adds up their backgrounds each time it is
    read; a render_line reads it for every line it draws, ~11 % of a frame's drawing. It changes
    only when the stylesheet is applied to the widget again (a class, a pseudo-class, the
    theme), which Textual says with notify_style_update, as it does for its own style caches."""

    _base_style: Style | None = None

    @property
    def base_style(self) -> Style:
        if self._base_style is None:
            self._base_style = self.rich_style
        return self._base_style

    def notify_style_update(self) -> None:
        self._base_style = None
        super().notify_style_update()


class FixedLines(BaseStyled):
    """A few lines of text in a box of fixed height, drawn through the line API.

    A Static parses, wraps and styles its whole content again on every update; the banner and the
    status line change every refresh (a rate, the last sample's time), and each was a Static
    drawn through Textual's content pipeline again each second (~0.5 ms the banner). Here each
    line is one cached Strip in the widget's style, a line longer than the width ends in an
    ellipsis, and an update marks dirty only the lines whose text changed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lines: tuple[Text, ...] = ()
        self._strips: dict[tuple[int, int, Style], Strip] = {}  # (line, width, base style) -> strip

    @property
    def content(self) -> Text:
        """The lines shown, joined."""
        return Text("\n").join(self._lines)

    def set_lines(self, lines: Sequence[Text | str]) -> None:
        new = tuple(line if isinstance(line, Text) else Text(line) for line in lines)
        old, self._lines = self._lines, new
        if len(new) != len(old):
            self._strips.clear()
            self.refresh()
            return
        width = max(self.size.width, 1)
        for y, (a, b) in enumerate(zip(new, old)):
            if a != b or a.style != b.style:  # Text's == compares the text and its spans
                self._strips = {k: v for k, v in self._strips.items() if k[0] != y}
                self.refresh(Region(0, y, width, 1))

    def render_line(self, y: int) -> Strip:
        width, base = self.size.width, self.base_style
        if y >= len(self._lines) or width <= 0:
            return Strip.blank(width, base)
        key = (y, width, base)
        strip = self._strips.get(key)
        if strip is None:
            if len(self._strips) > 8 * max(1, len(self._lines)):
                self._strips.clear()  # bounded: old widths and styles go
            line = self._lines[y]
            if line.cell_len > width:
                line = line.copy()
                line.truncate(width, overflow="ellipsis")
            strip = Strip(line.render(self.app.console), line.cell_len).extend_cell_length(width).apply_style(base)
            self._strips[key] = strip
        return strip


class VerdictBanner(FixedLines):
    """The live classifier's verdict, confidence and one-line reason."""

    verdict: var[Verdict | None] = var(None)

    _shown: tuple[str, ...] | None = None  # what the banner says: a new verdict saying the same is not drawn

    def watch_verdict(self, verdict: Verdict | None) -> None:
        # Each refresh brings a new Verdict (its facts move); a class change restyles the widget
        # (a stylesheet pass) and new lines draw it again, so both happen only when they change.
        if verdict is None:
            shown: tuple[str, ...] = ("-unsure",)
        else:
            kind = verdict.verdict
            cls = "-healthy" if kind.is_healthy else "-hang" if kind in HANG_KINDS else "-unsure"
            shown = (cls, kind.value, f"{verdict.confidence:.2f}", verdict.rule, verdict.summary)
        if shown == self._shown:
            return
        if self._shown is None or shown[0] != self._shown[0]:
            self.set_classes_of_verdict(shown[0])
        self._shown = shown
        if verdict is None:
            self.set_lines(["VERDICT  (waiting for evidence)"])
            return
        head = Text.assemble(("VERDICT  ", "bold"), (shown[1], "bold reverse"),
                             f"  (confidence {shown[2]})  rule {shown[3]}")
        self.set_lines([head, Text(shown[4])])

    def set_classes_of_verdict(self, cls: str) -> None:
        for other in ("-healthy", "-hang", "-unsure"):
            self.set_class(other == cls, other)


class StatusLine(FixedLines):
    """Target, freshness and what could not be reached."""

    status: var[tuple[str, bool]] = var(("", True))

    def watch_status(self, status: tuple[str, bool]) -> None:
        text, reachable = status
        self.set_class(not reachable, "-unreachable")
        self.set_lines([text])


class CounterPanel(BaseStyled):
    """The counters, one line each: name, a sparkline over the window (see model.spark_text) and
    the latest value. Lines appear as the counters do (the heartbeat's only when the engine has it).

    Drawn through the line API, one cached Strip per line, and a refresh marks dirty only the
    lines whose text changed: a line per counter used to be three widgets (label, sparkline,
    value), each styled and composited again every refresh, the largest part of a live frame's
    drawing after the tables (measured per widget)."""

    NAME_WIDTH = 16
    VALUE_WIDTH = 18
    counters: var[tuple[CounterRow, ...]] = var(())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._texts: list[str] = []  # each line's text, as the last counters gave them at _width
        self._width = -1
        self._strips: dict[tuple[str, Style], Strip] = {}

    def line_text(self, row: CounterRow, width: int) -> str:
        """One counter's line at `width` cells: its name, its bars, its value at the right."""
        spark = max(0, width - self.NAME_WIDTH - self.VALUE_WIDTH - 2)
        name = row.label[: self.NAME_WIDTH].ljust(self.NAME_WIDTH)
        value = row.current[-self.VALUE_WIDTH:].rjust(self.VALUE_WIDTH)
        return f"{name} {spark_text(row.values, spark, row.top)} {value}"[:width] if width > 0 else ""

    def watch_counters(self, counters: Sequence[CounterRow]) -> None:
        width = self.size.width
        texts = [self.line_text(row, width) for row in counters]
        if len(texts) != len(self._texts):
            self.refresh()
        else:
            for y, (new, old) in enumerate(zip(texts, self._texts)):
                if new != old:
                    self.refresh(Region(0, y, max(width, 1), 1))
        self._texts, self._width = texts, width

    def on_resize(self) -> None:
        self._texts = []  # every line again, at the new width
        self.watch_counters(self.counters)

    def render_line(self, y: int) -> Strip:
        width, style = self.size.width, self.base_style
        if y >= len(self.counters):
            return Strip.blank(width, style)
        # the text watch_counters made for this line, unless the width changed since
        text = self._texts[y] if width == self._width and y < len(self._texts) else self.line_text(self.counters[y],
                                                                                                   width)
        key = (text, style)
        strip = self._strips.get(key)
        if strip is None:
            if len(self._strips) > 4 * max(8, len(self.counters)):
                self._strips.clear()  # bounded: a long session's old lines go
            strip = self._strips[key] = Strip([Segment(text, style)], cell_length=len(text)).extend_cell_length(width,
                                                                                                                style)
        return strip


Cell = str | Text  # a str is drawn in its row's style; a Text in its own style and spans


def _cell_len(cell: Cell) -> int:
    if isinstance(cell, Text):
        return cell.cell_len
    return len(cell) if cell.isascii() else cell_len(cell)


class RowTable(ScrollView, BaseStyled, can_focus=True):
    """A table fed whole rows each refresh, drawn a line at a time (Textual's line API).

    DataTable renders every visible cell again whenever any cell changes (one update bumps the
    whole table's cache key); a refresh of top changes some CPU figure every second, so that was
    most of top's drawing. Here each row is one Strip, cached by its cells: a refresh draws only
    the rows whose cells changed. The cursor stays on the same key across refreshes; moving it
    posts RowTable.Highlighted.

    A row is its key, its cells and, optionally, a style for the whole row. A cell given as a str
    stays one (no Rich Text is made for the rows off screen, most of a process's threads), and a
    line whose cells are strs is one segment: every part of the compositor's work on a line
    (styling, filters, cropping) goes segment by segment.
    """

    BINDINGS = [
        Binding("up", "cursor(-1)", "up", show=False),
        Binding("down", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "cursor(-1000000)", "first", show=False),
        Binding("end", "cursor(1000000)", "last", show=False),
    ]
    COLUMNS: tuple[str, ...] = ()
    RIGHT: frozenset[int] = frozenset()  # columns aligned right (numbers)
    GAP = 2

    class Highlighted(Message):
        """The cursor moved to the row `key`."""

        def __init__(self, table: RowTable, key: str) -> None:
            super().__init__()
            self.table = table
            self.key = key

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keys: list[str] = []
        self._rows: list[tuple[tuple[Cell, ...], str]] = []  # each row's cells and its style
        self._drawn: list[tuple[object, ...]] = []  # what each row's line shows (its cells and style)
        self._widths: tuple[int, ...] = tuple(len(c) for c in self.COLUMNS)
        self._strips: dict[tuple[object, ...], Strip] = {}
        self.cursor_row = 0

    # -- what the app and its tests read

    @property
    def row_count(self) -> int:
        return len(self._rows)

    def get_row_at(self, index: int) -> tuple[Text, ...]:
        cells, style = self._rows[index]
        return tuple(c if isinstance(c, Text) else Text(c, style=style) for c in cells)

    @property
    def cursor_key(self) -> str | None:
        return self._keys[self.cursor_row] if 0 <= self.cursor_row < len(self._keys) else None

    # -- feeding it

    def set_rows(self, rows: Sequence[tuple[str, Sequence[object]] | tuple[str, Sequence[object], str]],
                 keep: str | None) -> None:
        """rows: (key, cells) or (key, cells, row style); a cell that is not a Text is drawn as str(cell)."""
        before = self.cursor_key
        drawn = self._drawn
        scrolled, widths_drawn = self.scroll_offset, self._widths
        self._keys = [r[0] for r in rows]
        self._rows = [(tuple(c if isinstance(c, (str, Text)) else str(c) for c in r[1]), r[2] if len(r) > 2 else "")
                      for r in rows]
        widths = [len(c) for c in self.COLUMNS]
        n = len(widths)
        for cells, _ in self._rows:
            for i, c in enumerate(cells[:n]):
                w = _cell_len(c)
                if w > widths[i]:
                    widths[i] = w
        self._widths = tuple(widths)
        target = keep if keep in self._keys else before if before in self._keys else None
        self.cursor_row = self._keys.index(target) if target is not None else min(self.cursor_row,
                                                                                  max(0, len(self._keys) - 1))
        self.virtual_size = Size(1 + sum(self._widths) + self.GAP * len(self._widths), len(self._rows) + 1)
        self._drawn = keys = [self._shown(i) for i in range(len(self._rows))]
        live = set(keys)
        self._strips = {k: v for k, v in self._strips.items() if k[0] in live}
        self._scroll_to_cursor()
        if len(keys) != len(drawn) or self.scroll_offset != scrolled or self._widths != widths_drawn:
            self.refresh()  # the header too
        else:  # the same rows in the same place: only the lines whose cells changed are drawn again
            for i, (new, old) in enumerate(zip(keys, drawn)):
                if new != old:
                    self.refresh_line(i + 1)  # below the header
        if self.cursor_key is not None and self.cursor_key != before:
            self.post_message(self.Highlighted(self, self.cursor_key))

    def move_cursor(self, row: int) -> None:
        if not self._rows:
            return
        row = max(0, min(row, len(self._rows) - 1))
        if row != self.cursor_row:
            self.cursor_row = row
            self._scroll_to_cursor()
            self.refresh()
            self.post_message(self.Highlighted(self, self._keys[row]))

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * max(1, self.scrollable_content_region.height - 1))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and offset.y >= 1:
            self.move_cursor(offset.y - 1 + int(self.scroll_offset.y))

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def _scroll_to_cursor(self) -> None:
        height = self.scrollable_content_region.height - 1  # below the header
        if height <= 0:
            return
        top = int(self.scroll_offset.y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif self.cursor_row >= top + height:
            self.scroll_to(y=self.cursor_row - height + 1, animate=False)

    # -- drawing

    def _shown(self, index: int) -> tuple[object, ...]:
        """What row `index`'s line shows, to compare and cache it by: a Text cell by its text, style and spans."""
        cells, style = self._rows[index]
        return (tuple(c if isinstance(c, str) else (c.plain, str(c.style), tuple(c.spans)) for c in cells), style)

    def _line(self, cells: Sequence[Cell], row_style: str, style: Style | None) -> Strip:
        """One row as segments: a margin (as a DataTable cell's padding), then each cell padded to
        its column's width, GAP apart. The margin, padding, gaps and str cells take the row's style
        and run together into one segment; a Text cell is a segment of its own style, or Rich's
        render of it when it has spans. (Joining the row into one Text and rendering that cost
        ~0.4 ms a row, and gave a line of three segments a cell.)"""
        console = self.app.console
        base = console.get_style(row_style) if row_style else None
        segments: list[Segment] = []
        run = [" "]
        gap = " " * self.GAP
        right = self.RIGHT
        for i, (cell, width) in enumerate(zip(cells, self._widths)):
            pad = " " * (width - _cell_len(cell))
            if i in right:
                run.append(pad)
            if isinstance(cell, str):
                run.append(cell)
            elif cell.plain:
                cell_style = console.get_style(cell.style) if cell.style else None
                if cell.spans or cell_style != base:
                    segments.append(Segment("".join(run), base))
                    run = []
                    if cell.spans:
                        segments.extend(cell.render(console))  # the cell's own style under each span's
                    else:
                        segments.append(Segment(cell.plain, cell_style))
                else:
                    run.append(cell.plain)
            if i not in right:
                run.append(pad)
            run.append(gap)
        segments.append(Segment("".join(run), base))
        strip = Strip(segments)
        return strip.apply_style(style) if style is not None else strip

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        x = int(self.scroll_offset.x)
        base = self.base_style
        if y == 0:
            return self._line(self.COLUMNS, "bold", None).crop_extend(x, x + width, base)
        index = y - 1 + int(self.scroll_offset.y)
        if index >= len(self._rows):
            return Strip.blank(width, base)
        key = (self._drawn[index], self._widths, index == self.cursor_row and self.has_focus, index == self.cursor_row)
        strip = self._strips.get(key)
        if strip is None:
            style = None
            if index == self.cursor_row:
                style = Style(reverse=True) if self.has_focus else Style(bold=True, underline=True)
            cells, row_style = self._rows[index]
            strip = self._strips[key] = self._line(cells, row_style, style)
        return strip.crop_extend(x, x + width, base)


class ProcessTable(RowTable):
    """The deployment's processes: role, state, CPU %."""

    COLUMNS = ("PID", "ROLE", "RANK", "S", "CPU%", "THR", "RSS MB", "NAME")
    RIGHT = frozenset({0, 4, 5, 6})
    entries: var[tuple[ProcessRow, ...]] = var((), init=False)
    selected: int | None = None

    def watch_entries(self, rows: Sequence[ProcessRow]) -> None:
        self.set_rows(
            [(str(p.pid), (str(p.pid), p.role, p.rank or "-", p.state, _pct(p.cpu_pct), str(p.threads),
                           "-" if p.rss_mb is None else f"{p.rss_mb:.0f}", p.name)) for p in rows],
            None if self.selected is None else str(self.selected),
        )


class ThreadTable(RowTable):
    """The selected process's threads; threads waiting on one futex share a colour."""

    COLUMNS = ("TID", "COMM", "S", "CPU%", "WCHAN", "SYSCALL", "FUTEX", "SHARE")
    RIGHT = frozenset({0, 3})
    entries: var[tuple[ThreadRow, ...]] = var((), init=False)
    selected: int | None = None

    def watch_entries(self, rows: Sequence[ThreadRow]) -> None:
        colours: dict[str, str] = {}
        for t in rows:
            if t.sharing > 1 and t.futex not in colours:
                colours[t.futex] = FUTEX_COLOURS[len(colours) % len(FUTEX_COLOURS)]
        out = [(str(t.tid), (str(t.tid), t.comm, t.state, _pct(t.cpu_pct), t.wchan[:22], t.syscall,
                             t.futex, f"x{t.sharing}" if t.sharing > 1 else ""),
                f"bold {colours[t.futex]}" if t.futex in colours else "") for t in rows]
        self.set_rows(out, None if self.selected is None else str(self.selected))


class TextPane(ScrollView, BaseStyled, can_focus=True):
    """Text wrapped to the pane's width and drawn a line at a time (Textual's line API), scrolled
    within the pane: for text whose length changes from one refresh to the next (a stack, the
    evidence).

    A Static of auto height in a scrolling box made every change of its line count lay the whole
    screen out again, and every scrollbar that came or went restyle it: against a serving server
    that was a layout every few refreshes, each dearer than a whole refresh otherwise. Here the
    pane's size is the box's whatever the text: the text moves only the virtual size, and a
    refresh draws again only the lines whose text changed. The scrollbar is always there, so
    the width the text wraps to never changes with its length."""

    DEFAULT_CSS = """
    TextPane {
        height: 1fr;
        overflow-x: hidden;
        overflow-y: scroll;
        scrollbar-size-vertical: 1;
    }
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._paras: tuple[Text, ...] = ()
        self._lines: list[Text] = []  # the text wrapped at _wrap_width
        self._keys: list[tuple[object, ...]] = []  # each line's plain text and spans
        self._strips: dict[tuple[object, ...], Strip] = {}
        # each paragraph's wrapped lines and their keys, at _wrap_width: the evidence pane is shown
        # again every refresh, most of its paragraphs as they were
        self._wrapped: dict[tuple[object, ...], tuple[list[Text], list[tuple[object, ...]]]] = {}
        self._wrap_width = -1

    @property
    def content(self) -> Text:
        """The text shown (whole, before wrapping)."""
        return Text("\n").join(self._paras)

    def show(self, text: Text | Sequence[Text]) -> None:
        """Show a text, or its paragraphs (its lines before wrapping) one Text each: a paragraph
        shown before at this width is not wrapped again. A trailing newline is no line of its own."""
        paras = list(text.split("\n", allow_blank=True)) if isinstance(text, Text) else list(text)
        while paras and not paras[-1].plain:
            paras.pop()
        # a paragraph's own style as a span: a line is drawn by Text.render, which leaves the base
        # style to its caller (Text.__rich_console__ joins the lines, which makes it a span)
        self._paras = tuple(Text("").join([p]) if p.style else p for p in paras)
        self._wrap()

    def on_resize(self) -> None:
        self._wrap()

    def _wrap(self) -> None:
        width = self.scrollable_content_region.width
        drawn = self._keys if width == self._wrap_width else None
        if width <= 0:  # not laid out yet: on_resize wraps it
            self._lines, self._keys, self._wrap_width = [], [], -1
            return
        if width != self._wrap_width:
            self._wrapped = {}
        wrapped: dict[tuple[object, ...], tuple[list[Text], list[tuple[object, ...]]]] = {}
        lines: list[Text] = []
        keys: list[tuple[object, ...]] = []
        for para in self._paras:
            key = (para.plain, tuple(para.spans), para.style)
            got = wrapped.get(key) or self._wrapped.get(key)
            if got is None:  # as Text.wrap wraps each line of a whole text
                out = list(para.wrap(self.app.console, width))
                got = (out, [(line.plain, tuple(line.spans), line.style) for line in out])
            wrapped[key] = got
            lines.extend(got[0])
            keys.extend(got[1])
        self._wrapped = wrapped
        self._lines, self._keys = lines, keys
        self._wrap_width = width
        live = set(self._keys)
        self._strips = {k: v for k, v in self._strips.items() if k in live}
        self._set_virtual_height(len(self._lines))
        if drawn is None or len(drawn) != len(self._keys):
            self.refresh()
            return
        top = int(self.scroll_offset.y)
        for i, (new, old) in enumerate(zip(self._keys, drawn)):
            if new != old and top <= i < top + self.size.height:
                self.refresh_line(i)

    def _set_virtual_height(self, height: int) -> None:
        size = Size(self.scrollable_content_region.width, height)
        if size == self.virtual_size:
            return
        update = getattr(self, "_scroll_update", None)
        if update is None:  # a Textual without it: the reactive's own way, a layout pass
            self.virtual_size = size
            return
        # Not through the reactive: it lays the whole screen out again (layout=True), where the
        # pane's size is fixed by the stylesheet and only its scrollbar moves.
        self.set_reactive(TextPane.virtual_size, size)
        update(size)
        if self.scroll_y > self.max_scroll_y:
            self.scroll_to(y=self.max_scroll_y, animate=False)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        base = self.base_style
        index = y + int(self.scroll_offset.y)
        if index >= len(self._lines):
            return Strip.blank(width, base)
        key = self._keys[index]
        strip = self._strips.get(key)
        if strip is None:
            strip = self._strips[key] = Strip(self._lines[index].render(self.app.console))
        return strip.crop_extend(0, width, base)


class StackView(TextPane):
    """The selected thread's Python stack, innermost frame first."""

    lines: var[tuple[str, ...]] = var(())

    def watch_lines(self, lines: Sequence[str]) -> None:
        self.show([Text(line) for line in lines])


class EvidenceView(TextPane):
    """What the verdict rests on, and what to do next."""

    verdict: var[Verdict | None] = var(None)

    def watch_verdict(self, verdict: Verdict | None) -> None:
        if verdict is None:
            self.show(Text())
            return
        paras = [Text.assemble((f"[{e.source}] ", "bold"), e.what) for e in verdict.evidence]
        paras += [Text.assemble(("next: ", "bold green"), a) for a in verdict.advice[:2]]
        # one paragraph a line of the text: a newline within one splits it, as Text.wrap would
        self.show([line for para in paras
                   for line in (para.split("\n", allow_blank=True) if "\n" in para.plain else (para,))])


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
