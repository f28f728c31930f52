"""The orphaned-engine rule: the API server is gone and its EngineCore and Workers live on, holding what they held."""

from __future__ import annotations

from wedgectl.classify import confidence as C
from wedgectl.classify.enginerules import stage_evidence
from wedgectl.classify.evidence import fmt_duration
from wedgectl.classify.facts import Facts
from wedgectl.classify.rule import Rule
from wedgectl.model.types import Evidence, ProcessSample, Role, Verdict, VerdictKind

_ENGINE_ROLES = (Role.ENGINE_CORE, Role.WORKER)


def survivors(f: Facts) -> tuple[ProcessSample, ...]:
    """The deployment's processes at the last sample, EngineCore first, then Workers, then helpers."""
    order = {Role.ENGINE_CORE: 0, Role.WORKER: 1}
    return tuple(sorted(f.last_processes, key=lambda p: (order.get(p.role, 2), p.pid)))


def _top_engine(f: Facts) -> ProcessSample | None:
    """The engine process whose parent is outside the deployment: the one that lost its API server."""
    pids = {p.pid for p in f.last_processes}
    return next((p for p in survivors(f) if p.role in _ENGINE_ROLES and p.ppid not in pids), None)


def live_orphaned_engine(f: Facts) -> bool:
    """No API server, and EngineCore or Worker processes alive with no vLLM parent: the API server
    died without shutting them down (SIGKILL: the OOM killer, `kill -9`, a crashed supervisor).
    vLLM 0.32's EngineCore never watches its parent (its busy loop blocks on input_queue.get and
    its input thread on a zmq poll; its SIGTERM handler is only reached by a signal), and its
    Workers exit only when the EngineCore closes their death pipe, so nothing ends them."""
    if not f.is_live or not f.saw_processes or f.exited:
        return False
    return f.api_server is None and _top_engine(f) is not None


def _few(items, most: int = 3) -> str:
    items = list(items)
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _holds(p: ProcessSample) -> str:
    parts = ["in its exit (PF_EXITING: killed or returned, the kernel tearing it down)"] if p.exiting else []
    if p.rss_bytes is not None:
        parts.append(f"RSS {p.rss_bytes / 2**20:.0f} MiB")
    parts.append(f"listening on {_few(p.listening)}" if p.listening else "no listening port")
    parts.append("accelerator: " + ", ".join(p.devices) if p.devices
                 else "accelerator memory: not visible (no device held)")
    return "; ".join(parts)


def _orphan_verdict(f: Facts) -> Verdict:
    top = _top_engine(f)
    assert top is not None
    procs = survivors(f)
    now = f.samples[-1].t
    reparented = top.ppid <= 1
    ev = [Evidence("proc", f"no API server; {top.role.value} pid {top.pid} has parent pid {top.ppid}"
                   + (" (init: its parent died)" if reparented else " (not a vLLM API server)"),
                   values={"pid": top.pid, "ppid": top.ppid})]
    for p in procs:
        age = f", up {fmt_duration(now - p.started)}" if p.started is not None else ""
        ev.append(Evidence("proc", f"{p.role.value} pid {p.pid} ({p.name}){age}: {_holds(p)}",
                           values={"pid": p.pid, "role": p.role.value, "rss_bytes": p.rss_bytes,
                                   "listening": list(p.listening), "devices": list(p.devices)}))
    if f.engine_cores is not None:
        ev.append(Evidence("proc",
                           f"engine used {f.engine_cores:.2f} cores over the window: it waits for requests no one can "
                           "send",
                           values={"cores": round(f.engine_cores, 3)}))
    if f.engine_report is not None and (stage := stage_evidence(f, f.engine_report)) is not None:
        ev.append(stage)  # the EngineCore's own word: idle on its input queue since the API server died
    if f.log is not None and f.log.shutdown == () and f.log.n_lines:
        ev.append(Evidence("log", "the log ends without any shutdown line: the API server was killed, not stopped",
                           values={"lines": f.log.n_lines}))
    pids = [p.pid for p in procs]
    engine = [p for p in procs if p.role in _ENGINE_ROLES]
    exiting = bool(engine) and all(p.exiting for p in engine)
    rss = sum(p.rss_bytes or 0 for p in procs)
    ports = sorted({a for p in procs for a in p.listening})
    devices = sorted({d for p in procs for d in p.devices})
    held = f"{rss / 2**20:.0f} MiB RSS" + (f", {len(ports)} listening port(s) ({_few(ports)})" if ports else "") + (
        f", devices {', '.join(devices)}" if devices else "")
    facts = {"pids": pids, "rss_bytes": rss, "listening": ports, "devices": devices,
             "roles": {str(p.pid): p.role.value for p in procs}, "reparented": reparented}
    if exiting:
        # Seen: a deployment killed whole on a loaded host, its EngineCore still in state R 3 s
        # later while the kernel tore it down; read as a certain orphan before.
        return Verdict(
            VerdictKind.ORPHANED_ENGINE, C.ORPHAN_EXITING,
            f"The API server is gone and its engine process(es) (pids {' '.join(map(str, pids))}) are in their exit: "
            "a deployment being killed or stopped, torn down by the kernel. Left behind only if they stay there.",
            "live_orphaned_engine", tuple(ev),
            ("Diagnose again in a few seconds: a process in its exit ends on its own, unless the kernel cannot "
             "finish it (state D, a driver's release: `cat /proc/PID/stack` as root shows where). kill -9 "
             "changes nothing for a process already in its exit.",),
            {**facts, "exiting": True},
        )
    advice = (
        f"Kill them: kill -9 {' '.join(map(str, pids))}. Nothing else will: the EngineCore does not watch "
        "its parent and the Workers exit only when the EngineCore does.",
        "Until then a restart fails or lands on a half-occupied host: the orphans hold "
        + held + (", and the accelerator memory behind those devices." if devices else ".")
        + " Check with `nvidia-smi --query-compute-apps=pid,used_memory --format=csv` on GPU hosts.",
        "Prevent it: run the patched engine (its engine processes exit when their API server dies), or have the "
        "supervisor kill the whole process group / cgroup, not only the API server.",
    )
    return Verdict(
        VerdictKind.ORPHANED_ENGINE, C.ORPHAN_REPARENTED if reparented else C.ORPHAN_NO_API,
        f"The API server is gone; {len(procs)} engine process(es) live on (pids {' '.join(map(str, pids))}) holding "
        f"{held}.",
        "live_orphaned_engine", tuple(ev), advice, facts,
    )


ORPHAN_RULE = Rule(live_orphaned_engine, _orphan_verdict)

__all__ = ["ORPHAN_RULE", "live_orphaned_engine", "survivors"]
