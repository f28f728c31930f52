"""Unit tests for the collective-hold fault against a stand-in for vLLM's model runner."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine.faults import FAULTS, FaultConfigError, collective  # noqa: E402


class Runner:
    """Stands in for GPUModelRunner: _model_forward is what the fault wraps."""

    def __init__(self) -> None:
        self.calls = 0

    def _model_forward(self, input_ids=None, positions=None, **kwargs):
        self.calls += 1
        return "out"


@pytest.fixture
def released():
    yield
    collective._never.set()  # let any held thread go
    collective.deactivate()
    collective._never.clear()


def _call_in_thread(runner: Runner) -> threading.Thread:
    t = threading.Thread(target=runner._model_forward, daemon=True)
    t.start()
    t.join(timeout=0.3)
    return t


def test_registered():
    assert FAULTS["collective-hold"] == "wedge_engine.faults.collective"


def test_holds_the_chosen_rank_after_n_passes(released):
    collective.activate({"WEDGE_ENGINE_FAULT_AFTER_STEPS": "2", "WEDGE_ENGINE_FAULT_RANK": "1"},
                        cls=Runner, rank_of=lambda: 1, in_worker=True)
    r = Runner()
    assert r._model_forward() == "out" and r._model_forward() == "out"
    t = _call_in_thread(r)
    assert t.is_alive() and r.calls == 2  # held before the model ran
    collective._never.set()
    t.join(timeout=2)
    assert not t.is_alive() and r.calls == 3


def test_other_ranks_run_on(released):
    collective.activate({"WEDGE_ENGINE_FAULT_AFTER_STEPS": "0"}, cls=Runner, rank_of=lambda: 0, in_worker=True)
    r = Runner()
    for _ in range(5):
        assert r._model_forward() == "out"
    assert r.calls == 5


def test_inert_outside_workers(released):
    what = collective.activate({}, cls=Runner, rank_of=lambda: 1, in_worker=False)
    assert "inert" in what and not collective.is_active()
    assert Runner.__dict__["_model_forward"].__name__ == "_model_forward"


def test_worker_process_names():
    assert collective._is_worker("VllmWorker-1") and not collective._is_worker("EngineCore_DP0")


@pytest.mark.parametrize("raw", ["x", "-1"])
def test_bad_rank_patches_nothing(raw, released):
    with pytest.raises(FaultConfigError):
        collective.activate({"WEDGE_ENGINE_FAULT_RANK": raw}, cls=Runner, rank_of=lambda: 1, in_worker=True)
    assert not collective.is_active()


def test_activates_once(released):
    collective.activate({}, cls=Runner, rank_of=lambda: 0, in_worker=True)
    assert collective.activate({}, cls=Runner, rank_of=lambda: 0, in_worker=True) == "already active"
    collective.deactivate()
    assert Runner.__dict__["_model_forward"].__name__ == "_model_forward"
