"""What the engine reports on the samples say, for the classifier: each process's latest reading, the engine
core's stage and since when, whether its report is fresh, its steps over the window (or over the history a
report carries of its writer's last writes, where that spans longer). No I/O.

Pure: it reads Sample.engine (model/engine.py) and the samples' process roles, and touches no process. A
report is the engine's own word, trusted as far as /metrics is: it says what the engine believes, from a
thread that runs beside the main one, so it keeps speaking while that thread is blocked, and stops (goes
stale) only when no Python runs in the process.
"""

from __future__ import annotations

from collections.abc import Sequence

from wedgectl.model.engine import NOT_FOUND, EngineReading
from wedgectl.model.types import Role, Sample

_ROLE_BY_NAME = {"api_server": Role.API_SERVER, "engine_core": Role.ENGINE_CORE, "worker": Role.WORKER}
ROLE_LABELS = {Role.ENGINE_CORE: "EngineCore", Role.WORKER: "Worker", Role.API_SERVER: "API server",
               Role.OTHER: "process"}


def looked(samples: Sequence[Sample]) -> bool:
    """The capture looked for engine reports (bundles from before them never did)."""
    return any(s.engine for s in samples)


def latest_readings(samples: Sequence[Sample]) -> dict[int, EngineReading]:
    """Each pid's latest reading over the window (a report that vanished reads as its reason)."""
    out: dict[int, EngineReading] = {}
    for s in samples:
        for r in s.engine:
            out[r.pid] = r
    return out


def process_roles(samples: Sequence[Sample]) -> dict[int, Role]:
    roles: dict[int, Role] = {}
    for s in samples:
        for p in s.processes:
            roles[p.pid] = p.role
    return roles


def role_of(reading: EngineReading, roles: dict[int, Role]) -> Role:
    """A reading's role: the process table's, else the one its report names."""
    if reading.pid in roles:
        return roles[reading.pid]
    return _ROLE_BY_NAME.get(reading.report.role, Role.OTHER) if reading.report is not None else Role.OTHER


def engine_core_reading(samples: Sequence[Sample]) -> EngineReading | None:
    """The EngineCore's latest reading that holds a report (the first EngineCore's, with data parallel)."""
    roles = process_roles(samples)
    found = [r for r in latest_readings(samples).values() if r.report is not None
             and role_of(r, roles) == Role.ENGINE_CORE]
    return min(found, key=lambda r: r.pid) if found else None


def steps_over_window(samples: Sequence[Sample], pid: int,
                      history_since_ns: int | None = 0) -> tuple[int, int, float] | None:
    """(first steps, last steps, seconds between) of pid's step count: over its fresh reports in the window, or
    over the history its latest fresh report carries (its writer's last writes) where the window has fewer than
    two or the history spans longer, so one reading can show the engine stepping. Only history written at or
    after `history_since_ns` counts (None: none does). None with fewer than two points, or a counter that went
    back (a restarted process's)."""
    points: list[tuple[int, int]] = []  # (written_mono_ns, steps)
    latest = None
    for s in samples:
        for r in s.engine:
            rep = r.report
            if r.pid == pid and rep is not None and r.fresh and rep.steps is not None:
                latest = rep
                if not points or rep.written_mono_ns > points[-1][0]:
                    points.append((rep.written_mono_ns, rep.steps))
    if latest is not None and history_since_ns is not None:
        history = [p for p in latest.step_history if p[0] >= history_since_ns]
        if len(history) >= 2 and (len(points) < 2 or history[-1][0] - history[0][0] > points[-1][0] - points[0][0]):
            points = history
    if len(points) < 2 or points[-1][1] < points[0][1]:
        return None
    return points[0][1], points[-1][1], (points[-1][0] - points[0][0]) / 1e9


def stale_readings(samples: Sequence[Sample]) -> tuple[EngineReading, ...]:
    """Reports not rewritten for STALE_INTERVALS periods whose process was alive at the last sample that
    saw processes: no Python runs in them (not even the writer's thread)."""
    alive: set[int] = set()
    for s in reversed(samples):
        if s.processes:
            alive = {p.pid for p in s.processes}
            break
    return tuple(r for r in latest_readings(samples).values() if r.stale and r.pid in alive)


def missing_readings(samples: Sequence[Sample]) -> tuple[EngineReading, ...]:
    """The latest readings that hold no report, when none of the window's does."""
    latest = latest_readings(samples)
    if any(r.report is not None for r in latest.values()):
        return ()
    return tuple(latest.values())


def ptrace_refused(samples: Sequence[Sample]) -> tuple[str, ...]:
    """The pids py-spy was refused ptrace access to (permission), in the order first seen."""
    pids: dict[str, None] = {}
    for s in samples:
        for fail in s.failures:
            if fail.collector == "pyspy" and fail.kind.value == "permission":
                pids[fail.target] = None
    return tuple(pids)


def reason_summary(readings: Sequence[EngineReading]) -> str:
    """The readings' reasons in a few words: 'not found' once, others by pid."""
    parts: list[str] = []
    for r in readings:
        text = NOT_FOUND if r.problem == NOT_FOUND else f"pid {r.pid}: {r.error}"
        if text not in parts:
            parts.append(text)
    return "; ".join(parts[:3]) + ("; ..." if len(parts) > 3 else "")
