"""Unit tests for the start-up deadline and parent-watch fixes, and the startup-stall fault (no vLLM needed)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"
sys.path.insert(0, str(ENGINE))

from wedge_engine.faults import FAULTS, FaultConfigError, startstall  # noqa: E402
from wedge_engine.fixes import FIXES, STARTUP_ENV, FixConfigError, orphan, settings_from  # noqa: E402
from wedge_engine.fixes.startup import with_deadline  # noqa: E402


def test_registered_and_configured():
    assert FIXES["startup"] == "wedge_engine.fixes.startup" and FIXES["orphan"] == "wedge_engine.fixes.orphan"
    assert FAULTS["startup-stall"] == "wedge_engine.faults.startstall"
    assert settings_from({}).startup_s == 1200.0
    assert settings_from({STARTUP_ENV: "45"}).startup_s == 45.0
    with pytest.raises(FixConfigError):
        settings_from({STARTUP_ENV: "-1"})


# ------------------------------------------------------------------ start-up deadline


def test_deadline_turns_an_endless_wait_into_a_clear_error():
    """The real interrupt: an exception raised into the waiting thread, as in the API server."""
    outcome = []

    def endless_wait():  # as vLLM's wait_for_engine_startup: returns to Python between polls
        while True:
            time.sleep(0.01)

    def run():
        try:
            with_deadline(endless_wait, 0.2)()
        except RuntimeError as exc:
            outcome.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert not t.is_alive() and 0.15 <= time.monotonic() - t0 < 5
    assert type(outcome[0]) is RuntimeError
    assert re.match(r"wedge_engine: start-up did not finish within 0.2 s: .*no deadline", str(outcome[0]))


def test_deadline_passes_a_result_through_and_cancels_its_timer():
    fired = []
    assert with_deadline(lambda x: x * 2, 0.2, lambda: fired.append(1))(21) == 42
    time.sleep(0.3)
    assert fired == []


def test_a_real_ctrl_c_is_not_turned_into_the_deadline_error():
    def wait():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with_deadline(wait, 10, lambda: None)()


# ------------------------------------------------------------------ parent watch


def test_parent_watch_terminates_then_exits_when_the_parent_changes():
    parents = iter([100, 100, 1])
    sent, exited = [], []
    orphan.watch_parent(100, "EngineCore", getppid=lambda: next(parents, 1), kill=lambda pid, sig: sent.append(sig),
                        exit_=exited.append, poll_s=0.01, grace_s=0.05)
    assert sent == [signal.SIGTERM] and exited == [orphan.EXIT_CODE]


def test_parent_watch_stops_quietly_while_the_parent_lives():
    stop = threading.Event()
    sent = []
    t = threading.Thread(target=orphan.watch_parent, args=(7, "Worker"),
                         kwargs={"getppid": lambda: 7, "kill": lambda *a: sent.append(a), "poll_s": 0.01, "stop": stop})
    t.start()
    time.sleep(0.1)
    stop.set()
    t.join(2)
    assert not t.is_alive() and sent == []


def test_parent_watch_only_in_engine_processes():
    assert orphan.activate(None, "api") is None


def test_a_real_orphan_exits(tmp_path):
    """A real child whose parent is SIGKILLed: with the watch it exits by itself within seconds."""
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        sys.path.insert(0, {str(ENGINE)!r})
        child = subprocess.Popen([sys.executable, "-c", '''
        import os, signal, sys, threading, time
        sys.path.insert(0, {str(ENGINE)!r})
        from wedge_engine.fixes import orphan
        signal.signal(signal.SIGTERM, lambda *a: None)  # like vLLM's handler during a hung start-up
        orphan.GRACE_S = 0.5
        orphan.activate(None, "engine")
        print(os.getpid(), flush=True)
        time.sleep(60)
        '''], stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{child_pid}").exists():
            try:
                if Path(f"/proc/{child_pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.1)
        alive = Path(f"/proc/{child_pid}").exists() and "Z" not in Path(f"/proc/{child_pid}/stat").read_text().split(")")[1].split()[0]
        assert not alive, "the orphan did not exit"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)


# ------------------------------------------------------------------ the fault


class _Wrapper:
    def __init__(self):
        self.worker = type("W", (), {"load_model": lambda self: "loaded"})()

    def __getattr__(self, attr):
        return getattr(self.worker, attr)

    def compile_or_warm_up_model(self):
        return "warm"


@pytest.fixture
def fault():
    yield startstall
    startstall._never.set()
    startstall.deactivate()
    startstall._never.clear()


def test_stall_blocks_in_a_frame_named_for_the_phase(fault):
    assert "compile_or_warm_up_model blocks forever" in fault.activate({}, _Wrapper)
    assert _Wrapper.compile_or_warm_up_model.__code__.co_name == "compile_or_warm_up_model"
    done = []
    t = threading.Thread(target=lambda: done.append(_Wrapper().compile_or_warm_up_model()), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and not done  # parked
    fault._never.set()
    t.join(2)
    assert done == ["warm"]


def test_stall_of_a_method_the_wrapper_forwards(fault):
    fault.activate({startstall.PHASE_ENV: "load"}, _Wrapper)
    fault._never.set()
    assert _Wrapper().load_model() == "loaded"
    fault.deactivate()
    assert "load_model" not in _Wrapper.__dict__ and _Wrapper().load_model() == "loaded"


def test_bad_phase_patches_nothing():
    with pytest.raises(FaultConfigError):
        startstall.activate({startstall.PHASE_ENV: "lunch"}, _Wrapper)
    assert not startstall.is_active()
