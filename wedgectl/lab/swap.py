"""Hot-swapping a running vLLM server for the same command with the wedge_engine fixes on (`wedgectl swap`).

The plan comes from /proc: the API server's command line, environment and
working directory, the deployment's process tree and the port it serves.
The swap: make sure the server's interpreter can import the plugin (install
the one this wedgectl carries if not, or if older), stop the old tree
(control.stop_tree: SIGTERM to the API server, SIGKILL to whatever of the
tree is left after a bound: it works on a server stuck in the shutdown hang),
start the same command in the same directory with the fixes on
(plugin.FIXES_ENV) on the same port, wait for /health, report the downtime.
If the patched server never gets healthy, the original command is started
again and the result says so.

Nothing of the target's runs as root: its interpreter, its pip and the new
server run as the target's uid, gid and groups (collect.target.Credentials),
its log is opened by the new server itself, and a plan (--dry-run) runs
nothing at all. The interpreter is resolved once, at plan time, to an absolute
path; the plugin probe and pip run it by that path from "/", never importing
from a working folder (plugin.run_python), and the new server is started by that
exact path (SwapPlan.launch_argv). swap refuses an interpreter, a folder above
it or a site-packages that someone other than root or that user could write
(swapsafety.path_risk, exit 44), and a server a supervisor would restart
(collect.target.detect_supervisor; a parent that runs API servers and is not
vLLM's own launcher, collect.processes.server_supervisor: exit 45) unless forced. Before it stops
anything it writes a script that starts the old command again exactly as it
ran; SIGINT, SIGTERM or SIGHUP while the old server is down roll back, and
where the rollback fails the result names what runs and that script.

Secrets are never shown: environment variables whose names look like
credentials and the values of flags such as ``--api-key`` are printed
(render.render_swap) and serialised as ``<redacted>``; the real values only go to the new
process's environment and argv.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from wedgectl.model import exitcodes

from wedgectl.read import redact
from wedgectl.read.pluginline import PluginFixes, plugin_fixes
from wedgectl.collect import procread
from wedgectl.collect.processes import server_supervisor
from wedgectl.collect.target import (
    Credentials,
    Supervisor,
    detect_supervisor,
    read_command,
    read_credentials,
)
from wedgectl.model.errors import NoSuchProcess, NotVllm, WedgectlError  # noqa: F401 - NoSuchProcess: read_proc raises it
from wedgectl.lab.lifecycle import Command, Server, ServerStartError, launch, stop_server, wait_healthy
from wedgectl.collect.control import ChildError, stop_tree, wait_port_free
from wedgectl.lab.engine_install import (
    ACTIVE_ENV,
    FIXES_ENV,
    PluginInstallError,
    engine_version,
    ensure_engine_plugin,
    install_dir,
    installed_version,
    recorded_version,
)
from wedgectl.lab.swapsafety import (
    SignalGuard,
    can_append_as,
    SwapInterrupted,
    path_risk,
    restore_script,
    write_restore_script,
)

REDACTED = redact.REDACTED
# Set at run time by the plugin in the old API server; the new one makes its own.
DROP_ENV = ("WEDGE_ENGINE_STATUS_FILE",)
STOP_GRACE_S = 15.0
HEALTH_TIMEOUT_S = 600.0
PORT_WAIT_S = 10.0  # for the stopped server's port to be free again


class SwapError(WedgectlError):
    exit_code = exitcodes.SWAP_FAILED


class SwapRefused(SwapError):
    """Swap will not act: an interpreter others may write (44), or a supervisor (45) without --force."""

    exit_code = exitcodes.SWAP_UNSAFE


# ------------------------------------------------------------------ redaction (pure)


# One rule for all of wedgectl (wedgectl.read.redact, docs/bundle.md); these names stay for swap's callers.
is_secret_name = redact.is_secret_name
redact_env = redact.redact_env
redact_argv = redact.redact_argv


def redact_text(text: str, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """`text` with every secret value of `env` and `argv` replaced (for messages that quote output)."""
    shown_env = redact_env(env)
    secrets = [v for k, v in env.items() if shown_env[k] != v and len(v) >= 4]
    shown = redact_argv(argv)
    secrets += [a for a, r in zip(argv, shown) if r != a and len(a) >= 4]
    secrets += [a.split("=", 1)[1] for a, r in zip(argv, shown)
                if r != a and "=" in a and len(a.split("=", 1)[1]) >= 4]
    for s in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return redact.redact_text(text)


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class SwapPlan:
    """What a swap will do; `env` holds secrets and is never printed (use `describe`)."""

    api_pid: int
    tree: tuple[int, ...]
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str] = field(repr=False)
    python: str  # the interpreter, absolute, resolved once and checked (path_risk): what every run executes
    url: str
    port: int
    host: str
    log_path: str | None  # the old server's log file (the new one appends to it), if it has one
    plugin: str  # what the interpreter has: "wedgectl-engine 0.2.0", "missing", "0.1.0 (older)"
    plugin_ok: bool
    stop_grace_s: float = STOP_GRACE_S
    run_as: Credentials = Credentials(0, 0)  # the server's user: its interpreter, pip and restart run as it
    supervisor: Supervisor | None = None  # what would restart the old server (swap refuses without --force)
    # pid -> start time when planned (procfs.start_ticks): a pid reused since is never signalled
    start_ticks: Mapping[int, int] = field(default_factory=dict, repr=False)

    @property
    def launch_argv(self) -> tuple[str, ...]:
        """The command as a restart runs it: argv with the checked interpreter's absolute path first,
        so nothing looks it up on a PATH again (a python put earlier on it since would run instead, and
        even one only named argv[0] would choose the prefix, and so the site-packages, it starts from)."""
        return (self.python, *self.argv[1:])

    @property
    def new_env(self) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if k not in DROP_ENV}
        env.update(FIXES_ENV)  # the fixes on; the per-fix settings the deployment has are kept
        return env

    @property
    def secret_names(self) -> list[str]:
        """Variables kept for the new server whose values are never shown."""
        return sorted(k for k in self.env if is_secret_name(k))

    def to_json(self) -> dict[str, Any]:
        return {
            "api_pid": self.api_pid,
            "tree": list(self.tree),
            "argv": redact_argv(self.argv),
            "cwd": self.cwd,
            "env": redact_env(self.env),
            "new_env_changes": redact_env({k: v for k, v in self.new_env.items() if self.env.get(k) != v}),
            "python": self.python,
            "url": redact.redact_url(self.url),
            "port": self.port,
            "log": self.log_path,
            "plugin": self.plugin,
            "plugin_ok": self.plugin_ok,
            "user": {"uid": self.run_as.uid, "gid": self.run_as.gid, "groups": list(self.run_as.groups)},
            "supervisor": None if self.supervisor is None else
            {"kind": self.supervisor.kind, "why": self.supervisor.why, "instead": self.supervisor.instead},
        }


@dataclass
class SwapResult:
    plan: SwapPlan
    dry_run: bool
    ok: bool
    message: str
    new_pid: int | None = None
    downtime_s: float | None = None  # SIGTERM to the old server -> first /health 200 of the new one
    stop_s: float | None = None  # SIGTERM -> old tree gone
    killed: bool = False  # the old tree needed SIGKILL
    rolled_back: bool = False
    log_path: str | None = None
    steps: list[str] = field(default_factory=list)
    interrupted: str | None = None  # the signal that cut the swap short ("SIGTERM"), rolled back where it could
    restore_script: str | None = None  # kept only when the original could not be brought back
    fixes: PluginFixes | None = None  # what the plugin said it turned on in the new server
    t_stop: float | None = field(default=None, repr=False)  # when the old server got SIGTERM
    server: Server | None = field(default=None, repr=False)  # the server started last, while it is ours to stop

    @property
    def url(self) -> str:
        return self.plan.url

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "dry_run": self.dry_run, "message": self.message, "new_pid": self.new_pid,
            "url": redact.redact_url(self.plan.url), "downtime_s": self.downtime_s, "stop_s": self.stop_s,
            "killed": self.killed,
            "rolled_back": self.rolled_back, "log": self.log_path, "steps": self.steps, "plan": self.plan.to_json(),
            "interrupted": self.interrupted, "restore_script": self.restore_script,
            "fixes": None if self.fixes is None else {"vllm": self.fixes.vllm, "on": list(self.fixes.on),
                                                      "off": list(self.fixes.off)},
        }


def read_proc(pid: int, proc_root: Path = procread.PROC) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, cwd) of a process, read bounded by collect.target; NoSuchProcess when gone."""
    argv, env, cwd = read_command(pid, proc_root)
    if not argv:
        raise SwapError(f"pid {pid} has no command line (a zombie or kernel thread)")
    return argv, env, cwd


def resolve_interpreter(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """The python the server runs, as an absolute path: argv[0] as the server resolved it (a venv's
    python, not the binary /proc/PID/exe points to, which is the base interpreter's). A relative
    argv[0], and a relative or empty entry of the server's PATH, are taken in the server's folder,
    never in wedgectl's. Resolved once, at plan time: everything after runs this exact path."""
    first = argv[0]
    if os.sep in first:
        return os.path.normpath(os.path.join(cwd, first))
    path = os.pathsep.join(os.path.join(cwd, entry or os.curdir)
                           for entry in env.get("PATH", os.defpath).split(os.pathsep))
    found = shutil.which(first, path=path)
    if found is None:
        raise SwapError(f"cannot find {first!r} on the server's PATH")
    return os.path.normpath(os.path.abspath(found))


def host_and_port(argv: Sequence[str], base_url: str | None) -> tuple[str, int]:
    """Where to reach the server: its --host (a wildcard means this host) and the port it listens on
    (from its LISTEN socket when known, else --port, else vLLM's 8000)."""
    from wedgectl.collect.sockets import port_from_cmdline

    host = "127.0.0.1"
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--host" and i + 1 < len(argv) else arg[7:] if arg.startswith("--host=") else None
        if value is not None:
            host = "127.0.0.1" if value in ("0.0.0.0", "::", "") else value
    port = port_from_cmdline(list(argv))
    if base_url:
        with contextlib.suppress(ValueError, IndexError):
            port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    return host, port


def probe_plugin(python: str, env: Mapping[str, str], run_as: Credentials | None = None) -> tuple[str, bool]:
    """What the server's interpreter has of the plugin: (description, whether it has this version's fixes).

    It runs the interpreter, as the server's user: never from a plan (see recorded_plugin).
    """
    want = engine_version()
    # Asked with the plugin inactive: a fault or fix must not run in the probe.
    probe_env = {k: v for k, v in env.items() if k not in ACTIVE_ENV}
    try:
        have = installed_version(python, env=probe_env, run_as=run_as)
    except (OSError, ChildError) as exc:
        return f"unknown ({type(exc).__name__})", False
    return _judge(have, want)


def recorded_plugin(python: str) -> tuple[str, bool]:
    """What a plan can say of the plugin without running anything: the dist-info beside the interpreter."""
    have, where = recorded_version(python)
    if not have:
        return f"not found under {where} (asked of the interpreter, as its user, when swapping)", False
    return _judge(have, engine_version())


def _judge(have: str, want: str) -> tuple[str, bool]:
    if not have:
        return "missing", False
    if _version_tuple(have) < _version_tuple(want):
        return f"wedgectl-engine {have} (older than the bundled {want})", False
    return f"wedgectl-engine {have}", True


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3]) or (0,)


def plan_swap(pid: int, proc_root: Path = procread.PROC) -> SwapPlan:
    """Read the deployment `pid` belongs to and say what a swap would do. Touches nothing and runs
    nothing of the target's; SwapRefused when its interpreter is writable by another user."""
    from wedgectl.capture.discover import discover
    from wedgectl.model.types import Role

    dep = discover(pid=pid)
    api = dep.api_pid
    if api is None:
        raise NotVllm(f"pid {pid}: found no vLLM API server in its process tree")
    argv, env, cwd = read_proc(api, proc_root)
    if any(a == "--uds" or a.startswith("--uds=") for a in argv):
        raise SwapError("the server listens on a unix socket (--uds); swap handles TCP servers only")
    python = resolve_interpreter(argv, env, cwd)
    run_as = read_credentials(api, proc_root)
    risk = path_risk(python, run_as.uid)
    if risk:
        raise SwapRefused(f"refusing to run {python} for pid {api} ({run_as}): {risk}; only root or the "
                          f"server's user may be able to write its interpreter", exit_code=exitcodes.SWAP_UNSAFE)
    host, port = host_and_port(argv, dep.base_url)
    plugin, ok = recorded_plugin(python)
    tree = tuple([api, *(p for p, r in dep.roles.items() if p != api and r is not Role.OTHER),
                  *(p for p, r in dep.roles.items() if p != api and r is Role.OTHER)])
    return SwapPlan(api_pid=api, tree=tree, argv=tuple(argv), cwd=cwd, env=env, python=python,
                    url=f"http://{host}:{port}", port=port, host=host, log_path=dep.log_path,
                    plugin=plugin, plugin_ok=ok, run_as=run_as, supervisor=_supervisor(api, env, proc_root),
                    start_ticks=dict(dep.start_ticks))


def _supervisor(api: int, env: Mapping[str, str], proc_root: Path) -> Supervisor | None:
    """What would restart the server: a known supervisor (collect.target), or a parent that runs API
    servers and is not vLLM's own launcher (processes.server_supervisor): it may start them again."""
    found = detect_supervisor(api, env, proc_root)
    if found is not None or proc_root != procread.PROC:
        return found
    above = server_supervisor(api)
    if above is None:
        return None
    pid, why = above
    fix = " ".join(f"{k}={v}" for k, v in FIXES_ENV.items())
    return Supervisor("launcher", why, f"set {fix} in the environment pid {pid} starts its servers with, "
                                       f"and restart them through it")


# ------------------------------------------------------------------ stopping and starting


def start_command(argv: Sequence[str], env: Mapping[str, str], cwd: str, url: str, log_path: str,
                  health_timeout_s: float, run_as: Credentials | None = None,
                  guard: SignalGuard | None = None,
                  on_start: Callable[[Server], None] = lambda _s: None) -> tuple[Server | None, str]:
    """Start the server detached (it outlives wedgectl) as `run_as`, output appended to log_path (opened
    as that user); wait for /health, a wait that `guard`'s signals may cut short (SwapInterrupted).
    argv[0] must be the checked interpreter's absolute path (SwapPlan.launch_argv): exactly that file
    is executed, never one looked up on a PATH.

    (server, "") once healthy; (server, why) when it exited or stayed silent; (None, why) when it
    could not be started at all.
    """
    if not os.path.isabs(argv[0]):
        return None, f"it was not started: {argv[0]!r} is not an absolute path"
    tmp = env.get("TMPDIR")
    if tmp and (run_as is None or run_as.is_root):
        os.makedirs(tmp, exist_ok=True)  # a launcher may have removed the old server's temp folder
    try:
        server = launch(Command(argv=tuple(argv), env=env, url=url, log_path=Path(log_path), cwd=cwd,
                                run_as=run_as, executable=argv[0]), owned=False)
    except (OSError, ChildError) as exc:
        return None, f"it could not be started ({exc})"
    on_start(server)
    if guard is not None:
        guard.check()
    try:
        with guard.interruptible() if guard is not None else contextlib.nullcontext():
            wait_healthy(server, health_timeout_s)
    except ServerStartError as exc:
        return server, exc.reason
    return server, ""


def _new_log_path(plan: SwapPlan) -> str:
    """The old server's log, if its user may append to it; else a new file (in a folder of the user's own)."""
    if plan.log_path and (not plan.run_as.popen_kwargs or can_append_as(plan.log_path, plan.run_as)):
        return plan.log_path
    name = f"vllm-{plan.port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    if plan.run_as.popen_kwargs:
        # A folder of the user's own: the log is created by the server, as that user.
        folder = tempfile.mkdtemp(prefix=f"wedgectl-swap-{plan.port}-")
        os.chown(folder, plan.run_as.uid, plan.run_as.gid)
        return os.path.join(folder, name)
    from wedgectl.lab.runtime.install import cache_dir

    return str(cache_dir() / "swap" / name)


def swap_deployment(
    pid: int,
    dry_run: bool = False,
    progress: Callable[[str], None] = lambda _m: None,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
    stop_grace_s: float = STOP_GRACE_S,
    plan: SwapPlan | None = None,
    force: bool = False,
) -> SwapResult:
    """Replace the deployment `pid` belongs to with the same command, fixes on, on the same port.

    SwapRefused when a supervisor runs it (unless `force`). A dry run executes
    nothing of the target's. SIGINT, SIGTERM or SIGHUP while the old server is
    down roll back: the original command is started again (result.interrupted).
    """
    plan = plan or plan_swap(pid)
    if stop_grace_s != plan.stop_grace_s:
        plan = replace(plan, stop_grace_s=stop_grace_s)
    if plan.supervisor is not None and not force:
        raise SwapRefused(f"refusing to swap pid {plan.api_pid}: {plan.supervisor.line}",
                          exit_code=exitcodes.SWAP_SUPERVISED)
    if dry_run:
        return SwapResult(plan, dry_run=True, ok=True, message="dry run: nothing was touched")
    result = SwapResult(plan, dry_run=False, ok=False, message="")
    say = _Say(progress, result, plan)
    if plan.supervisor is not None:
        say(f"--force: swapping although {plan.supervisor.line}")
    with SignalGuard() as guard:
        try:
            with guard.interruptible():
                _ensure_plugin(plan, say)
        except SwapInterrupted as sig:
            raise SwapError(f"interrupted by {sig} while installing the plugin; nothing was stopped",
                            exit_code=exitcodes.INTERRUPTED) from None
        restore = _write_restore(plan, _new_log_path(plan))
        result.log_path = restore.log_path
        try:
            return _replace(plan, result, say, guard, health_timeout_s, restore)
        except SwapInterrupted as sig:
            result.interrupted = str(sig)
            say(f"interrupted by {sig}: rolling back to the original command")
            return _roll_back(plan, result, say, guard, health_timeout_s, restore, f"interrupted by {sig}")
        except Exception:
            say(f"swap stopped by an error; to start the original command again: sh {restore.path}")
            raise
        finally:
            if result.ok or (result.rolled_back and result.restore_script is None):
                restore.discard()


@dataclass(frozen=True)
class _Restore:
    """The restore script on disk and where the servers log."""

    path: Path
    log_path: str

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def _write_restore(plan: SwapPlan, log_path: str) -> _Restore:
    from wedgectl.lab.runtime.install import cache_dir

    text = restore_script(plan.launch_argv, plan.env, plan.cwd, log_path, plan.run_as)
    return _Restore(write_restore_script(cache_dir() / "swap", plan.port, text), log_path)


def _ensure_plugin(plan: SwapPlan, say: Callable[[str], None]) -> None:
    """The plugin in the server's interpreter, asked and installed as the server's user."""
    probe_env = {k: v for k, v in plan.env.items() if k not in ACTIVE_ENV}
    plugin, ok = (plan.plugin, True) if plan.plugin_ok else probe_plugin(plan.python, plan.env, plan.run_as)
    if ok:
        return
    target = install_dir(plan.python, probe_env, plan.run_as)
    risk = path_risk(target, plan.run_as.uid) if target else f"{plan.python} did not say where it installs"
    if risk:
        raise SwapRefused(f"refusing to install the plugin for pid {plan.api_pid} ({plan.run_as}): {risk}; "
                          f"nothing was stopped", exit_code=exitcodes.SWAP_UNSAFE)
    say(f"plugin in {plan.python}: {plugin}; installing the bundled engine/ as {plan.run_as}")
    try:
        ensure_engine_plugin(Path(plan.python), say, env=probe_env, run_as=plan.run_as)
    except PluginInstallError as exc:
        raise SwapError(f"cannot install the plugin into {plan.python}: {exc}; nothing was stopped") from None


def _replace(plan: SwapPlan, result: SwapResult, say: _Say, guard: SignalGuard, health_timeout_s: float,
             restore: _Restore) -> SwapResult:
    """Stop the old tree, start the patched command; roll back if it never gets healthy."""
    say(f"stopping pid {plan.api_pid} and its tree (SIGTERM, SIGKILL after {plan.stop_grace_s:g} s)")
    t_stop = result.t_stop = time.monotonic()
    stopped = stop_tree(plan.api_pid, plan.stop_grace_s, extra=plan.tree, planned=plan.start_ticks)
    result.stop_s, result.killed = stopped.seconds, stopped.killed
    for refusal in stopped.refused:
        say(refusal)
    say(f"old server gone after {result.stop_s:.1f} s" + (" (SIGKILL needed)" if result.killed else ""))
    guard.check()
    with guard.interruptible():
        wait_port_free(plan.host, plan.port, PORT_WAIT_S)
    say(f"starting the same command with {', '.join(f'{k}={v}' for k, v in FIXES_ENV.items())} on port {plan.port}")
    new, why = _start(plan, plan.new_env, result, guard, health_timeout_s)
    if not why:
        result.ok = True
        result.new_pid = new.pid if new else None
        result.downtime_s = round(time.monotonic() - t_stop, 2)
        result.fixes = _fixes_of(result.log_path)
        result.message = (f"swapped: pid {result.new_pid} serves {plan.url} with the wedge_engine fixes on"
                          f"{_fixes_text(result.fixes)} (downtime {result.downtime_s:.1f} s)")
        say(result.message)
        return result
    say(f"the patched server did not become healthy: {why}; starting the original command again")
    return _roll_back(plan, result, say, guard, health_timeout_s, restore,
                      f"the patched server did not become healthy ({why})")


FIXES_LOG_MAX = 4 << 20  # the tail of the new server's log read for the plugin's lines


def _fixes_of(log_path: str | None) -> PluginFixes | None:
    """What the plugin says it turned on in the new server (each process logs it before /health answers)."""
    if not log_path:
        return None
    try:
        fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - FIXES_LOG_MAX), os.SEEK_SET)
        text = os.read(fd, FIXES_LOG_MAX).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    return plugin_fixes(text.splitlines())


def _fixes_text(fixes: PluginFixes | None) -> str:
    if fixes is None or not fixes.found:
        return " (the plugin logged no line about them: see the server's log)"
    text = f": {', '.join(fixes.on) or 'none'} (vLLM {fixes.vllm})"
    return text + (f"; off on this vLLM: {', '.join(fixes.off)}" if fixes.off else "")


def _start(plan: SwapPlan, env: Mapping[str, str], result: SwapResult, guard: SignalGuard,
           health_timeout_s: float) -> tuple[Server | None, str]:
    """start_command, with the server kept on the result as soon as it runs (a signal may come next)."""

    def keep(server: Server) -> None:
        result.server = server

    return start_command(plan.launch_argv, env, plan.cwd, plan.url, result.log_path or _new_log_path(plan),
                         health_timeout_s, plan.run_as, guard, on_start=keep)


def _roll_back(plan: SwapPlan, result: SwapResult, say: _Say, guard: SignalGuard, health_timeout_s: float,
               restore: _Restore, cause: str) -> SwapResult:
    """Stop whatever was started and start the original command again; say exactly what runs if that fails."""
    result.rolled_back = True
    t_stop = result.t_stop or time.monotonic()
    try:
        if result.server is not None:
            stop_server(result.server, grace=5.0)
            result.server = None
        if result.stop_s is None:  # the signal came before the old tree was stopped: finish that first
            stopped = stop_tree(plan.api_pid, plan.stop_grace_s, extra=plan.tree, planned=plan.start_ticks)
            result.stop_s, result.killed = stopped.seconds, stopped.killed
        wait_port_free(plan.host, plan.port, PORT_WAIT_S)
        original, why_back = _start(plan, plan.env, result, guard, health_timeout_s)
    except SwapInterrupted as sig:
        original, why_back = result.server, f"interrupted again by {sig} while rolling back"
    result.new_pid = original.pid if original else None
    if not why_back:
        result.downtime_s = round(time.monotonic() - t_stop, 2)
        result.message = (f"swap failed: {cause}; the original command is running again as pid "
                          f"{result.new_pid} (downtime {result.downtime_s:.1f} s)")
        say(result.message)
        return result
    result.restore_script = str(restore.path)
    running = _running_now(plan, original)
    result.message = (f"swap failed: {cause}, and the original command did not come back ({why_back}); "
                      + "; ".join(running)
                      + ("; if it does not answer /health, stop it, then" if original and original.tree_pids() else ";")
                      + f" to start the original again: sh {restore.path} (log {result.log_path})")
    say(result.message)
    return result


def _running_now(plan: SwapPlan, server: Server | None) -> list[str]:
    """What serves, or holds, the port now: pids and commands, secrets redacted."""
    lines = []
    pids = server.tree_pids() if server is not None else ()
    for pid in pids:
        try:
            cmd = " ".join(redact_argv(procread.read_cmdline(pid)))
        except OSError:
            continue
        lines.append(f"running now: pid {pid}: {cmd}")
    return lines or [f"nothing wedgectl started is running for port {plan.port}"]


class _Say:
    """progress(), with secrets redacted, and every step kept in the result."""

    def __init__(self, progress: Callable[[str], None], result: SwapResult, plan: SwapPlan) -> None:
        self.progress, self.result, self.plan = progress, result, plan

    def __call__(self, msg: str) -> None:
        msg = redact_text(msg, self.plan.env, self.plan.argv)
        self.result.steps.append(msg)
        with contextlib.suppress(OSError):  # a terminal gone with SIGHUP must not stop a rollback
            self.progress(msg)
