"""Engine reports for unit tests.

The house rule is that fakes are data recorded from real runs: `reading` builds on a real EngineCore report
(a vLLM 0.32 repro's, recorded as nobody: tests/fixtures/bundles/unprivileged/), with the fields a test is
about put in its place. `schema_report` is the contract's own example (docs/bundle.md), for the reader's
tests of the schema itself.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

from pathlib import Path

from wedgectl.model.engine import EngineReading, EngineReport
from wedgectl.model.types import Bundle
from wedgectl.store.bundle import read_bundle

# The schema's example, as written in the contract (comments dropped).
SCHEMA_EXAMPLE: dict[str, Any] = {
    "schema": 1,
    "pid": 1234,
    "proc_start_ticks": 987654,
    "role": "engine_core",
    "vllm": "0.32.0",
    "seq": 17,
    "written_mono_ns": 123,
    "written_unix": 1733500000.123,
    "interval_s": 1.0,
    "stage": {"name": "execute_model_wait", "since_mono_ns": 100, "phase": None},
    "steps": 1234,
    "model_steps": 1200,
    "last_model_step_mono_ns": 99,
    "scheduler": {
        "running": 1,
        "waiting": 14,
        "waiting_by_reason": {"capacity": 14, "deferred": 0},
        "paused": False,
        "kv_blocks": {"free": 3, "total": 4, "block_size": 16},
    },
    "requests_total": 15,
    "requests": [
        {"id": "cmpl-abc-0", "state": "waiting", "age_s": 12.3, "prompt_tokens": 5, "output_tokens": 0,
         "blocks_held": 0, "blocks_needed": 5, "client_connected": None},
    ],
    "rank": None,
    "stacks": None,
}


def schema_report(**over: Any) -> dict[str, Any]:
    """The schema's example with top-level keys replaced (a dict value replaces the whole key)."""
    out = copy.deepcopy(SCHEMA_EXAMPLE)
    out.update(over)
    return out


def report_bytes(**over: Any) -> bytes:
    return json.dumps(schema_report(**over)).encode()


def _recorded_engine_core() -> dict[str, Any]:
    """A real EngineCore report: the one a `repro leaked-capacity` server (vLLM 0.32) wrote, as read by nobody
    (tests/fixtures/bundles/unprivileged/leaked-capacity.tar.gz), without its stacks and history."""
    bundle = read_bundle(Path(__file__).parent / "fixtures" / "bundles" / "unprivileged" / "leaked-capacity.tar.gz")
    found = next(r.report for s in reversed(bundle.samples) for r in s.engine
                 if r.report is not None and r.report.role == "engine_core")
    return {**found.to_dict(), "stacks": None, "history": None}  # a test gives the state its own history


RECORDED_ENGINE_CORE: dict[str, Any] = _recorded_engine_core()


def recorded_report(**over: Any) -> dict[str, Any]:
    """The recorded EngineCore report with top-level keys replaced (a dict value replaces the whole key)."""
    out = copy.deepcopy(RECORDED_ENGINE_CORE)
    out.update(over)
    return out


def reading(pid: int, t: float, age_s: float = 0.3, stage_age_s: float | None = None, **over: Any) -> EngineReading:
    """A reading of pid's report at unix time t, as the collector would have made it: the recorded EngineCore
    report, with what the test says in its place."""
    report = EngineReport.from_dict(recorded_report(pid=pid, **over))
    assert report is not None
    return EngineReading(pid, t, f"/tmp/wedge-engine-reports-0/wedge-engine-{pid}.report.json", report, None,
                         age_s, stage_age_s)


def missing(pid: int, t: float, error: str = "not found: no report in /tmp/wedge-engine-reports-0") -> EngineReading:
    return EngineReading(pid, t, error=error)


def with_readings(bundle: Bundle, make) -> Bundle:  # make(sample index, sample) -> tuple of readings
    return replace(bundle, verdict=None, samples=tuple(replace(s, engine=tuple(make(i, s)))
                                                     for i, s in enumerate(bundle.samples)))
