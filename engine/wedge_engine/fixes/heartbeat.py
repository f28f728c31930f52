"""Engine heartbeat: prevents a stuck engine from looking healthy on /metrics.

The hang it exposes: in a spinning wedge vLLM keeps publishing gauges (every
no-op step carries scheduler stats) and in a blocked deadlock it publishes
nothing, so every vllm: series freezes at its last value; /metrics alone
cannot tell either from a quiet server, and vLLM 0.32 has no step counter.

The EngineCore records each busy-loop step in the status record
(``wedge_engine/status.py``; hook ``EngineCoreProc._process_engine_step``,
``_common.install_step_recorder``). The API server publishes it on /metrics
through a prometheus_client collector on the default registry, read at scrape
time from the shared file, never from the engine's output stream:

* ``wedge_engine:steps_total``: engine steps;
* ``wedge_engine:model_steps_total``: steps that ran the model;
* ``wedge_engine:last_step_age_seconds``, ``wedge_engine:last_model_step_age_seconds``:
  seconds since the last of each (they keep growing while the engine is blocked).

The same collector publishes ``wedge_engine:admission_rejections_total`` for
the admission fix (``publish("admission")``).

``wedgectl diagnose`` reads the first four (``wedgectl/read/metrics.py``).
With several API servers (``--api-server-count`` > 1) vLLM serves a
multiprocess registry and these series are not exposed.

Cost when nothing is wrong: one ``struct.pack_into`` per engine step.
"""

from __future__ import annotations

import logging
from typing import Any

from wedge_engine.capability import Needs
from wedge_engine.fixes import _common

logger = logging.getLogger("vllm.wedge_engine")

# What it wraps in vLLM (capability.py); the /metrics side is prometheus_client's, not vLLM's.
REQUIRES: tuple[Needs, ...] = (_common.STEP_RECORDER,)
OPTIONAL: tuple[Needs, ...] = ()

_active: set[str] = set()
_collector: Any = None


class EngineStatusCollector:
    """prometheus_client collector over the status record (read at every scrape).

    `groups` says which series it publishes: "heartbeat" (the step series) and
    "admission" (the rejection counter), one per fix that is on.
    """

    def __init__(self, read, groups: set[str]) -> None:
        self._read = read
        self.groups = groups

    def describe(self):
        """Every series it may publish, named up front (registering reads nothing). prometheus_client
        indexes a collector by these names, and its restricted page (`/metrics/?name[]=...`, what
        wedgectl's top and a watcher's cheap ticks ask for) collects only the collectors it
        indexed: one that named nothing was left out, and wedgectl took the whole page instead."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily("wedge_engine:admission_rejections", "")
        yield CounterMetricFamily("wedge_engine:steps", "")
        yield CounterMetricFamily("wedge_engine:model_steps", "")
        yield GaugeMetricFamily("wedge_engine:last_step_age_seconds", "")
        yield GaugeMetricFamily("wedge_engine:last_model_step_age_seconds", "")

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reader = self._read()
        if reader is None:
            return
        snap = reader.read()
        if "admission" in self.groups:
            yield CounterMetricFamily("wedge_engine:admission_rejections",
                                      "Requests the wedge_engine admission guard failed as unadmittable.",
                                      value=snap.admission_rejections)
        if "heartbeat" not in self.groups:
            return
        yield CounterMetricFamily("wedge_engine:steps", "EngineCore busy-loop steps (wedge_engine heartbeat).",
                                  value=snap.steps)
        yield CounterMetricFamily("wedge_engine:model_steps",
                                  "EngineCore steps that scheduled tokens and ran the model.",
                                  value=snap.model_steps)
        yield GaugeMetricFamily("wedge_engine:last_step_age_seconds",
                                "Seconds since the EngineCore last finished a step; grows while it is blocked.",
                                value=snap.last_step_age_s)
        yield GaugeMetricFamily("wedge_engine:last_model_step_age_seconds",
                                "Seconds since the EngineCore last finished a step that ran the model.",
                                value=snap.last_model_step_age_s)


def publish(group: str) -> bool:
    """Publish `group`'s series on the API server's /metrics; False if it already was."""
    global _collector
    if _collector is None:
        from prometheus_client import REGISTRY

        _collector = EngineStatusCollector(_common.status_reader, set())
        REGISTRY.register(_collector)
    if group in _collector.groups:
        return False
    _collector.groups.add(group)
    return True


def activate(settings: Any, role: str) -> str | None:
    done = []
    if role in ("api", "engine"):
        _common.ensure_status_file(role)
        if _common.install_step_recorder():
            done.append("EngineCoreProc._process_engine_step records steps")
    if role == "api" and publish("heartbeat"):
        done.append("wedge_engine:* series on /metrics")
    _active.update(done)
    return ", ".join(done) if done else None


def is_active() -> bool:
    return bool(_active)
