"""Reading vLLM's Prometheus /metrics text into the few numbers the classifier needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Series the plugin in engine/ publishes (the engine heartbeat). Absent on stock vLLM.
HEARTBEAT_STEPS = "wedge_engine:steps_total"
HEARTBEAT_MODEL_STEPS = "wedge_engine:model_steps_total"
HEARTBEAT_STEP_AGE = "wedge_engine:last_step_age_seconds"
HEARTBEAT_MODEL_STEP_AGE = "wedge_engine:last_model_step_age_seconds"


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape, as {sample name: [(labels, value), ...]}."""

    samples: dict[str, tuple[tuple[dict[str, str], float], ...]] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of every sample of `name` whose labels include `labels`; None if absent."""
        rows = self.samples.get(name)
        if not rows:
            return None
        matched = [v for lab, v in rows if all(lab.get(k) == want for k, want in labels.items())]
        return sum(matched) if matched else None

    @property
    def is_vllm(self) -> bool:
        return any(name.startswith("vllm:") for name in self.samples)

    @property
    def has_heartbeat(self) -> bool:
        return HEARTBEAT_STEPS in self.samples

    # The vLLM 0.32 names (docs/hang-*.md say which move when).
    @property
    def running(self) -> float | None:
        return self.value("vllm:num_requests_running")

    @property
    def waiting(self) -> float | None:
        return self.value("vllm:num_requests_waiting")

    @property
    def waiting_capacity(self) -> float | None:
        return self.value("vllm:num_requests_waiting_by_reason", reason="capacity")

    @property
    def waiting_deferred(self) -> float | None:
        return self.value("vllm:num_requests_waiting_by_reason", reason="deferred")

    @property
    def kv_usage(self) -> float | None:
        """KV cache usage as a fraction 0..1."""
        return self.value("vllm:kv_cache_usage_perc")

    @property
    def generation_tokens(self) -> float | None:
        return self.value("vllm:generation_tokens_total")

    @property
    def prompt_tokens(self) -> float | None:
        return self.value("vllm:prompt_tokens_total")

    @property
    def preemptions(self) -> float | None:
        return self.value("vllm:num_preemptions_total")

    @property
    def requests_finished(self) -> float | None:
        return self.value("vllm:request_success_total")

    @property
    def iterations(self) -> float | None:
        """Steps that scheduled tokens: the iteration histogram's count."""
        return self.value("vllm:iteration_tokens_total_count")

    @property
    def heartbeat_steps(self) -> float | None:
        return self.value(HEARTBEAT_STEPS)

    @property
    def heartbeat_model_steps(self) -> float | None:
        return self.value(HEARTBEAT_MODEL_STEPS)

    @property
    def heartbeat_step_age(self) -> float | None:
        return self.value(HEARTBEAT_STEP_AGE)

    @property
    def heartbeat_model_step_age(self) -> float | None:
        return self.value(HEARTBEAT_MODEL_STEP_AGE)


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse exposition text; raise MetricsParseError when it is not Prometheus text.

    Cached by text: the classifier re-reads every scrape of its window on each call (a live
    sampler or `top` classifies after every sample), and a snapshot is never mutated."""
    return _parse_cached(text)


@functools.lru_cache(maxsize=256)
def _parse_cached(text: str) -> MetricsSnapshot:
    if not text.strip():
        raise MetricsParseError("empty metrics page")
    if "\x00" in text or text.lstrip().startswith("<"):
        raise MetricsParseError("the page is not Prometheus text (binary or HTML)")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError(f"the page is not Prometheus text: {exc}") from None
    if not samples:
        raise MetricsParseError("the page holds no metric samples")
    return MetricsSnapshot({k: tuple(v) for k, v in samples.items()})
