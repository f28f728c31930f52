"""`wedgectl remedy`: from a verdict to the least drastic act that ends the hang.

It diagnoses the deployment, saves that evidence, and plans by the verdict's class:

- admission wedge: in place. The request the scheduler can never admit waits, held by its client's
  connection; nothing executes meanwhile, so every request the server holds waits behind it. Its
  client connections to the API server's port are ended from the server's side (SOCK_DESTROY, as
  `ss -K` does; CAP_NET_ADMIN), the API server aborts the requests whose clients are gone, and the
  same processes serve again. vLLM's own abort route (/inference/v1/abort_requests, 0.32 with
  --enable-scale-out) needs request ids, which no outside reader has.
- orphaned engine: stop the orphans (SIGTERM, SIGKILL after a grace) and free the /dev/shm segments
  they held and no one else holds.
- shutdown hang: the bound is past (that is the verdict): SIGKILL what is left of the tree.
- engine deadlock, collective hang, start-up hang, engine dead, leaked capacity: a restart, only with
  --restart: as `swap` does (the same command, as the same user, with the fixes on); under a supervisor,
  the tree is ended and the supervisor starts it again.
- starved, idle, progressing, inconclusive: nothing, and why.

Every act is scoped to the deployment the evidence names and checked against the start times its pids
had when planned (a pid reused since is never touched). After acting it diagnoses again and says
whether the hang is gone.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wedgectl.classify.facts import Facts
from wedgectl.capture.diagnosis import Diagnosis, LiveOptions, diagnose
from wedgectl.collect import sockets, sockkill
from wedgectl.collect.control import runs_as_planned, stop_tree
from wedgectl.collect.procfs.stat import start_ticks
from wedgectl.model import exitcodes
from wedgectl.model.errors import NoSuchProcess, WedgectlError
from wedgectl.model.types import Bundle, ProcessSample, Role, VerdictKind

if TYPE_CHECKING:
    from wedgectl.lab.swap import SwapPlan

V = VerdictKind
Progress = Callable[[str], None]

IN_PLACE = "end-client-connections"
STOP_ORPHANS = "stop-orphans"
KILL = "kill"
RESTART = "restart"
NOTHING = "none"

STOP_GRACE_S = 5.0
KILL_GRACE_S = 1.0  # a shutdown hang has had its bound already: SIGTERM again, then SIGKILL
REAP_WAIT_S = 5.0  # after a stop: for the kernel to finish a SIGKILLed process's exit
SETTLE_S = 2.0  # after ending the connections: vLLM aborts the requests, its gauges follow at the next step

RESTART_CLASSES = (V.ENGINE_DEADLOCK, V.COLLECTIVE_HANG, V.STARTUP_HANG, V.ENGINE_DEAD, V.LEAKED_CAPACITY)
NOTHING_WHY = {
    V.IDLE: "idle: nothing to remedy",
    V.PROGRESSING: "progressing: nothing to remedy",
    V.STARVED: ("starved is not a hang: a long request holds the KV capacity and the queue moves when it ends; "
                "cap max_tokens, or give the server more KV blocks"),
    V.INCONCLUSIVE: "the evidence decides nothing: no act is safe on it; diagnose again with a longer --window",
}
RESTART_WHY = {
    V.ENGINE_DEADLOCK: "the engine stopped stepping with work in flight: nothing outside it can restart the step",
    V.COLLECTIVE_HANG: "a rank never reached the collective: every rank waits, and only a restart frees them",
    V.STARTUP_HANG: "the start-up waits with no deadline: it will not finish by itself",
    V.ENGINE_DEAD: "the engine core is gone: the API server cannot serve again without one",
    V.LEAKED_CAPACITY: ("the requests whose clients left have no connection to end and no id an outside reader can "
                        "abort them by; the patched engine's reaper (`wedgectl swap`) aborts them as they happen"),
}


@dataclass(frozen=True)
class Plan:
    """What remedy will do for a verdict: `action` (one of the names above), the steps to print, why."""

    verdict: VerdictKind
    action: str
    why: str
    steps: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()  # the processes it acts on (start times checked when acting)
    port: int | None = None  # admission wedge: the API server's port whose client connections end

    @property
    def acts(self) -> bool:
        return self.action != NOTHING

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "action": self.action, "why": self.why, "steps": list(self.steps),
                "pids": list(self.pids), "port": self.port}


@dataclass
class Outcome:
    """What remedy did and found."""

    diagnosis: Diagnosis
    plan: Plan
    acted: bool = False
    done: list[str] = field(default_factory=list)
    failed: str | None = None  # why the act could not be carried out
    after: Diagnosis | None = None  # the diagnosis once it acted (None: the deployment is gone, as planned)
    gone: bool | None = None  # the hang is over
    same_pids: bool | None = None  # an in-place remedy kept the server's processes
    after_pid: int | None = None  # a restart's new API server

    @property
    def exit_code(self) -> int:
        if not self.acted:
            if self.failed is not None:
                return exitcodes.REMEDY_NO_PATH
            return exitcodes.for_verdict(self.plan.verdict)
        return exitcodes.OK if self.gone else exitcodes.REMEDY_FAILED

    def to_json(self) -> dict[str, Any]:
        after = self.after.verdict if self.after is not None else None
        return {"verdict": self.plan.verdict.value, "summary": self.diagnosis.verdict.summary,
                "bundle": str(self.diagnosis.saved) if self.diagnosis.saved else None,
                "plan": self.plan.to_json(), "acted": self.acted, "done": self.done, "failed": self.failed,
                "after": None if after is None else {"verdict": after.verdict.value, "summary": after.summary},
                "gone": self.gone, "same_pids": self.same_pids, "new_pid": self.after_pid}


# ------------------------------------------------------------------ planning (pure)


def _port_of(p: ProcessSample) -> int | None:
    for address in p.listening:
        try:
            return int(address.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
    return None


def plan_for(b: Bundle, kind: VerdictKind, restart: bool, supervised: str | None = None) -> Plan:
    """The plan for evidence `b` classified as `kind`. `restart`: --restart was given; `supervised`: what
    supervises the server (a restart then only ends the tree), None for a bare server."""
    procs = Facts(b).last_processes
    pids = tuple(p.pid for p in procs)
    api = next((p for p in procs if p.role is Role.API_SERVER), None)
    if kind in NOTHING_WHY:
        return Plan(kind, NOTHING, NOTHING_WHY[kind])
    if not procs:
        return Plan(kind, NOTHING, "the evidence holds no process of the deployment (metrics only, --url): every "
                                   "act needs them; run again with --pid, as root or the server's user")
    if kind is V.ADMISSION_WEDGE:
        port = _port_of(api) if api is not None else None
        if api is None or port is None:
            return Plan(kind, NOTHING, "the API server's process or port is not in the evidence (run as root, "
                                       "or with --pid): no connection to end")
        return Plan(kind, IN_PLACE,
                    "the request the scheduler cannot admit is held by its client's connection; ended from the "
                    "server's side, the API server aborts it and the same processes serve again",
                    (f"end the established client connections to port {port} that API server pid {api.pid} holds "
                     "(SOCK_DESTROY; their clients see a reset and may retry)",
                     "wait for the API server to abort their requests, then diagnose again"),
                    (api.pid,), port)
    if kind is V.ORPHANED_ENGINE:
        return Plan(kind, STOP_ORPHANS, "the API server is gone; its engine processes hold memory and the device",
                    (f"stop pids {' '.join(map(str, pids))} (SIGTERM, SIGKILL after {STOP_GRACE_S:g} s)",
                     "wait until they have exited, then free the /dev/shm segments they held"), pids)
    if kind is V.SHUTDOWN_HANG:
        return Plan(kind, KILL, "SIGTERM was acknowledged long ago; the process will not exit by itself",
                    (f"SIGKILL pids {' '.join(map(str, pids))} (a last SIGTERM, then SIGKILL after "
                     f"{KILL_GRACE_S:g} s)",), pids)
    why = RESTART_WHY.get(kind, "no act ends this in place")
    if not restart:
        return Plan(kind, NOTHING, f"{why}; a restart would end it: run again with --restart")
    if supervised:
        return Plan(kind, RESTART, f"{why}; {supervised} restarts it once it ends",
                    (f"end pids {' '.join(map(str, pids))} (SIGTERM, SIGKILL after {STOP_GRACE_S:g} s); "
                     f"{supervised} starts it again",), pids)
    return Plan(kind, RESTART, why,
                ("restart as `wedgectl swap` does: the same command, as the same user, on the same port, with "
                 "the wedge_engine fixes on",), pids)


# ------------------------------------------------------------------ acting


def remedy(pid: int | None, url: str | None = None, *, yes: bool, restart: bool, save_to: Path | None,
           options: LiveOptions = LiveOptions(), progress: Progress | None = None,
           on_evidence: Callable[[Diagnosis], None] | None = None) -> Outcome:
    """Diagnose, save the evidence to `save_to` (and hand it to `on_evidence`: watch keeps it with its own
    bundles), plan, and with `yes` act and diagnose again. Both before any act."""
    say = progress or (lambda _m: None)
    found = diagnose(pid=pid, url=url, save_to=save_to, options=options, progress=progress)
    if found.saved is not None:
        say(f"evidence saved to {found.saved}")
    if on_evidence is not None:
        on_evidence(found)
    kind = found.verdict.verdict
    # planned once: what supervises it decides the plan, and the same swap plan carries the restart out
    swap_plan = _swap_plan(found.bundle) if restart and kind in RESTART_CLASSES else None
    supervised = swap_plan.supervisor.kind if swap_plan is not None and swap_plan.supervisor is not None else None
    plan = plan_for(found.bundle, kind, restart, supervised)
    # every process of the deployment, with the start time it has now: acts and checks go by these
    ticks = {p.pid: t for p in Facts(found.bundle).last_processes if (t := start_ticks(p.pid)) is not None}
    out = Outcome(found, plan)
    if not plan.acts:
        if kind not in NOTHING_WHY:  # a hang no act here ends: say why, and exit 47
            out.failed = plan.why
        return out
    if not yes:
        return out
    say(f"remedy for {kind.value}: {plan.action}")
    out.acted = True
    try:
        if plan.action == IN_PLACE:
            _end_connections(plan, ticks, out, say)
        elif plan.action in (STOP_ORPHANS, KILL) or (plan.action == RESTART and supervised):
            _stop(plan, ticks, out, say)
        else:
            _restart(plan, out, say, swap_plan)
    except (OSError, WedgectlError) as exc:
        out.failed = str(exc)
        out.gone = False
        return out
    if out.failed is None:
        _check_after(pid, plan, ticks, out, options, say)
    return out


def _alive_as_planned(pid: int, ticks: dict[int, int]) -> bool:
    return runs_as_planned(pid, ticks.get(pid))


def _end_connections(plan: Plan, ticks: dict[int, int], out: Outcome, say: Progress) -> None:
    (api,) = plan.pids
    assert plan.port is not None
    if not _alive_as_planned(api, ticks):
        raise NoSuchProcess(f"API server pid {api} is gone (or is another process now): nothing was touched")
    ours = sockets.own_tcp_addresses(sockets.TcpTables())
    conns = sockkill.client_connections(api, plan.port, exclude=ours)
    if not conns:
        out.failed = (f"API server pid {api} holds no client connection on port {plan.port}: the waiting request has "
                      "no connection to end (a client that left: restart with --restart)")
        out.acted = False  # nothing was touched
        return
    ended = 0
    for conn in conns:
        try:
            sockkill.destroy(conn)
            ended += 1
            out.done.append(f"ended {conn.describe()}")
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                continue  # closed meanwhile: its request is over too
            why = {errno.EPERM: "needs CAP_NET_ADMIN", errno.EACCES: "needs CAP_NET_ADMIN",
                   errno.EOPNOTSUPP: "this kernel lacks CONFIG_INET_DIAG_DESTROY"}.get(exc.errno or 0, str(exc))
            out.failed = f"cannot end the client connections: {why}; restart with --restart instead"
            out.acted = ended > 0  # a refusal comes at the first one: then nothing was touched
            out.gone = False if ended else None
            return
    say(f"ended {ended} client connection(s) to port {plan.port} of API server pid {api}")
    time.sleep(SETTLE_S)


def _stop(plan: Plan, ticks: dict[int, int], out: Outcome, say: Progress) -> None:
    live = [p for p in plan.pids if _alive_as_planned(p, ticks)]
    if not live:
        out.done.append("every planned pid had exited already")
        return
    grace = KILL_GRACE_S if plan.action == KILL else STOP_GRACE_S
    stopped = stop_tree(live[0], grace, extra=live[1:], planned={p: ticks[p] for p in live})
    out.done.append(f"stopped pids {' '.join(map(str, live))} in {stopped.seconds:.1f} s"
                    + (" (SIGKILL needed)" if stopped.killed else ""))
    out.done += [f"freed {name}" for name in stopped.shm_removed]
    out.done += [f"kept {name} (still held, or not the tree's own)" for name in stopped.shm_kept]
    out.done += list(stopped.refused)
    say(out.done[0])


def _restart(plan: Plan, out: Outcome, say: Progress, swap_plan: SwapPlan | None) -> None:
    """As swap does, by the plan made when remedy planned (None: it could not be made then; swap plans
    again, and says why it refuses)."""
    from wedgectl.lab.swap import swap_deployment

    api = next(iter(plan.pids))
    result = swap_deployment(api, progress=say, plan=swap_plan)
    out.done.append(result.message)
    if not result.ok:
        out.failed = result.message
        out.gone = False
    elif result.new_pid is not None:
        out.done.append(f"new API server pid {result.new_pid}")
        out.after_pid = result.new_pid


def _swap_plan(b: Bundle) -> SwapPlan | None:
    """The swap plan of the deployment's API server (its supervisor among what it says), None when there is
    no API server in the evidence or swap cannot plan for it."""
    from wedgectl.lab.swap import plan_swap

    api = Facts(b).api_server
    if api is None:
        return None
    try:
        return plan_swap(api.pid)
    except (OSError, WedgectlError):
        return None


def _check_after(pid: int | None, plan: Plan, ticks: dict[int, int], out: Outcome,
                 options: LiveOptions, say: Progress) -> None:
    """Whether the hang is over: the deployment diagnosed again, or for a stop, nothing left of it."""
    if plan.action in (STOP_ORPHANS, KILL) or (plan.action == RESTART and out.after_pid is None):
        deadline = time.monotonic() + REAP_WAIT_S
        left = [p for p in plan.pids if _alive_as_planned(p, ticks)]
        while left and time.monotonic() < deadline:  # SIGKILLed, still being torn down by the kernel
            time.sleep(0.1)
            left = [p for p in left if _alive_as_planned(p, ticks)]
        out.gone = not left
        if left:
            out.failed = f"pids {' '.join(map(str, left))} still run"
        return
    again_pid = out.after_pid or (plan.pids[0] if plan.action == IN_PLACE else pid)
    say("diagnosing again")
    try:
        out.after = diagnose(pid=again_pid, options=options)
    except WedgectlError as exc:
        out.failed = f"the diagnosis after the remedy failed: {exc}"
        out.gone = False
        return
    kind = out.after.verdict.verdict
    out.gone = kind in (V.IDLE, V.PROGRESSING, V.STARVED)
    if plan.action == IN_PLACE:
        out.same_pids = bool(ticks) and all(_alive_as_planned(p, ticks) for p in ticks)


__all__ = ["Outcome", "Plan", "plan_for", "remedy"]
