"""The capture's names as they were before it was cut into modules, for the callers that have not moved yet.

Each name now lives in the module of its one concern: options, policy, tree, bursts, sample,
probing, window (capture.*) and collect.priority. Import from there; this module goes once no
caller is left.
"""

from __future__ import annotations

from wedgectl.capture.options import ESCALATE_BURST, SamplerOptions
from wedgectl.capture.policy import CERTAIN, engine_stepping, next_step, stacks_cannot_help
from wedgectl.capture.probing import start_probes as _start_probes
from wedgectl.capture.probing import with_probes as _with_probes
from wedgectl.capture.sample import take_sample
from wedgectl.capture.tree import TreeCache
from wedgectl.capture.window import EXITED_NOTE, capture, fatal_problem
from wedgectl.capture.window import summarise as _summarise
from wedgectl.collect.priority import (
    NICE,
    lower_priority,
    raise_priority,
    restore_priority,
    restore_priority_if_starved,
)

__all__ = ["CERTAIN", "ESCALATE_BURST", "EXITED_NOTE", "NICE", "SamplerOptions", "TreeCache", "_start_probes",
           "_summarise", "_with_probes", "capture", "engine_stepping", "fatal_problem", "lower_priority", "next_step",
           "raise_priority", "restore_priority", "restore_priority_if_starved", "stacks_cannot_help", "take_sample"]
