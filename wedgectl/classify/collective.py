"""Ranks and the collective hang: where each Worker of a parallel deployment is, which rank lags, and the rules
that name it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from wedgectl.read import stacks as stk
from wedgectl.classify.evidence import (counter_evidence, fmt_duration, log_stamp, message, metrics_evidence, present,
                                        stepless_evidence)
from wedgectl.classify.facts import MIN_FROZEN_S, PARKED_CORES, SPINNING_CORES, Facts
from wedgectl.classify.enginerules import requests_evidence, stage_evidence
from wedgectl.classify.rankreports import rank_report_evidence
from wedgectl.classify.rule import Rule
from wedgectl.model import engine as E
from wedgectl.model.types import Bundle, Evidence, ProcessSample, Role, StackDump, Verdict, VerdictKind

# How sure a collective_hang is (the scale of confidence.py).
# Ranks split, the waiting ones in a named collective frame (Python or native), counters frozen.
COLLECTIVE_NAMED = 0.95
# Ranks split by the CPU contrast alone: one spinning in place inside a compiled graph, one parked
# before it; the Python stack names no collective (torch.compile inlined it).
COLLECTIVE_CONTRAST = 0.85
# Every rank inside the collective, none lagging on the host: the fabric, the library or a kernel.
COLLECTIVE_ALL_INSIDE = 0.8
# The log's RPC timeout: a step that never completed on some rank for VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS.
STEP_TIMEOUT_LOG = 0.9

# The kind of a rank placed by its own report (no stacks): in a step, no collective its Python opened.
REPORTED_STEP = "in a step (by its report)"

# A main thread seen runnable (state R) in at least this share of the samples spins, however
# little CPU a loaded host gives it; a thread parked in a wait is S in every sample.
RUNNABLE_SHARE = 0.5

# The executor's world is laid out PP-major, then PCP, then TP (vllm/distributed/parallel_state.py
# initialize_model_parallel); DP ranks run separate executors, DCP and EP subdivide the TP group.
_WORLD_DIMS = ("PP", "PCP", "TP")
# "(Worker_TP1 pid=25065)": vLLM's log prefix names each worker by the same title.
_LOG_WORKER = re.compile(r"\(Worker((?:_[A-Z]+\d+)+) pid=(\d+)\)")
_RANK_PART = re.compile(r"_([A-Z]+)(\d+)")
# vllm/v1/executor/multiproc_executor.py collective_rpc: TimeoutError(f"RPC call to {method} timed out.")
_RPC_TIMEOUT = re.compile(r"RPC call to (\w+) timed out")


@dataclass(frozen=True)
class RankView:
    """One Worker of the deployment: its place in the parallel groups, its CPU and where its stack is."""

    pid: int
    label: str  # "TP1", "PP0_TP1"; "pid N" when no title names its rank
    rank: int | None  # its rank in the executor's world (PP, PCP, TP); None when untitled
    parallel: dict[str, int]
    device: str  # "cuda:3" (the device node it holds), "cpu" with none
    state: str  # the process state letter at the last sample
    cpu_cores: float | None  # mean cores over the window (a --native-dumped one: its fastest interval)
    group: str  # stacks.INSIDE / BEFORE / ELSEWHERE
    kind: str  # stacks.KIND_*: what its innermost telling frame is
    frame: str  # that frame
    stuck: bool | None  # its innermost Python frame stayed put across the burst (None: fewer than 2 dumps)
    dumps: int
    native: bool
    inferred: str = ""  # why INSIDE was inferred without a collective frame
    frames: tuple[str, ...] = field(default_factory=tuple)  # the main thread's frames, innermost first
    running_share: float | None = None  # share of samples that saw its main thread runnable (state R)

    @property
    def spinning(self) -> bool:
        """Burning CPU, or runnable in most samples: on a loaded host a spinning thread gets a sliver of
        a core yet stays runnable, where a parked one sleeps."""
        on_cpu = self.cpu_cores is not None and self.cpu_cores >= SPINNING_CORES
        return on_cpu or (self.running_share is not None and self.running_share >= RUNNABLE_SHARE)

    @property
    def parked(self) -> bool:
        asleep = self.running_share is None or self.running_share < RUNNABLE_SHARE
        return self.cpu_cores is not None and self.cpu_cores <= PARKED_CORES and asleep

    @property
    def summary(self) -> dict[str, object]:
        """One rank of `--json`'s `ranks`."""
        return {"rank": self.rank, "label": self.label, "pid": self.pid, "role": Role.WORKER.value,
                "device": self.device, "state": self.state,
                "cpu_cores": None if self.cpu_cores is None else round(self.cpu_cores, 3),
                "where": self.group, "kind": self.kind, "frame": self.frame, "stuck": self.stuck,
                "dumps": self.dumps, "native": self.native, "inferred": self.inferred or None,
                "runnable_share": None if self.running_share is None else round(self.running_share, 2),
                "stack": list(self.frames[:8])}


def device_of(p: ProcessSample) -> str:
    """The accelerator a Worker holds open: /dev/nvidia3 -> "cuda:3" (the physical index, whatever
    CUDA_VISIBLE_DEVICES renumbers), /dev/accel/accel0 -> "accel:0"; "cpu" when it holds none."""
    nodes = getattr(p, "devices", ())  # the device nodes collect.processes reads (a newer field)
    for node in nodes:
        m = re.fullmatch(r"/dev/nvidia(\d+)", node) or re.fullmatch(r"/dev/(?:accel/accel|davinci)(\d+)", node)
        if m:
            return ("cuda:" if "nvidia" in node else "accel:") + m.group(1)
    if any(n.startswith(("/dev/dri/render", "/dev/kfd")) for n in nodes):
        return "gpu"
    return "cpu"


def _titles_from_log(lines: Sequence[str]) -> dict[int, dict[str, int]]:
    """pid -> ranks, from the log's "(Worker_TP1 pid=N)" prefixes: for workers whose title py-spy or
    /proc could not read (no setproctitle, a cut comm)."""
    out: dict[int, dict[str, int]] = {}
    for line in lines:
        m = _LOG_WORKER.search(line)
        if m:
            out.setdefault(int(m.group(2)), {k: int(v) for k, v in _RANK_PART.findall(m.group(1))})
    return out


def _world_ranks(parallel: Sequence[dict[str, int]]) -> list[int | None]:
    """Each worker's rank in its executor's world, sizing each dimension by the ranks seen."""
    sizes = {d: max((p.get(d, 0) for p in parallel), default=0) + 1 for d in _WORLD_DIMS}
    out: list[int | None] = []
    for p in parallel:
        if not p:
            out.append(None)
            continue
        r = 0
        for d in _WORLD_DIMS:
            r = r * sizes[d] + p.get(d, 0)
        out.append(r)
    return out


def _position(dumps: Sequence[StackDump]) -> tuple[str, str, str, bool | None, tuple[str, ...]]:
    """(group, kind, frame, stuck, frames) of a Worker's main thread over a burst of dumps: the last
    dump says where; the innermost Python frame staying put across all of them says stuck."""
    threads = [stk.main_thread(d) for d in dumps]
    keys = {stk.frame_key(t) for t in threads}
    stuck = None if len(threads) < 2 else (len(keys) == 1 and None not in keys)
    # A native dump names more (shm_allreduce, cudaStreamSynchronize): prefer the last native one.
    best = next((t for d, t in zip(reversed(dumps), reversed(threads)) if d.native and t),
                threads[-1] if threads else None)
    group, kind, frame = stk.rank_position(best)
    return group, kind, frame, stuck, tuple(stk.frame_names(best)) if best else ()


def rank_views(f: Facts) -> tuple[RankView, ...]:
    """Every Worker at the last sample, in rank order, with where its main thread is. A rank spinning
    in place inside a compiled graph while another sits parked before it is INSIDE its collective:
    torch.compile inlines the all-reduce into the graph, so the Python stack names only a generated
    file, and vLLM's CPU all-reduce (shm_allreduce) and the GPU host waits spin there, while a
    forward pass of compute would move on within the burst and finish within a step."""
    workers = f.workers
    if not workers:
        return ()
    cpu = _unpaused_cores(f)
    from_log = _titles_from_log(f.bundle.log_lines) if any(not p.parallel_rank for p in workers) else {}
    parallel = [p.parallel_rank or from_log.get(p.pid, {}) for p in workers]
    ranks = _world_ranks(parallel)
    views = []
    for p, par, rank in zip(workers, parallel, ranks):
        dumps = f.stack_burst(p.pid)
        group, kind, frame, stuck, frames = _position(dumps) if dumps else _reported_position(f, p.pid)
        label = "_".join(f"{k}{v}" for k, v in par.items()) or f"pid {p.pid}"
        views.append(RankView(p.pid, label, rank, par, device_of(p), p.state, cpu.get(p.pid), group, kind, frame,
                              stuck, len(dumps), any(d.native for d in dumps), frames=frames,
                              running_share=_runnable_share(f, p.pid)))
    views = _infer_inside(views)
    return tuple(sorted(views, key=lambda v: (v.rank is None, v.rank if v.rank is not None else v.pid)))


PEAK_SPAN_S = 0.5  # the shortest interval between two samples whose CPU rate counts (clock ticks are 10 ms)


def _unpaused_cores(f: Facts) -> dict[int, float]:
    """Each Worker's cores over the window; for one that `--native` dumped, its fastest interval between two
    samples instead, where that is more: py-spy --native stops the process for each dump (seconds, on a loaded
    host), so its mean undercounts a rank that spins while it runs, and read parked, the spin-wait that tells
    the rank waiting inside the collective from the one that never came is lost (an engine deadlock said)."""
    cpu = f.cpu_by_pid(Role.WORKER)
    paused = {d.pid for s in f.samples for d in s.stacks if d.native}
    if not paused:
        return cpu
    series: dict[int, list[tuple[float, float]]] = {}
    for t, p in f.processes_with_role(Role.WORKER):
        if p.pid in paused:
            series.setdefault(p.pid, []).append((t, p.cpu_s))
    for pid, pts in series.items():
        rates = [(c2 - c1) / (t2 - t1) for (t1, c1), (t2, c2) in zip(pts, pts[1:]) if t2 - t1 >= PEAK_SPAN_S]
        if rates and max(rates) > cpu.get(pid, 0.0):
            cpu[pid] = max(rates)
    return cpu


def _reported_position(f: Facts, pid: int) -> tuple[str, str, str, bool | None, tuple[str, ...]]:
    """Where a rank is by its own report, where no stack of it was read (no ptrace): fresh and in a step
    (stage execute_model) for MIN_FROZEN_S, it is INSIDE the collective its report says it is inside (a
    collective frame's equivalent, stuck while it lasts), else BEFORE it (in the model, outside any collective
    its Python opened); anything else says nothing (ELSEWHERE), as a rank with no stacks did before."""
    r = f.engine_readings.get(pid)
    rep = r.report if r is not None else None
    if r is None or rep is None or not r.fresh or rep.stage_name != E.EXECUTE_MODEL or (r.stage_age_s or 0.0) < \
            MIN_FROZEN_S:
        return stk.ELSEWHERE, stk.KIND_UNKNOWN, "", None, ()
    c = rep.rank.collective if rep.rank is not None else None
    if c is not None and c.inside:
        what = f"{c.op}" + (f" #{c.seq}" if c.seq is not None else "") + (f" on {c.group}" if c.group else "")
        return stk.INSIDE, stk.KIND_COLLECTIVE, f"{what} (its own report)", True, ()
    step = f"execute_model for {fmt_duration(r.stage_age_s or 0.0)}, no collective open"
    return stk.BEFORE, REPORTED_STEP, step, None, ()


def _runnable_share(f: Facts, pid: int) -> float | None:
    """The share of samples in which the process's main thread (tid == pid) was runnable."""
    states = [t.state for s in f.samples for p in s.processes if p.pid == pid for t in p.threads if t.tid == pid]
    return sum(1 for st in states if st == "R") / len(states) if states else None


def _infer_inside(views: list[RankView]) -> list[RankView]:
    """Compiled graphs: the CPU contrast decides which rank waits inside (see rank_views). Ranks placed by
    their reports alone (REPORTED_STEP: in a step, no Python collective open) are judged the same way: the one
    spinning in place waits in a collective its graph inlined, the parked one never came to it."""
    reported = all(v.kind == REPORTED_STEP for v in views if v.group == stk.BEFORE)
    parked_before = [v for v in views if v.group == stk.BEFORE and v.kind != stk.KIND_COMPILED and v.parked]
    if not parked_before:
        return views
    out = []
    for v in views:
        compiled = v.kind == stk.KIND_COMPILED or (reported and v.kind == REPORTED_STEP and v not in parked_before)
        if v.group == stk.BEFORE and compiled and v.spinning and v.stuck is not False:
            who = ", ".join(p.label for p in parked_before)
            if v.kind == REPORTED_STEP:
                v = replace(v, frame=f"a collective inlined in its compiled graph (its own report: {v.frame})")
            v = replace(v, group=stk.INSIDE, inferred=f"spinning ({_cpu_text(v)}) in place inside a compiled graph "
                                                     f"while {who} sleeps before it: the graph's inlined collective "
                                                     "spin-waits")
        out.append(v)
    return out


def _cpu_text(v: RankView) -> str:
    cpu = "? cores" if v.cpu_cores is None else f"{v.cpu_cores:.2f} cores"
    return cpu if v.running_share is None else f"{cpu}, runnable in {v.running_share:.0%} of samples"


# ------------------------------------------------------------------ GPU-side signatures


NEVER_ARRIVED = "rank_never_arrived"
KERNEL_NEVER_FINISHED = "kernel_never_finished"


def device_signature(views: Sequence[RankView]) -> tuple[str, str] | None:
    """What native frames say: a rank that never arrived (it runs host code or sleeps while the
    others wait in the collective or on their device), or a kernel that never finished (every rank's
    host thread waits on its device or in the collective, none is still on the host: the device
    side, a kernel or the fabric, holds them all). None without native frames of two ranks."""
    native = [v for v in views if v.native and v.group != stk.ELSEWHERE]
    if len(native) < 2:
        return None
    waiting = [v for v in native if v.kind in (stk.KIND_COLLECTIVE, stk.KIND_DEVICE_SYNC)]
    host = [v for v in native if v.kind in (stk.KIND_MODEL, stk.KIND_COMPILED) and v.group == stk.BEFORE]
    if waiting and host:
        return NEVER_ARRIVED, (f"{', '.join(v.label for v in host)} on the host ({host[0].frame}) while "
                               f"{', '.join(v.label for v in waiting)} wait ({waiting[0].frame}): "
                               "the lagging rank never arrived")
    if waiting and len(waiting) == len(native):
        syncs = [v for v in waiting if v.kind == stk.KIND_DEVICE_SYNC]
        return KERNEL_NEVER_FINISHED, (f"every rank's host thread waits ({waiting[0].frame}"
                                       + (f"; {len(syncs)} in a device synchronise" if syncs else "")
                                       + "): a kernel or the collective itself never finished on the device")
    return None


# ------------------------------------------------------------------ the live rule


def _split(views: Sequence[RankView]) -> tuple[list[RankView], list[RankView]]:
    inside = [v for v in views if v.group == stk.INSIDE and v.stuck is not False]
    before = [v for v in views if v.group == stk.BEFORE]
    return inside, before


def live_collective_hang(f: Facts) -> bool:
    """A collective that never completes: two or more Workers, work in flight and the counters frozen,
    every Worker inside its step, at least one waiting inside a collective (a collective frame,
    shm_allreduce natively, or spinning in place in a compiled graph while another rank sleeps), and
    the rest before it. vLLM's collectives have no timeout of their own; only
    VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (default 300 s) ends the step. A single Worker stuck in its
    model is engine_deadlock's; Workers idle between steps are not in a step at all."""
    if not f.is_live or len(f.workers) < 2 or f.running + f.waiting < 1:
        return False
    if not (f.tokens_frozen or f.heartbeat_frozen):
        return False
    views = rank_views(f)
    if any(v.group == stk.ELSEWHERE for v in views):
        return False
    inside, before = _split(views)
    return bool(inside) and len(inside) + len(before) == len(views)


def _lagging(views: Sequence[RankView]) -> list[RankView]:
    inside, before = _split(views)
    return before if inside else []


def _collective_verdict(f: Facts) -> Verdict:
    views = rank_views(f)
    inside, before = _split(views)
    lagging = _lagging(views)
    waited = max(f.tokens_frozen_s, f.heartbeat_steps.frozen_s)
    collective = inside[0].frame if inside else ""
    named = any(not v.inferred for v in inside)
    signature = device_signature(views)
    lag_ranks = [v.rank if v.rank is not None else v.pid for v in lagging]
    ev: list[Evidence] = [metrics_evidence(f, f"{f.running:.0f} running, {f.waiting:.0f} waiting, all gauges frozen"),
                          counter_evidence(f), *present(stepless_evidence(f))]
    for v in views:
        role = "waits in the collective" if v in inside else "lags before it" if v in lagging else "in the step"
        ev.append(Evidence("stack", f"rank {v.label} (pid {v.pid}, {v.device}) {role}: {v.kind} at {v.frame or '?'}; "
                           f"{_cpu_text(v)}"
                           + (", frame stayed put" if v.stuck else ", frame moved" if v.stuck is False else ""),
                           values={"pid": v.pid, "rank": v.rank, "cpu_cores": v.cpu_cores, "stuck": v.stuck,
                                   "dumps": v.dumps, "native": v.native, "frames": list(v.frames[:6])}))
        if v.inferred:
            ev.append(Evidence("proc", f"rank {v.label}: {v.inferred}", values={"pid": v.pid}))
    # The ranks' own word, where their reports carry it: each one's steps and last collective.
    ev.extend(rank_report_evidence(f.samples, [(v.pid, v.label) for v in views]))
    core = f.engine_report  # the EngineCore's own report: the step it waits on, and the requests frozen in it
    if core is not None and core.report is not None:
        ev.extend(present(stage_evidence(f, core), requests_evidence(core.report)))
    if signature is not None:
        ev.append(Evidence("stack", f"native frames: {signature[1]}", values={"shape": signature[0]}))
    if lagging:
        summary = (f"Collective hang: rank(s) {', '.join(v.label for v in lagging)} never reached the collective "
                   f"that {', '.join(v.label for v in inside)} wait(s) in ({collective}); no step for at least "
                   f"{fmt_duration(waited)}.")
        confidence = COLLECTIVE_NAMED if named else COLLECTIVE_CONTRAST
    else:
        summary = (f"Collective hang: every rank waits inside the collective ({collective}) for "
                   f"{fmt_duration(waited)}; none lags on the host: the fabric, the library or a kernel.")
        confidence = COLLECTIVE_ALL_INSIDE
    reading = ("a lagging rank in cudaStreamSynchronize / cuEventSynchronize means a kernel before the collective "
               "never finished (a device fault or a hung kernel: check the device next); in Python or host code it "
               "means the rank never arrived (a host-side bug or a desynchronised code path: its stack names where).")
    advice = (
        (f"Read the ranks' native frames above: {reading}" if f.native_captured else
         "Capture native stacks (`wedgectl diagnose --pid PID --native`; py-spy pauses each rank while it unwinds, "
         f"~50 ms idle, seconds on a loaded host): {reading}"),
        "Dump the flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE set: `torch.distributed` dump, or SIGUSR1 "
        "with TORCH_NCCL_DUMP_ON_TIMEOUT): if it shows the collective's sequence number on some ranks only, "
        "those ranks arrived; equal numbers on all with the op not completed point at the fabric. It sees only c10d "
        "process-group ops: vLLM's custom all-reduce and the CPU shm collectives are not in it.",
        "On NCCL, query its RAS (NCCL_RAS_ENABLE=1, `ncclras`): a peer unreachable or a rank missing from "
        "the communicator is the fabric or a dead process; all ranks present and waiting is a rank that never called "
        "it.",
        "Read the device state of each rank's device (nvidia-smi -q -d UTILIZATION,ECC; dmesg Xid): 100 % "
        "utilisation with no progress on one device is a kernel spinning; an Xid or ECC error is a device fault.",
        "vLLM ends this by itself after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (default 300 s) with "
        "'RPC call to execute_model timed out' and EngineDeadError; restart the server to recover now.",
    )
    facts: dict[str, object] = {
        "lagging_ranks": lag_ranks,
        "lagging_labels": [v.label for v in lagging],
        "waiting_ranks": [v.rank if v.rank is not None else v.pid for v in inside],
        "collective": collective,
        "collective_inferred": not named,
        "waited_s": round(waited, 2),
        "laggard_frames": {v.label: v.frame for v in lagging},
        "hang_shape": signature[0] if signature else None,
        "ranks": [v.summary for v in views],
    }
    return Verdict(VerdictKind.COLLECTIVE_HANG, confidence, summary, "live_collective_hang", tuple(ev), advice, facts)


# ------------------------------------------------------------------ the log rule


def _rpc_timeouts(f: Facts) -> list[tuple[int, str, str]]:
    """(line number, method, text) of each 'RPC call to METHOD timed out' line."""
    return [(i + 1, m.group(1), line) for i, line in enumerate(f.bundle.log_lines) if (m := _RPC_TIMEOUT.search(line))]


def log_step_timeout(f: Facts) -> bool:
    """'RPC call to execute_model timed out': vLLM's executor gave up waiting for a worker's reply
    after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (default 300; multiproc_executor.collective_rpc), then
    EngineCore died (EngineDeadError). More than a generic engine death: a model step never completed,
    on some rank, for that long: a rank stuck in or before a collective, or a kernel that never ended."""
    return bool(_rpc_timeouts(f))


def _step_timeout_verdict(f: Facts) -> Verdict:
    lineno, method, text = _rpc_timeouts(f)[0]
    titles = _titles_from_log(f.bundle.log_lines).values()
    ranks = sorted({"_".join(f"{k}{v}" for k, v in r.items()) for r in titles if r})
    ev = [Evidence("log", message(text)[:160], values={"line": lineno, "method": method})]
    if ranks:
        ev.append(Evidence("log", f"{len(ranks)} ranks in the log ({', '.join(ranks)}): with tensor or pipeline "
                           "parallelism a step that never completes is most often a collective one rank never reached",
                           values={"ranks": ranks}))
    dead = f.failures_of("engine_dead", "engine_core_failed")
    if dead:
        ev.append(Evidence("log", message(dead[0].text)[:160], t=log_stamp(dead[0].t), values={"line": dead[0].lineno}))
    return Verdict(
        VerdictKind.ENGINE_DEAD, STEP_TIMEOUT_LOG,
        f"A model step never completed on some rank: vLLM's RPC call to {method} timed out "
        "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, default 300 s) and the engine died.",
        "log_step_timeout", present(*ev),
        ("The hang came before the death: next time run `wedgectl diagnose --pid PID` within that timeout; with "
         "several ranks it names the one that lagged (collective_hang).",
         "Read the workers' lines just before the timeout: a rank that logged nothing more, or raised, is the laggard.",
         "Restart the server; raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS only to leave more time to diagnose."),
        {"method": method, "ranks_in_log": ranks},
    )


COLLECTIVE_RULE = Rule(live_collective_hang, _collective_verdict)
STEP_TIMEOUT_RULE = Rule(log_step_timeout, _step_timeout_verdict)


def rank_summaries(bundle: Bundle) -> list[dict[str, object]]:
    """`--json`'s `ranks`: one object per Worker (rank, role, state, CPU, where its stack is)."""
    return [v.summary for v in rank_views(Facts(bundle))] if bundle.samples else []
