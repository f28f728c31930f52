"""wedgectl top on a recorded TP 2 deployment: the RANK column, and two ranks' stacks side by side (Pilot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.tui.app import make_app
from wedgectl.tui.source import BundleSource
from wedgectl.tui.widgets import ProcessTable, StackView

from test_top import until  # noqa: E402 - the Pilot wait the top tests share

BUNDLE = Path(__file__).parent / "fixtures" / "bundles" / "healthy-tp2.tar.gz"
SIZE = (120, 40)


async def select(pilot, app, pid: int) -> None:
    """Move the focused process table's cursor down to pid's row, as a user would."""
    for _ in range(8):
        if app.selected_pid == pid:
            return
        await pilot.press("down")
        await pilot.pause(0.05)
    assert app.selected_pid == pid


@pytest.mark.asyncio
async def test_rank_column_and_pinned_stack_side_by_side():
    b = read_bundle(BUNDLE)
    app = make_app(BundleSource(b, BUNDLE))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        table = app.query_one(ProcessTable)
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        ranks = {r[0]: r[2] for r in rows if r[1] == "worker"}
        assert sorted(ranks.values()) == ["TP0", "TP1"]
        by_rank = {v: int(k) for k, v in ranks.items()}
        table.focus()
        await select(pilot, app, by_rank["TP0"])
        await pilot.press("p")
        assert app.pinned_pid == by_rank["TP0"] and app.query_one("#pinned-box").display
        await select(pilot, app, by_rank["TP1"])
        await until(pilot, lambda: str(app.query_one("#stack", StackView).content) != "")
        pinned = str(app.query_one("#pinned", StackView).content)
        live = str(app.query_one("#stack", StackView).content)
        assert pinned and live and pinned != live  # TP0's stack beside TP1's
        assert "TP0" in app.query_one("#pinned-box").border_title
        await pilot.press("p")  # p on another selection pins that one instead
        assert app.pinned_pid == by_rank["TP1"]
