"""Bounded work on daemon threads: what diagnose, top and watch run beside their own clock.

One runner, `Workers`, serves all three: a sample's scrape, /health and stack dumps beside its
/proc reading (`run_in_background`), a burst of dumps fanned out over a few threads
(`map_bounded`), and watch's evaluations and recordings. Daemon threads, not an executor: the
interpreter joins an executor's workers at exit, so one stuck job (a py-spy past its timeout, a
scrape of a wedged server) would hold wedgectl's exit for ever; a daemon thread holds nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_ABANDONED = 16  # abandoned threads running at once, at most: past it, a stuck job keeps its slot


class Workers:
    """Jobs on daemon threads, at most `size` holding a slot at once (the watcher's CPU stays
    bounded, and a slow target does not hold the others back). A job still running after `bound_s`
    is abandoned: its slot is freed for another job while its thread runs on, up to `max_abandoned`
    such threads at once (past the cap, a stuck job keeps its slot). Daemon threads, not an
    executor: the interpreter joins an executor's workers at exit, so one stuck job would hold
    watch's exit for ever; a daemon thread holds nothing."""

    def __init__(self, size: int, bound_s: float, max_abandoned: int = MAX_ABANDONED,
                 name: str = "wedgectl-watch") -> None:
        self.size, self.bound_s, self.max_abandoned, self.name = size, bound_s, max_abandoned, name
        self._lock = threading.Lock()
        self._slots: dict[Future, float] = {}  # the jobs holding a slot -> when each started (monotonic)
        self._abandoned: set[Future] = set()
        self.abandoned_total = 0

    def submit(self, fn: Callable[..., object], *args: object) -> Future | None:
        """Start fn(*args) in a slot; None when every slot is taken."""
        with self._lock:
            self._reap(time.monotonic())
            if len(self._slots) >= self.size:
                return None
            fut: Future = Future()
            self._slots[fut] = time.monotonic()

        def run() -> None:
            result, error = None, None
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                error = exc
            with self._lock:  # the slot is free before the job shows done: the next tick finds it
                self._slots.pop(fut, None)
                self._abandoned.discard(fut)
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        try:
            threading.Thread(target=run, daemon=True, name=self.name).start()
        except RuntimeError:  # no thread to be had (the process's limit): nothing started
            with self._lock:
                self._slots.pop(fut, None)
            return None
        return fut

    def _reap(self, now: float) -> None:
        for fut, started in list(self._slots.items()):
            if now - started > self.bound_s and len(self._abandoned) < self.max_abandoned:
                del self._slots[fut]
                self._abandoned.add(fut)
                self.abandoned_total += 1

    @property
    def abandoned(self) -> int:
        with self._lock:
            return len(self._abandoned)


class Results(Future):
    """{name: result} of a set of background jobs, once all are done; abandon() gives those done so far."""

    def __init__(self, jobs: dict[str, Callable[[], object]]) -> None:
        super().__init__()
        self.jobs = tuple(jobs)
        self.got: dict[str, object] = {}
        self.lock = threading.Lock()
        self.abandoned = False

    def abandon(self) -> dict[str, object]:
        """What has come so far; what comes later is dropped (its thread ends on its own bound)."""
        with self.lock:
            self.abandoned = True
            return dict(self.got)

    def deliver(self, key: str, value: object) -> None:
        """One job's result (None for a job that raised or never started)."""
        with self.lock:
            if not self.abandoned:
                self.got[key] = value
            if len(self.got) == len(self.jobs) and not self.done():
                self.set_result(dict(self.got))


def run_in_background(jobs: dict[str, Callable[[], object]]) -> Results:
    """Run each job on its own daemon thread; the future gives {name: result} once all are done.
    A job still running when its caller stops waiting is abandoned (it ends on its own bound). The
    jobs are collectors, which never raise; a bug in one still resolves the future, with None."""
    done = Results(jobs)
    if not jobs:
        done.set_result({})
        return done
    pool = Workers(len(jobs), bound_s=float("inf"), name="wedgectl-sample")
    for key, fn in jobs.items():
        fut = pool.submit(fn)
        if fut is None:  # no thread to be had
            done.deliver(key, None)
        else:
            fut.add_done_callback(_deliver_to(done, key))
    return done


def _deliver_to(done: Results, key: str) -> Callable[[Future], None]:
    def deliver(fut: Future) -> None:
        done.deliver(key, None if fut.exception() is not None else fut.result())
    return deliver


def map_bounded(fn: Callable[[T], R], items: Sequence[T], workers: int, bound_s: float) -> dict[int, R]:
    """fn over items on at most `workers` daemon threads, for at most bound_s: {index: result} of those
    done by then. An item whose fn raised (a collector bug) gives nothing, as one not done in time."""
    results: dict[int, R] = {}
    todo = deque(enumerate(items))
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, item = todo.popleft()
            try:
                value = fn(item)
            except Exception:  # noqa: BLE001 - a collector bug: that item goes without
                continue
            with lock:
                results[i] = value

    n = min(workers, len(items))
    pool = Workers(max(n, 1), bound_s, max_abandoned=n, name="wedgectl-stacks")
    running = [f for _ in range(n) if (f := pool.submit(drain)) is not None]
    wait(running, timeout=bound_s)
    with lock:
        return dict(results)
