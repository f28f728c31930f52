"""The vllm.general_plugins entry point: applies the selected fault and fixes that the running vLLM can carry.

vLLM calls ``register()`` in every process it starts (API server, EngineCore,
each Worker; ``vllm/plugins/__init__.py`` ``load_general_plugins``), so it is
idempotent, cheap, and never raises into vLLM: a bad setting is one log line
and nothing patched.

There is no version gate. Each fix and fault module declares the vLLM names it
relies on (``REQUIRES``, and ``OPTIONAL`` for parts it leaves out where they
are absent; see ``capability.py``); they are checked in this process before the
module is activated. A fault whose names do not hold patches nothing (one error
line); a fix whose names do not hold is off, the others still apply, and one
line per process says which fixes are on and which are off, and why.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

from wedge_engine import capability
from wedge_engine.faults import FAULT_ENV, FAULTS, FaultConfigError, load_fault
from wedge_engine.fixes import FIXES, FixConfigError, load_fix, process_role, settings_from

# A child of vLLM's "vllm" logger, so our lines go through vLLM's handler and
# format and land in the server log next to the lines they explain.
logger = logging.getLogger("vllm.wedge_engine")

_registered = False


def _problems(module: ModuleType) -> list[str]:
    """What of `module`'s REQUIRES does not hold here, each line once (several names share a module)."""
    return list(dict.fromkeys(capability.problems(getattr(module, "REQUIRES", ()))))


def _missing_optional(module: ModuleType) -> list[str]:
    """The OPTIONAL names of `module` that do not hold here (the parts it runs without)."""
    return [str(n) for n in getattr(module, "OPTIONAL", ()) if capability.check(n) is not None]


def capabilities(names: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Fix or fault name -> what of its REQUIRES does not hold in this process (empty: it runs here).

    `names` defaults to every fix, then every fault; an unknown name is a KeyError.
    Imports the vLLM modules the declarations name.
    """
    chosen = [*FIXES, *FAULTS] if names is None else list(names)
    out: dict[str, list[str]] = {}
    for name in chosen:
        if name in FIXES:
            load, module_name = load_fix, FIXES[name]
        elif name in FAULTS:
            load, module_name = load_fault, FAULTS[name]
        else:
            raise KeyError(f"{name!r} is neither a fix ({', '.join(FIXES)}) nor a fault ({', '.join(FAULTS)})")
        try:
            module = load(name)
        except Exception as exc:
            out[name] = [f"{module_name} does not import ({type(exc).__name__})"]
            continue
        out[name] = _problems(module)
    return out


def read_vllm_version() -> str | None:
    """The running vLLM's version; None when vLLM is not importable."""
    try:
        from vllm import __version__
    except Exception:  # ImportError, or a broken install: treat as unknown
        return None
    return str(__version__)


def selected_fault(environ: Mapping[str, str]) -> str | None:
    """The fault named by WEDGE_ENGINE_FAULT, normalised; None when unset or blank."""
    raw = environ.get(FAULT_ENV, "").strip().lower()
    return raw or None


def apply_from_environment(
    environ: Mapping[str, str],
    vllm_version: str | None,
    load: Callable[[str], ModuleType] = load_fault,
) -> str | None:
    """Activate the fault `environ` selects if this vLLM has what it wraps; return its name or None.

    `vllm_version` is for the log line only. `load` is the seam tests use to stand in for the fault modules.
    """
    name = selected_fault(environ)
    if name is None:
        return None
    if name not in FAULTS:
        logger.error(
            "wedge_engine: unknown %s=%r (known: %s); patching nothing",
            FAULT_ENV,
            environ.get(FAULT_ENV),
            ", ".join(sorted(FAULTS)),
        )
        return None
    try:
        module = load(name)
        missing = _problems(module)
        if missing:
            logger.error(
                "wedge_engine: fault %s cannot run on vLLM %s: %s; patching nothing",
                name,
                vllm_version or "(not importable)",
                "; ".join(missing),
            )
            return None
        if module.is_active():
            return name
        what = module.activate(environ)
    except FaultConfigError as e:
        logger.error("wedge_engine: fault %s not activated: %s; patching nothing", name, e)
        return None
    except Exception:
        # Its names are there but vLLM's internals do not behave as expected.
        logger.exception("wedge_engine: fault %s could not be activated; patching nothing", name)
        return None
    logger.info(
        "wedge_engine: fault %s active in %s (pid %d), for repros only: %s",
        name,
        multiprocessing.current_process().name,
        os.getpid(),
        what,
    )
    return name


def apply_fixes_from_environment(
    environ: Mapping[str, str],
    vllm_version: str | None,
    load: Callable[[str], ModuleType] = load_fix,
    role: str | None = None,
) -> tuple[str, ...]:
    """Activate the fixes WEDGE_ENGINE_FIXES selects that this vLLM can carry; return the names that are on.

    A fix whose REQUIRES do not hold here is off; a missing OPTIONAL name is a
    part it runs without. Then one line for this process names what is on and
    what is off, and why (WARNING when a selected fix is off). `vllm_version` is
    for that line only; `load` is the seam tests use to stand in for the fix modules.
    """
    try:
        settings = settings_from(environ)
    except FixConfigError as e:
        logger.error("wedge_engine: %s; patching no fix", e)
        return ()
    if not settings.fixes:
        return ()
    role = role or process_role()
    applied: list[str] = []
    on: list[str] = []
    off: list[str] = []
    for name in FIXES:
        if name not in settings.fixes:
            continue
        try:
            module = load(name)
            missing = _problems(module)
            without = _missing_optional(module) if not missing else []
        except Exception as exc:
            logger.exception("wedge_engine: fix %s could not be checked in the %s process; it is off", name, role)
            off.append(f"{name} (could not be checked: {type(exc).__name__})")
            continue
        if missing:
            off.append(f"{name} ({'; '.join(missing)})")
            continue
        try:
            what = module.activate(settings, role)
        except Exception as exc:
            # Its names are there but vLLM's internals do not behave as expected.
            logger.exception("wedge_engine: fix %s could not be activated in the %s process; it is off", name, role)
            off.append(f"{name} (activation failed: {type(exc).__name__}: {exc})")
            continue
        if what:
            applied.append(name)
            on.append(f"{name} ({what}{'; without ' + ', '.join(without) if without else ''})")
    if on or off:
        _log_fixes(role, vllm_version, on, off)
    return tuple(applied)


def fixes_line(role: str, vllm_version: str | None, on: list[str], off: list[str], pid: int | None = None) -> str:
    """The one line a process logs about its fixes: the names in brackets first (what `wedgectl swap` reads
    back from the new server's log), then each with what it patched, or why it is off."""
    parts = []
    if on:
        parts.append("on: " + ", ".join(on))
    if off:
        parts.append("off: " + ", ".join(off))
    names = f"[on={','.join(e.split(' ', 1)[0] for e in on)} off={','.join(e.split(' ', 1)[0] for e in off)}]"
    return (f"wedge_engine: vLLM {vllm_version or '(not importable)'}, {role} process "
            f"(pid {os.getpid() if pid is None else pid}) {names}: {'; '.join(parts)}")


def _log_fixes(role: str, vllm_version: str | None, on: list[str], off: list[str]) -> None:
    line = fixes_line(role, vllm_version, on, off)
    if off:  # a selected fix that does not run: say it now (WARNING passes before vLLM configures logging)
        logger.warning("%s", line)
        return
    if role != "api" or logging.getLogger("vllm").handlers:
        logger.info("%s", line)
        return
    # The API server loads plugins while building its argument parser, before
    # vLLM configures logging (INFO would be dropped): say it once the engine client exists.
    try:
        from wedge_engine.fixes import _common

        said: list[bool] = []

        def say(_llm) -> None:
            if not said:
                said.append(True)
                logger.info("%s", line)

        _common.on_async_llm(say)
    except Exception:
        logger.warning("%s", line)


def register() -> None:
    """vLLM's general-plugin hook; runs once per process, whatever vLLM does, and never raises into it."""
    global _registered
    if _registered:
        return
    _registered = True
    version = read_vllm_version()
    for what, apply in (("fault", apply_from_environment), ("fixes", apply_fixes_from_environment)):
        try:
            apply(os.environ, version)
        except Exception:  # a bug of ours must not stop vLLM from starting
            logger.exception("wedge_engine: applying the %s failed; what it had not patched stays unpatched", what)
