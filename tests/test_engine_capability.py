"""The capability gate: each fix and fault declares the vLLM names it wraps, checked before it is activated.

Run without vLLM: a tiny package tree named ``vllm`` in tmp_path stands in for it,
checked both in this process (``check``) and from its source (``static_problem``).
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from wedge_engine import capability, plugin  # noqa: E402
from wedge_engine.capability import AnyOf, Needs, check, problems, static_problem  # noqa: E402
from wedge_engine.faults import FAULTS  # noqa: E402
from wedge_engine.fixes import FIXES, _common  # noqa: E402

VERSION = "0.99.0"
SCHED = "vllm.v1.core.sched.scheduler"
CORE = "vllm.v1.engine.core"
LAUNCHER = "vllm.entrypoints.launchers.launcher"

TREE = {
    "vllm/__init__.py": f"__version__ = {VERSION!r}\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/sched/__init__.py": "",
    "vllm/v1/core/sched/base.py": """
        class SchedulerBase:
            def add_request(self, request):
                self.added = getattr(self, "added", []) + [request]
        """,
    "vllm/v1/core/sched/scheduler.py": """
        from vllm.v1.core.sched.base import SchedulerBase

        MAX = 4

        class Scheduler(SchedulerBase):
            def schedule(self, *args, **kwargs):
                return "scheduled"

            def update_from_output(self, scheduler_output, model_runner_output):
                return {}
        """,
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/core.py": """
        class EngineCore:
            def step(self):
                return None

        class EngineCoreProc(EngineCore):
            def _process_engine_step(self):
                return True
        """,
}


def _vllm_modules() -> list[str]:
    return [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The tree above first on sys.path, and no other vllm module imported while the test runs."""
    root = tmp_path / "site"
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for name in _vllm_modules():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    yield root
    for name in _vllm_modules():  # what the test imported from the tree; monkeypatch restores the rest
        del sys.modules[name]
    _common.unpatch_all()


def records(caplog, level=logging.DEBUG):
    return [r for r in caplog.records if r.name.startswith("vllm.wedge_engine") and r.levelno >= level]


# --- check and static_problem give the same answers --------------------------------------------

SAME = [
    (Needs(SCHED, "Scheduler.schedule"), None),
    (Needs(SCHED, "Scheduler"), None),
    (Needs(SCHED, "MAX"), None),
    (Needs(SCHED, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output")), None),
    (Needs(SCHED, "Scheduler.update_from_output", ("self", "scheduler_output")), None),  # leading names only
    (Needs(SCHED, "Scheduler.add_request", ("self", "request")), None),  # inherited from another module
    (Needs(CORE, "EngineCoreProc._process_engine_step", ("self",)), None),
    (Needs(CORE, "EngineCoreProc.step"), None),  # inherited in the same module
    (Needs(CORE, "EngineCore._initialize_kv_caches"), "vllm.v1.engine.core.EngineCore._initialize_kv_caches is missing"),
    (Needs(SCHED, "Scheduler.finish_requests"), "vllm.v1.core.sched.scheduler.Scheduler.finish_requests is missing"),
    (Needs(SCHED, "AsyncScheduler"), "vllm.v1.core.sched.scheduler.AsyncScheduler is missing"),
    (Needs(SCHED, "Scheduler.update_from_output", ("self", "output")),
     "vllm.v1.core.sched.scheduler.Scheduler.update_from_output takes "
     "(self, scheduler_output, model_runner_output), not (self, output, ...)"),
    (Needs(SCHED, "Scheduler.add_request", ("self", "req")),
     "vllm.v1.core.sched.scheduler.Scheduler.add_request takes (self, request), not (self, req, ...)"),
]


@pytest.mark.parametrize(("needs", "want"), SAME, ids=[f"{n.name}{n.params or ''}" for n, _ in SAME])
def test_check_and_static_problem_agree(fake_vllm, needs, want):
    assert check(needs) == want
    assert static_problem(needs, fake_vllm) == want


@pytest.mark.parametrize("module", [LAUNCHER, "vllm.v1.engine.async_llm", "vllm.nothing"])
def test_missing_module(fake_vllm, module):
    needs = Needs(module, "Anything.at_all")
    assert check(needs) == f"{module} does not import (ModuleNotFoundError)"
    assert static_problem(needs, fake_vllm) == f"{module} does not exist"


def test_no_vllm_at_all(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    assert check(Needs(SCHED, "Scheduler.schedule")) == f"{SCHED} does not import (ModuleNotFoundError)"


def test_problems_lists_only_what_does_not_hold(fake_vllm):
    got = problems([Needs(SCHED, "Scheduler.schedule"), Needs(CORE, "EngineCore.sleep"), Needs(LAUNCHER, "X")])
    assert got == [f"{CORE}.EngineCore.sleep is missing", f"{LAUNCHER} does not import (ModuleNotFoundError)"]


# --- every module declares its names -----------------------------------------------------------

MODULES = sorted({**FIXES, **FAULTS}.values())


@pytest.mark.parametrize("module_name", MODULES)
def test_every_module_declares_requires_and_optional(module_name):
    module = importlib.import_module(module_name)
    for attr in ("REQUIRES", "OPTIONAL"):
        value = getattr(module, attr)
        assert isinstance(value, tuple), (module_name, attr)
        for declared in value:
            assert isinstance(declared, (Needs, AnyOf)), (module_name, attr, declared)
            assert declared.why, (module_name, declared)
            options = declared.options if isinstance(declared, AnyOf) else (declared,)
            assert len(options) >= 1
            for needs in options:
                assert needs.module == "vllm" or needs.module.startswith("vllm."), (module_name, needs)
                assert needs.name, (module_name, needs)
                assert needs.params is None or (isinstance(needs.params, tuple) and needs.params), needs
    assert not set(module.REQUIRES) & set(module.OPTIONAL)


def test_modules_with_vllm_code_declare_it():
    # Only the parent watch runs without vLLM names.
    empty = [name for name, mod in {**FIXES, **FAULTS}.items() if not importlib.import_module(mod).REQUIRES]
    assert empty == ["orphan"]


def test_declarations_import_no_vllm():
    engine = Path(plugin.__file__).parent.parent
    code = (f"import sys; sys.path.insert(0, {str(engine)!r}); import importlib\n"
            f"for m in {MODULES!r}: importlib.import_module(m)\n"
            "print(sorted(n for n in sys.modules if n == 'vllm' or n.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_real_declarations_against_the_fake_tree(fake_vllm):
    caps = plugin.capabilities(["heartbeat", "orphan", "shutdown", "stream-sessions", "runaway-hold"])
    assert caps == {
        "heartbeat": [],
        "orphan": [],
        "shutdown": [f"{LAUNCHER} does not import (ModuleNotFoundError) and vllm.entrypoints.launcher does not "
                     "import (ModuleNotFoundError)",
                     "vllm.v1.engine.async_llm does not import (ModuleNotFoundError)"],
        "stream-sessions": [],
        "runaway-hold": [],
    }
    # The same answers from the source.
    for name in ("heartbeat", "stream-sessions", "runaway-hold"):
        mod = importlib.import_module({**FIXES, **FAULTS}[name])
        assert [static_problem(n, fake_vllm) for n in mod.REQUIRES] == [None] * len(mod.REQUIRES)


def test_capabilities_refuses_an_unknown_name():
    with pytest.raises(KeyError):
        plugin.capabilities(["heartbeats"])


# --- fixes: off where their names do not hold, one line per process ----------------------------


# The engine report comes with any fix; these tests are about the fixes they name.
NO_REPORT = {"WEDGE_ENGINE_REPORT": "0"}


def fake_fix(name: str, requires=(), optional=(), result="patched", error=None):
    module = types.ModuleType(f"fake_{name}")
    module.REQUIRES, module.OPTIONAL = tuple(requires), tuple(optional)
    module.calls = []

    def activate(settings, role):
        module.calls.append(role)
        if error is not None:
            raise error
        return result

    module.activate = activate
    return module


def test_fix_whose_requires_fail_is_off_and_named_in_the_one_line(fake_vllm, caplog):
    fakes = {
        "heartbeat": fake_fix("heartbeat", [Needs(CORE, "EngineCoreProc._process_engine_step", ("self",))],
                              result="steps recorded"),
        "shutdown": fake_fix("shutdown", [Needs(LAUNCHER, "NoSignalServer.shutdown", ("self", "sockets"))]),
    }
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "heartbeat,shutdown", **NO_REPORT}, VERSION,
                                                  load=fakes.__getitem__, role="engine")
    assert got == ("heartbeat",)
    assert fakes["heartbeat"].calls == ["engine"] and fakes["shutdown"].calls == []
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    reason = check(fakes["shutdown"].REQUIRES[0])
    assert reason == f"{LAUNCHER} does not import (ModuleNotFoundError)"
    assert recs[0].getMessage() == plugin.fixes_line("engine", VERSION, ["heartbeat (steps recorded)"],
                                                     [f"shutdown ({reason})"])
    assert recs[0].getMessage().startswith(f"wedge_engine: vLLM {VERSION}, engine process (pid ")
    assert recs[0].getMessage().endswith(f"on: heartbeat (steps recorded); off: shutdown ({reason})")


def test_real_shutdown_fix_is_off_on_the_fake_tree(fake_vllm, caplog):
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "shutdown", **NO_REPORT}, VERSION,
                                                  role="api")
    assert got == ()
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    want = "; ".join(plugin.capabilities(["shutdown"])["shutdown"])
    assert recs[0].getMessage().endswith(f"off: shutdown ({want})")
    assert "on:" not in recs[0].getMessage()


def test_every_fix_off_is_still_one_warning(fake_vllm, caplog):
    fakes = {name: fake_fix(name, [Needs(LAUNCHER, "NoSignalServer")]) for name in FIXES}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "all"}, VERSION, load=fakes.__getitem__,
                                                  role="engine")
    assert got == ()
    assert all(f.calls == [] for f in fakes.values())
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    reason = f"{LAUNCHER} does not import (ModuleNotFoundError)"
    assert recs[0].getMessage().endswith("off: " + ", ".join(f"{name} ({reason})" for name in FIXES))


def test_missing_optional_is_without_and_keeps_the_fix_on(fake_vllm, caplog):
    honest = Needs(CORE, "EngineCore._initialize_kv_caches", ("self", "vllm_config"))
    fakes = {"admission": fake_fix("admission", [Needs(SCHED, "Scheduler.schedule")],
                                   [honest, Needs(SCHED, "Scheduler.update_from_output")], result="guard")}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "admission", **NO_REPORT}, VERSION,
                                                  load=fakes.__getitem__, role="engine")
    assert got == ("admission",) and fakes["admission"].calls == ["engine"]
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.INFO
    assert recs[0].getMessage().endswith(f"on: admission (guard; without {honest})")
    assert str(honest) == "vllm.v1.engine.core.EngineCore._initialize_kv_caches"


def test_admission_declares_the_honest_length_optional(fake_vllm):
    from wedge_engine.fixes import admission

    assert admission.HONEST_LEN in admission.OPTIONAL and admission.HONEST_LEN not in admission.REQUIRES
    assert check(admission.HONEST_LEN) == f"{admission.HONEST_LEN} is missing"


def test_fix_whose_activate_raises_is_off_in_the_line(fake_vllm, caplog):
    fakes = {"heartbeat": fake_fix("heartbeat", result="steps"),
             "watchdog": fake_fix("watchdog", error=AttributeError("moved"))}
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_fixes_from_environment({"WEDGE_ENGINE_FIXES": "heartbeat,watchdog", **NO_REPORT}, VERSION,
                                                  load=fakes.__getitem__, role="engine")
    assert got == ("heartbeat",)
    recs = records(caplog)
    assert [r.levelno for r in recs] == [logging.ERROR, logging.WARNING]
    assert "watchdog" in recs[0].getMessage()
    assert recs[1].getMessage().endswith("on: heartbeat (steps); off: watchdog (activation failed: AttributeError: "
                                         "moved)")


# --- faults: nothing patched where their names do not hold -------------------------------------


def test_fault_whose_requires_fail_patches_nothing_with_one_error(fake_vllm, caplog):
    from wedge_engine.faults import overhang

    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        got = plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "admission-overhang"}, VERSION)
    assert got is None and not overhang.is_active()
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.ERROR
    reasons = {check(n) for n in overhang.REQUIRES}
    assert reasons == {"vllm.v1.core.kv_cache_utils does not import (ModuleNotFoundError)"}
    assert recs[0].getMessage() == (f"wedge_engine: fault admission-overhang cannot run on vLLM {VERSION}: "
                                    f"{reasons.pop()}; patching nothing")


def test_fault_whose_requires_hold_is_activated(fake_vllm, caplog):
    from wedge_engine.faults import sessions

    sched = importlib.import_module(SCHED).Scheduler
    inherited = sched.add_request
    try:
        with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
            got = plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "stream-sessions"}, VERSION)
        assert got == "stream-sessions" and sessions.is_active()
        assert sched.add_request is not inherited
        assert [r.levelno for r in records(caplog)] == [logging.INFO]
    finally:
        sessions.deactivate()


def test_fault_with_a_wrong_signature_patches_nothing(fake_vllm, caplog):
    needs = Needs(SCHED, "Scheduler.update_from_output", ("self", "outputs"))
    fake = types.SimpleNamespace(REQUIRES=(needs,), activate=lambda env: pytest.fail("activated"),
                                 is_active=lambda: False)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        assert plugin.apply_from_environment({"WEDGE_ENGINE_FAULT": "model-stall"}, VERSION,
                                             load=lambda _n: fake) is None
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.ERROR
    assert check(needs) in recs[0].getMessage() and "takes (self, scheduler_output" in recs[0].getMessage()


def test_register_checks_and_never_raises(fake_vllm, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("WEDGE_ENGINE_FAULT", "admission-overhang")
    monkeypatch.delenv("WEDGE_ENGINE_FIXES", raising=False)
    with caplog.at_level(logging.DEBUG, logger="vllm.wedge_engine"):
        plugin.register()
    recs = records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.ERROR
    assert f"on vLLM {VERSION}:" in recs[0].getMessage()  # the version read from the (fake) vllm
    assert capability.check(Needs("vllm", "__version__")) is None
