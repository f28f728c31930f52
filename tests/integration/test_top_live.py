"""wedgectl top against a real wedged vLLM server, in a real terminal (tmux), read back with capture-pane."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.model.types import VerdictKind

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (as root, tests/setup.sh installs it)"),
]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def wedged_server(admission_wedge):
    """A real admission wedge, kept hung: (pid, url). The session's (conftest.KeptWedge): `repro
    admission-wedge --keep`, whose detached holder keeps the never-admitted request open."""
    assert (admission_wedge.out["verdict"], admission_wedge.rc) == ("admission_wedge", 0), admission_wedge.out["summary"]
    return admission_wedge.pid, admission_wedge.url


class Tmux:
    """A 120x40 terminal: a detached session on a private tmux socket, running one command."""

    SOCKET = f"wedgectl-test-{os.getpid()}"

    def __init__(self, name: str, command: str) -> None:
        self.name = name
        self.tmux("new-session", "-d", "-s", name, "-x", "120", "-y", "40")
        self.tmux("set-option", "-t", name, "window-size", "manual")
        # The command is typed into the session's shell only once the terminal has its size:
        # an app started while tmux still resizes a new pane can keep 80x24.
        deadline = time.monotonic() + 30
        while self.tmux("display", "-p", "-t", name, "#{window_width}x#{window_height}").strip() != "120x40":
            if time.monotonic() > deadline:
                raise AssertionError("tmux did not size the window 120x40")
            time.sleep(0.1)
        # Textual draws on stderr: leave it to the terminal.
        self.keys(f"cd {REPO} && {command}; echo TOP-EXITED $?", "Enter")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.SOCKET, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def wait_for(self, *texts: str, timeout: float = 60.0) -> str:
        """The screen once every one of `texts` is on it at the same time.

        The screen is polled, not slept on: on a loaded host top starts (imports, py-spy, the
        first window of samples) many times slower than on an idle one, so the deadlines are
        generous bounds, not expected durations.
        """
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if all(t in screen for t in texts):
                return screen
            time.sleep(0.5)
        missing = [t for t in texts if t not in screen]
        raise AssertionError(f"{missing!r} not on screen after {timeout:.0f} s; the screen:\n{screen}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.SOCKET, "kill-session", "-t", self.name], capture_output=True)


def test_top_shows_the_wedge_verdict_on_a_real_terminal(wedged_server, tmp_path):
    pid, url = wedged_server
    term = Tmux(f"wedgectl-top-{os.getpid()}", f"{sys.executable} -m wedgectl top --pid {pid} --save-dir {tmp_path}")
    try:
        # The verdict and what the screen shows beside it may land on different redraws.
        screen = term.wait_for(
            "VERDICT  admission_wedge", f"pid {pid} {url}", "that the scheduler never admits",
            "engine_core", "worker", "api_server", "threads of pid", "WCHAN", "SYSCALL", timeout=300,
        )
        print(screen)  # the README's screen comes from here (pytest -s)
        assert "UNREACHABLE" not in screen
        term.keys("s")
        term.wait_for("saved ", timeout=120)
        saved = list(tmp_path.glob("wedgectl-top-*.tar.gz"))
        assert len(saved) == 1
        assert read_bundle(saved[0]).verdict.verdict == VerdictKind.ADMISSION_WEDGE
        term.keys("q")
        term.wait_for("TOP-EXITED 0", timeout=60)
    finally:
        term.close()


def test_top_with_no_target_lists_the_server(wedged_server):
    pid, url = wedged_server
    term = Tmux(f"wedgectl-pick-{os.getpid()}", f"{sys.executable} -m wedgectl top")
    try:
        screen = term.wait_for("server(s) found", f" {pid} ", timeout=180)
        row = next((line for line in screen.splitlines() if f" {pid} " in line), None)
        assert row is not None and url in row, screen
        term.keys("q")
        term.wait_for("TOP-EXITED 0", timeout=60)
    finally:
        term.close()
