"""Unit tests for the wedge_engine plugin's selection logic, run without vLLM installed."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine import plugin  # noqa: E402
from wedge_engine.faults import FAULTS, FaultConfigError  # noqa: E402

KNOWN = "0.32.0"


class FakeFault:
    """Stands in for a fault module: records activate() calls."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[dict] = []
        self.error = error
        self.active = False

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


# --- version check -----------------------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.1rc1.dev12+g5559679", "v0.32.2", "0.32"])
def test_known_versions(version):
    assert plugin.is_known_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "0.320.0", "1.32.0", "0.3.2", "dev", "", None, "garbage"])
def test_unknown_versions(version):
    assert not plugin.is_known_version(version)


def test_parse_series():
    assert plugin.parse_series("0.32.0+cpu") == (0, 32)
    assert plugin.parse_series("0.24.1rc1") == (0, 24)
    assert plugin.parse_series("nope") is None


def test_unknown_version_warns_once_and_patches_nothing(caplog, loader):
    env = {"WEDGE_ENGINE_FAULT": "model-stall"}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment(env, "0.33.0", load=loader) is None
    assert loader.fakes == {}
    recs = records(caplog)
    assert len(recs) == 1
    assert recs[0].levelno == logging.WARNING
    assert "0.33.0" in recs[0].getMessage() and "0.32.x" in recs[0].getMessage()


def test_vllm_not_importable_counts_as_unknown(caplog, loader):
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "model-stall"}, None, load=loader) is None
    assert loader.fakes == {}
    assert [r.levelno for r in records(caplog)] == [logging.WARNING]


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
    monkeypatch.setattr(plugin, "apply_from_environment", lambda env, version: calls.append(version))
    monkeypatch.setattr(plugin, "read_vllm_version", lambda: KNOWN)
    plugin.register()
    plugin.register()
    assert calls == [KNOWN]


def test_register_without_vllm_patches_nothing(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.setenv("WEDGE_ENGINE_FAULT", "admission-overhang")
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        plugin.register()
    assert [r.levelno for r in records(caplog)] == [logging.WARNING]
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
