"""Engine reports for unit tests, built from the contract (/work/drafts/engine-report-schema.md, schema 1).

The house rule is that fakes are data recorded from real runs. The plugin's writer does not exist yet,
so these follow the schema's own example field by field; once the writer lands, record a real report
of each state (serving, a model-stage deadlock, an admission wedge, shutting_down, starting) and build
from those instead (the tests that use `schema_report` are the ones to swap).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

from wedgectl.model.engine import EngineReading, EngineReport
from wedgectl.model.types import Bundle

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


def reading(pid: int, t: float, age_s: float = 0.3, stage_age_s: float | None = None, **over: Any) -> EngineReading:
    """A reading of pid's report at unix time t, as the collector would have made it."""
    report = EngineReport.from_dict(schema_report(pid=pid, **over))
    assert report is not None
    return EngineReading(pid, t, f"/tmp/wedge-engine-reports-0/wedge-engine-{pid}.report.json", report, None,
                         age_s, stage_age_s)


def missing(pid: int, t: float, error: str = "not found: no report in /tmp/wedge-engine-reports-0") -> EngineReading:
    return EngineReading(pid, t, error=error)


def with_readings(bundle: Bundle, make) -> Bundle:  # make(sample index, sample) -> tuple of readings
    return replace(bundle, verdict=None, samples=tuple(replace(s, engine=tuple(make(i, s)))
                                                     for i, s in enumerate(bundle.samples)))
