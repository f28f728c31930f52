"""Unit tests for the wedge_engine fault modules against stand-ins for the vLLM code they wrap."""

from __future__ import annotations

import functools
import sys
import threading
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine.faults import FAULTS, FaultConfigError, overhang, runaway, stall  # noqa: E402

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


# --- runaway-hold ------------------------------------------------------------


class Req:
    """The Request fields the pacing reads."""

    def __init__(self, prompt: int, max_tokens: int, computed: int, output: int = 0) -> None:
        self.num_prompt_tokens, self.max_tokens = prompt, max_tokens
        self.num_computed_tokens, self.num_output_tokens = computed, output


class FakeScheduler:
    def __init__(self, running: list[Req]) -> None:
        self.running = running
        self.steps = 0

    def schedule(self, throttle_prefills: bool = False):
        self.steps += 1
        return f"step{self.steps}"


class Clock:
    """A monotonic clock that only moves when the fault sleeps or the test says so."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def paced():
    clock = Clock()
    yield clock
    runaway.deactivate()


def test_runaway_hold_is_registered():
    assert FAULTS["runaway-hold"] == "wedge_engine.faults.runaway"


@pytest.mark.parametrize(("raw", "s"), [("", 90.0), ("60", 60.0), (" 2.5 ", 2.5)])
def test_hold_s(raw, s):
    assert runaway.hold_s_from({"WEDGE_ENGINE_FAULT_HOLD_S": raw}) == s


@pytest.mark.parametrize("raw", ["x", "0", "-3", "inf", "nan"])
def test_hold_s_rejects(raw):
    with pytest.raises(FaultConfigError):
        runaway.hold_s_from({"WEDGE_ENGINE_FAULT_HOLD_S": raw})


def test_bad_hold_patches_nothing(paced):
    original = FakeScheduler.__dict__["schedule"]
    with pytest.raises(FaultConfigError):
        runaway.activate({"WEDGE_ENGINE_FAULT_HOLD_S": "x"}, cls=FakeScheduler)
    assert FakeScheduler.__dict__["schedule"] is original and not runaway.is_active()


def test_most_remaining_counts_only_decoding_requests():
    prefilling = Req(prompt=5000, max_tokens=9000, computed=2048)
    decoding = Req(prompt=5000, max_tokens=5000, computed=5010, output=10)
    short = Req(prompt=10, max_tokens=16, computed=12, output=2)
    assert runaway.most_remaining([prefilling, decoding, short]) == 4990
    assert runaway.most_remaining([prefilling]) == 0
    assert runaway.most_remaining([]) == 0


def test_runaway_ends_no_sooner_than_the_deadline_then_runs_free(paced):
    hold = 10.0
    runaway.activate({"WEDGE_ENGINE_FAULT_HOLD_S": str(hold)}, cls=FakeScheduler, sleep=paced.sleep, clock=paced)
    req = Req(prompt=100, max_tokens=50, computed=100)
    s = FakeScheduler([req])
    start = paced.now
    while req.num_output_tokens < req.max_tokens:
        before = s.steps
        assert s.schedule() == f"step{before + 1}"  # the original still schedules every step
        req.num_output_tokens += 1  # one token per step, as decode does
        req.num_computed_tokens += 1
        paced.now += 0.01  # the step's own work
    assert paced.now - start >= hold  # the last token came at or after the deadline
    assert max(paced.slept) <= runaway.MAX_PAUSE_S
    assert paced.slept[0] == pytest.approx(hold / 50)
    # Past the deadline nothing is paced, even for a new long request.
    s.running = [Req(prompt=100, max_tokens=500, computed=100)]
    n = len(paced.slept)
    s.schedule()
    assert len(paced.slept) == n


def test_a_slow_host_is_not_slowed_further(paced):
    runaway.activate({"WEDGE_ENGINE_FAULT_HOLD_S": "1"}, cls=FakeScheduler, sleep=paced.sleep, clock=paced)
    req = Req(prompt=100, max_tokens=10, computed=100)
    s = FakeScheduler([req])
    s.schedule()
    paced.now += 5.0  # one step took longer than the whole hold
    s.schedule()
    assert paced.slept == [pytest.approx(0.1)]


def test_no_pause_without_a_decoding_request(paced):
    runaway.activate({}, cls=FakeScheduler, sleep=paced.sleep, clock=paced)
    s = FakeScheduler([Req(prompt=5000, max_tokens=5000, computed=0)])
    s.schedule()
    s.running = []
    s.schedule()
    assert paced.slept == [] and s.steps == 2


def test_runaway_activates_once(paced):
    original = FakeScheduler.__dict__["schedule"]
    assert "90 s" in runaway.activate({}, cls=FakeScheduler, sleep=paced.sleep, clock=paced)
    wrapped = FakeScheduler.schedule
    assert runaway.activate({}, cls=FakeScheduler) == "already active"
    assert FakeScheduler.schedule is wrapped
    runaway.deactivate()
    assert FakeScheduler.__dict__["schedule"] is original
