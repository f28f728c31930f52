"""A live capture overrules its log's past: a server whose /metrics shows no request held is not wedged or
deadlocked because its log's last stats lines (from a hang that has ended) say so. Recorded bundles, vLLM 0.32."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.classify import classify
from wedgectl.model.types import VerdictKind
from wedgectl.store.bundle import read_bundle
from wedgectl.store.sources import bundle_from_log

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


@pytest.mark.parametrize("log, past", [("admission-wedge", VerdictKind.ADMISSION_WEDGE),
                                       ("engine-deadlock", VerdictKind.ENGINE_DEADLOCK)])
def test_an_idle_servers_first_look_is_not_its_logs_past_hang(log, past):
    idle = read_bundle(BUNDLES / "idle.tar.gz")
    old = bundle_from_log(BUNDLES / f"{log}.log")
    # the log alone, read when the idle server was looked at, says the hang
    assert classify(replace(old, manifest=replace(old.manifest, created=idle.samples[0].t))).verdict is past
    # watch's first look at the server after the hang ended: one sample, 0 running and 0 waiting, that log
    first = replace(idle, samples=idle.samples[:1], log_lines=old.log_lines)
    assert first.samples[0].metrics is not None and first.samples[0].metrics.ok
    assert classify(first).verdict is not past
    assert classify(replace(idle, log_lines=old.log_lines)).verdict is VerdictKind.IDLE  # the next looks: idle


def test_a_live_server_holding_requests_still_gets_the_logs_verdict():
    wedge = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    assert classify(wedge).verdict is VerdictKind.ADMISSION_WEDGE
