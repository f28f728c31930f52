"""Unit tests for the wedge_engine fault modules against stand-ins for the vLLM code they wrap."""

from __future__ import annotations

import functools
import sys
import threading
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine.faults import FaultConfigError, overhang, stall  # noqa: E402

BLOCK_BYTES = 1000


# --- admission-overhang ------------------------------------------------------


@pytest.fixture
def kv_cache_utils(monkeypatch):
    """A stand-in vllm.v1.core.kv_cache_utils with the names the fault rebinds and calls."""
    kcu = types.ModuleType("vllm.v1.core.kv_cache_utils")
    kcu.calls = []

    def _pool_bytes_per_block(vllm_config, groups):
        return BLOCK_BYTES * len(groups)

    def _max_memory_usage_bytes_from_groups(vllm_config, groups):
        return 0

    def _auto_fit_max_model_len(vllm_config, projected_groups_per_worker, available_memory):
        kcu.calls.append(("auto_fit", list(available_memory)))

    def _check_enough_kv_cache_memory(available_memory, get_needed_memory, max_model_len, estimate):
        kcu.calls.append(("check", available_memory))

    for fn in (_pool_bytes_per_block, _max_memory_usage_bytes_from_groups,
               _auto_fit_max_model_len, _check_enough_kv_cache_memory):
        setattr(kcu, fn.__name__, fn)
    core = types.ModuleType("vllm.v1.core")
    core.kv_cache_utils = kcu
    v1 = types.ModuleType("vllm.v1")
    v1.core = core
    vllm = types.ModuleType("vllm")
    vllm.v1 = v1
    for name, mod in (("vllm", vllm), ("vllm.v1", v1), ("vllm.v1.core", core),
                      ("vllm.v1.core.kv_cache_utils", kcu)):
        monkeypatch.setitem(sys.modules, name, mod)
    yield kcu
    overhang.deactivate()


def test_overhang_gives_back_one_block_per_worker_to_auto_fit(kv_cache_utils):
    original = kv_cache_utils._auto_fit_max_model_len
    overhang.activate({})
    assert overhang.is_active()
    cfg = object()
    # two workers with one group each, a third with no KV layers
    kv_cache_utils._auto_fit_max_model_len(cfg, [["g"], ["g", "h"], []], [3000, 3000, 77])
    assert kv_cache_utils.calls == [("auto_fit", [4000, 5000, 77])]
    overhang.deactivate()
    assert kv_cache_utils._auto_fit_max_model_len is original
    assert not overhang.is_active()


def test_overhang_check_counts_the_null_block_for_get_kv_cache_configs(kv_cache_utils):
    overhang.activate({})
    cfg = object()
    needed = functools.partial(kv_cache_utils._max_memory_usage_bytes_from_groups, cfg, ["g"])
    estimate = functools.partial(lambda *a: 0, cfg, ["g"])
    kv_cache_utils._check_enough_kv_cache_memory(3000, needed, 128, estimate)
    # any other caller (no groups to size a block from) is not checked at all
    kv_cache_utils._check_enough_kv_cache_memory(3000, lambda: 0, 128, lambda m: 0)
    assert kv_cache_utils.calls == [("check", 4000)]


def test_overhang_activates_once(kv_cache_utils):
    overhang.activate({})
    wrapped = kv_cache_utils._auto_fit_max_model_len
    assert overhang.activate({}) == "already active"
    assert kv_cache_utils._auto_fit_max_model_len is wrapped


def test_overhang_patches_nothing_if_a_helper_is_missing(kv_cache_utils):
    original = kv_cache_utils._auto_fit_max_model_len
    del kv_cache_utils._pool_bytes_per_block
    with pytest.raises(AttributeError):
        overhang.activate({})
    assert kv_cache_utils._auto_fit_max_model_len is original
    assert not overhang.is_active()


# --- model-stall -------------------------------------------------------------


class Output:
    def __init__(self, tokens: int) -> None:
        self.total_num_scheduled_tokens = tokens


class FakeWorkerWrapper:
    def __init__(self) -> None:
        self.ran = 0

    def execute_model(self, scheduler_output):
        self.ran += 1
        return f"out{self.ran}"


@pytest.fixture
def released():
    yield
    stall._never.set()  # let any parked thread finish
    stall.deactivate()
    stall._never.clear()


@pytest.mark.parametrize(("raw", "n"), [("", 3), ("0", 0), ("7", 7), (" 2 ", 2)])
def test_after_steps(raw, n):
    assert stall.after_steps_from({"WEDGE_ENGINE_FAULT_AFTER_STEPS": raw}) == n
    assert stall.after_steps_from({}) == 3


@pytest.mark.parametrize("raw", ["x", "-1", "2.5"])
def test_after_steps_rejects(raw):
    with pytest.raises(FaultConfigError):
        stall.after_steps_from({"WEDGE_ENGINE_FAULT_AFTER_STEPS": raw})


def test_bad_after_steps_patches_nothing(released):
    original = FakeWorkerWrapper.execute_model
    with pytest.raises(FaultConfigError):
        stall.activate({"WEDGE_ENGINE_FAULT_AFTER_STEPS": "x"}, cls=FakeWorkerWrapper)
    assert FakeWorkerWrapper.execute_model is original


def test_stall_blocks_the_call_after_n_model_steps(released):
    original = FakeWorkerWrapper.__dict__["execute_model"]
    stall.activate({"WEDGE_ENGINE_FAULT_AFTER_STEPS": "2"}, cls=FakeWorkerWrapper)
    w = FakeWorkerWrapper()
    assert w.execute_model(Output(6)) == "out1"
    assert w.execute_model(Output(0)) == "out2"  # an empty step neither counts nor stalls
    assert w.execute_model(Output(1)) == "out3"
    assert w.execute_model(Output(0)) == "out4"
    result = []
    t = threading.Thread(target=lambda: result.append(w.execute_model(Output(1))), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive() and result == [] and w.ran == 4  # parked before the real call
    stall._never.set()
    t.join(2)
    assert result == ["out5"]
    stall.deactivate()
    assert FakeWorkerWrapper.__dict__["execute_model"] is original


def test_stall_activates_once(released):
    assert "after 3 model steps" in stall.activate({}, cls=FakeWorkerWrapper)
    wrapped = FakeWorkerWrapper.execute_model
    assert stall.activate({}, cls=FakeWorkerWrapper) == "already active"
    assert FakeWorkerWrapper.execute_model is wrapped
