"""Admission guard: prevents the admission wedge, a request the scheduler can never admit left waiting forever.

The hang (seed 003; vLLM 0.22-0.24 for real, ``WEDGE_ENGINE_FAULT=admission-overhang``
on 0.32): the server advertises a context larger than its KV pool can hold
for one request (block 0 is BlockPool's null block, so only ``num_blocks - 1``
blocks are allocatable). A request that fits the advertised figure but not the
pool is admitted, decodes to the end of the pool, preempts itself, and the
scheduler's waiting loop refuses it on every step after that
(``KVCacheManager.allocate_slots`` returns None, then ``break``): running 0,
waiting 1, /health 200, the client waiting forever.

Three hooks, all in vLLM 0.32's v1 engine:

* ``EngineCore._initialize_kv_caches`` (EngineCore): once the KV pool is
  sized, if ``model_config.max_model_len`` exceeds what the pool serves to one
  request, lower it to that (and tell the workers, as auto-fit does). vLLM
  sends the figure to the API server in its ready response, so the server
  advertises the honest context and its own validation refuses a longer
  request at admission with HTTP 400 ("max_tokens=110 cannot be greater than
  max_model_len=96").
* ``Scheduler.add_request`` / ``Scheduler.schedule`` (EngineCore): a request
  whose tokens so far (prompt, or prompt + output on resume) plus the
  lookahead need more blocks than are allocatable with the whole pool free is
  finished with FINISHED_ERROR at once, at admission or the first time it
  reaches the head of the waiting queue, and counted in the status record
  (``wedge_engine:admission_rejections_total``). Where the block arithmetic is
  not plain (sliding-window, mamba groups) the guard falls back to what it
  observes: the head refused on steps that scheduled nothing, with nothing
  running and the whole pool free. ``Scheduler.update_from_output`` carries
  the error to the client with a message stating blocks and tokens needed and
  allocatable.
* ``RequestOutputCollector.put`` (API server): that error output becomes a
  GracefulHTTPError(400), so the client gets HTTP 400 with the message as the
  body instead of vLLM's generic 500 "Internal server error".

Cost when nothing is wrong: one ``peek`` and one integer comparison per step
with a waiting request, one attribute test per finished output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wedge_engine.capability import AnyOf, Need, Needs, check, holds
from wedge_engine.fixes import _common
from wedge_engine.fixes._common import ERROR_MARKER, patch_method

logger = logging.getLogger("vllm.wedge_engine")

_SCHED = "vllm.v1.core.sched.scheduler"
# What it wraps and imports in vLLM (capability.py).
FULL_ATTENTION = Needs("vllm.v1.kv_cache_interface", "is_full_attention_spec", None, "plain block arithmetic")
REQUIRES: tuple[Need, ...] = (
    Needs(_SCHED, "Scheduler.add_request", ("self", "request"), "fails an unadmittable request at admission"),
    Needs(_SCHED, "Scheduler.schedule", None, "checks the head of the waiting queue"),
    Needs(_SCHED, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
          "carries the error to the client"),
    Needs(_SCHED, "Scheduler.finish_requests", None, "finishes the request with FINISHED_ERROR"),
    Needs("vllm.v1.request", "RequestStatus.WAITING", None, "which requests the guard checks"),
    Needs("vllm.v1.request", "RequestStatus.PREEMPTED", None, "which requests the guard checks"),
    Needs("vllm.v1.request", "RequestStatus.FINISHED_ERROR", None, "the rejected request's status"),
    Needs("vllm.v1.engine", "EngineCoreOutput", None, "the error output"),
    Needs("vllm.v1.engine", "EngineCoreOutputs", None, "the error output"),
    Needs("vllm.v1.engine", "FinishReason.ERROR", None, "the error output"),
    AnyOf((FULL_ATTENTION, Needs("vllm.v1.kv_cache_interface", "FullAttentionSpec")),
          "plain block arithmetic (before is_full_attention_spec: an isinstance test)"),
    Needs("vllm.v1.engine.output_processor", "RequestOutputCollector.put", ("self", "output"),
          "turns the error into HTTP 400"),
)
# The honest max_model_len, a part of its own: without it the scheduler guard still runs.
HONEST_LEN = Needs("vllm.v1.engine.core", "EngineCore._initialize_kv_caches", ("self", "vllm_config"),
                   "honest max_model_len once the KV pool is sized")
OPTIONAL: tuple[Needs, ...] = (HONEST_LEN, _common.HTTP_ERROR)

PREFIX = ERROR_MARKER + "admission:"
# Consecutive observed refusals before the fallback (non-plain block arithmetic) fails a request:
# a wedge refuses forever, ~700 steps/s on the spinning engine, so 50 costs ~0.1 s and rules out blips.
FALLBACK_REFUSALS = 50

_active: set[str] = set()
AdmissionRejected: type | None = None


@dataclass(frozen=True)
class Capacity:
    """How many blocks one request can hold: the pool less the null block, shared by every KV group."""

    num_blocks: int
    block_sizes: tuple[int, ...] | None  # one per group; None: not plain full attention

    @property
    def allocatable(self) -> int:
        return max(0, self.num_blocks - 1)

    @property
    def plain(self) -> bool:
        return bool(self.block_sizes)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of `tokens` tokens holds (every full-attention group keeps every block)."""
        assert self.block_sizes
        return sum(-(-tokens // bs) for bs in self.block_sizes)

    def max_tokens(self) -> int:
        """The longest request the whole pool holds."""
        assert self.block_sizes
        lo, hi = 0, self.allocatable * max(self.block_sizes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid) <= self.allocatable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        if not self.block_sizes:
            return f"{self.allocatable} allocatable of {self.num_blocks} blocks"
        sizes = sorted(set(self.block_sizes))
        bs = f"{sizes[0]} tokens" if len(sizes) == 1 else f"{'/'.join(map(str, sizes))} tokens"
        groups = f" across {len(self.block_sizes)} KV groups" if len(self.block_sizes) > 1 else ""
        return (f"{self.allocatable} blocks allocatable ({self.num_blocks} in the pool, one is the null "
                f"block; block size {bs}{groups}) = {self.max_tokens()} tokens")


def _full_attention_test() -> Callable[[Any], bool]:
    """vLLM's is_full_attention_spec (0.29 on: it also sees through UniformTypeKVCacheSpecs); before it, an
    isinstance test of FullAttentionSpec, which is what those releases' own code asks."""
    if holds(FULL_ATTENTION):
        from vllm.v1.kv_cache_interface import is_full_attention_spec

        return is_full_attention_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return lambda spec: isinstance(spec, FullAttentionSpec)


def capacity_from(kv_cache_config: Any, num_blocks: int | None = None, context_parallel: int = 1) -> Capacity:
    """Capacity of a vLLM KVCacheConfig; plain only when every group is full attention.

    With context parallelism a scheduler block holds block_size x cp tokens;
    that arithmetic is left to the observing fallback (not plain).
    """
    is_full_attention_spec = _full_attention_test()
    groups = [g for g in kv_cache_config.kv_cache_groups if not getattr(g, "host_resident", False)]
    blocks = kv_cache_config.num_blocks if num_blocks is None else num_blocks
    if context_parallel == 1 and groups and all(is_full_attention_spec(g.kv_cache_spec) for g in groups):
        return Capacity(blocks, tuple(int(g.kv_cache_spec.block_size) for g in groups))
    return Capacity(blocks, None)


def capacity_of_manager(kv_cache_manager: Any) -> Capacity:
    """Capacity from the scheduler's KVCacheManager: its per-group managers' block sizes are the ones it
    allocates by."""
    is_full_attention_spec = _full_attention_test()
    blocks = kv_cache_manager.block_pool.num_gpu_blocks
    managers = kv_cache_manager.coordinator.single_type_managers
    if managers and all(is_full_attention_spec(m.kv_cache_spec) for m in managers):
        return Capacity(blocks, tuple(int(m.block_size) for m in managers))
    return Capacity(blocks, None)


def _context_parallel(vllm_config: Any) -> int:
    pc = getattr(vllm_config, "parallel_config", None)
    return max(int(getattr(pc, "decode_context_parallel_size", 1) or 1),
               int(getattr(pc, "prefill_context_parallel_size", 1) or 1))


# ------------------------------------------------------------------ honest max_model_len


def honest_max_model_len(advertised: int, cap: Capacity) -> int | None:
    """The figure to advertise instead of `advertised`, or None when it is already servable."""
    if not cap.plain:
        return None
    servable = cap.max_tokens()
    return servable if 0 < servable < advertised else None


def _patch_initialize_kv_caches() -> bool:
    from vllm.v1.engine.core import EngineCore

    def make(original):
        def _initialize_kv_caches(self, vllm_config):
            result = original(self, vllm_config)
            try:
                _make_advertised_len_honest(self, vllm_config, _kv_cache_config_of(result))
            except Exception:
                logger.exception("wedge_engine admission: could not check the advertised max_model_len")
            return result

        return _initialize_kv_caches

    return patch_method(EngineCore, "_initialize_kv_caches", make)


def _kv_cache_config_of(result: Any) -> Any:
    """What EngineCore._initialize_kv_caches returned: the KVCacheConfig (0.19 on), or in older releases (0.15)
    the tuple (num_gpu_blocks, num_cpu_blocks, KVCacheConfig); None when neither."""
    if isinstance(result, tuple):
        return next((x for x in result if hasattr(x, "kv_cache_groups")), None)
    return result if hasattr(result, "kv_cache_groups") else None


def _make_advertised_len_honest(engine: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return
    cap = capacity_from(kv_cache_config, context_parallel=_context_parallel(vllm_config))
    advertised = vllm_config.model_config.max_model_len
    honest = honest_max_model_len(advertised, cap)
    if honest is None:
        return
    logger.warning(
        "wedge_engine admission: max_model_len %d is more than the KV pool holds for one request "
        "(%s); advertising max_model_len=%d, so longer requests are refused at admission",
        advertised, cap.describe(), honest,
    )
    vllm_config.model_config.max_model_len = honest
    writer = _common.status_writer()
    if writer is not None:  # for an API server whose vLLM does not take the figure from the engine
        writer.set_max_model_len(honest)
    try:
        engine.collective_rpc("update_max_model_len", args=(honest,))
    except Exception as exc:  # workers keep the larger figure: harmless, the scheduler enforces the smaller
        logger.warning("wedge_engine admission: workers not told the new max_model_len: %s", exc)


def adopt_honest_len(llm: Any) -> int | None:
    """In the API server, once its AsyncLLM is up (the engine has sized its pool by then): advertise the
    engine's honest max_model_len where this vLLM left the API server with the larger figure. vLLM 0.32 sends
    the figure in the engine's ready response; 0.19 syncs only its workers, so the server goes on accepting
    requests the pool can never hold, and they end cut short instead of refused. Returns the figure adopted."""
    reader = _common.status_reader()
    honest = reader.max_model_len() if reader is not None else None
    config = getattr(llm, "model_config", None)
    current = getattr(config, "max_model_len", None)
    if honest is None or not isinstance(current, int) or honest >= current:
        return None
    config.max_model_len = honest
    vllm_config = getattr(llm, "vllm_config", None)
    if vllm_config is not None and getattr(vllm_config, "model_config", None) is not config:
        vllm_config.model_config.max_model_len = honest
    logger.warning("wedge_engine admission: the engine serves at most %d tokens to one request; this API "
                   "server advertised %d and now advertises max_model_len=%d, so longer requests are refused "
                   "at admission", honest, current, honest)
    return honest


# ------------------------------------------------------------------ the scheduler guard


def _capacity_of(scheduler: Any) -> Capacity:
    cap = scheduler.__dict__.get("_wedge_capacity")
    if cap is None:
        try:
            cap = capacity_of_manager(scheduler.kv_cache_manager)
        except AttributeError:  # a scheduler without the coordinator layout: read its config
            cap = capacity_from(scheduler.kv_cache_config, scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
                                _context_parallel(getattr(scheduler, "vllm_config", None)))
        scheduler._wedge_capacity = cap
    return cap


def unadmittable_reason(request: Any, cap: Capacity, lookahead: int) -> str | None:
    """Why `request` can never be scheduled with this pool (blocks, tokens); None when it can."""
    if not cap.plain:
        return None
    tokens = int(request.num_tokens) + int(lookahead)
    need = cap.blocks_for(tokens)
    if need <= cap.allocatable:
        return None
    prompt = int(getattr(request, "num_prompt_tokens", request.num_tokens))
    generated = int(request.num_tokens) - prompt
    parts = [f"{prompt} prompt"]
    if generated:
        parts.append(f"{generated} generated")
    if lookahead:
        parts.append(f"{lookahead} lookahead")
    return (f"the request needs {need} KV-cache blocks for {tokens} tokens ({' + '.join(parts)}) but only "
            f"{cap.describe()} even with the whole pool free, so it can never be scheduled; "
            f"send a shorter prompt or lower max_tokens, or serve with a larger KV cache")


def _reject(scheduler: Any, request: Any, reason: str) -> None:
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus

    rid = request.request_id
    scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)
    pending = scheduler.__dict__.setdefault("_wedge_pending_errors", [])
    pending.append((request.client_index, EngineCoreOutput(
        request_id=rid,
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        stop_reason=PREFIX + reason,
        events=request.take_events(),
        trace_headers=getattr(request, "trace_headers", None),
    )))
    writer = _common.status_writer()
    if writer is not None:
        writer.count_admission_rejection()
    logger.warning("wedge_engine admission: failing request %s: %s", rid, reason)


# The statuses of a request the waiting loop would try to allocate for; set when the scheduler is patched.
_WAITING_STATES: tuple = ()


def _check_waiting_head(scheduler: Any) -> None:
    cap = scheduler.__dict__.get("_wedge_capacity") or _capacity_of(scheduler)
    for _ in range(8):  # a few unadmittable heads in a row, then the next step
        waiting = scheduler.waiting
        if not waiting:
            return
        head = waiting.peek_request()
        if cap.plain:
            # A waiting request's size does not change: check each (request, size) once.
            key = (head.request_id, head.num_tokens)
            if scheduler.__dict__.get("_wedge_checked") == key or head.status not in _WAITING_STATES:
                return
            reason = unadmittable_reason(head, cap, getattr(scheduler, "num_lookahead_tokens", 0) or 0)
            if reason is None:
                scheduler._wedge_checked = key
                return
        else:
            if head.status not in _WAITING_STATES:
                return
            reason = _observed_refusal_reason(scheduler, head, cap)
            if reason is None:
                return
        _reject(scheduler, head, reason)


def _observed_refusal_reason(scheduler: Any, head: Any, cap: Capacity) -> str | None:
    seen = scheduler.__dict__.get("_wedge_refusals")
    if not seen or seen[0] != head.request_id or seen[1] < FALLBACK_REFUSALS:
        return None
    return (f"the request ({head.num_tokens} tokens) was refused {seen[1]} steps in a row with nothing else "
            f"running and the whole KV pool free ({cap.describe()}), so it can never be scheduled; send a "
            f"shorter prompt or lower max_tokens, or serve with a larger KV cache")


def _note_refusal(scheduler: Any, output: Any) -> None:
    """Fallback bookkeeping: the head was refused although the pool was entirely free."""
    waiting = scheduler.waiting
    if (output.total_num_scheduled_tokens or scheduler.running or not waiting
            or getattr(scheduler, "connector", None) is not None):
        scheduler.__dict__.pop("_wedge_refusals", None)
        return
    pool = scheduler.kv_cache_manager.block_pool
    pause = getattr(scheduler, "_pause_state", None)
    if pool.get_num_free_blocks() < pool.num_gpu_blocks - 1 or (pause is not None and pause.name != "UNPAUSED"):
        scheduler.__dict__.pop("_wedge_refusals", None)
        return
    head = waiting.peek_request()
    seen = scheduler.__dict__.get("_wedge_refusals")
    count = seen[1] + 1 if seen and seen[0] == head.request_id else 1
    scheduler._wedge_refusals = (head.request_id, count)


def _patch_scheduler() -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    global _WAITING_STATES
    _WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def make_add(original):
        def add_request(self, request):
            original(self, request)
            cap = _capacity_of(self)
            if cap.plain and request.status == RequestStatus.WAITING:
                reason = unadmittable_reason(request, cap, getattr(self, "num_lookahead_tokens", 0) or 0)
                if reason is not None:
                    _reject(self, request, reason)

        return add_request

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            if self.waiting:
                _check_waiting_head(self)
            out = original(self, *args, **kwargs)
            cap = self.__dict__.get("_wedge_capacity")
            if cap is not None and not cap.plain:
                _note_refusal(self, out)
            return out

        return schedule

    def make_update(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            outputs = original(self, scheduler_output, model_runner_output)
            pending = self.__dict__.get("_wedge_pending_errors")
            if pending:
                _attach_pending(outputs, pending)
            return outputs

        return update_from_output

    a = patch_method(Scheduler, "add_request", make_add)
    b = patch_method(Scheduler, "schedule", make_schedule)
    c = patch_method(Scheduler, "update_from_output", make_update)
    return a or b or c


def _attach_pending(outputs: dict, pending: list) -> None:
    from vllm.v1.engine import EngineCoreOutputs

    for client_index, out in pending:
        eco = outputs.get(client_index)
        if eco is None:
            outputs[client_index] = EngineCoreOutputs(outputs=[out])
        else:
            eco.outputs.append(out)
    pending.clear()


# ------------------------------------------------------------------ API server: the HTTP error


def rejection_message(output: Any) -> str | None:
    """The guard's message when a finished RequestOutput is its error; None otherwise."""
    for completion in getattr(output, "outputs", None) or ():
        reason = getattr(completion, "stop_reason", None)
        if (getattr(completion, "finish_reason", None) == "error" and isinstance(reason, str)
                and reason.startswith(PREFIX)):
            return "Request rejected by the wedge_engine admission guard: " + reason[len(PREFIX):]
    return None


def _patch_output_collector() -> bool:
    from vllm.v1.engine.output_processor import RequestOutputCollector

    global AdmissionRejected
    if AdmissionRejected is None:
        AdmissionRejected = _common.http_error_class("AdmissionRejected", 400)
    error_class = AdmissionRejected

    def make(original):
        def put(self, output):
            if getattr(output, "finished", False) and not isinstance(output, BaseException):
                message = rejection_message(output)
                if message is not None:
                    output = error_class(message)
            return original(self, output)

        return put

    return patch_method(RequestOutputCollector, "put", make)


# ------------------------------------------------------------------ activation


def activate(settings: Any, role: str) -> str | None:
    """Patch what runs in `role`; return what was patched, or None when nothing of the guard runs here."""
    done = []
    if role in ("api", "engine"):
        _common.ensure_status_file(role)
        if settings.honest_max_model_len and check(HONEST_LEN) is None and _patch_initialize_kv_caches():
            done.append("EngineCore._initialize_kv_caches")
        if _patch_scheduler():
            done.append("Scheduler.add_request/schedule/update_from_output")
    if role == "api":
        if settings.honest_max_model_len:
            _common.on_async_llm(adopt_honest_len)
        if _patch_output_collector():
            done.append("RequestOutputCollector.put")
        from wedge_engine.fixes import heartbeat

        if heartbeat.publish("admission"):
            done.append("wedge_engine:admission_rejections_total on /metrics")
    _active.update(done)
    return ", ".join(done) if done else None


def is_active() -> bool:
    return bool(_active)

