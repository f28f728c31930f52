"""Unit tests for the wedge_engine plugin's selection logic, run without vLLM installed."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine import plugin  # noqa: E402
from wedge_engine.capability import Needs, check  # noqa: E402
from wedge_engine.faults import FAULTS, FaultConfigError  # noqa: E402

KNOWN = "0.32.0"


class FakeFault:
    """Stands in for a fault module: records activate() calls."""

    def __init__(self, error: Exception | None = None, requires: tuple = ()) -> None:
        self.calls: list[dict] = []
        self.error = error
        self.active = False
        self.REQUIRES = requires
        self.OPTIONAL = ()

    def activate(self, environ):
        self.calls.append(dict(environ))
        if self.error is not None:
            raise self.error
        self.active = True
        return "patched the fake"

    def is_active(self) -> bool:
        return self.active


@pytest.fixture
def loader():
    fakes: dict[str, FakeFault] = {}

    def load(name: str):
        return fakes.setdefault(name, FakeFault())

    load.fakes = fakes  # type: ignore[attr-defined]
    return load


def records(caplog, level=logging.DEBUG):
    return [r for r in caplog.records if r.name.startswith("vllm.wedge_engine") and r.levelno >= level]


# --- capability check (no version gate) ---------------------------------------


def test_no_version_gate_left():
    for name in ("KNOWN_VLLM_SERIES", "is_known_version", "parse_series"):
        assert not hasattr(plugin, name)


@pytest.mark.parametrize("version", ["0.33.0", "0.19.1", "dev", None])
def test_any_version_activates_a_fault_whose_names_hold(caplog, loader, version):
    env = {"WEDGE_ENGINE_FAULT": "model-stall"}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment(env, version, load=loader) == "model-stall"
    assert loader.fakes["model-stall"].calls == [env]
    assert [r.levelno for r in records(caplog)] == [logging.INFO]


def test_fault_needing_what_is_missing_errors_once_and_patches_nothing(caplog):
    needs = Needs("vllm.v1.worker.worker_base", "WorkerWrapperBase.execute_model")
    fake = FakeFault(requires=(needs, needs))
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "model-stall"}, "0.33.0", load=lambda _n: fake) is None
    assert fake.calls == []
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.ERROR
    reason = check(needs)
    assert reason is not None
    assert recs[0].getMessage() == f"wedge_engine: fault model-stall cannot run on vLLM 0.33.0: {reason}; patching nothing"


def test_vllm_not_importable_fault_patches_nothing(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    fake = FakeFault(requires=(Needs("vllm.v1.worker.worker_base", "WorkerWrapperBase.execute_model"),))
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "model-stall"}, None, load=lambda _n: fake) is None
    assert fake.calls == []
    recs = records(caplog)
    assert [r.levelno for r in recs] == [logging.ERROR]
    assert recs[0].getMessage() == ("wedge_engine: fault model-stall cannot run on vLLM (not importable): "
                                    "vllm.v1.worker.worker_base does not import (ModuleNotFoundError); patching nothing")


# --- fault selection ---------------------------------------------------------


@pytest.mark.parametrize("env", [{}, {"WEDGE_ENGINE_FAULT": ""}, {"WEDGE_ENGINE_FAULT": "   "}])
def test_inert_when_unset(caplog, loader, env):
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment(env, KNOWN, load=loader) is None
    assert loader.fakes == {}
    assert records(caplog) == []


def test_inert_run_imports_no_fault_module(monkeypatch):
    for name in FAULTS.values():
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert plugin.apply_from_environment({}, KNOWN) is None
    assert not [name for name in FAULTS.values() if name in sys.modules]


def test_selected_fault_is_normalised():
    assert plugin.selected_fault({"WEDGE_ENGINE_FAULT": " Model-Stall "}) == "model-stall"
    assert plugin.selected_fault({}) is None


def test_fault_names():
    assert {"admission-overhang", "model-stall", "runaway-hold", "lost-abort", "stream-sessions"} <= set(FAULTS)


def test_unknown_fault_one_error_nothing_patched(caplog, loader):
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "model-stal"}, KNOWN, load=loader) is None
    assert loader.fakes == {}
    recs = records(caplog)
    assert len(recs) == 1
    assert recs[0].levelno == logging.ERROR
    msg = recs[0].getMessage()
    assert "'model-stal'" in msg and "admission-overhang" in msg and "model-stall" in msg


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_known_fault_activates_and_logs_one_info_line(caplog, loader, name):
    env = {"WEDGE_ENGINE_FAULT": name, "WEDGE_ENGINE_FAULT_AFTER_STEPS": "5"}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment(env, KNOWN, load=loader) == name
    assert list(loader.fakes) == [name]
    assert loader.fakes[name].calls == [env]
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.INFO
    assert name in recs[0].getMessage() and "patched the fake" in recs[0].getMessage()


def test_already_active_fault_is_not_activated_again(caplog, loader):
    env = {"WEDGE_ENGINE_FAULT": "model-stall"}
    plugin.apply_from_environment(env, KNOWN, load=loader)
    plugin.apply_from_environment(env, KNOWN, load=loader)
    assert len(loader.fakes["model-stall"].calls) == 1


@pytest.mark.parametrize(
    ("error", "level"),
    [(FaultConfigError("WEDGE_ENGINE_FAULT_AFTER_STEPS='x' is not an integer"), logging.ERROR),
     (AttributeError("kv_cache_utils._auto_fit_max_model_len"), logging.ERROR)],
)
def test_failed_activation_is_logged_not_raised(caplog, error, level):
    fake = FakeFault(error)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "model-stall"}, KNOWN, load=lambda _n: fake) is None
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == level
    assert "patching nothing" in recs[0].getMessage()


# --- register() --------------------------------------------------------------


def test_register_is_idempotent(monkeypatch):
    calls = []
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "apply_from_environment", lambda env, version: calls.append(("fault", version)))
    monkeypatch.setattr(plugin, "apply_fixes_from_environment", lambda env, version: calls.append(("fixes", version)))
    monkeypatch.setattr(plugin, "read_vllm_version", lambda: KNOWN)
    plugin.register()
    plugin.register()
    assert calls == [("fault", KNOWN), ("fixes", KNOWN)]


def test_register_never_raises_into_vllm(monkeypatch, caplog):
    def boom(*_a, **_k):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "apply_from_environment", boom)
    monkeypatch.setattr(plugin, "apply_fixes_from_environment", boom)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        plugin.register()
    recs = records(caplog)
    assert [r.levelno for r in recs] == [logging.ERROR, logging.ERROR]
    assert "applying the fault failed" in recs[0].getMessage()
    assert "applying the fixes failed" in recs[1].getMessage()


def test_register_without_vllm_patches_nothing(monkeypatch, caplog):
    from wedge_engine.faults import overhang

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.setenv("WEDGE_ENGINE_FAULT", "admission-overhang")
    monkeypatch.delenv("WEDGE_ENGINE_FIXES", raising=False)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        plugin.register()
    recs = records(caplog)
    assert [r.levelno for r in recs] == [logging.ERROR]
    assert "cannot run on vLLM (not importable)" in recs[0].getMessage()
    assert not overhang.is_active()
    assert plugin.read_vllm_version() is None


def test_entry_point_is_declared():
    import tomllib

    data = tomllib.loads((Path(plugin.__file__).parent.parent / "pyproject.toml").read_text())
    assert data["project"]["name"] == "wedgectl-engine"
    assert data["project"]["dependencies"] == []
    assert data["project"]["entry-points"]["vllm.general_plugins"] == {"wedge_engine": "wedge_engine.plugin:register"}


def test_plugin_module_imports_no_vllm():
    # Cheap in every vLLM process: importing the plugin pulls in no vLLM module itself.
    engine = Path(plugin.__file__).parent.parent
    code = f"import sys; sys.path.insert(0, {str(engine)!r}); import wedge_engine.plugin; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
