"""The startup-hang and orphaned-engine repro configs: what they ask of repro's machinery."""

from __future__ import annotations

from wedgectl.classify.startup import STARTUP_QUIET_RANGE, STARTUP_QUIET_S
from wedgectl.lab.repro import find_config


def test_startup_hang_waits_past_the_classifiers_deadline_without_health():
    cfg = find_config("startup-hang")
    assert cfg.expected == "startup_hang" and cfg.until == "starting"
    assert cfg.faults == ("startup-stall",) and cfg.env["WEDGE_ENGINE_FAULT_PHASE"] == "warm-up"
    # judged by a shorter start-up bound than the default, one diagnose accepts, and waited past
    assert cfg.startup_quiet_s is not None and cfg.startup_quiet_s < STARTUP_QUIET_S
    assert STARTUP_QUIET_RANGE[0] <= cfg.startup_quiet_s <= STARTUP_QUIET_RANGE[1]
    assert cfg.log_marker == "wedge_engine: startup-stall" and cfg.settle_s > cfg.startup_quiet_s
    assert cfg.timeout_s > cfg.settle_s + 120  # a loaded host takes minutes to reach the stall


def test_orphaned_engine_is_stock_vllm_and_sigkills_the_api_server():
    cfg = find_config("orphaned-engine")
    assert cfg.expected == "orphaned_engine" and cfg.env == {} and cfg.faults == ()
    assert cfg.shutdown_signal == "SIGKILL" and cfg.log_marker is None
