"""Stack dumps of a deployment: a burst of the engine's processes, fanned out over a few daemon threads."""

from __future__ import annotations

import time

from wedgectl.capture.runner import map_bounded
from wedgectl.collect import processes, pyspy
from wedgectl.model.types import CollectorFailure, FailureKind, ProcessSample, Role, StackDump

BURST_GAP_S = 0.03
DUMP_TIMEOUT_S = 5.0  # pyspy.dump_stacks' own timeout for one non-native dump


def dump_burst(pid: int, native: bool, repeats: int) -> list[StackDump]:
    """Up to `repeats` good dumps of one pid, BURST_GAP_S apart. A non-blocking read of a busy
    process sometimes races its interpreter ("Failed to get stack traces": 6 % of the dumps of a
    vLLM Worker serving 4 streams, measured, and back to back now and then), so a failed dump
    is retried (2 x repeats + 2 attempts at most: a single dump gets four tries); failures are
    kept only if nothing succeeded."""
    good: list[StackDump] = []
    failed: list[StackDump] = []
    for attempt in range(2 * repeats + 2):
        d = pyspy.dump_stacks(pid, native=native, nonblocking=not native)
        (good if d.error is None else failed).append(d)
        if len(good) >= repeats or (d.error is not None and not d.error.startswith(("error", "bad_data"))):
            break  # done, or a failure that will not go away (permission, missing tool, gone)
        time.sleep(BURST_GAP_S)
    return good or failed[-1:]


def collect_stacks(procs: tuple[ProcessSample, ...], native: bool, burst: int = 1,
                    others: bool = False) -> tuple[tuple[StackDump, ...], list[CollectorFailure]]:
    """One dump of every Python process; or a burst of `burst` dumps of the EngineCore and Workers
    only (a single snapshot of a loop says little about where it spends its time), with one dump
    of each other Python process too when `others` (the first sample took none). multiprocessing's
    helpers (the resource tracker) are never dumped: a py-spy run each, and nothing of the server's
    runs there."""
    targets = [p for p in procs if (p.role != Role.OTHER or "python" in p.name.lower())
               and not processes.is_mp_helper(p.cmdline)]
    if burst > 1 and not others:  # a burst asks where the engine spends its time; the first sample dumped the rest
        targets = [p for p in targets if p.role in (Role.ENGINE_CORE, Role.WORKER)] or targets
    if not targets:
        return (), []
    def run(p: ProcessSample) -> list[StackDump]:
        n = burst if p.role in (Role.ENGINE_CORE, Role.WORKER) else 1
        return dump_burst(p.pid, native, n)
    got = map_bounded(run, targets, workers=4, bound_s=stacks_bound_s(burst, native, len(targets)))
    late = f"{FailureKind.TIMEOUT.value}: no dump within the bound"
    dumps = tuple(d for i, p in enumerate(targets)
                  for d in got.get(i) or [StackDump(p.pid, time.time(), native, error=late)])
    failures = list({(f.collector, f.target,
                      f.message): f for d in dumps if (f := pyspy.stack_failure(d)) is not None}.values())
    return dumps, failures


def stacks_bound_s(burst: int, native: bool, n: int = 1) -> float:
    """The longest collect_stacks may take: every py-spy attempt of a burst (dump_burst) at its
    own timeout, for n processes on 4 threads, and a margin. Past it the dumps are abandoned."""
    attempts = 2 * max(burst, 1) + 2
    one = pyspy.NATIVE_TIMEOUT_S if native else DUMP_TIMEOUT_S
    return attempts * (one + BURST_GAP_S) * -(-max(n, 1) // 4) + 5.0
