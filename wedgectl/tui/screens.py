"""The screens `wedgectl top` shows over its main view: the help, the swap confirmation, and the picker
of vLLM servers on this machine (when no target was given)."""

from __future__ import annotations

import time

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Label, Static

from wedgectl.tui.source import ServerInfo, find_servers

HELP = """\
wedgectl top: a vLLM deployment and its live verdict, refreshed every few seconds.

  s        save an evidence bundle (the window so far) in the save folder
  d        take a Python stack dump now (py-spy --nonblocking: never pauses the target)
  D        take a native stack dump (py-spy --native pauses each process while it unwinds)
  w        swap the deployment to the patched engine (shows the plan, asks first)
  p        pin the selected process's stack beside the next one you select:
           two ranks side by side (p on the pinned one unpins)
  [  ]     replaying a bundle: one sample back / forward
  up/down  move in the focused table; tab switches between processes and threads
  ?  h     this help (escape closes it)
  q        quit

Threads of one process that wait on the same futex address (one lock or
condition) share a colour and show xN under SHARE. Stacks are dumped every
Nth refresh (--stacks-every), every 60 s while the verdict is healthy
(--stacks-quiet), and
on d / D; the stack view says how old its dump is. A target that stops answering is shown as UNREACHABLE; top keeps
trying and never blocks the screen.
"""
URL_WIDTH = 30  # http://[IPv6 address]:port fits; 127.0.0.1 and a hostname with room to spare
MODEL_WIDTH = 40  # the model's path or name, its end kept
COMMAND_WIDTH = 60


class ServersFound(Message):
    def __init__(self, servers: list[ServerInfo]) -> None:
        super().__init__()
        self.servers = servers


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,h", "dismiss", "close")]

    def __init__(self, cpu_line: str = "") -> None:
        super().__init__()
        self.cpu_line = cpu_line

    def compose(self) -> ComposeResult:
        yield Static(HELP + (f"\n{self.cpu_line}\n" if self.cpu_line else ""), id="help")


class ConfirmSwap(ModalScreen[bool]):
    """The swap plan, and a key to act on it: nothing happens before `y`."""

    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, pid: int, lines: list[str] | None = None, refused: str = "") -> None:
        super().__init__()
        self.pid, self.lines, self.refused = pid, lines or [], refused

    def compose(self) -> ComposeResult:
        plan = "\n".join(self.lines)
        if self.refused:
            yield Static(f"{plan}\n\nswap refused: {self.refused}\n\nn / escape: close", id="confirm")
            return
        yield Static(f"Swap pid {self.pid} to the patched engine?\n{plan}\n"
                     "The server restarts with the wedge_engine fixes on; requests in flight may fail.\n\n"
                     "y: swap    n: cancel", id="confirm")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes and not self.refused)


class PickerScreen(Screen[int]):
    """No target given: the vLLM servers on this machine; Enter watches one."""

    BINDINGS = [Binding("r", "rescan", "rescan"), Binding("q", "app.quit", "quit")]

    def compose(self) -> ComposeResult:
        yield Label("vLLM servers on this machine (Enter watches one, r rescans)", id="picker-title")
        yield DataTable(id="servers", cursor_type="row")
        yield Label("", id="picker-status")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#servers", DataTable)
        # Every column gets a fixed width, the widest its value is cut to (pid_max is 7 digits):
        # an auto column sized before the first rows arrive was seen to stay at its header's
        # width on a loaded host ("htt" for the URL).
        table.add_column("PID", width=7)
        table.add_column("URL", width=URL_WIDTH)
        table.add_column("MODEL", width=MODEL_WIDTH)
        table.add_column("UP", width=4)
        table.add_column("COMMAND", width=COMMAND_WIDTH)
        self.action_rescan()

    def action_rescan(self) -> None:
        self.query_one("#picker-status", Label).update("scanning processes...")
        self.scan()

    @work(thread=True, exclusive=True, group="scan")
    def scan(self) -> None:
        self.post_message(ServersFound(find_servers()))

    def on_servers_found(self, msg: ServersFound) -> None:
        table = self.query_one("#servers", DataTable)
        table.clear()
        now = time.time()
        for s in msg.servers:
            table.add_row(s.pid, s.url or "-", s.model[-MODEL_WIDTH:], model_duration(now - s.started),
                          s.cmdline[:COMMAND_WIDTH], key=str(s.pid))
        self.query_one("#picker-status", Label).update(
            f"{len(msg.servers)} server(s) found" if msg.servers
            else "no vLLM API server found on this machine (r rescans)")
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.dismiss(int(event.row_key.value))


def model_duration(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"
