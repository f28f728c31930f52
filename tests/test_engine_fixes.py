"""Unit tests for the wedge_engine fixes: settings, the status record, and each fix against stand-ins for vLLM."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine import capability, plugin, status  # noqa: E402
from wedge_engine.fixes import (  # noqa: E402
    FIXES,
    FixConfigError,
    FixSettings,
    _common,
    parse_fixes,
    process_role,
    settings_from,
)

KNOWN = "0.32.0"


def records(caplog, level=logging.DEBUG):
    return [r for r in caplog.records if r.name.startswith("vllm.wedge_engine") and r.levelno >= level]


@pytest.fixture(autouse=True)
def _undo_patches():
    yield
    _common.unpatch_all()


# --- settings ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("all", set(FIXES)),
        ("ALL", set(FIXES)),
        ("all,-watchdog", set(FIXES) - {"watchdog"}),
        ("admission, heartbeat", {"admission", "heartbeat"}),
        ("shutdown", {"shutdown"}),
        ("", set()),
        (None, set()),
        ("none", set()),
        ("0", set()),
    ],
)
def test_parse_fixes(raw, want):
    chosen, unknown = parse_fixes(raw)
    assert chosen == want and unknown == ()


def test_parse_fixes_reports_unknown_names():
    assert parse_fixes("admision,heartbeat") == (frozenset({"heartbeat"}), ("admision",))


def test_settings_defaults_and_overrides():
    s = settings_from({"WEDGE_ENGINE_FIXES": "all"})
    assert s.watchdog_s == 60.0 and s.shutdown_s == 10.0 and s.honest_max_model_len
    s = settings_from({"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_WATCHDOG_S": "2.5", "WEDGE_ENGINE_SHUTDOWN_S": "3",
                       "WEDGE_ENGINE_HONEST_MAX_MODEL_LEN": "0"})
    assert (s.watchdog_s, s.shutdown_s, s.honest_max_model_len) == (2.5, 3.0, False)
    assert settings_from({}).fixes == frozenset()


@pytest.mark.parametrize(
    "env",
    [
        {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_WATCHDOG_S": "soon"},
        {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_SHUTDOWN_S": "0"},
        {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_SHUTDOWN_S": "-1"},
        {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_WATCHDOG_S": "inf"},
        {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_HONEST_MAX_MODEL_LEN": "maybe"},
        {"WEDGE_ENGINE_FIXES": "wachdog"},
    ],
)
def test_bad_settings_raise(env):
    with pytest.raises(FixConfigError):
        settings_from(env)


@pytest.mark.parametrize(("name", "role"), [("EngineCore", "engine"), ("EngineCore_DP1", "engine"),
                                            ("VllmWorker-0", "worker"), ("MainProcess", "api"),
                                            ("ApiServer_0", "api")])
def test_process_role(name, role):
    assert process_role(name) == role


# --- plugin: fix selection ------------------------------------------------------


class FakeFix:
    def __init__(self, result="patched", error=None):
        self.calls, self.result, self.error = [], result, error

    def activate(self, settings, role):
        self.calls.append((settings, role))
        if self.error:
            raise self.error
        return self.result


@pytest.fixture
def fix_loader():
    fakes: dict[str, FakeFix] = {}

    def load(name):
        return fakes.setdefault(name, FakeFix())

    load.fakes = fakes
    return load


def test_fixes_inert_when_unset(caplog, fix_loader):
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_fixes_from_environment({}, KNOWN, load=fix_loader, role="engine") == ()
    assert fix_loader.fakes == {} and records(caplog) == []


def test_inert_run_imports_no_fix_module(monkeypatch):
    for name in FIXES.values():
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert plugin.apply_fixes_from_environment({}, KNOWN) == ()
    assert not [name for name in FIXES.values() if name in sys.modules]


def test_fixes_all_activate_in_order_with_settings(caplog, fix_loader):
    env = {"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_WATCHDOG_S": "5"}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment(env, KNOWN, load=fix_loader, role="engine")
    assert got == tuple(FIXES)
    settings, role = fix_loader.fakes["watchdog"].calls[0]
    assert isinstance(settings, FixSettings) and settings.watchdog_s == 5.0 and role == "engine"
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.INFO and "engine process" in recs[0].getMessage()


def test_fix_switched_off_by_configuration(fix_loader):
    got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "all,-shutdown"}, KNOWN, load=fix_loader,
                                              role="engine")
    assert "shutdown" not in got and "shutdown" not in fix_loader.fakes


def test_bad_fix_setting_is_one_error_and_nothing(caplog, fix_loader):
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "all", "WEDGE_ENGINE_SHUTDOWN_S": "x"},
                                                  KNOWN, load=fix_loader, role="engine")
    assert got == () and fix_loader.fakes == {}
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.ERROR and "WEDGE_ENGINE_SHUTDOWN_S" in recs[0].getMessage()


def test_failing_fix_is_logged_and_the_others_still_apply(caplog):
    fakes = {name: FakeFix(error=AttributeError("moved") if name == "admission" else None) for name in FIXES}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "all"}, KNOWN, load=fakes.__getitem__,
                                                  role="engine")
    assert got == tuple(n for n in FIXES if n != "admission")
    assert any(r.levelno == logging.ERROR and "admission" in r.getMessage() for r in records(caplog))


def test_fix_with_nothing_in_this_role_is_not_reported(fix_loader):
    fix_loader.fakes["shutdown"] = FakeFix(result=None)
    got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "shutdown", "WEDGE_ENGINE_REPORT": "0"},
                                              KNOWN, load=fix_loader, role="worker")
    assert got == ()


def test_register_applies_the_fixes_on_any_version(monkeypatch):
    """No version gate: a release the plugin never saw gets each fix its vLLM names hold for (the
    capability gate, tests/test_engine_plugin.py), not nothing."""
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "read_vllm_version", lambda: "0.40.0")
    called = []
    monkeypatch.setattr(plugin, "apply_fixes_from_environment", lambda *a, **k: called.append(a[1]))
    monkeypatch.setenv("WEDGE_ENGINE_FIXES", "all")
    plugin.register()
    assert called == ["0.40.0"]


# --- the status record -------------------------------------------------------------


def test_status_record_round_trip(tmp_path):
    path = str(tmp_path / "s")
    status.create(path)
    reader = status.StatusReader(path)
    first = reader.read()
    assert (first.steps, first.model_steps, first.engine_pid, first.admission_rejections) == (0, 0, 0, 0)
    writer = status.StatusWriter(path)
    writer.attach_engine(4242)
    writer.record_step(True)
    writer.record_step(False)
    writer.record_step(False)
    writer.count_admission_rejection()
    snap = reader.read()
    assert (snap.steps, snap.model_steps, snap.engine_pid, snap.admission_rejections) == (3, 1, 4242, 1)
    assert snap.last_step_ns >= snap.last_model_step_ns >= first.created_ns
    # A second writer (an EngineCore restarted on the same record) continues the counters.
    again = status.StatusWriter(path)
    again.record_step(True)
    assert reader.read().steps == 4 and reader.read().model_steps == 2


def test_ages_grow_without_writes(tmp_path):
    path = str(tmp_path / "s")
    status.create(path)
    writer = status.StatusWriter(path)
    writer.record_step(True)
    reader = status.StatusReader(path)
    a = reader.read()
    time.sleep(0.2)
    b = reader.read()
    assert b.last_step_age_s >= a.last_step_age_s + 0.15
    assert b.last_model_step_age_s >= 0.15 and b.steps == a.steps


def test_reader_refuses_other_files(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"x" * 200)
    with pytest.raises(status.StatusFileError):
        status.StatusReader(str(p))
    p.write_bytes(b"WEHB")
    with pytest.raises(status.StatusFileError):
        status.StatusReader(str(p))


def test_pid_list(tmp_path):
    path = str(tmp_path / "s")
    status.create(path)
    assert status.read_pids(path) == []
    status.register_pid(path, 11, "engine")
    status.register_pid(path, 12, "worker")
    assert status.read_pids(path) == [(11, "engine"), (12, "worker")]
    status.remove(path)
    assert not os.path.exists(path) and not os.path.exists(status.pids_path(path))


def test_status_file_created_by_api_and_inherited(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    env: dict[str, str] = {}
    assert _common.ensure_status_file("engine", env) is None  # engines never create it
    path = _common.ensure_status_file("api", env)
    assert path and os.path.exists(path) and env[status.STATUS_FILE_ENV] == path
    assert _common.ensure_status_file("api", env) == path  # idempotent
    assert _common.ensure_status_file("engine", env) == path  # children find it in their env
    status.remove(path)


# --- stand-ins for the vLLM code the fixes wrap ----------------------------------------


class RequestStatus(enum.IntEnum):
    WAITING = 1
    RUNNING = 5
    PREEMPTED = 6
    FINISHED_ERROR = 11


class FinishReason(enum.IntEnum):
    ERROR = 3


@dataclasses.dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list
    finish_reason: object = None
    stop_reason: object = None
    events: object = None
    trace_headers: object = None


@dataclasses.dataclass
class EngineCoreOutputs:
    outputs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FullAttentionSpec:
    block_size: int


@dataclasses.dataclass
class SlidingWindowSpec:
    block_size: int


@dataclasses.dataclass
class Group:
    kv_cache_spec: object


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list


class FakeRequest:
    def __init__(self, rid, prompt, generated=0, status=RequestStatus.WAITING):
        self.request_id, self.num_prompt_tokens = rid, prompt
        self.num_tokens = prompt + generated
        self.status, self.client_index, self.trace_headers = status, 0, None

    def take_events(self):
        return None


class Queue(list):
    def peek_request(self):
        return self[0]


class FakeScheduler:
    """The few Scheduler members the admission guard touches."""

    def __init__(self, num_blocks=4, block_size=32, spec=FullAttentionSpec):
        self.kv_cache_config = KVCacheConfig(num_blocks, [Group(spec(block_size))])
        pool = types.SimpleNamespace(num_gpu_blocks=num_blocks, get_num_free_blocks=lambda: num_blocks - 1)
        self.kv_cache_manager = types.SimpleNamespace(block_pool=pool)
        self.waiting, self.running, self.num_lookahead_tokens = Queue(), [], 0
        self.finished, self.connector = [], None

    def add_request(self, request):
        self.waiting.append(request)

    def schedule(self, *args):
        return types.SimpleNamespace(total_num_scheduled_tokens=0)

    def update_from_output(self, scheduler_output, model_runner_output):
        return {}

    def finish_requests(self, rid, status_):
        self.finished.append((rid, status_))
        for r in list(self.waiting):
            if r.request_id == rid:
                self.waiting.remove(r)
                r.status = status_


@pytest.fixture
def fake_vllm(monkeypatch):
    """Stand-in vllm modules with the names the fixes import."""

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    mod("vllm")
    mod("vllm.v1")
    mod("vllm.v1.request", RequestStatus=RequestStatus)
    mod("vllm.v1.engine", EngineCoreOutput=EngineCoreOutput, EngineCoreOutputs=EngineCoreOutputs,
        FinishReason=FinishReason)
    mod("vllm.v1.kv_cache_interface", is_full_attention_spec=lambda spec: isinstance(spec, FullAttentionSpec))
    mod("vllm.v1.core")
    mod("vllm.v1.core.sched")
    sched = mod("vllm.v1.core.sched.scheduler", Scheduler=type("Scheduler", (FakeScheduler,), {}))

    class EngineCore:
        def __init__(self, max_model_len):
            self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=max_model_len))
            self.rpcs = []
            self.kv_cache_config = KVCacheConfig(4, [Group(FullAttentionSpec(32))])

        def _initialize_kv_caches(self, vllm_config):
            return self.kv_cache_config

        def collective_rpc(self, method, args=()):
            self.rpcs.append((method, args))

    class EngineCoreProc(EngineCore):
        def __init__(self, steps):
            self.steps = steps

        def _process_engine_step(self):
            return self.steps.pop(0)

    mod("vllm.v1.engine.core", EngineCore=EngineCore, EngineCoreProc=EngineCoreProc)

    class GracefulHTTPError(Exception):
        def __init__(self, message, http_status):
            super().__init__(message)
            self.message, self.http_status = message, http_status

    mod("vllm.exceptions", GracefulHTTPError=GracefulHTTPError)

    class RequestOutputCollector:
        def __init__(self):
            self.output = None

        def put(self, output):
            self.output = output

    mod("vllm.v1.engine.output_processor", RequestOutputCollector=RequestOutputCollector)
    return types.SimpleNamespace(Scheduler=sched.Scheduler, EngineCore=EngineCore, EngineCoreProc=EngineCoreProc,
                                 Collector=RequestOutputCollector, GracefulHTTPError=GracefulHTTPError)


# --- admission guard -----------------------------------------------------------------


def test_capacity_arithmetic():
    from wedge_engine.fixes.admission import Capacity, honest_max_model_len

    cap = Capacity(4, (32,))
    assert cap.allocatable == 3 and cap.blocks_for(96) == 3 and cap.blocks_for(97) == 4
    assert cap.max_tokens() == 96
    assert honest_max_model_len(128, cap) == 96  # the null-block overhang: 4 x 32 advertised, 96 servable
    assert honest_max_model_len(96, cap) is None and honest_max_model_len(64, cap) is None
    two = Capacity(9, (16, 16))  # two full-attention groups share the pool
    assert two.max_tokens() == 64
    assert Capacity(4, None).plain is False and honest_max_model_len(128, Capacity(4, None)) is None


def test_unadmittable_reason_states_blocks_and_tokens():
    from wedge_engine.fixes.admission import Capacity, unadmittable_reason

    cap = Capacity(4, (32,))
    assert unadmittable_reason(FakeRequest("a", 6, 90), cap, 0) is None
    why = unadmittable_reason(FakeRequest("a", 6, 91), cap, 0)
    assert "needs 4 KV-cache blocks for 97 tokens (6 prompt + 91 generated)" in why
    assert "3 blocks allocatable" in why and "= 96 tokens" in why
    assert "2 lookahead" in unadmittable_reason(FakeRequest("a", 95), cap, 2)


def test_honest_max_model_len_lowers_the_overhang(fake_vllm, caplog):
    from wedge_engine.fixes import admission

    assert admission._patch_initialize_kv_caches()
    engine = fake_vllm.EngineCore(max_model_len=128)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        engine._initialize_kv_caches(engine.vllm_config)
    assert engine.vllm_config.model_config.max_model_len == 96
    assert engine.rpcs == [("update_max_model_len", (96,))]
    assert "advertising max_model_len=96" in records(caplog)[0].getMessage()
    honest = fake_vllm.EngineCore(max_model_len=96)
    honest._initialize_kv_caches(honest.vllm_config)
    assert honest.vllm_config.model_config.max_model_len == 96 and honest.rpcs == []


def test_guard_fails_a_resumed_request_that_can_never_fit(fake_vllm, tmp_path, monkeypatch):
    from wedge_engine.fixes import admission

    monkeypatch.setattr(_common, "_writer", None)
    monkeypatch.setattr(_common, "_writer_failed", True)  # no status record here
    assert admission._patch_scheduler()
    sched = fake_vllm.Scheduler()
    fits = FakeRequest("fits", 6, 80)
    sched.add_request(fits)
    sched.schedule()
    assert sched.finished == [] and list(sched.waiting) == [fits]
    # The wedging request after its self-preemption: 97 tokens, 4 blocks, 3 allocatable.
    stuck = FakeRequest("stuck", 6, 91, status=RequestStatus.PREEMPTED)
    sched.waiting.insert(0, stuck)
    sched.schedule()
    assert sched.finished == [("stuck", RequestStatus.FINISHED_ERROR)]
    out = sched.update_from_output(None, None)
    (o,) = out[0].outputs
    assert o.request_id == "stuck" and o.finish_reason == FinishReason.ERROR
    assert o.stop_reason.startswith(admission.PREFIX) and "4 KV-cache blocks" in o.stop_reason
    assert sched.update_from_output(None, None) == {}  # delivered once


def test_guard_fails_an_oversized_prompt_at_admission(fake_vllm, monkeypatch):
    from wedge_engine.fixes import admission

    monkeypatch.setattr(_common, "_writer_failed", True)
    monkeypatch.setattr(_common, "_writer", None)
    admission._patch_scheduler()
    sched = fake_vllm.Scheduler()
    sched.waiting.append(FakeRequest("other", 6))
    sched.add_request(FakeRequest("huge", 200))
    assert sched.finished == [("huge", RequestStatus.FINISHED_ERROR)]


def test_guard_fallback_needs_repeated_refusals_with_the_pool_free(fake_vllm, monkeypatch):
    from wedge_engine.fixes import admission

    monkeypatch.setattr(_common, "_writer_failed", True)
    monkeypatch.setattr(_common, "_writer", None)
    admission._patch_scheduler()
    sched = fake_vllm.Scheduler(spec=SlidingWindowSpec)  # block arithmetic not plain: observe instead
    sched.add_request(FakeRequest("r", 6, 91))
    for _ in range(admission.FALLBACK_REFUSALS):
        sched.schedule()
        assert sched.finished == []
    sched.schedule()
    assert sched.finished == [("r", RequestStatus.FINISHED_ERROR)]


def test_guard_counts_into_the_status_record(fake_vllm, tmp_path, monkeypatch):
    from wedge_engine.fixes import admission

    path = str(tmp_path / "s")
    status.create(path)
    monkeypatch.setenv(status.STATUS_FILE_ENV, path)
    monkeypatch.setattr(_common, "_writer", None)
    monkeypatch.setattr(_common, "_writer_failed", False)
    admission._patch_scheduler()
    sched = fake_vllm.Scheduler()
    sched.waiting.append(FakeRequest("stuck", 6, 91, status=RequestStatus.PREEMPTED))
    sched.schedule()
    assert status.StatusReader(path).read().admission_rejections == 1
    _common._writer.close()


def test_api_turns_the_guard_error_into_http_400(fake_vllm):
    from wedge_engine.fixes import admission

    assert admission._patch_output_collector()
    collector = fake_vllm.Collector()
    done = types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(
        finish_reason="error", stop_reason=admission.PREFIX + "the request needs 4 KV-cache blocks")])
    collector.put(done)
    assert isinstance(collector.output, fake_vllm.GracefulHTTPError)
    assert collector.output.http_status == 400 and "4 KV-cache blocks" in collector.output.message
    other = types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(finish_reason="error",
                                                                                stop_reason=None)])
    collector.put(other)
    assert collector.output is other  # vLLM's own errors pass through unchanged
    partial = types.SimpleNamespace(finished=False, outputs=[])
    collector.put(partial)
    assert collector.output is partial


# --- heartbeat ------------------------------------------------------------------------


def test_step_recorder_and_collector(fake_vllm, tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    from wedge_engine.fixes import heartbeat

    path = str(tmp_path / "s")
    status.create(path)
    monkeypatch.setenv(status.STATUS_FILE_ENV, path)
    monkeypatch.setattr(_common, "_writer", None)
    monkeypatch.setattr(_common, "_writer_failed", False)
    monkeypatch.setattr(_common, "_reader", None)
    assert _common.install_step_recorder()
    proc = fake_vllm.EngineCoreProc([True, False, False])
    assert [proc._process_engine_step() for _ in range(3)] == [True, False, False]
    registry = CollectorRegistry()
    registry.register(heartbeat.EngineStatusCollector(_common.status_reader, {"heartbeat", "admission"}))
    text = generate_latest(registry).decode()
    assert "wedge_engine:steps_total 3.0" in text
    assert "wedge_engine:model_steps_total 1.0" in text
    assert "wedge_engine:last_step_age_seconds" in text and "wedge_engine:last_model_step_age_seconds" in text
    assert "wedge_engine:admission_rejections_total 0.0" in text
    # named up front: the restricted page wedgectl asks for (name[]) holds the heartbeat too
    from wedgectl.read.metrics import JUDGED_SERIES

    lean = generate_latest(registry.restricted_registry(list(JUDGED_SERIES))).decode()
    assert "wedge_engine:steps_total 3.0" in lean and "wedge_engine:model_steps_total 1.0" in lean
    assert "wedge_engine:last_model_step_age_seconds" in lean and "admission_rejections" not in lean
    _common._writer.close()


# --- watchdog -------------------------------------------------------------------------


class FakeLLM:
    def __init__(self, n=0):
        self.n = n
        self.output_processor = types.SimpleNamespace(get_num_unfinished_requests=lambda: self.n, request_states={})


class FakeLoop:
    def __init__(self):
        self.calls = []

    def is_closed(self):
        return False

    def call_soon_threadsafe(self, fn):
        self.calls.append(fn)


@pytest.fixture
def watch(tmp_path, monkeypatch):
    from wedge_engine.fixes import watchdog

    path = str(tmp_path / "s")
    status.create(path)
    monkeypatch.setenv(status.STATUS_FILE_ENV, path)
    watchdog.reset()
    watchdog._state.limit_s = 5.0
    watchdog._state.loop = FakeLoop()
    yield watchdog, status.StatusWriter(path), status.StatusReader(path)
    watchdog.reset()


def test_watchdog_quiet_while_idle_and_while_progressing(watch):
    wd, writer, reader = watch
    llm = FakeLLM(0)
    t = time.monotonic_ns()
    assert not wd.check_once(llm, reader, 1.0, now_ns=t + 3600 * 10**9)  # idle for an hour: fine
    llm.n = 2
    writer.record_step(True)
    now = time.monotonic_ns()
    assert not wd.check_once(llm, reader, 1.0, now_ns=now)
    assert not wd.check_once(llm, reader, 1.0, now_ns=now + 4 * 10**9)
    assert not wd._state.tripped


def test_watchdog_counts_from_when_work_arrived(watch):
    wd, writer, reader = watch
    writer.record_step(True)
    llm = FakeLLM(1)
    later = time.monotonic_ns() + 100 * 10**9  # the last model step was long before the request came
    assert not wd.check_once(llm, reader, 1.0, now_ns=later)
    assert not wd.check_once(llm, reader, 1.0, now_ns=later + 4 * 10**9)
    assert wd.check_once(llm, reader, 1.0, now_ns=later + 5 * 10**9)


def test_watchdog_trips_once_and_describes_a_blocked_engine(watch, caplog, monkeypatch):
    wd, writer, reader = watch
    monkeypatch.setattr(wd, "dump_engine_stacks", lambda targets=None: [])
    writer.record_step(True)
    llm = FakeLLM(2)
    now = time.monotonic_ns()
    wd.check_once(llm, reader, 1.0, now_ns=now)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert wd.check_once(llm, reader, 1.0, now_ns=now + 6 * 10**9)
    assert wd._state.tripped and "blocked" in wd._state.message and "2 request(s)" in wd._state.message
    assert len(wd._state.loop.calls) == 1  # failing the requests is handed to the event loop
    assert not wd.check_once(llm, reader, 1.0, now_ns=now + 7 * 10**9)  # once
    assert any(r.levelno == logging.ERROR for r in records(caplog))


def test_describe_stall_spinning_vs_blocked():
    from wedge_engine.fixes import watchdog

    now = time.monotonic_ns()
    spinning = status.StatusSnapshot(700, 3, now - 10**6, now - 9 * 10**9, now - 20 * 10**9, 1, 0, now)
    blocked = status.StatusSnapshot(3, 3, now - 9 * 10**9, now - 9 * 10**9, now - 20 * 10**9, 1, 0, now)
    assert "spinning" in watchdog.describe_stall(spinning, 9.0, 1, 1.0)
    assert "blocked" in watchdog.describe_stall(blocked, 9.0, 1, 1.0)


def test_stack_dump_targets_skip_strangers(watch, monkeypatch):
    wd, _writer, _reader = watch
    path = os.environ[status.STATUS_FILE_ENV]
    status.register_pid(path, os.getpid(), "engine")
    status.register_pid(path, 999_999_999, "worker")
    monkeypatch.setattr(wd, "_descendants", lambda: {os.getpid()})
    assert wd.stack_dump_targets() == [(os.getpid(), "engine")]


def test_fail_requests_puts_errors_and_aborts():
    aborted = []

    class Queue:
        def __init__(self):
            self.items = []

        def put(self, item):
            self.items.append(item)

    q1, q2 = Queue(), Queue()

    class LLM:
        output_processor = types.SimpleNamespace(request_states={"a": types.SimpleNamespace(queue=q1),
                                                                  "b": types.SimpleNamespace(queue=q2)})

        async def abort(self, ids, internal=False):
            aborted.append((ids, internal))

    async def go():
        ids = _common.fail_requests(LLM(), lambda: RuntimeError("stalled"))
        await asyncio.sleep(0)
        return ids

    assert asyncio.run(go()) == ["a", "b"]
    assert [type(x) for x in q1.items + q2.items] == [RuntimeError, RuntimeError]
    assert aborted == [(["a", "b"], True)]


def test_capacity_from_the_schedulers_own_managers(fake_vllm):
    from wedge_engine.fixes import admission

    def manager(spec, bs):
        return types.SimpleNamespace(kv_cache_spec=spec, block_size=bs)

    def kvm(*managers):
        return types.SimpleNamespace(block_pool=types.SimpleNamespace(num_gpu_blocks=9),
                                     coordinator=types.SimpleNamespace(single_type_managers=managers))

    # A context-parallel scheduler allocates 64-token blocks although each spec says 32: its managers know.
    cap = admission.capacity_of_manager(kvm(manager(FullAttentionSpec(32), 64)))
    assert cap.block_sizes == (64,) and cap.max_tokens() == 8 * 64
    assert not admission.capacity_of_manager(kvm(manager(FullAttentionSpec(32), 32),
                                                 manager(SlidingWindowSpec(32), 32))).plain
    config = KVCacheConfig(4, [Group(FullAttentionSpec(32))])
    assert admission.capacity_from(config, context_parallel=2).plain is False


def test_before_vllm_0_29_the_guard_uses_what_the_release_has(fake_vllm, monkeypatch):
    """vLLM 0.19-0.28 has neither is_full_attention_spec nor GracefulHTTPError (docs/vllm-versions.md): the
    block arithmetic asks FullAttentionSpec, and the client's error is a ValueError, which those releases'
    AsyncLLM.generate passes through and their server answers 400 with the message; a 5xx is a RuntimeError
    (vLLM's generic 500)."""
    from wedge_engine.fixes import _common, admission

    kv = sys.modules["vllm.v1.kv_cache_interface"]
    monkeypatch.delattr(kv, "is_full_attention_spec")
    monkeypatch.setattr(kv, "FullAttentionSpec", FullAttentionSpec, raising=False)
    monkeypatch.delattr(sys.modules["vllm.exceptions"], "GracefulHTTPError")
    assert capability.problems(admission.REQUIRES) == []
    assert [str(n) for n in admission.OPTIONAL if capability.check(n)] == [str(_common.HTTP_ERROR)]
    config = KVCacheConfig(4, [Group(FullAttentionSpec(32))])
    assert admission.capacity_from(config).block_sizes == (32,)  # plain: the arithmetic, not the fallback
    assert not admission.capacity_from(KVCacheConfig(4, [Group(SlidingWindowSpec(32))])).plain
    rejected = _common.http_error_class("AdmissionRejected", 400)("too long")
    stalled = _common.http_error_class("EngineStalled", 503)("stalled")
    assert isinstance(rejected, ValueError) and str(rejected) == "too long" and rejected.status_code == 400
    assert isinstance(stalled, RuntimeError) and not isinstance(stalled, ValueError) and stalled.status_code == 503


def test_before_0_29_a_5xx_is_the_handlers_own_generation_error(fake_vllm, monkeypatch):
    """vLLM 0.15-0.28 keep a GenerationError that the OpenAI handlers catch (before ValueError) and answer with its
    status_code and message. A 5xx that is one, and a ValueError (which AsyncLLM.generate passes unwrapped), is
    answered 503 with its reason; as a RuntimeError it became a bare 500 (on 0.15, an error body sent with HTTP
    200: its completions route returns the handler's error unconverted). The class is vLLM 0.19's, as written."""
    from http import HTTPStatus

    from wedge_engine.fixes import _common

    monkeypatch.delattr(sys.modules["vllm.exceptions"], "GracefulHTTPError")

    class GenerationError(Exception):
        def __init__(self, message: str = "Internal server error"):
            super().__init__(message)
            self.status_code = HTTPStatus.INTERNAL_SERVER_ERROR

    protocol = types.ModuleType("vllm.entrypoints.openai.engine.protocol")
    protocol.GenerationError = GenerationError
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.openai.engine.protocol", protocol)
    stalled = _common.http_error_class("EngineStalled", 503)("engine stalled: no step for 8.0 s")
    assert isinstance(stalled, GenerationError) and isinstance(stalled, ValueError)
    assert stalled.status_code == HTTPStatus.SERVICE_UNAVAILABLE and str(stalled) == "engine stalled: no step for 8.0 s"
    rejected = _common.http_error_class("AdmissionRejected", 400)("too long")  # a 4xx stays a plain ValueError
    assert not isinstance(rejected, GenerationError) and rejected.status_code == 400


def test_the_kv_cache_config_is_found_in_either_return_shape():
    """EngineCore._initialize_kv_caches returns the KVCacheConfig (0.19 on) or, on 0.15, a tuple
    (num_gpu_blocks, num_cpu_blocks, KVCacheConfig): the honest-length check reads both."""
    from wedge_engine.fixes import admission

    config = KVCacheConfig(4, [Group(FullAttentionSpec(32))])
    assert admission._kv_cache_config_of(config) is config
    assert admission._kv_cache_config_of((4, 0, config)) is config
    assert admission._kv_cache_config_of((4, 0)) is None and admission._kv_cache_config_of(None) is None


def test_the_api_server_adopts_the_engines_honest_length(tmp_path, monkeypatch):
    """vLLM 0.19 passes the engine's max_model_len to its workers only: the API server goes on advertising
    the larger figure, and a request the pool can never hold is cut short instead of refused. The EngineCore's
    guard publishes the honest figure in the status record; the API server adopts it once its AsyncLLM is up."""
    from wedge_engine.fixes import _common, admission

    path = str(tmp_path / "s")
    status.create(path)
    monkeypatch.setenv(status.STATUS_FILE_ENV, path)
    monkeypatch.setattr(_common, "_reader", None)
    config = types.SimpleNamespace(max_model_len=16384)
    llm = types.SimpleNamespace(model_config=config, vllm_config=types.SimpleNamespace(model_config=config))
    assert admission.adopt_honest_len(llm) is None and config.max_model_len == 16384  # nothing published yet
    status.StatusWriter(path).set_max_model_len(96)
    assert status.StatusReader(path).max_model_len() == 96
    assert admission.adopt_honest_len(llm) == 96 and config.max_model_len == 96
    assert admission.adopt_honest_len(llm) is None  # already honest (vLLM 0.32 passes it on itself)


def test_the_engine_publishes_the_length_it_lowered(fake_vllm, tmp_path, monkeypatch):
    from wedge_engine.fixes import _common, admission

    path = str(tmp_path / "s")
    status.create(path)
    monkeypatch.setenv(status.STATUS_FILE_ENV, path)
    monkeypatch.setattr(_common, "_writer", None)
    monkeypatch.setattr(_common, "_writer_failed", False)
    engine = fake_vllm.EngineCore(max_model_len=128)
    admission._make_advertised_len_honest(engine, engine.vllm_config, engine.kv_cache_config)
    assert engine.vllm_config.model_config.max_model_len == 96
    assert status.StatusReader(path).max_model_len() == 96
