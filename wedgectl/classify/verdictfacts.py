"""The facts a verdict carries in its JSON (`facts`), one set per class whichever rule decided it: the
metrics' reading of a wedge or a deadlock, or the engine's own report. A consumer of `diagnose --json` reads
the same keys either way; the report's rules add theirs (`source`, `stage`, `request`, ...). No I/O."""

from __future__ import annotations

from wedgectl.classify.deferred import waiting_reason
from wedgectl.classify.facts import Facts


def wedge_facts(f: Facts) -> dict[str, object]:
    """The facts an admission-wedge verdict carries in its JSON, whichever rule decided it."""
    m = f.last_metrics
    return {"frozen_s": round(f.tokens_frozen_s, 2), "engine_cores": f.engine_cores, "waiting": f.waiting,
            "worker_model_share": f.worker_model_share,
            "kv_usage_pct": None if m is None else round((m.kv_usage or 0) * 100, 2),
            "waiting_capacity": None if m is None else m.waiting_capacity,
            "waiting_deferred": None if m is None else m.waiting_deferred,
            "reason": None if m is None else waiting_reason(m)}


def deadlock_facts(f: Facts) -> dict[str, object]:
    """The facts an engine-deadlock verdict carries in its JSON, whichever rule decided it."""
    return {"frozen_s": round(f.tokens_frozen_s, 2), "engine_cores": f.engine_cores, "running": f.running,
            "waiting": f.waiting, "worker_model_share": f.worker_model_share}
