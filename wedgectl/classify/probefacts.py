"""What the probe results on the samples say, for the classifier: parked and spinning main threads, as evidence.

Pure: it reads Sample.probes (a ProbeResult, then one ThreadProbe per thread)
and the samples' process roles, and touches no process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from wedgectl.model.types import Evidence, ProbeResult, Role, Sample, ThreadProbe

ROLE_LABELS = {Role.ENGINE_CORE: "EngineCore", Role.WORKER: "Worker", Role.API_SERVER: "API server",
               Role.OTHER: "process"}
_ROLE_ORDER = {Role.ENGINE_CORE: 0, Role.WORKER: 1, Role.API_SERVER: 2, Role.OTHER: 3}


def probe_header(samples: Sequence[Sample]) -> ProbeResult | None:
    """The header of the latest probe run on the samples."""
    for s in reversed(samples):
        for r in s.probes:
            if isinstance(r, ProbeResult):
                return r
    return None


def probe_threads(samples: Sequence[Sample]) -> list[ThreadProbe]:
    """The per-thread results of the latest sample that carries probe results."""
    for s in reversed(samples):
        threads = [r for r in s.probes if isinstance(r, ThreadProbe)]
        if threads:
            return threads
    return []


def _roles(samples: Sequence[Sample]) -> dict[int, Role]:
    roles: dict[int, Role] = {}
    for s in samples:
        for p in s.processes:
            roles[p.pid] = p.role
    return roles


def parked_threads(samples: Sequence[Sample], min_s: float | None = None, main_only: bool = True
                   ) -> list[tuple[ThreadProbe, Role]]:
    """Threads in a futex wait that lasted the whole window (or min_s) with no wake on that address.

    main_only: only each process's main thread (tid == pid): vLLM's EngineCore
    busy loop and the Worker's execute loop run there; pools of idle helper
    threads park forever in a healthy server too.
    """
    roles = _roles(samples)
    out = []
    for t in probe_threads(samples):
        if t.futex_addr is None or t.wait_s is None or (main_only and not t.is_main):
            continue
        need = min_s if min_s is not None else max(1.0, 0.9 * t.window_s)
        if t.wait_s >= need and not t.wakes_on_addr:
            out.append((t, roles.get(t.pid, Role.OTHER)))
    out.sort(key=lambda tr: (_ROLE_ORDER[tr[1]], -(tr[0].wait_s or 0), tr[0].tid))
    return out


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def probe_evidence(samples: Sequence[Sample], most: int = 4) -> list[Evidence]:
    """Evidence lines from the probe results: which main threads sat parked on one futex with no wake
    on that address, which ones spun on the CPU, and which back-end measured it."""
    header = probe_header(samples)
    threads = probe_threads(samples)
    if header is None and not threads:
        return []
    roles = _roles(samples)
    out: list[Evidence] = []
    for t, role in parked_threads(samples)[:most]:
        who = f"{ROLE_LABELS[role]} main thread" if t.is_main else f"{ROLE_LABELS[role]} thread {t.comm}"
        if t.wakes_on_addr is None and t.wait_source in ("sched", "tracepoint"):
            # it has not run since the wait began (its last run, or a switch-out the program saw): not woken
            wake = f"not woken for {t.wait_s:.0f} s (wake calls not traced: {t.backend})"
        elif t.wakes_on_addr is None:
            wake = f"wakes not traced ({t.backend})"
        else:
            wake = f"no wake on that address in the {t.window_s:.1f} s window"
        out.append(Evidence(
            source="probe",
            what=f"{who} (tid {t.tid}) parked {t.wait_s:.0f} s on one futex ({t.futex_addr:#x}), {wake}",
            t=_iso(t.wait_started),
            values={"tid": t.tid, "pid": t.pid, "comm": t.comm, "role": role.value,
                    "futex_addr": hex(t.futex_addr or 0), "wait_s": round(t.wait_s or 0, 1),
                    "wait_source": t.wait_source, "parked_throughout": t.parked_throughout,
                    "wakes_on_addr": t.wakes_on_addr, "oncpu_s": t.oncpu_s, "backend": t.backend},
        ))
    spinning = [t for t in threads if t.is_main and t.oncpu_s is not None and t.window_s > 0
                and t.oncpu_s >= 0.8 * t.window_s]
    for t in sorted(spinning, key=lambda t: (_ROLE_ORDER[roles.get(t.pid, Role.OTHER)], -(t.oncpu_s or 0)))[:2]:
        role = roles.get(t.pid, Role.OTHER)
        out.append(Evidence(
            source="probe",
            what=f"{ROLE_LABELS[role]} main thread (tid {t.tid}) on the CPU {100 * (t.oncpu_s or 0) / t.window_s:.0f}% "
                 f"of the {t.window_s:.1f} s window, {t.waits if t.waits is not None else '?'} futex waits: spinning, "
                 "not parked",
            values={"tid": t.tid, "pid": t.pid, "role": role.value, "oncpu_s": t.oncpu_s, "offcpu_s": t.offcpu_s,
                    "runq_s": t.runq_s, "waits": t.waits, "backend": t.backend},
        ))
    if header is not None:
        out.append(Evidence(
            source="probe",
            what=f"probes: {header.backend} over {header.window_s:.1f} s on pids {list(header.pids)}",
            values={"backend": header.backend, "reason": header.reason, "threads": len(threads),
                    "parked_main_threads": len(parked_threads(samples))},
        ))
    return out


__all__ = ["ROLE_LABELS", "parked_threads", "probe_evidence", "probe_header", "probe_threads"]
