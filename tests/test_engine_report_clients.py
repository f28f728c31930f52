"""The API server's part of the engine report: the requests its OutputProcessor tracks and whether each one's
client is still there (engine/wedge_engine/fixes/report.py: `tracking`, `api_fields`), and how the reader takes it."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine.fixes import report as report_fix  # noqa: E402
from wedgectl.model.engine import EngineReport  # noqa: E402
from engine_reports import schema_report  # noqa: E402


@pytest.fixture(autouse=True)
def _clean():
    report_fix._live.clear()
    report_fix._gone.clear()
    yield
    report_fix._live.clear()
    report_fix._gone.clear()
    report_fix._llm_ref = None


def _generate(outputs: list, fail: BaseException | None = None, gate: asyncio.Event | None = None):
    """Stands for AsyncLLM.generate(self, prompt, sampling_params, request_id): yields outputs, may wait on gate."""
    async def generate(self, prompt, sampling_params, request_id):
        for out in outputs:
            if gate is not None:
                await gate.wait()
            yield out
        if fail is not None:
            raise fail
    return report_fix.tracking(generate)


def test_a_request_that_finishes_leaves_no_trace():
    gen = _generate([SimpleNamespace(finished=False), SimpleNamespace(finished=True)])

    async def run():
        seen = []
        async for out in gen(None, "p", None, "cmpl-a"):
            seen.append(report_fix._live.get("cmpl-a") is not None)
        return seen

    assert asyncio.run(run()) == [True, True]  # its client waits while it runs
    assert report_fix._live == {} and report_fix._gone == {}
    assert report_fix.client_state("cmpl-a", time.monotonic()) == (None, None)


def test_a_disconnect_marks_the_client_gone_with_its_time():
    gate = asyncio.Event()
    gen = _generate([SimpleNamespace(finished=False)] * 3, gate=gate)

    async def run():
        async def client():
            async for _ in gen(None, "p", None, "cmpl-b"):
                pass

        task = asyncio.create_task(client())
        await asyncio.sleep(0.01)
        assert report_fix.client_state("cmpl-b", time.monotonic()) == (True, None)
        task.cancel()  # what vLLM's handler gets when its client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    connected, since = report_fix.client_state("cmpl-b", time.monotonic() + 5)
    assert connected is False and since is not None and 5 <= since < 6
    assert "cmpl-b" not in report_fix._live


def test_an_error_before_the_end_counts_as_gone_and_is_not_swallowed():
    gen = _generate([SimpleNamespace(finished=False)], fail=RuntimeError("engine dead"))

    async def run():
        async for _ in gen(None, "p", None, "cmpl-c"):
            pass

    with pytest.raises(RuntimeError, match="engine dead"):
        asyncio.run(run())
    assert report_fix.client_state("cmpl-c", time.monotonic())[0] is False


def test_the_gone_ids_are_bounded(monkeypatch):
    monkeypatch.setattr(report_fix, "MAX_GONE", 3)
    gen = _generate([SimpleNamespace(finished=False)], fail=ValueError("x"))

    async def run(rid):
        async for _ in gen(None, "p", None, rid):
            pass

    for i in range(5):
        with pytest.raises(ValueError):
            asyncio.run(run(f"r{i}"))
    assert list(report_fix._gone) == ["r2", "r3", "r4"]  # the oldest dropped


def _state(rid: str, external: str, arrival: float, prompt: int = 7) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, external_req_id=external, prompt_len=prompt,
                           stats=SimpleNamespace(arrival_time=arrival), prompt="never reported")


def test_api_fields_list_the_ghosts_first_and_count_the_clients():
    now = time.time()
    states = {"a-1": _state("a-1", "a", now - 30), "b-1": _state("b-1", "b", now - 10),
              "c-1": _state("c-1", "c", now - 20)}
    llm = SimpleNamespace(output_processor=SimpleNamespace(request_states=states))
    report_fix._llm_ref = lambda: llm
    report_fix._live.update(a=time.monotonic())
    report_fix._gone.update(b=time.monotonic() - 4)
    out = report_fix.api_fields()
    assert out["requests_total"] == 3 and out["clients"] == {"connected": 1, "gone": 1}
    ids = [q["id"] for q in out["requests"]]
    assert ids == ["b-1", "a-1", "c-1"]  # the gone first, then the oldest
    gone = out["requests"][0]
    assert gone["client_connected"] is False and 4 <= gone["disconnected_s"] < 5 and gone["prompt_tokens"] == 7
    assert out["requests"][2]["client_connected"] is None  # no generator seen for it: unknown, not gone
    assert "never reported" not in repr(out)  # no prompt text, ever


def test_api_fields_without_an_async_llm_report_nothing():
    report_fix._llm_ref = None
    assert report_fix.api_fields() == {}


def test_the_reader_takes_the_clients_and_bounds_them():
    d = schema_report(role="api_server", clients={"connected": 2, "gone": 3}, requests=[
        {"id": "x-1", "state": "in_flight", "client_connected": False, "disconnected_s": 12.5},
        {"id": "x-2", "state": "in_flight", "client_connected": "no", "disconnected_s": -1},
    ])
    rep = EngineReport.from_dict(d)
    assert rep is not None and (rep.clients_connected, rep.clients_gone) == (2, 3)
    assert rep.requests[0].client_connected is False and rep.requests[0].disconnected_s == 12.5
    assert rep.requests[1].client_connected is None and rep.requests[1].disconnected_s is None  # garbage dropped
    assert rep.to_dict()["clients"] == {"connected": 2, "gone": 3}
    bad = EngineReport.from_dict(schema_report(clients=["not", "a", "dict"]))
    assert bad is not None and bad.clients_gone is None and "clients" not in bad.to_dict()
