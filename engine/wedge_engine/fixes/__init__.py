"""The fix registry: names accepted in WEDGE_ENGINE_FIXES, their settings, and the process roles they patch.

``WEDGE_ENGINE_FIXES`` is "all" or a comma list of fix names; "-name" drops
one ("all,-watchdog"); unset, empty or "none" patches nothing. The engine
report (``report``) comes with any fix ("-report" or ``WEDGE_ENGINE_REPORT=0``
leaves it out) and runs alone with ``WEDGE_ENGINE_REPORT=1``. Each fix module
exposes ``activate(settings, role) -> str | None`` (patch what belongs to this
process, return a one-line description, or None when nothing of it runs here)
and ``is_active()``. Modules are imported only when selected.

vLLM loads the plugin in every process it starts; a fix patches only the
process roles whose code it changes:

* ``api``: the API server (uvicorn, AsyncLLM, /metrics, /health);
* ``engine``: an EngineCore (scheduler, busy loop);
* ``worker``: a model worker.

A process that runs the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
offline ``LLM``) is ``api`` and gets the engine patches too.
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

from wedge_engine._env import positive_seconds

FIXES_ENV = "WEDGE_ENGINE_FIXES"
WATCHDOG_ENV = "WEDGE_ENGINE_WATCHDOG_S"
SHUTDOWN_ENV = "WEDGE_ENGINE_SHUTDOWN_S"
HONEST_LEN_ENV = "WEDGE_ENGINE_HONEST_MAX_MODEL_LEN"
STARTUP_ENV = "WEDGE_ENGINE_STARTUP_S"
REPORT_ENV = "WEDGE_ENGINE_REPORT"
REPORT = "report"

# Application order: the status record first (the others read or count into it); the report last (its
# wrappers go on top of the others').
FIXES: dict[str, str] = {
    "heartbeat": "wedge_engine.fixes.heartbeat",
    "admission": "wedge_engine.fixes.admission",
    "watchdog": "wedge_engine.fixes.watchdog",
    "shutdown": "wedge_engine.fixes.shutdown",
    "startup": "wedge_engine.fixes.startup",
    "orphan": "wedge_engine.fixes.orphan",
    "reaper": "wedge_engine.fixes.reaper",
    REPORT: "wedge_engine.fixes.report",
}

# A model step on a healthy server takes milliseconds (seconds for a huge
# prefill on a CPU); 60 s without one while requests wait is a hang.
DEFAULT_WATCHDOG_S = 60.0
DEFAULT_SHUTDOWN_S = 10.0
# A large model loaded from network storage and compiled starts in minutes, never twenty.
DEFAULT_STARTUP_S = 1200.0


class FixConfigError(ValueError):
    """WEDGE_ENGINE_FIXES or a fix's setting is unusable; nothing was patched."""


@dataclass(frozen=True)
class FixSettings:
    """What WEDGE_ENGINE_FIXES and the per-fix variables select."""

    fixes: frozenset[str] = frozenset()
    watchdog_s: float = DEFAULT_WATCHDOG_S
    shutdown_s: float = DEFAULT_SHUTDOWN_S
    startup_s: float = DEFAULT_STARTUP_S
    # The admission guard lowers an over-advertised max_model_len; "0" keeps
    # vLLM's figure and leaves only the scheduler guard (tests of that guard).
    honest_max_model_len: bool = True

    @property
    def needs_status_record(self) -> bool:
        """The heartbeat is published from it, the watchdog reads it, the admission guard counts into it."""
        return bool(self.fixes & {"heartbeat", "watchdog", "admission"})


def parse_fixes(raw: str | None) -> tuple[frozenset[str], tuple[str, ...]]:
    """(selected fix names, unknown names) from a WEDGE_ENGINE_FIXES value."""
    chosen: set[str] = set()
    unknown: list[str] = []
    for token in (raw or "").replace(" ", ",").lower().split(","):
        token = token.strip()
        if not token or token in ("none", "off", "0"):
            continue
        drop = token.startswith("-")
        name = token[1:] if drop else token
        names = set(FIXES) if name == "all" else {name} if name in FIXES else None
        if names is None:
            unknown.append(name)
        elif drop:
            chosen -= names
        else:
            chosen |= names
    return frozenset(chosen), tuple(unknown)


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise FixConfigError(f"{name}={raw!r} is not 0 or 1")


def with_report(fixes: frozenset[str], raw: str | None, report_flag: bool | None) -> frozenset[str]:
    """`fixes` with the engine report added or taken out: on with any fix unless "-report" is listed,
    and WEDGE_ENGINE_REPORT (when set) decides either way."""
    dropped = any(t.strip() == "-" + REPORT for t in (raw or "").replace(" ", ",").lower().split(","))
    on = (bool(fixes) and not dropped) if report_flag is None else report_flag
    return fixes | {REPORT} if on else fixes - {REPORT}


def settings_from(environ: Mapping[str, str]) -> FixSettings:
    """FixSettings from the environment; FixConfigError on an unknown fix or a bad number."""
    raw = environ.get(FIXES_ENV)
    fixes, unknown = parse_fixes(raw)
    if unknown:
        raise FixConfigError(
            f"unknown {FIXES_ENV} entr{'ies' if len(unknown) > 1 else 'y'} {', '.join(map(repr, unknown))} "
            f"(known: all, {', '.join(FIXES)})"
        )
    report_flag = _flag(environ, REPORT_ENV, True) if environ.get(REPORT_ENV, "").strip() else None
    return FixSettings(
        fixes=with_report(fixes, raw, report_flag),
        watchdog_s=positive_seconds(environ, WATCHDOG_ENV, DEFAULT_WATCHDOG_S, FixConfigError),
        shutdown_s=positive_seconds(environ, SHUTDOWN_ENV, DEFAULT_SHUTDOWN_S, FixConfigError),
        startup_s=positive_seconds(environ, STARTUP_ENV, DEFAULT_STARTUP_S, FixConfigError),
        honest_max_model_len=_flag(environ, HONEST_LEN_ENV, True),
    )


def process_role(name: str | None = None) -> str:
    """'engine', 'worker' or 'api' from the multiprocessing name vLLM gives the process."""
    name = multiprocessing.current_process().name if name is None else name
    if name.startswith("EngineCore"):
        return "engine"
    if name.startswith("VllmWorker"):
        return "worker"
    return "api"


def load_fix(name: str) -> ModuleType:
    """Import the module of fix `name` (a key of FIXES)."""
    return importlib.import_module(FIXES[name])


__all__ = [
    "FIXES",
    "FIXES_ENV",
    "HONEST_LEN_ENV",
    "REPORT_ENV",
    "SHUTDOWN_ENV",
    "STARTUP_ENV",
    "WATCHDOG_ENV",
    "FixConfigError",
    "FixSettings",
    "load_fix",
    "parse_fixes",
    "process_role",
    "settings_from",
    "with_report",
]
