"""The live rules on evidence recorded from older vLLM releases (tests/fixtures/bundles/vVERSION/, made by
`python tests/fixtures/bundles/record.py --vllm VERSION NAME ...` on that release's managed runtime).

What differs there and matters for a verdict (docs/vllm-versions.md): vLLM 0.19 runs the model inside the
EngineCore process on one rank (no Worker process), publishes no vllm:num_requests_waiting_by_reason, and
stock 0.19.1 over-advertises its context (16384 tokens on a 4-block pool), so its admission wedge needs no
fault. Its wedged busy loop sleeps 1 ms after every empty step: ~0.2 cores, which CPU alone reads as parked.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.classify import Facts, classify
from wedgectl.model.types import VerdictKind
from wedgectl.store.bundle import read_bundle

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
# Every class the repros make on every recorded release (idle, healthy and saturated, the stock shutdown hang
# and orphaned engine, and each fault repro the plugin restores there), named by the repro that recorded it.
EXPECTED = {
    "idle": VerdictKind.IDLE,
    "healthy": VerdictKind.PROGRESSING,
    "healthy-loaded": VerdictKind.PROGRESSING,
    "admission-wedge": VerdictKind.ADMISSION_WEDGE,
    "engine-deadlock": VerdictKind.ENGINE_DEADLOCK,
    "shutdown-hang": VerdictKind.SHUTDOWN_HANG,
    "starved": VerdictKind.STARVED,
    "leaked-capacity": VerdictKind.LEAKED_CAPACITY,
    "startup-hang": VerdictKind.STARTUP_HANG,
    "orphaned-engine": VerdictKind.ORPHANED_ENGINE,
}
# A hang that lives only in some releases: the deferred wedge needs the scheduler to count paused streaming
# sessions against max_num_seqs (0.26 on; `repro deferred-wedge` exits 46 before that, see its [requires]).
SINCE = {"deferred-wedge": ((0, 26), VerdictKind.ADMISSION_WEDGE)}
# What a release does differently, recorded where it showed. vLLM 0.15 runs the deferred-wedge repro's paused
# streaming sessions beside a new request (served): the two session requests stay "waiting" while the engine waits
# for input, which is no hang wedgectl can name (engine_deadlock before the engine's stack was read for it).
OTHER = {"deferred-sessions": VerdictKind.INCONCLUSIVE}
RECORDED = sorted((p.parent.name, p.name.removesuffix(".tar.gz")) for p in BUNDLES.glob("v*/*.tar.gz"))
SEED_RELEASES = {"v0.15.0", "v0.19.1", "v0.23.0", "v0.26.0", "v0.29.0"}


def release_of(name: str) -> tuple[int, int]:
    major, minor = name.removeprefix("v").split(".")[:2]
    return int(major), int(minor)


# A repro that shows nothing on a release, and why: no recording to classify.
NOT_SHOWN = {
    ("v0.29.0", "admission-wedge"): "stock 0.29 admits no request its pool cannot hold (the arithmetic was fixed in "
                                    "0.25), and the admission-overhang fault cannot restore the old one there: its "
                                    "helper _pool_bytes_per_block takes (kv_cache_groups) on 0.29-0.31 "
                                    "(docs/vllm-versions.md, fault: admission-overhang)",
}


def expected_here(release: str) -> dict[str, VerdictKind]:
    since = {name: kind for name, (first, kind) in SINCE.items() if release_of(release) >= first}
    return {name: kind for name, kind in {**EXPECTED, **since}.items() if (release, name) not in NOT_SHOWN}


def test_each_recorded_release_has_every_class():
    releases = {v for v, _ in RECORDED}
    assert SEED_RELEASES <= releases
    for release in releases:
        names = {n for v, n in RECORDED if v == release}
        assert set(expected_here(release)) <= names <= set(expected_here(release)) | set(OTHER), release


@pytest.mark.parametrize("release, name", RECORDED)
def test_recorded_bundle_of_an_older_release_gives_the_expected_verdict(release, name):
    b = read_bundle(BUNDLES / release / f"{name}.tar.gz")
    v = classify(b)
    assert v.verdict is {**expected_here(release), **OTHER}[name], v.summary
    if name in expected_here(release):
        assert b.verdict is not None and b.verdict.verdict is v.verdict  # same answer as at capture
    assert (BUNDLES / release / f"{name}.log").read_text().count(f"(v{release[1:]})") >= 1  # it is that release


def test_a_0_19_wedge_steps_at_a_fifth_of_a_core():
    b = read_bundle(BUNDLES / "v0.19.1" / "admission-wedge.tar.gz")
    f = Facts(b)
    assert f.engine_parked and f.engine_stepping  # ~0.2 cores, yet its main thread never rests
    v = classify(b)
    assert "inferred" in v.summary  # no waiting_by_reason before 0.20: said, not hidden
    assert any("num_requests_waiting_by_reason" in e.what for e in v.evidence)
    assert any("stepping all the same" in e.what for e in v.evidence)


def test_without_the_main_threads_quiet_the_0_19_wedge_reads_as_a_deadlock():
    """What the verdict leans on: take the main thread's quiet away and the 0.19 wedge is the parked
    engine it looks like by CPU alone."""
    b = read_bundle(BUNDLES / "v0.19.1" / "admission-wedge.tar.gz")
    bare = replace(b, samples=tuple(replace(s, processes=tuple(replace(p, main_quiet_s=None) for p in s.processes))
                                    for s in b.samples))
    assert not Facts(bare).engine_stepping
    assert classify(bare).verdict is VerdictKind.ENGINE_DEADLOCK


def test_a_0_19_deadlock_is_not_stepping():
    f = Facts(read_bundle(BUNDLES / "v0.19.1" / "engine-deadlock.tar.gz"))
    assert f.engine_parked and not f.engine_stepping


def test_a_0_15_engine_that_waits_for_input_is_not_deadlocked():
    """vLLM 0.15 has no waiting-by-reason gauge: two paused sessions read as 2 waiting, counters frozen and the
    engine parked. Its stack says why: the busy loop blocks on its input queue only when its scheduler has nothing
    it could step. Without that reading the same bundle is the engine_deadlock recorded at capture."""
    b = read_bundle(BUNDLES / "v0.15.0" / "deferred-sessions.tar.gz")
    f = Facts(b)
    assert f.waiting == 2 and f.running == 0 and f.engine_parked and f.engine_awaits_input
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert any("waits for requests at every sample while 2 wait" in e.what for e in v.evidence)
    assert b.verdict is not None and b.verdict.verdict is VerdictKind.ENGINE_DEADLOCK  # what it was called then
