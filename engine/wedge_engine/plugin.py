"""The vllm.general_plugins entry point: checks the vLLM version, then applies the selected fault and fixes.

vLLM calls ``register()`` in every process it starts (API server, EngineCore,
each Worker; ``vllm/plugins/__init__.py`` ``load_general_plugins``), so it is
idempotent, cheap, and never raises into vLLM: a bad setting is one log line
and nothing patched. On a vLLM version it does not know it logs one warning
and patches nothing, neither faults nor fixes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
from collections.abc import Callable, Mapping
from types import ModuleType

from wedge_engine.faults import FAULT_ENV, FAULTS, FaultConfigError, load_fault
from wedge_engine.fixes import FIXES, FixConfigError, load_fix, process_role, settings_from

# A child of vLLM's "vllm" logger, so our lines go through vLLM's handler and
# format and land in the server log next to the lines they explain.
logger = logging.getLogger("vllm.wedge_engine")

# Release series whose internals the faults (and later the fixes) were written
# against and measured on. Any other version gets a warning and no patches:
# the functions we wrap may have moved or changed meaning.
KNOWN_VLLM_SERIES: tuple[tuple[int, int], ...] = ((0, 32),)

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:[.+\-a-z]|$)", re.IGNORECASE)

_registered = False


def parse_series(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string such as '0.32.0+cpu'; None if unparsable."""
    if not version:
        return None
    m = _VERSION_RE.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_known_version(version: str | None) -> bool:
    """Whether `version` belongs to a release series in KNOWN_VLLM_SERIES."""
    return parse_series(version) in KNOWN_VLLM_SERIES


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
    """Check the version, then activate the fault `environ` selects; return its name or None.

    `load` is the seam tests use to stand in for the fault modules.
    """
    if not is_known_version(vllm_version):
        known = ", ".join(f"{a}.{b}.x" for a, b in KNOWN_VLLM_SERIES)
        logger.warning(
            "wedge_engine: vLLM %s is not a known version (known: %s); patching nothing",
            vllm_version or "(not importable)",
            known,
        )
        return None
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
        if module.is_active():
            return name
        what = module.activate(environ)
    except FaultConfigError as e:
        logger.error("wedge_engine: fault %s not activated: %s; patching nothing", name, e)
        return None
    except Exception:
        # Version check passed but vLLM's internals do not look as expected.
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
    """Activate the fixes WEDGE_ENGINE_FIXES selects that concern this process; return their names.

    The caller has checked the version (apply_from_environment logs the one
    warning); an unknown version patches nothing here either. `load` is the seam
    tests use to stand in for the fix modules.
    """
    if not is_known_version(vllm_version):
        return ()
    try:
        settings = settings_from(environ)
    except FixConfigError as e:
        logger.error("wedge_engine: %s; patching no fix", e)
        return ()
    if not settings.fixes:
        return ()
    role = role or process_role()
    applied: list[str] = []
    described: list[str] = []
    for name in FIXES:
        if name not in settings.fixes:
            continue
        try:
            module = load(name)
            what = module.activate(settings, role)
        except Exception:
            # Version check passed but vLLM's internals do not look as expected.
            logger.exception("wedge_engine: fix %s could not be activated in the %s process; it is off", name, role)
            continue
        if what:
            applied.append(name)
            described.append(f"{name} ({what})")
    if described:
        _log_fixes_active(role, "; ".join(described))
    return tuple(applied)


def _log_fixes_active(role: str, what: str) -> None:
    line = ("wedge_engine: fixes active in the %s process (pid %d): %s", role, os.getpid(), what)
    if role != "api" or logging.getLogger("vllm").handlers:
        logger.info(*line)
        return
    # The API server loads plugins while building its argument parser, before
    # vLLM configures logging (INFO would be dropped): say it once the engine client exists.
    try:
        from wedge_engine.fixes import _common

        said: list[bool] = []

        def say(_llm) -> None:
            if not said:
                said.append(True)
                logger.info(*line)

        _common.on_async_llm(say)
    except Exception:
        logger.warning(*line)


def register() -> None:
    """vLLM's general-plugin hook; runs once per process, whatever vLLM does."""
    global _registered
    if _registered:
        return
    _registered = True
    version = read_vllm_version()
    apply_from_environment(os.environ, version)
    if is_known_version(version):
        apply_fixes_from_environment(os.environ, version)
