"""Running each hang repro with the engine plugin's fixes on, and checking that nothing hangs (`repro --patched`).

The server gets the config's fault as before plus ``WEDGE_ENGINE_FIXES=all``.
What "no hang" means depends on the hang class the config reproduces:

* admission_wedge: every request ends in an HTTP error within
  ADMISSION_BOUND_S whose body states the tokens or blocks needed and available;
* engine_deadlock: the watchdog fails every request with an HTTP error and
  /health turns 503, both within the watchdog limit plus WATCHDOG_SLACK_S;
* shutdown_hang: SIGTERM while the stalled generation and the half-sent upload
  are open; the generation's client gets an HTTP error and the server exits,
  both within the shutdown bound, and the upload's connection is closed;
* starved, progressing: every request completes (HTTP 200);
* idle: nothing to check before the SIGTERM;
* startup_hang: with a start-up deadline of STARTUP_S, the server fails its
  start-up by itself, says why in its log, and leaves no process behind;
* orphaned_engine: SIGKILL to the API server; its EngineCore and Workers exit
  by themselves within ORPHAN_BOUND_S.

Every other config ends with a SIGTERM to the API server; its exit time must be
within the shutdown bound. Each check is a `Check` with its measured time.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wedgectl.collect.processes import is_alive
from wedgectl.collect.control import Signal
from wedgectl.lab.lifecycle import Server, health_client, health_status, log_tail, signal_server, stop_server, wait_exit
from wedgectl.lab.engine_install import SHUTDOWN_S, WATCHDOG_S, patched_env
from wedgectl.lab.repro import ReproConfig, Workload, scrape_snapshot, start_repro_server, symptom_reached

ADMISSION_BOUND_S = 5.0  # an unadmittable request's error (measured: ~0.01 s at admission)
WATCHDOG_SLACK_S = 4.0  # the watchdog polls every <= 1 s; the client and /health poll add the rest
EXIT_SLACK_S = 0.5  # measurement slack on the SIGTERM -> exit bound
COMPLETION_BOUND_S = {"starved": 240.0, "progressing": 60.0}
# the reaper aborts a request once its generate() ends (measured: within a step on an idle host; with two busy
# loops and four test workers on 2 cores, 1 of the 3 ghosts reaped within 30 s)
REAP_BOUND_S = 60.0
REAPED = "wedge_engine:reaped_requests_total"
STREAM_S = 8.0  # how long the healthy control streams
IDLE_S = 2.0
# The start-up deadline a patched startup-hang repro runs with: above a healthy start of the tiny
# model on a loaded 2-core host (~20-40 s idle, up to ~90 s measured under load).
STARTUP_S = 90.0
STARTUP_SLACK_S = 60.0  # the API server's own start before its wait begins, and vLLM's teardown
HEARTBEAT_FROZEN_S = 2.0  # the heartbeat must be seen frozen this long before the watchdog (8 s) answers 503
HEARTBEAT_SLACK_S = 0.25  # the ages surely grew as long as the stretch proven frozen (heartbeat_stall): rounding
ORPHAN_BOUND_S = 10.0  # the parent watch polls every 1 s, then gives SIGTERM 5 s before it kills
STARTUP_FAILED_LINE = "wedge_engine: start-up did not finish within"

# "blocks" / "tokens" / "max_model_len=96": a body that says what was needed and what is available.
_CAPACITY_WORDS = re.compile(r"block|token|max_model_len", re.IGNORECASE)


@dataclass(frozen=True)
class Check:
    """One no-hang condition and whether it held."""

    name: str
    passed: bool
    detail: str
    seconds: float | None = None


@dataclass
class Observation:
    """What a patched run saw: the raw material the checks judge."""

    client: list[dict[str, Any]] = field(default_factory=list)
    health_503_after_s: float | None = None  # since the workload started
    exit_s: float | None = None  # SIGTERM -> API server exit
    tree_exit_s: float | None = None  # SIGTERM -> every process of the tree gone
    upload_closed: bool | None = None  # the half-sent upload's socket was closed by the server
    answered_after_sigterm_s: list[float] = field(default_factory=list)  # each response that came after SIGTERM
    answered_before_sigterm: int | None = None  # how many of `client` were in before the SIGTERM
    watchdog_s: float = WATCHDOG_S
    shutdown_s: float = SHUTDOWN_S
    startup_s: float = STARTUP_S  # the start-up deadline the server was given (startup_hang)
    startup_exit_s: float | None = None  # launch -> the API server failed its start-up and exited
    startup_error_logged: bool = False  # the log says why (STARTUP_FAILED_LINE)
    left_running: list[int] = field(default_factory=list)  # tree pids alive at the end of the bound
    orphans_exit_s: float | None = None  # SIGKILL of the API server -> every other process gone
    reaped: float | None = None  # wedge_engine:reaped_requests_total once the clients that leave are gone
    reaped_after_s: float | None = None  # since the workload started
    gave_up: int = 0  # clients that leave by design (disconnect_after_s)
    # The plugin's heartbeat while the engine was blocked and before the watchdog's 503 (engine_deadlock):
    # its step counts frozen, for how long, and its ages; None where no scrape carried the heartbeat.
    heartbeat: dict[str, float] | None = None


@dataclass
class PatchedResult:
    config: ReproConfig
    checks: list[Check]
    observation: Observation
    pid: int | None
    url: str | None
    log_path: Path | None
    notes: list[str]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "repro": self.config.name,
            "expected": self.config.expected,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
            "observation": asdict(self.observation),
            "pid": self.pid,
            "url": self.url,
            "log": str(self.log_path) if self.log_path else None,
            "notes": self.notes,
        }


# ------------------------------------------------------------------ the checks (pure)


def _requests(obs: Observation) -> list[dict[str, Any]]:
    """The requests owed an answer: not a half-sent upload, not a client that left by design."""
    return [r for r in obs.client if not r.get("stalled_upload") and not r.get("gave_up")]


def states_capacity(body: str) -> bool:
    """Whether an error body says what was needed and what is available (two figures, blocks/tokens)."""
    return bool(_CAPACITY_WORDS.search(body)) and len(re.findall(r"\d+", body)) >= 2


def check_errors_within(obs: Observation, bound_s: float, name: str, need_capacity: bool = False) -> Check:
    reqs = _requests(obs)
    if not reqs:
        return Check(name, False, "no request finished (the client is still waiting: a hang)")
    bad = [r for r in reqs if not (400 <= int(r.get("status", 0)) < 600) or r.get("elapsed_s", 1e9) > bound_s]
    if need_capacity:
        bad += [r for r in reqs if r not in bad and not states_capacity(r.get("body", ""))]
    worst = max(r.get("elapsed_s", 0.0) for r in reqs)
    if bad:
        r = bad[0]
        return Check(name, False, f"{len(bad)} of {len(reqs)} request(s) did not get a clear HTTP error within "
                                  f"{bound_s:g} s: {_summary(r)}", worst)
    codes = sorted({int(r["status"]) for r in reqs})
    return Check(name, True, f"{len(reqs)} request(s) got HTTP {'/'.join(map(str, codes))} in {worst:.2f} s "
                             f"(bound {bound_s:g} s): {_body_message(reqs[0])}", worst)


def check_shutdown_errors(obs: Observation) -> Check:
    """The requests held open at SIGTERM get an HTTP error, within the bound of the signal."""
    name = "error on shutdown"
    reqs = _requests(obs)
    if not reqs:
        return Check(name, False, "the held request's client never got a response (a hang)")
    bad = [r for r in reqs if not (400 <= int(r.get("status", 0)) < 600)]
    late = max(obs.answered_after_sigterm_s, default=None)
    if bad:
        return Check(name, False, f"{len(bad)} of {len(reqs)} held request(s) got no HTTP error: {_summary(bad[0])}",
                     late)
    if late is None or late > obs.shutdown_s:
        return Check(name, False, f"the held request(s) were answered {late} s after SIGTERM "
                                  f"(bound {obs.shutdown_s:g} s)", late)
    codes = sorted({int(r["status"]) for r in reqs})
    return Check(name, True, f"{len(reqs)} held request(s) got HTTP {'/'.join(map(str, codes))} {late:.2f} s after "
                             f"SIGTERM: {_body_message(reqs[0])}", late)


def check_completions(obs: Observation, bound_s: float, name: str = "completions") -> Check:
    """Every request answered before the SIGTERM completed (those the SIGTERM met get 503 by design)."""
    before = obs.client if obs.answered_before_sigterm is None else obs.client[: obs.answered_before_sigterm]
    reqs = [r for r in before if not r.get("stalled_upload") and not r.get("gave_up")]
    if not reqs:
        return Check(name, False, "no request finished")
    bad = [r for r in reqs if r.get("status") != 200 or r.get("elapsed_s", 1e9) > bound_s]
    worst = max(r.get("elapsed_s", 0.0) for r in reqs)
    if bad:
        return Check(name, False, f"{len(bad)} of {len(reqs)} request(s) did not complete: {_summary(bad[0])}", worst)
    return Check(name, True, f"{len(reqs)} request(s) completed with HTTP 200, the slowest in {worst:.1f} s", worst)


def check_health_503(obs: Observation, bound_s: float) -> Check:
    if obs.health_503_after_s is None:
        return Check("health 503", False, f"/health never answered 503 (watchdog limit {obs.watchdog_s:g} s)")
    ok = obs.health_503_after_s <= bound_s
    return Check("health 503", ok, f"/health answered 503 after {obs.health_503_after_s:.1f} s "
                                   f"({'within' if ok else 'beyond'} {bound_s:g} s)", obs.health_503_after_s)


Beat = tuple[float, float, float, float, float, float]


def heartbeat_stall(beats: list[Beat]) -> dict[str, float] | None:
    """The heartbeat's last frozen stretch, from readings (monotonic time the scrape was sent, the time its answer
    came, steps, model steps, step age, model step age) taken while /health still answered 200: the counts at the
    last reading, how long they surely held, and how far each age grew meanwhile. None without a reading.

    The server read its record somewhere between a scrape's send and its answer, and a loaded host can put
    seconds between the two; so the stretch is the one the readings prove, from the first frozen reading's
    answer to the last one's send, and an engine that is truly blocked ages at least that much."""
    if not beats:
        return None
    sent1, _, steps, model_steps, step_age, model_age = beats[-1]
    _, came0, _, _, step_age0, model_age0 = next(b for b in beats if (b[2], b[3]) == (steps, model_steps))
    return {"steps": steps, "model_steps": model_steps, "frozen_s": round(max(0.0, sent1 - came0), 2),
            "step_age_s": round(step_age, 2), "model_step_age_s": round(model_age, 2),
            "step_age_grew_s": round(step_age - step_age0, 2),
            "model_step_age_grew_s": round(model_age - model_age0, 2)}


def check_heartbeat(obs: Observation) -> Check:
    """Blocked (no step at all, not even an empty one), the heartbeat's counts freeze and both its ages grow with
    the clock, while vLLM's /health still answers 200: what an alert on the heartbeat sees before any watchdog."""
    hb, name = obs.heartbeat, "heartbeat ages while blocked"
    if hb is None:
        return Check(name, False, "no heartbeat was read before /health answered 503")
    frozen, grew = hb["frozen_s"], min(hb["step_age_grew_s"], hb["model_step_age_grew_s"])
    ok = frozen >= HEARTBEAT_FROZEN_S and grew >= frozen - HEARTBEAT_SLACK_S
    return Check(name, ok, f"steps frozen at {hb['steps']:.0f} ({hb['model_steps']:.0f} with model work) for "
                           f"{frozen:.1f} s while /health answered 200; step age {hb['step_age_s']:.1f} s, model step "
                           f"age {hb['model_step_age_s']:.1f} s (each grew {grew:.1f} s or more)", frozen)


def check_exit(obs: Observation) -> Check:
    bound = obs.shutdown_s + EXIT_SLACK_S
    if obs.exit_s is None:
        return Check("exit on SIGTERM", False, f"the API server did not exit within {bound:g} s of SIGTERM")
    ok = obs.exit_s <= bound
    tree = f", whole tree {obs.tree_exit_s:.2f} s" if obs.tree_exit_s is not None else ""
    return Check("exit on SIGTERM", ok, f"the API server exited {obs.exit_s:.2f} s after SIGTERM{tree} "
                                        f"(bound {obs.shutdown_s:g} s)", obs.exit_s)


def check_upload_closed(obs: Observation) -> Check:
    ok = bool(obs.upload_closed)
    return Check("upload connection closed", ok,
                 "the half-sent upload's connection was closed by the server" if ok
                 else "the half-sent upload's connection is still open")


def check_startup_failed(obs: Observation) -> Check:
    bound = obs.startup_s + STARTUP_SLACK_S
    if obs.startup_exit_s is None:
        return Check("start-up deadline", False, f"the server was still starting {bound:g} s after launch")
    ok = obs.startup_error_logged and not obs.left_running
    what = "said why in its log" if obs.startup_error_logged else f"did not log {STARTUP_FAILED_LINE!r}"
    left = (f"; pids {' '.join(map(str, obs.left_running))} outlived it" if obs.left_running
            else "; nothing left running")
    return Check("start-up deadline", ok, f"the server failed its start-up {obs.startup_exit_s:.1f} s after launch "
                                          f"(deadline {obs.startup_s:g} s), {what}{left}", obs.startup_exit_s)


def check_orphans_exit(obs: Observation) -> Check:
    if obs.orphans_exit_s is None:
        return Check("engine exits with its API server", False, f"pids {' '.join(map(str, obs.left_running))} "
                     f"still ran {ORPHAN_BOUND_S:g} s after the API server was SIGKILLed")
    return Check("engine exits with its API server", True, f"every engine process exited {obs.orphans_exit_s:.1f} s "
                 f"after the API server was SIGKILLed (bound {ORPHAN_BOUND_S:g} s)", obs.orphans_exit_s)


def check_reaped(obs: Observation) -> Check:
    ok = obs.reaped is not None and obs.reaped >= obs.gave_up and obs.reaped_after_s is not None
    detail = (f"{obs.reaped:.0f} request(s) reaped of {obs.gave_up} whose client left, after {obs.reaped_after_s} s"
              if ok else f"reaped {obs.reaped} of {obs.gave_up} within {REAP_BOUND_S:g} s")
    return Check("ghosts reaped", ok, detail, obs.reaped_after_s)


def evaluate(expected: str, obs: Observation, no_fix: str | None = None) -> list[Check]:
    """The no-hang checks for a config reproducing `expected` (a VerdictKind value). `no_fix`: the
    patched engine has no fix for this hang; only a bounded SIGTERM and answered clients are checked."""
    if no_fix:
        return [check_exit(obs), check_all_answered(obs)]
    if expected == "startup_hang":
        return [check_startup_failed(obs)]
    if expected == "orphaned_engine":
        return [check_orphans_exit(obs)]
    checks: list[Check] = []
    if expected == "admission_wedge":
        checks.append(check_errors_within(obs, ADMISSION_BOUND_S, "clear error", need_capacity=True))
    elif expected == "engine_deadlock":
        bound = obs.watchdog_s + WATCHDOG_SLACK_S
        if obs.heartbeat is not None:  # the heartbeat fix on (each release that has it)
            checks.append(check_heartbeat(obs))
        checks.append(check_errors_within(obs, bound, "watchdog error"))
        checks.append(check_health_503(obs, bound))
    elif expected == "shutdown_hang":
        checks.append(check_shutdown_errors(obs))
        if any(r.get("stalled_upload") for r in obs.client):
            checks.append(check_upload_closed(obs))
    elif expected == "leaked_capacity":
        checks.append(check_reaped(obs))
        checks.append(check_completions(obs, COMPLETION_BOUND_S["progressing"]))
    elif expected in COMPLETION_BOUND_S:
        checks.append(check_completions(obs, COMPLETION_BOUND_S[expected]))
    checks.append(check_exit(obs))
    checks.append(check_all_answered(obs))
    return checks


def check_all_answered(obs: Observation) -> Check:
    """No client is left without a response at the end (the server has exited by then)."""
    reqs = _requests(obs)
    bad = [r for r in reqs if "status" not in r]
    if bad:
        return Check("every client answered", False,
                     f"{len(bad)} of {len(reqs)} request(s) got no HTTP response: {_summary(bad[0])}")
    return Check("every client answered", True, f"{len(reqs)} request(s), each got an HTTP response")


def _body_message(result: dict[str, Any]) -> str:
    body = result.get("body", "")
    try:
        return str(json.loads(body)["error"]["message"])[:240]
    except (ValueError, KeyError, TypeError):
        return body[:240]


def _summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"{result['error']} after {result.get('elapsed_s')} s"
    return f"HTTP {result.get('status')} after {result.get('elapsed_s')} s: {_body_message(result)[:160]}"


# ------------------------------------------------------------------ the run


def run_patched(
    cfg: ReproConfig,
    python: str | None = None,
    out_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _m: None,
    extra_env: dict[str, str] | None = None,
) -> PatchedResult:
    """Start the config's server with the fixes on, drive its workload, check that nothing hangs, SIGTERM it."""
    env = {**cfg.env, **patched_env(),
           **({"WEDGE_ENGINE_STARTUP_S": f"{STARTUP_S:g}"} if cfg.expected == "startup_hang" else {}),
           **(extra_env or {})}
    obs = Observation(watchdog_s=float(env["WEDGE_ENGINE_WATCHDOG_S"]),
                      shutdown_s=float(env["WEDGE_ENGINE_SHUTDOWN_S"]),
                      startup_s=float(env.get("WEDGE_ENGINE_STARTUP_S", STARTUP_S)))
    out_dir = out_dir or Path.cwd() / "wedgectl-repro" / f"{cfg.name}-patched"
    server, log_path = start_repro_server(cfg, env, python, out_dir, progress, label="patched vLLM")
    notes: list[str] = []
    workload = Workload(server.url, cfg, hold_s=max(120.0, COMPLETION_BOUND_S.get(cfg.expected, 0) + 30))
    try:
        if cfg.expected in ("startup_hang", "orphaned_engine"):
            _check_lifecycle(cfg, server, obs, progress)
            return _patched_result(cfg, server, log_path, obs, workload, out_dir, notes)
        _drive(cfg, server, workload, obs, progress, notes)
        if cfg.stream is not None:
            # Let the healthy stream's requests in flight complete, so the SIGTERM meets a quiet server.
            workload.drain(join_s=10.0)
        obs.answered_before_sigterm = len(workload.results)
        progress(f"sending SIGTERM to the API server pid {server.pid}")
        t_sig = time.monotonic()
        watcher = _ResultWatcher(workload, t_sig)
        signal_server(server, Signal.TERM)
        if wait_exit(server, obs.shutdown_s + 15) is None:  # the hang the fix exists to end
            notes.append("the API server outlived SIGTERM + bound + 15 s")
        else:
            obs.exit_s = round(time.monotonic() - t_sig, 3)
        obs.tree_exit_s = round(time.monotonic() - t_sig + stop_server(server, grace=5), 3)
        if cfg.expected == "shutdown_hang":
            workload.wait_results(sum(s.count for s in cfg.requests), 5.0)
        obs.answered_after_sigterm_s = watcher.stop()
        obs.upload_closed = workload.uploads_closed()
        progress(f"SIGTERM -> exit {obs.exit_s} s")
    finally:
        stop_server(server, grace=5)
        workload.stop(join_s=2.0)
    return _patched_result(cfg, server, log_path, obs, workload, out_dir, notes)


def _patched_result(cfg: ReproConfig, server: Server, log_path: Path, obs: Observation, workload: Workload,
                    out_dir: Path, notes: list[str]) -> PatchedResult:
    obs.client = list(workload.results)
    obs.gave_up = sum(s.count for s in cfg.requests if s.disconnect_after_s > 0)
    checks = evaluate(cfg.expected, obs, cfg.patched_no_fix)
    if cfg.patched_no_fix:
        notes.append(f"no fix in the patched engine for this hang: {cfg.patched_no_fix}")
    (out_dir / "client.json").write_text(json.dumps(obs.client, indent=2))
    result = PatchedResult(cfg, checks, obs, server.pid, server.url, log_path, notes)
    (out_dir / "patched.json").write_text(json.dumps(result.to_json(), indent=2))
    return result


def _check_lifecycle(cfg: ReproConfig, server: Server, obs: Observation, progress: Callable[[str], None]) -> None:
    """startup_hang: wait for the server to fail its own start-up; orphaned_engine: SIGKILL the API
    server once healthy and time its engine's exit. Whatever is left is stopped by the caller."""
    if cfg.expected == "startup_hang":
        progress(f"waiting for the start-up deadline ({obs.startup_s:g} s)")
        tree: tuple[int, ...] = ()
        while server.popen.poll() is None and time.time() - server.started_at < obs.startup_s + STARTUP_SLACK_S:
            tree = tuple(sorted(set(tree) | set(server.tree_pids())))
            time.sleep(0.5)
        if server.popen.poll() is not None:
            obs.startup_exit_s = round(time.time() - server.started_at, 1)
        obs.startup_error_logged = STARTUP_FAILED_LINE in log_tail(server.log_path, 400)
        deadline = time.monotonic() + ORPHAN_BOUND_S
        while any(is_alive(p) for p in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.2)
        obs.left_running = [p for p in tree[1:] if is_alive(p)]
        return
    tree = server.tree_pids()
    progress(f"sending SIGKILL to the API server pid {server.pid}")
    t_sig = time.monotonic()
    signal_server(server, Signal.KILL)
    while time.monotonic() - t_sig < ORPHAN_BOUND_S and any(is_alive(p) for p in tree[1:]):
        time.sleep(0.1)
    obs.left_running = [p for p in tree[1:] if is_alive(p)]
    if not obs.left_running:
        obs.orphans_exit_s = round(time.monotonic() - t_sig, 2)


def _drive(cfg: ReproConfig, server: Server, workload: Workload, obs: Observation,
           progress: Callable[[str], None], notes: list[str]) -> None:
    """Run the workload until the config's outcome is in (or its bound passes)."""
    expected = cfg.expected
    if expected == "admission_wedge":
        bound = ADMISSION_BOUND_S + 2
    elif expected == "engine_deadlock":
        bound = obs.watchdog_s + WATCHDOG_SLACK_S + 2
    elif expected == "progressing":
        bound = STREAM_S
    elif expected in COMPLETION_BOUND_S:
        bound = COMPLETION_BOUND_S[expected] + 5
    elif expected == "shutdown_hang":
        bound = cfg.timeout_s
    elif expected == "leaked_capacity":
        bound = REAP_BOUND_S + COMPLETION_BOUND_S["progressing"]
    else:
        bound = IDLE_S
    start = time.monotonic()
    workload.start_now()
    history: list[tuple[float, Any]] = []
    beats: list[Beat] = []
    try:
        _poll(cfg, server, workload, obs, progress, notes, bound, start, history, beats)
    finally:
        if expected == "engine_deadlock":
            obs.heartbeat = heartbeat_stall(beats)


def _poll(cfg: ReproConfig, server: Server, workload: Workload, obs: Observation, progress: Callable[[str], None],
          notes: list[str], bound: float, start: float, history: list[tuple[float, Any]],
          beats: list[Beat]) -> None:
    """_drive's loop: scrape, poll /health, until the outcome the config's class expects (or the bound)."""
    expected = cfg.expected
    n_requests = sum(s.count for s in cfg.requests if not s.stalled_upload)
    with health_client() as client:
        while time.monotonic() - start < bound:
            sent = time.monotonic()
            snap = scrape_snapshot(client, server.url)
            if snap is not None:
                history.append((time.monotonic(), snap))
                workload.start_later(snap.generation_tokens or 0)
                steps, model_steps = snap.heartbeat_steps, snap.heartbeat_model_steps
                age, model_age = snap.heartbeat_step_age, snap.heartbeat_model_step_age
                if obs.health_503_after_s is None and steps is not None and model_steps is not None and \
                        age is not None and model_age is not None:
                    beats.append((sent, history[-1][0], steps, model_steps, age, model_age))
            if obs.health_503_after_s is None and health_status(client, server.url) == 503:
                obs.health_503_after_s = round(time.monotonic() - start, 2)
            done = len([r for r in workload.results if not r.get("stalled_upload")])
            if expected == "shutdown_hang":
                if symptom_reached(cfg.until, history, cfg.settle_s) and workload.start_later(0):
                    progress(f"symptom {cfg.until!r} established after {time.monotonic() - start:.1f} s")
                    return
            elif expected == "engine_deadlock":
                if done >= n_requests and obs.health_503_after_s is not None:
                    return
            elif expected == "leaked_capacity" and snap is not None:
                # Reaped, the ghosts free their slots long before the counter a late request
                # waits for: once they are gone, send it now; it must then complete.
                gone = sum(s.count for s in cfg.requests if s.disconnect_after_s > 0)
                reaped = snap.value(REAPED)
                if obs.reaped_after_s is None and reaped is not None and reaped >= gone:
                    obs.reaped, obs.reaped_after_s = reaped, round(time.monotonic() - start, 2)
                    workload.start_later(float("inf"))
                if obs.reaped_after_s is not None and done >= n_requests:
                    return
                if obs.reaped_after_s is None and time.monotonic() - start > REAP_BOUND_S:
                    obs.reaped = reaped
                    notes.append(f"the ghosts were not reaped within {REAP_BOUND_S:g} s")
                    return
            elif expected not in ("progressing", "idle") and n_requests and done >= n_requests:
                return
            time.sleep(0.25)
    if expected not in ("progressing", "idle"):
        notes.append(f"outcome not complete within {bound:.0f} s")
        progress(notes[-1])


class _ResultWatcher:
    """Times each client response that arrives after SIGTERM (the workload records only durations)."""

    def __init__(self, workload: Workload, t0: float) -> None:
        import threading

        self._workload, self._t0 = workload, t0
        self._seen = len(workload.results)
        self._times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            n = len(self._workload.results)
            if n > self._seen:
                self._times += [round(time.monotonic() - self._t0, 3)] * (n - self._seen)
                self._seen = n
            time.sleep(0.02)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(timeout=1)
        return list(self._times)
