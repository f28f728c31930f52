"""The fault registry: names accepted in WEDGE_ENGINE_FAULT and the modules that apply them.

Every fault exists only to reproduce a hang class on a real vLLM server for
``wedgectl repro``; none belongs in a production deployment. Each module
exposes ``activate(environ) -> str`` (patch, return a one-line description,
raise ``FaultConfigError`` before patching anything if its settings are bad),
``deactivate()`` and ``is_active()``. Modules are imported only when their
fault is selected, so an inert run never imports vLLM internals from here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAULT_ENV = "WEDGE_ENGINE_FAULT"

FAULTS: dict[str, str] = {
    "admission-overhang": "wedge_engine.faults.overhang",
    "lost-abort": "wedge_engine.faults.lostabort",
    "stream-sessions": "wedge_engine.faults.sessions",
    "model-stall": "wedge_engine.faults.stall",
    "runaway-hold": "wedge_engine.faults.runaway",
    "startup-stall": "wedge_engine.faults.startstall",
    "collective-hold": "wedge_engine.faults.collective",
}


class FaultConfigError(ValueError):
    """A fault's settings (its environment variables) are unusable; nothing was patched."""


def load_fault(name: str) -> ModuleType:
    """Import the module that applies fault `name` (a key of FAULTS)."""
    return importlib.import_module(FAULTS[name])


__all__ = ["FAULTS", "FAULT_ENV", "FaultConfigError", "load_fault"]
