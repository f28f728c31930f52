"""Evidence that makes a short window certain: vLLM's own reasons for a queue, agreeing with the stacks.

A live capture stops once the verdict is certain (wedgectl/capture/window.py). Counters
frozen for MIN_FROZEN_S alone could be a slow step; these predicates name the
readings that leave no other reading, so the rules may be certain without
waiting CERTAIN_FROZEN_S. Each holds only over at least MIN_FROZEN_S of scrapes, but
for the capacity-refused wedge, whose reading no healthy server gives even once a second.
"""

from __future__ import annotations

from wedgectl.classify.facts import MIN_FROZEN_S, SHORT_SPAN_S, Facts

EMPTY_POOL = 0.01  # KV usage (0..1) at or below this: no running request holds blocks
OUTSIDE_MODEL = 0.5  # below this share of Worker stack samples in execute_model: the Workers do not compute


def _capacity_every_scrape(f: Facts, span_s: float = MIN_FROZEN_S) -> bool:
    """vllm:num_requests_waiting_by_reason{reason="capacity"} >= 1 at every scrape over span_s:
    the scheduler refused the request for KV blocks each time (not deferred it, as a grammar
    compile or a remote KV transfer would)."""
    cap = f.series(lambda m: m.waiting_capacity)
    return cap.span_s >= span_s and len(cap.points) == len(f.scrapes) and all(v >= 1 for _, v in cap.points)


def wedge_refused_for_capacity(f: Facts) -> bool:
    """An admission wedge beyond doubt, on two scrapes about a second apart (SHORT_SPAN_S): each
    shows the request refused for capacity, nothing running and the KV pool empty, the generation
    counter did not move between them, and the Workers' stack burst sits outside execute_model.
    With nothing running, no block is held for another request and none can be freed: a request
    that fits would have been admitted on the next step (milliseconds) and counted its first
    token, so vLLM's waiting loop (allocate_slots() returns None, then break) refuses it every
    step. A slow step would show a request running, blocks in use and a Worker inside the model.
    The same reading with deferred sessions needs MIN_FROZEN_S of scrapes."""
    share = f.worker_model_share
    kv = [v for _, v in f.kv.points]
    running = [v for _, v in f.series(lambda m: m.running).points]
    # Sessions deferred for their client's next input hold their slots by design until it comes: a
    # pause of a second is theirs to take, so with any deferred the window must be MIN_FROZEN_S.
    deferred = any(v for _, v in f.series(lambda m: m.waiting_deferred).points)
    span = MIN_FROZEN_S if deferred else SHORT_SPAN_S
    return (_capacity_every_scrape(f, span) and f.gen_tokens.delta == 0
            and bool(kv) and max(kv) <= EMPTY_POOL and bool(running) and max(running) == 0
            and share is not None and share < OUTSIDE_MODEL)


def starved_for_capacity(f: Facts) -> bool:
    """Starvation named by vLLM itself: every scrape over MIN_FROZEN_S shows requests waiting for
    capacity while tokens advance (the running requests hold the blocks the queue needs)."""
    return _capacity_every_scrape(f) and f.tokens_advance


__all__ = ["starved_for_capacity", "wedge_refused_for_capacity"]
