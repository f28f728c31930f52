"""Hot-swapping a running vLLM server for the same command with the wedge_engine fixes on (`wedgectl swap`).

The plan comes from /proc: the API server's command line, environment and
working directory, the deployment's process tree and the port it serves.
The swap: make sure the server's interpreter can import the plugin (install
the one this wedgectl carries if not, or if older), stop the old tree
(lifecycle.stop_tree: SIGTERM to the API server, SIGKILL to whatever of the
tree is left after a bound: it works on a server stuck in the shutdown hang),
start the same command in the same directory with the fixes on
(plugin.FIXES_ENV) on the same port, wait for /health, report the downtime. If the patched server never gets healthy, the original
command is started again and the result says so.

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
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wedgectl import exitcodes
from wedgectl.errors import NoSuchProcess, NotVllm, WedgectlError
from wedgectl.lifecycle import (
    Command,
    Server,
    ServerStartError,
    launch,
    stop_server,
    stop_tree,
    wait_healthy,
    wait_port_free,
)
from wedgectl.plugin import (
    ACTIVE_ENV,
    FIXES_ENV,
    PluginInstallError,
    engine_version,
    ensure_engine_plugin,
    installed_version,
)

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)
# Set at run time by the plugin in the old API server; the new one makes its own.
DROP_ENV = ("WEDGE_ENGINE_STATUS_FILE",)
STOP_GRACE_S = 15.0
HEALTH_TIMEOUT_S = 600.0
PORT_WAIT_S = 10.0  # for the stopped server's port to be free again


class SwapError(WedgectlError):
    exit_code = exitcodes.SWAP_FAILED


# ------------------------------------------------------------------ redaction (pure)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_name(k) and v else v) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with the values of credential-like flags (--api-key X, --hf-token=X) replaced."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("--") and is_secret_name(arg.split("=", 1)[0]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def redact_text(text: str, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """`text` with every secret value of `env` and `argv` replaced (for messages that quote output)."""
    secrets = [v for k, v in env.items() if is_secret_name(k) and len(v) >= 4]
    secrets += [a for a, r in zip(argv, redact_argv(argv)) if r != a and len(a) >= 4]
    secrets += [a.split("=", 1)[1] for a, r in zip(argv, redact_argv(argv))
                if r != a and "=" in a and len(a.split("=", 1)[1]) >= 4]
    for s in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class SwapPlan:
    """What a swap will do; `env` holds secrets and is never printed (use `describe`)."""

    api_pid: int
    tree: tuple[int, ...]
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str] = field(repr=False)
    python: str
    url: str
    port: int
    host: str
    log_path: str | None  # the old server's log file (the new one appends to it), if it has one
    plugin: str  # what the interpreter has: "wedgectl-engine 0.2.0", "missing", "0.1.0 (older)"
    plugin_ok: bool
    stop_grace_s: float = STOP_GRACE_S

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
            "new_env_changes": {k: v for k, v in self.new_env.items() if self.env.get(k) != v},
            "python": self.python,
            "url": self.url,
            "port": self.port,
            "log": self.log_path,
            "plugin": self.plugin,
            "plugin_ok": self.plugin_ok,
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

    @property
    def url(self) -> str:
        return self.plan.url

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "dry_run": self.dry_run, "message": self.message, "new_pid": self.new_pid,
            "url": self.plan.url, "downtime_s": self.downtime_s, "stop_s": self.stop_s, "killed": self.killed,
            "rolled_back": self.rolled_back, "log": self.log_path, "steps": self.steps, "plan": self.plan.to_json(),
        }


def read_proc(pid: int, proc_root: Path = Path("/proc")) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, cwd) of a process, from /proc; NoSuchProcess / SwapError when unreadable."""
    base = proc_root / str(pid)
    try:
        argv = [a.decode(errors="surrogateescape") for a in (base / "cmdline").read_bytes().split(b"\0") if a]
        raw_env = (base / "environ").read_bytes()
        cwd = os.readlink(base / "cwd")
    except FileNotFoundError:
        raise NoSuchProcess(f"pid {pid}: no such process") from None
    except PermissionError:
        raise SwapError(f"pid {pid}: cannot read its environment or cwd (run as its user or root)",
                        exit_code=exitcodes.PERMISSION) from None
    env: dict[str, str] = {}
    for item in raw_env.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="surrogateescape")] = v.decode(errors="surrogateescape")
    if not argv:
        raise SwapError(f"pid {pid} has no command line (a zombie or kernel thread)")
    return argv, env, cwd


def resolve_interpreter(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """The python the server runs: argv[0] as the server resolved it (a venv's python, not the
    binary /proc/PID/exe points to, which is the base interpreter's)."""
    first = argv[0]
    if os.sep in first:
        return first if os.path.isabs(first) else os.path.normpath(os.path.join(cwd, first))
    found = shutil.which(first, path=env.get("PATH", os.defpath))
    if found is None:
        raise SwapError(f"cannot find {first!r} on the server's PATH")
    return found


def host_and_port(argv: Sequence[str], base_url: str | None) -> tuple[str, int]:
    """Where to reach the server: its --host (a wildcard means this host) and the port it listens on
    (from its LISTEN socket when known, else --port, else vLLM's 8000)."""
    from wedgectl.discover import port_from_cmdline

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


def probe_plugin(python: str, env: Mapping[str, str]) -> tuple[str, bool]:
    """What the server's interpreter has of the plugin: (description, whether it has this version's fixes)."""
    want = engine_version()
    # Asked with the plugin inactive: a fault or fix must not run in the probe.
    probe_env = {k: v for k, v in env.items() if k not in ACTIVE_ENV}
    try:
        have = installed_version(python, env=probe_env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})", False
    if not have:
        return "missing", False
    if _version_tuple(have) < _version_tuple(want):
        return f"wedgectl-engine {have} (older than the bundled {want})", False
    return f"wedgectl-engine {have}", True


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3]) or (0,)


def plan_swap(pid: int, proc_root: Path = Path("/proc")) -> SwapPlan:
    """Read the deployment `pid` belongs to and say what a swap would do. Touches nothing."""
    from wedgectl.discover import discover
    from wedgectl.types import Role

    dep = discover(pid=pid)
    api = dep.api_pid
    if api is None:
        raise NotVllm(f"pid {pid}: found no vLLM API server in its process tree")
    argv, env, cwd = read_proc(api, proc_root)
    if any(a == "--uds" or a.startswith("--uds=") for a in argv):
        raise SwapError("the server listens on a unix socket (--uds); swap handles TCP servers only")
    python = resolve_interpreter(argv, env, cwd)
    host, port = host_and_port(argv, dep.base_url)
    plugin, ok = probe_plugin(python, env)
    tree = tuple([api, *(p for p, r in dep.roles.items() if p != api and r is not Role.OTHER),
                  *(p for p, r in dep.roles.items() if p != api and r is Role.OTHER)])
    return SwapPlan(api_pid=api, tree=tree, argv=tuple(argv), cwd=cwd, env=env, python=python,
                    url=f"http://{host}:{port}", port=port, host=host, log_path=dep.log_path,
                    plugin=plugin, plugin_ok=ok)


# ------------------------------------------------------------------ stopping and starting


def start_command(argv: Sequence[str], env: Mapping[str, str], cwd: str, url: str, log_path: str,
                  health_timeout_s: float) -> tuple[Server, str]:
    """Start the server detached (it outlives wedgectl), output appended to log_path; wait for /health.

    (server, "") once healthy; (server, why) when it exited or stayed silent.
    """
    tmp = env.get("TMPDIR")
    if tmp:
        os.makedirs(tmp, exist_ok=True)  # a launcher may have removed the old server's temp folder
    server = launch(Command(argv=tuple(argv), env=env, url=url, log_path=Path(log_path), cwd=cwd), owned=False)
    try:
        wait_healthy(server, health_timeout_s)
    except ServerStartError as exc:
        return server, exc.reason
    return server, ""


def _new_log_path(plan: SwapPlan) -> str:
    if plan.log_path:
        return plan.log_path
    from wedgectl.runtime.install import cache_dir

    return str(cache_dir() / "swap" / f"vllm-{plan.port}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def swap_deployment(
    pid: int,
    dry_run: bool = False,
    progress: Callable[[str], None] = lambda _m: None,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
    stop_grace_s: float = STOP_GRACE_S,
    plan: SwapPlan | None = None,
) -> SwapResult:
    """Replace the deployment `pid` belongs to with the same command, fixes on, on the same port."""
    plan = plan or plan_swap(pid)
    if stop_grace_s != plan.stop_grace_s:
        from dataclasses import replace

        plan = replace(plan, stop_grace_s=stop_grace_s)
    if dry_run:
        return SwapResult(plan, dry_run=True, ok=True, message="dry run: nothing was touched")
    result = SwapResult(plan, dry_run=False, ok=False, message="")
    say = _Say(progress, result, plan)
    if not plan.plugin_ok:
        say(f"plugin in {plan.python}: {plan.plugin}; installing the bundled engine/")
        try:
            ensure_engine_plugin(Path(plan.python), say)
        except PluginInstallError as exc:
            raise SwapError(f"cannot install the plugin into {plan.python}: {exc}; nothing was stopped") from None
    say(f"stopping pid {plan.api_pid} and its tree (SIGTERM, SIGKILL after {plan.stop_grace_s:g} s)")
    t_stop = time.monotonic()
    stopped = stop_tree(plan.api_pid, plan.stop_grace_s, extra=plan.tree)
    result.stop_s, result.killed = stopped.seconds, stopped.killed
    say(f"old server gone after {result.stop_s:.1f} s" + (" (SIGKILL needed)" if result.killed else ""))
    wait_port_free(plan.host, plan.port, PORT_WAIT_S)
    log_path = _new_log_path(plan)
    result.log_path = log_path
    say(f"starting the same command with {', '.join(f'{k}={v}' for k, v in FIXES_ENV.items())} on port {plan.port}")
    new, why = start_command(plan.argv, plan.new_env, plan.cwd, plan.url, log_path, health_timeout_s)
    if not why:
        result.ok = True
        result.new_pid = new.pid
        result.downtime_s = round(time.monotonic() - t_stop, 2)
        result.message = (f"swapped: pid {new.pid} serves {plan.url} with the wedge_engine fixes on "
                          f"(downtime {result.downtime_s:.1f} s)")
        say(result.message)
        return result
    say(f"the patched server did not become healthy: {why}; starting the original command again")
    stop_server(new, grace=5.0)
    wait_port_free(plan.host, plan.port, PORT_WAIT_S)
    original, why_back = start_command(plan.argv, plan.env, plan.cwd, plan.url, log_path, health_timeout_s)
    result.rolled_back = True
    result.new_pid = original.pid
    if not why_back:
        result.downtime_s = round(time.monotonic() - t_stop, 2)
        result.message = (f"swap failed: the patched server did not become healthy ({why}); the original "
                          f"command is running again as pid {original.pid} (downtime {result.downtime_s:.1f} s)")
    else:
        result.message = (f"swap failed: the patched server did not become healthy ({why}), and neither did "
                          f"the original command started again as pid {original.pid} ({why_back}); see {log_path}")
    say(result.message)
    return result


class _Say:
    """progress(), with secrets redacted, and every step kept in the result."""

    def __init__(self, progress: Callable[[str], None], result: SwapResult, plan: SwapPlan) -> None:
        self.progress, self.result, self.plan = progress, result, plan

    def __call__(self, msg: str) -> None:
        msg = redact_text(msg, self.plan.env, self.plan.argv)
        self.result.steps.append(msg)
        self.progress(msg)
