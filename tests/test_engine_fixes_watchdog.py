"""Unit tests for the watchdog's progress, pause, sleep and recovery, and the status record's private home."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from test_engine_fixes import FakeLLM, _undo_patches  # noqa: E402,F401 - the stand-ins and the autouse undo
from test_engine_fixes import watch as _watch  # noqa: E402,F401
from wedge_engine import status  # noqa: E402
from wedge_engine.fixes import _common, watchdog  # noqa: E402

S = 10**9


@pytest.fixture
def watch(_watch, monkeypatch):
    """test_engine_fixes' watchdog over a fresh record (limit 5 s), without the stack dumps."""
    _wd, writer, reader = _watch
    monkeypatch.setattr(watchdog, "dump_engine_stacks", lambda targets=None: [])
    return writer, reader


def poll(llm, reader, at_s, t0):
    return watchdog.check_once(llm, reader, 1.0, now_ns=t0 + int(at_s * S))


def test_a_paused_engine_never_trips_and_the_clock_restarts_on_resume(watch):
    writer, reader = watch
    llm, t0 = FakeLLM(3), time.monotonic_ns()
    writer.set_flag(status.PAUSED, True)  # Scheduler.set_pause_state(PAUSED_ALL): requests frozen by design
    assert reader.read().paused
    for s in range(0, 120, 5):
        assert not poll(llm, reader, s, t0)
    writer.set_flag(status.PAUSED, False)
    assert not poll(llm, reader, 120, t0)
    assert not poll(llm, reader, 124, t0)  # 4 s since the resume, not 124 s since the work arrived
    assert poll(llm, reader, 125, t0)  # resumed and still nothing moves: a stall after all


def test_a_sleeping_engine_never_trips(watch):
    writer, reader = watch
    llm, t0 = FakeLLM(1), time.monotonic_ns()
    writer.set_flag(status.SLEEPING, True)
    assert reader.read().sleeping and not reader.read().paused
    assert not any(poll(llm, reader, s, t0) for s in range(0, 300, 7))
    assert not watchdog._state.tripped


def test_the_api_servers_own_pause_and_sleep_calls_count(watch):
    _writer, reader = watch

    class Engine:
        async def pause_generation(self, mode="abort"):
            return None

        async def resume_generation(self):
            return None

        async def sleep(self, level=1):
            return None

        async def wake_up(self, tags=None):
            return tags != ["weights"]  # a partial wake: still asleep

    assert watchdog._patch_pause_calls(Engine)
    llm, t0, engine = FakeLLM(2), time.monotonic_ns(), Engine()
    asyncio.run(engine.pause_generation(mode="keep"))
    assert not poll(llm, reader, 0, t0) and not poll(llm, reader, 60, t0)
    asyncio.run(engine.resume_generation())
    assert not poll(llm, reader, 61, t0)
    asyncio.run(engine.sleep(1))
    asyncio.run(engine.wake_up(["weights"]))
    assert watchdog._state.api_paused  # only part of it woke
    assert not poll(llm, reader, 200, t0)
    asyncio.run(engine.wake_up())
    assert not watchdog._state.api_paused
    assert not poll(llm, reader, 201, t0) and poll(llm, reader, 206, t0)


def test_progress_is_model_steps_or_tokens_completed(watch):
    writer, reader = watch
    llm, t0 = FakeLLM(1), time.monotonic_ns()
    assert not poll(llm, reader, 0, t0)
    for s in range(2, 40, 2):
        writer.add_tokens(16)  # tokens completed, no new model step recorded
        assert not poll(llm, reader, s, t0)
    assert reader.read().tokens == 16 * 19
    for s in range(40, 80, 2):
        writer.record_step(True)
        assert not poll(llm, reader, s, t0)
    assert watchdog._state.effective_limit_s == 5.0  # 2 s between moves: no stretch
    writer.record_step(False)  # a step that ran no model (spinning) is not progress
    assert not poll(llm, reader, 82, t0)
    assert poll(llm, reader, 83, t0)


def test_it_recovers_once_progress_resumes(watch, caplog):
    writer, reader = watch
    llm, t0 = FakeLLM(2), time.monotonic_ns()
    assert not poll(llm, reader, 0, t0)
    assert poll(llm, reader, 6, t0)
    assert watchdog._state.tripped and "blocked" in watchdog._state.message
    llm.n = 0  # the watchdog failed them
    assert not poll(llm, reader, 30, t0) and watchdog._state.tripped  # nothing moved: still tripped
    writer.record_step(True)  # the stuck step returned
    with caplog.at_level(logging.INFO, logger="vllm.wedge_engine"):
        assert not poll(llm, reader, 31, t0)
    assert not watchdog._state.tripped and watchdog._state.message == ""
    assert any("made progress again" in r.getMessage() and "/health answers 200" in r.getMessage()
               for r in caplog.records)
    llm.n = 1  # new work is watched again from when it arrives
    assert not poll(llm, reader, 32, t0) and poll(llm, reader, 32 + watchdog._state.effective_limit_s, t0)


def test_health_and_admission_follow_the_trip_and_the_recovery(watch, monkeypatch):
    writer, reader = watch

    class EngineDeadError(Exception):
        pass

    class AsyncLLM:
        async def add_request(self, *a):
            return "queued"

        async def check_health(self):
            return None

    for name, attrs in (("vllm", {}), ("vllm.v1", {}), ("vllm.v1.engine", {}),
                        ("vllm.v1.engine.async_llm", {"AsyncLLM": AsyncLLM}),
                        ("vllm.v1.engine.exceptions", {"EngineDeadError": EngineDeadError}),
                        ("vllm.exceptions", {"GracefulHTTPError": type("G", (Exception,), {
                            "__init__": lambda self, m, s: Exception.__init__(self, m)})})):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(_common, "on_async_llm", lambda cb: None)
    monkeypatch.setattr(watchdog, "EngineStalled", None)
    watchdog._patch_api()
    api, llm, t0 = AsyncLLM(), FakeLLM(1), time.monotonic_ns()
    asyncio.run(api.check_health())
    poll(llm, reader, 0, t0)
    assert poll(llm, reader, 5, t0)
    with pytest.raises(EngineDeadError):
        asyncio.run(api.check_health())
    with pytest.raises(Exception, match="engine stalled"):
        asyncio.run(api.add_request())
    writer.add_tokens(1)
    poll(llm, reader, 9, t0)
    asyncio.run(api.check_health())  # /health 200 again
    assert asyncio.run(api.add_request()) == "queued"


def test_a_server_with_habitually_long_steps_gets_a_longer_limit(watch):
    writer, reader = watch
    llm, t0 = FakeLLM(1), time.monotonic_ns()
    poll(llm, reader, 0, t0)
    for s in (4, 8, 12):  # every step takes 4 s (limit 5)
        writer.record_step(True)
        assert not poll(llm, reader, s, t0)
    assert watchdog._state.effective_limit_s == pytest.approx(8.0)
    assert not poll(llm, reader, 12 + 7, t0)  # a 7 s step: long for the limit, not for this server
    writer.record_step(True)
    assert not poll(llm, reader, 20, t0)  # seen 8 s after the last move: the limit is now 2 x 8 s
    assert not poll(llm, reader, 20 + 15.5, t0)
    assert poll(llm, reader, 20 + 16, t0)


def test_the_stretch_is_capped_so_a_deadlock_is_still_caught(watch):
    writer, reader = watch
    llm, t0 = FakeLLM(1), time.monotonic_ns()
    poll(llm, reader, 0, t0)
    writer.record_step(True)
    poll(llm, reader, 100, t0)  # one 100 s step happened once
    assert watchdog._state.effective_limit_s == watchdog.MAX_STRETCH * 5.0
    assert not poll(llm, reader, 119, t0) and poll(llm, reader, 120, t0)


def test_idle_gaps_do_not_stretch_the_limit(watch):
    writer, reader = watch
    llm, t0 = FakeLLM(0), time.monotonic_ns()
    poll(llm, reader, 0, t0)
    writer.record_step(True)
    poll(llm, reader, 500, t0)  # nothing was waiting: not a gap between moves of progress
    assert watchdog._state.effective_limit_s == 5.0


def test_engine_recorders_count_tokens_and_mirror_pause_and_sleep(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    status.create(path)
    monkeypatch.setenv(status.STATUS_FILE_ENV, path)
    monkeypatch.setattr(_common, "_writer", None)
    monkeypatch.setattr(_common, "_writer_failed", False)

    class Scheduler:
        def update_from_output(self, scheduler_output, model_runner_output):
            return {}

        def set_pause_state(self, pause_state):
            self.state = pause_state

    class EngineCore:
        model_executor = types.SimpleNamespace(is_sleeping=False)

        def sleep(self, level=1, mode="abort"):
            self.model_executor.is_sleeping = level >= 1

        def wake_up(self, tags=None):
            self.model_executor.is_sleeping = False
            return True

    for name, attrs in (("vllm", {}), ("vllm.v1", {}), ("vllm.v1.core", {}), ("vllm.v1.core.sched", {}),
                        ("vllm.v1.core.sched.scheduler", {"Scheduler": Scheduler}), ("vllm.v1.engine", {}),
                        ("vllm.v1.engine.core", {"EngineCore": EngineCore})):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    assert watchdog.install_engine_recorders()
    reader, sched, core = status.StatusReader(path), Scheduler(), EngineCore()
    sched.update_from_output(types.SimpleNamespace(total_num_scheduled_tokens=7), None)
    sched.update_from_output(types.SimpleNamespace(total_num_scheduled_tokens=0), None)
    assert reader.read().tokens == 7
    sched.set_pause_state(2)  # PauseState.PAUSED_ALL
    assert reader.read().paused
    sched.set_pause_state(0)
    assert not reader.read().paused
    core.sleep(1)
    assert reader.read().sleeping
    core.wake_up()
    assert not reader.read().sleeping
    _common.status_writer().close()
    monkeypatch.setattr(_common, "_writer", None)


# --- the status record's home ------------------------------------------------------------------------


def test_the_record_lives_in_a_private_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = status.default_path(4242)
    d = os.path.dirname(path)
    assert d == str(tmp_path / "wedge-engine")
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    status.create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("plant", ["symlink", "open-dir"])
def test_an_untrustworthy_runtime_directory_is_passed_over(tmp_path, monkeypatch, plant):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if plant == "symlink":
        (tmp_path / "xdg" / "wedge-engine").symlink_to(elsewhere)
    else:
        (tmp_path / "xdg" / "wedge-engine").mkdir()
        os.chmod(tmp_path / "xdg" / "wedge-engine", 0o777)
    monkeypatch.setattr(status.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    got = status.runtime_dir()
    assert got == str(tmp_path / "tmp" / f"wedge-engine-{os.geteuid()}")
    assert stat.S_IMODE(os.lstat(got).st_mode) == 0o700


def test_create_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "wedge-engine-1.status"
    path.symlink_to(victim)
    status.create(str(path))
    assert victim.read_text() == "precious"  # the link was replaced, its target untouched
    assert not path.is_symlink() and path.stat().st_size == status.RECORD_SIZE


def test_readers_refuse_a_link(tmp_path):
    real = tmp_path / "real"
    status.create(str(real))
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OSError):
        status.StatusReader(str(link))
    os.symlink(tmp_path / "elsewhere.pids", status.pids_path(str(link)))
    with pytest.raises(OSError):
        status.register_pid(str(link), 1, "engine")
    assert not (tmp_path / "elsewhere.pids").exists()
    assert status.read_pids(str(link)) == []
