"""The engine's reads over the window (/proc/PID/io on the samples): bytes read as start-up progress. No I/O.

Weight loading from slow or network storage idles the CPU in reads, so CPU alone cannot tell a slow load
from a stuck one; the bytes the engine reads can. Each sample carries each process's cumulative rchar
(every read(2)-family call's bytes: page cache, pipes and sockets too) and read_bytes (what the block layer
fetched from storage: a load through mmap, as safetensors does, shows here), or None where /proc/PID/io was
not readable (another user's process without CAP_SYS_PTRACE; older bundles). Both unchanged over the
window in every engine process (EngineCore and Workers) is an engine that read nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wedgectl.classify.evidence import fmt_duration
from wedgectl.model.types import Evidence, FailureKind, ProcessSample, Role, Sample

ENGINE_ROLES = (Role.ENGINE_CORE, Role.WORKER)
_ROLE_LABELS = {Role.ENGINE_CORE: "EngineCore", Role.WORKER: "Worker"}


@dataclass(frozen=True)
class EngineReads:
    """What /proc/PID/io says of the engine's reads over the window.

    pids: the engine processes at the last sample that saw processes; unread: those of them whose io was
    read at fewer than two samples (unreadable, or too few samples), with never_readable the ones read at
    none, and denied those of them a collector was refused (permission) at some sample: another user's
    process; rchar and read_bytes: the growth over the window, summed over the pids read; span_s: the
    shortest span between a pid's first and last reading (what 'for N s' can claim)."""

    pids: tuple[int, ...] = ()
    unread: tuple[int, ...] = ()
    never_readable: tuple[int, ...] = ()
    denied: tuple[int, ...] = ()
    rchar: int = 0
    read_bytes: int = 0
    span_s: float = 0.0
    roles: tuple[tuple[int, Role], ...] = ()

    @property
    def known(self) -> bool:
        """Every engine process's io was read at two samples or more over a span of time."""
        return bool(self.pids) and not self.unread and self.span_s > 0

    @property
    def reading(self) -> bool:
        """Some engine process read bytes over the window (rchar or read_bytes grew)."""
        return self.rchar > 0 or self.read_bytes > 0

    @property
    def none_read(self) -> bool:
        """Every engine process's io was read, and neither counter moved in any of them."""
        return self.known and not self.reading

    def who(self, pids: Sequence[int]) -> str:
        roles = dict(self.roles)
        return ", ".join(f"{_ROLE_LABELS.get(roles.get(pid, Role.OTHER), 'process')} pid {pid}" for pid in pids)

    @property
    def loader(self) -> int | None:
        """The process that loads the weights: the first Worker, else the EngineCore (which runs the model
        itself before vLLM 0.23's multiprocess executor)."""
        roles = dict(self.roles)
        return next((pid for pid in self.pids if roles.get(pid) is Role.WORKER), self.pids[0] if self.pids else None)


def engine_reads(samples: Sequence[Sample]) -> EngineReads:
    """The engine's reads over the samples (see EngineReads)."""
    last: tuple[ProcessSample, ...] = next((s.processes for s in reversed(samples) if s.processes), ())
    engine = [p for p in last if p.role in ENGINE_ROLES]
    if not engine:
        return EngineReads()
    points: dict[int, list[tuple[float, int, int]]] = {p.pid: [] for p in engine}
    for s in samples:
        for p in s.processes:
            if p.pid in points and p.io_rchar is not None and p.io_read_bytes is not None:
                points[p.pid].append((s.t, p.io_rchar, p.io_read_bytes))
    unread = tuple(pid for pid, pts in points.items() if len(pts) < 2)
    read = [pts for pts in points.values() if len(pts) >= 2]
    # max - min, not last - first: a counter that went back (a hostile bundle, a pid reused) counts as moved
    rchar = sum(max(x[1] for x in pts) - min(x[1] for x in pts) for pts in read)
    read_bytes = sum(max(x[2] for x in pts) - min(x[2] for x in pts) for pts in read)
    span = min((pts[-1][0] - pts[0][0] for pts in read), default=0.0)
    never = tuple(pid for pid, pts in points.items() if not pts)
    refused = {fail.target for s in samples for fail in s.failures if fail.kind is FailureKind.PERMISSION}
    return EngineReads(tuple(points), unread, never, tuple(pid for pid in never if str(pid) in refused), rchar,
                       read_bytes, max(0.0, span), tuple((p.pid, p.role) for p in engine))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} bytes"


def reads_evidence(r: EngineReads, cores: float | None) -> Evidence | None:
    """One line on what the engine read over the window, or why that is not known; None without engine
    processes. `cores`: the engine's CPU over the window, named beside 'no bytes read'."""
    if not r.pids:
        return None
    values: dict[str, object] = {"pids": list(r.pids), "rchar": r.rchar, "read_bytes": r.read_bytes,
                                 "span_s": round(r.span_s, 1)}
    if r.none_read:
        cpu = f" and no CPU ({cores:.2f} cores)" if cores is not None else ""
        return Evidence("proc", f"no bytes read{cpu} for {fmt_duration(r.span_s)}: rchar and read_bytes "
                        f"(/proc/PID/io) unchanged in {r.who(r.pids)}", values=values)
    if r.reading:
        part = f" ({r.who(r.unread)} not read)" if r.unread else ""
        return Evidence("proc", f"the engine read {_mb(r.rchar)} (rchar) and had {_mb(r.read_bytes)} fetched from "
                        f"storage (read_bytes) over {fmt_duration(r.span_s)}: still reading{part}", values=values)
    return Evidence("wedgectl", unknown_reason(r, detail=True), values={**values, "unread": list(r.unread)})


def unknown_reason(r: EngineReads, detail: bool = False) -> str:
    """'bytes read unknown: ' and why; with detail, which processes, and what would read them."""
    if r.denied:
        return "bytes read unknown: /proc/PID/io unreadable without ptrace" + (
            f" for {r.who(r.denied)} (another user's process: it needs CAP_SYS_PTRACE or the server's own user)"
            if detail else "")
    if r.never_readable:
        return "bytes read unknown: /proc/PID/io not recorded" + (
            f" for {r.who(r.never_readable)} (a capture from before wedgectl read it, or unreadable)" if detail else "")
    if r.unread:
        return "bytes read unknown: /proc/PID/io read at one sample only" + (
            f" for {r.who(r.unread)}" if detail else "")
    return "bytes read unknown: /proc/PID/io readings span no time"


__all__ = ["EngineReads", "engine_reads", "reads_evidence", "unknown_reason"]
