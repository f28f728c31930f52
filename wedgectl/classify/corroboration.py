"""Evidence that makes a short window certain: vLLM's own reasons for a queue, agreeing with the stacks.

A live capture stops once the verdict is certain (wedgectl/sampler.py). Counters
frozen for MIN_FROZEN_S alone could be a slow step; these predicates name the
readings that leave no other reading, so the rules may be certain without
waiting CERTAIN_FROZEN_S. Each holds only over at least MIN_FROZEN_S of scrapes.
"""

from __future__ import annotations

from wedgectl.classify.facts import MIN_FROZEN_S, Facts

EMPTY_POOL = 0.01  # KV usage (0..1) at or below this: no running request holds blocks
OUTSIDE_MODEL = 0.5  # below this share of Worker stack samples in execute_model: the Workers do not compute


def _capacity_every_scrape(f: Facts) -> bool:
    """vllm:num_requests_waiting_by_reason{reason="capacity"} >= 1 at every scrape over MIN_FROZEN_S:
    the scheduler refused the request for KV blocks each time (not deferred it, as a grammar
    compile or a remote KV transfer would)."""
    cap = f.series(lambda m: m.waiting_capacity)
    return cap.span_s >= MIN_FROZEN_S and len(cap.points) == len(f.scrapes) and all(v >= 1 for _, v in cap.points)


def wedge_refused_for_capacity(f: Facts) -> bool:
    """An admission wedge beyond doubt: every scrape shows the request refused for capacity while the
    KV pool is empty, and the Workers' stack burst sits outside execute_model. Nothing running can
    free a block, so vLLM's waiting loop (allocate_slots() returns None, then break) refuses it
    again every step; a slow step would show a Worker inside the model and blocks in use."""
    share = f.worker_model_share
    kv = [v for _, v in f.kv.points]
    return (_capacity_every_scrape(f) and bool(kv) and max(kv) <= EMPTY_POOL
            and share is not None and share < OUTSIDE_MODEL)


def starved_for_capacity(f: Facts) -> bool:
    """Starvation named by vLLM itself: every scrape over MIN_FROZEN_S shows requests waiting for
    capacity while tokens advance (the running requests hold the blocks the queue needs)."""
    return _capacity_every_scrape(f) and f.tokens_advance


__all__ = ["starved_for_capacity", "wedge_refused_for_capacity"]
