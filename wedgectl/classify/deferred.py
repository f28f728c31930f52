"""Why an admission wedge's requests wait: for KV capacity, or behind deferred requests that keep their slots."""

from __future__ import annotations

from wedgectl.read.metrics import MetricsSnapshot
from wedgectl.model.types import ProcessSample

CAPACITY = "capacity"
DEFERRED = "deferred"

DEFERRED_ADVICE = (
    "Deferred requests (paused streaming-input sessions, requests waiting on a KV transfer) keep their "
    "model-runner slots: once running + deferred reach --max-num-seqs nothing is admitted. End or abort "
    "the idle sessions (or restart), and raise --max-num-seqs above the sessions you hold open.",
    "Give streaming-input clients an idle timeout that closes their session.",
)


def waiting_reason(m: MetricsSnapshot) -> str:
    """`deferred` when vLLM reports deferred waiting requests: they hold slots and are the cause
    (vLLM 0.32's waiting loop counts paused sessions against max_num_seqs); else `capacity`."""
    return DEFERRED if (m.waiting_deferred or 0) >= 1 else CAPACITY


def max_num_seqs(api: ProcessSample | None) -> int | None:
    """--max-num-seqs from the API server's command line; None when it is not given there."""
    argv = list(api.cmdline) if api is not None else []
    for i, arg in enumerate(argv):
        if arg == "--max-num-seqs" and i + 1 < len(argv) and argv[i + 1].isdigit():
            return int(argv[i + 1])
        if arg.startswith("--max-num-seqs=") and arg.split("=", 1)[1].isdigit():
            return int(arg.split("=", 1)[1])
    return None


def reason_text(m: MetricsSnapshot, api: ProcessSample | None) -> str:
    """The waiting breakdown as evidence text: '(1 for capacity, 2 deferred holding slots: 0 running
    + 2 deferred = --max-num-seqs 2)'."""
    parts = []
    if m.waiting_capacity:
        parts.append(f"{m.waiting_capacity:.0f} for capacity")
    if m.waiting_deferred:
        held = (m.running or 0) + m.waiting_deferred
        cap = max_num_seqs(api)
        slots = f": {m.running or 0:.0f} running + {m.waiting_deferred:.0f} deferred" + (
            f" = --max-num-seqs {cap}" if cap is not None and held >= cap else f" = {held:.0f} slots held")
        parts.append(f"{m.waiting_deferred:.0f} deferred holding slots{slots}")
    return f" ({', '.join(parts)})" if parts else ""
