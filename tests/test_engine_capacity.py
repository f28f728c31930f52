"""Unit tests for the leaked-capacity and deferred-wedge parts of wedge_engine: the lost-abort and
stream-sessions faults and the reaper fix, against stand-ins for the vLLM classes they wrap."""

from __future__ import annotations

import asyncio
import sys
import types
from collections import deque
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine.faults import FAULTS, FaultConfigError, lostabort, sessions  # noqa: E402
from wedge_engine.fixes import FIXES, FixSettings, _common, reaper  # noqa: E402


class FakeOutputProcessor:
    def __init__(self):
        self.external_req_ids: dict[str, list[str]] = {}


class FakeAsyncLLM:
    """generate()'s shape in vllm/v1/engine/async_llm.py: register, yield outputs, abort on disconnect."""

    def __init__(self, outputs=2, hang=False):
        self.output_processor = FakeOutputProcessor()
        self.aborted: list[str] = []
        self.outputs, self.hang = outputs, hang

    async def abort(self, request_id, internal=False):
        self.aborted.append(request_id)
        self.output_processor.external_req_ids.pop(request_id, None)

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        self.output_processor.external_req_ids[request_id] = [request_id + "-int"]
        try:
            for i in range(self.outputs):
                await asyncio.sleep(0)
                finished = i == self.outputs - 1 and not self.hang
                if finished:
                    self.output_processor.external_req_ids.pop(request_id, None)
                yield types.SimpleNamespace(finished=finished)
            if self.hang:
                await asyncio.sleep(3600)
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id, internal=True)
            raise


@pytest.fixture
def fake_async_llm(monkeypatch):
    for name in ("vllm", "vllm.v1", "vllm.v1.engine"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    cls = type("AsyncLLM", (FakeAsyncLLM,), {})
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", types.SimpleNamespace(AsyncLLM=cls))
    yield cls
    lostabort.deactivate()
    _common.unpatch_all()
    reaper.reaped.clear()


async def _client_disconnects(llm, request_id="cmpl-1"):
    """A handler task consuming generate() is cancelled mid-request, as vLLM's with_cancellation does."""

    async def handler():
        async for _ in llm.generate("p", None, request_id):
            pass

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(3):
        await asyncio.sleep(0)  # let background aborts run


def test_registries_name_the_new_modules():
    assert FAULTS["lost-abort"] == "wedge_engine.faults.lostabort"
    assert FAULTS["stream-sessions"] == "wedge_engine.faults.sessions"
    assert FIXES["reaper"] == "wedge_engine.fixes.reaper"


# --- lost-abort ----------------------------------------------------------------


def test_stock_disconnect_aborts(fake_async_llm):
    llm = fake_async_llm(hang=True)
    asyncio.run(_client_disconnects(llm))
    assert llm.aborted == ["cmpl-1"] and llm.output_processor.external_req_ids == {}


def test_lost_abort_leaves_the_request_tracked(fake_async_llm):
    assert "AsyncLLM.abort" in lostabort.activate({})
    assert lostabort.activate({}) == "already active"
    llm = fake_async_llm(hang=True)
    asyncio.run(_client_disconnects(llm))
    assert llm.aborted == [] and lostabort.dropped == ["cmpl-1"]
    assert llm.output_processor.external_req_ids == {"cmpl-1": ["cmpl-1-int"]}  # the ghost


def test_lost_abort_lets_other_aborts_through(fake_async_llm):
    lostabort.activate({})
    llm = fake_async_llm()
    asyncio.run(llm.abort("cmpl-9"))  # an abort outside a disconnect (reaper, /abort_requests)
    assert llm.aborted == ["cmpl-9"]


def test_lost_abort_is_inert_outside_the_api_server(fake_async_llm, monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "current_process", lambda: types.SimpleNamespace(name="EngineCore_DP0"))
    assert lostabort.activate({}) == "inert outside the API server"
    assert not lostabort.is_active()


# --- reaper --------------------------------------------------------------------


def test_reaper_aborts_and_counts_a_ghost(fake_async_llm):
    lostabort.activate({})
    assert "AsyncLLM.generate" in reaper.activate(FixSettings(), "api")
    llm = fake_async_llm(hang=True)
    asyncio.run(_client_disconnects(llm))
    assert reaper.reaped == ["cmpl-1"]
    assert llm.aborted == ["cmpl-1"] and llm.output_processor.external_req_ids == {}


def test_reaper_counts_nothing_when_vllm_aborted_or_finished(fake_async_llm):
    reaper.activate(FixSettings(), "api")
    llm = fake_async_llm(hang=True)
    asyncio.run(_client_disconnects(llm))  # stock abort ran first
    assert reaper.reaped == [] and llm.aborted == ["cmpl-1"]

    async def complete():
        return [o.finished async for o in llm2.generate("p", None, request_id="cmpl-2")]

    llm2 = fake_async_llm(outputs=3)
    assert asyncio.run(complete()) == [False, False, True]
    assert reaper.reaped == [] and llm2.aborted == []


def test_reaper_patches_nothing_outside_the_api_server(fake_async_llm):
    assert reaper.activate(FixSettings(), "engine") is None
    assert reaper.activate(FixSettings(), "worker") is None


def test_request_id_of():
    assert reaper.request_id_of(("p", None, "cmpl-3"), {}) == "cmpl-3"
    assert reaper.request_id_of(("p", None), {"request_id": "cmpl-4"}) == "cmpl-4"
    assert reaper.request_id_of(("p",), {}) is None


# --- stream-sessions ------------------------------------------------------------


class FakeScheduler:
    """The lines of vllm/v1/core/sched/scheduler.py the fault leans on: add_request gives a resumable
    request a streaming queue; a stopped resumable request parks in WAITING_FOR_STREAMING_REQ and
    counts against max_num_active_reqs."""

    def __init__(self, max_num_active_reqs=2):
        self.requests, self.waiting, self.running = {}, [], []
        self.deferred_waiting: set = set()
        self.num_waiting_for_streaming_input = 0
        self.max_num_active_reqs = max_num_active_reqs

    def add_request(self, request):
        if request.resumable:
            request.streaming_queue = deque()
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_turn(self, request):
        if request.resumable and not request.streaming_queue:
            self.num_waiting_for_streaming_input += 1
            self.deferred_waiting.add(request.request_id)

    def admits(self) -> bool:
        return len(self.running) + self.num_waiting_for_streaming_input < self.max_num_active_reqs


@pytest.fixture
def fake_scheduler(monkeypatch):
    cls = type("Scheduler", (FakeScheduler,), {})
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", types.SimpleNamespace(Scheduler=cls))
    yield cls
    sessions.deactivate()


def _req(rid):
    return types.SimpleNamespace(request_id=rid, resumable=False, streaming_queue=None)


def test_sessions_mark_the_first_n_and_stop_admission(fake_scheduler):
    assert "first 2" in sessions.activate({"WEDGE_ENGINE_FAULT_SESSIONS": "2"})
    s = fake_scheduler(max_num_active_reqs=2)
    reqs = [_req(f"r{i}") for i in range(3)]
    for r in reqs:
        s.add_request(r)
    assert [r.resumable for r in reqs] == [True, True, False]
    assert reqs[0].streaming_queue == deque()
    for r in reqs[:2]:
        s.finish_turn(r)
    assert len(s.deferred_waiting) == 2 and not s.admits()  # the deferred wedge


def test_sessions_settings(fake_scheduler):
    assert sessions.sessions_from({}) == 2
    for bad in ("0", "x", "-1"):
        with pytest.raises(FaultConfigError):
            sessions.sessions_from({"WEDGE_ENGINE_FAULT_SESSIONS": bad})
    sessions.activate({})
    assert sessions.is_active() and sessions.activate({}) == "already active"
    sessions.deactivate()
    assert not sessions.is_active()
