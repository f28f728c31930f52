"""Starts and stops a real vLLM OpenAI server with the runtime's python.

The server runs in its own session so the whole tree (API server, EngineCore,
Worker, multiprocessing's resource tracker) can be found and torn down by
pid; nothing here leaves a process behind, whatever exception interrupts it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import psutil

from wedgectl import exitcodes
from wedgectl.errors import WedgectlError
from wedgectl.runtime.install import cache_dir

SERVE_SCRIPT = Path(__file__).with_name("_serve.py")

# Flags that make the tiny model serve on a small CPU box and start quickly.
# --block-size: CPU attention needs a multiple of 32 (16 fails with
#   "No common block size").
# --enforce-eager: skips torch.compile and its warm-up. Time to /health on
#   2 cores, tiny model: 43 s cold / 27 s warm (compile cache filled) without
#   it, 22 s / 17 s with it; generation speed is about the same.
# --max-model-len 512: small KV footprint; the tiny model allows 4096.
CPU_SERVE_DEFAULTS: tuple[str, ...] = (
    "--dtype", "bfloat16",
    "--block-size", "32",
    "--max-model-len", "512",
    "--enforce-eager",
)

HEALTH_POLL_S = 0.5
LOG_TAIL_LINES = 40


class ServerStartError(WedgectlError):
    """vLLM exited or never answered /health; the message ends with the log tail."""

    exit_code = exitcodes.SERVER_FAILED


@dataclass(frozen=True)
class ServerSpec:
    """What to serve and how. `extra_args` come last, so they override defaults."""

    model: Path
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "tiny"
    defaults: tuple[str, ...] = CPU_SERVE_DEFAULTS
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True, eq=False)
class Server:
    pid: int
    url: str
    log_path: Path
    popen: subprocess.Popen
    spec: ServerSpec
    tmp_dir: Path
    started_at: float  # time.time() just before the launch
    _log: IO[bytes] = field(repr=False)

    def tree_pids(self) -> tuple[int, ...]:
        """The API server and every live descendant, right now."""
        try:
            root = psutil.Process(self.pid)
            return (self.pid, *(p.pid for p in root.children(recursive=True)))
        except psutil.Error:
            return ()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (racy by nature; bind soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_args(spec: ServerSpec) -> list[str]:
    """argv after the interpreter and _serve.py."""
    return [
        "serve", str(spec.model),
        "--host", spec.host,
        "--port", str(spec.port),
        "--served-model-name", spec.served_model_name,
        *spec.defaults,
        *spec.extra_args,
    ]


def server_env(
    spec: ServerSpec,
    tmp_dir: Path,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The server's environment: `base`, offline and CPU defaults, then spec.env."""
    env = dict(os.environ if base is None else base)
    defaults = {
        # vLLM writes a torch.compile cache under ~/.cache/vllm otherwise.
        "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # GiB of KV cache on CPU; the default (4+) is far more than needed.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # "auto" pins every server's Worker to the same core (core 0 of 2
        # here), so two servers on one box starve each other; one unpinned
        # thread is all the tiny model needs.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    for key, value in defaults.items():
        env.setdefault(key, value)
    # Log lines must reach the file as they are written: other tools tail it.
    env["PYTHONUNBUFFERED"] = "1"
    # vLLM leaves /tmp/vllm_dist_* files behind; give it a folder we remove.
    env["TMPDIR"] = str(tmp_dir)
    env.update(spec.env)
    return env


def start_server(
    spec: ServerSpec,
    python: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    health_timeout: float = 180,
) -> Server:
    """Launch vLLM and return once GET /health answers 200.

    Raises ServerStartError (after tearing the tree down) if the process exits
    first or /health stays silent for `health_timeout` seconds.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Short path on purpose: ZMQ ipc:// socket paths live here (108-byte limit).
    tmp_dir = Path(tempfile.mkdtemp(prefix="wedgectl-vllm-"))
    log = open(log_path, "ab")
    started_at = time.time()
    try:
        popen = subprocess.Popen(
            [str(python), str(SERVE_SCRIPT), *serve_args(spec)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(spec, tmp_dir),
            start_new_session=True,
        )
    except BaseException:
        log.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    server = Server(
        pid=popen.pid,
        url=spec.url,
        log_path=log_path,
        popen=popen,
        spec=spec,
        tmp_dir=tmp_dir,
        started_at=started_at,
        _log=log,
    )
    _live.add(server)
    try:
        _wait_healthy(server, health_timeout)
    except BaseException:
        stop_server(server, grace=5)
        raise
    return server


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            code = server.popen.poll()
            if code is not None:
                raise ServerStartError(
                    f"vLLM exited with code {code} before /health answered "
                    f"(log {server.log_path}):\n{log_tail(server.log_path)}"
                )
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"vLLM did not answer {server.url}/health within "
                    f"{timeout:.0f} s (log {server.log_path}):\n"
                    f"{log_tail(server.log_path)}"
                )
            time.sleep(HEALTH_POLL_S)


def stop_server(server: Server, grace: float = 10) -> float:
    """Tear the server's whole tree down; return seconds until it had exited.

    SIGTERM goes to the API server only (vLLM stops its own engine processes);
    whatever of the tree still runs after `grace` seconds is SIGKILLed. The
    return value counts until every process had exited; after that it waits a
    little longer (bounded) for the exited ones to be reaped, so their pids
    are gone when it returns. Calling it again is harmless.
    """
    start = time.monotonic()
    others = _find_descendants(server)
    # Only then is the group id surely still this server's (see _kill_tree).
    group_is_ours = server.popen.poll() is None or bool(others)
    try:
        if server.popen.poll() is None:
            server.popen.send_signal(signal.SIGTERM)
        _wait_exited(server, others, start + grace)
    finally:
        # Also on KeyboardInterrupt mid-wait: nothing of the tree survives.
        _kill_tree(server, others, group_is_ours)
        elapsed = time.monotonic() - start
        _wait_reaped(others, time.monotonic() + 5)
        server._log.close()
        shutil.rmtree(server.tmp_dir, ignore_errors=True)
        _live.discard(server)
    return elapsed


def detach(server: Server) -> None:
    """Stop owning a server: wedgectl's exit leaves it running (repro --keep)."""
    _live.discard(server)
    server._log.close()


@contextlib.contextmanager
def running_server(
    spec: ServerSpec,
    python: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    health_timeout: float = 180,
    grace: float = 10,
) -> Iterator[Server]:
    server = start_server(spec, python, log_path, health_timeout)
    try:
        yield server
    finally:
        stop_server(server, grace)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _find_descendants(server: Server) -> list[psutil.Process]:
    """Every process of the server's tree except the API server itself.

    Its children are found from it while it is alive; once it is dead they are
    reparented and only their process group (the session's, = its pid) still
    ties them to the server, so members of that group are collected too.
    """
    found: dict[int, psutil.Process] = {}
    if server.popen.poll() is None:
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(server.pid).children(recursive=True):
                found[proc.pid] = proc
    for proc in psutil.process_iter():
        if proc.pid == server.pid or proc.pid in found:
            continue
        try:
            # create_time rules out a group id reused after the server's end.
            if (
                os.getpgid(proc.pid) == server.pid
                and proc.create_time() >= server.started_at - 1
            ):
                found[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    return list(found.values())


def _has_exited(proc: psutil.Process) -> bool:
    # A zombie has exited; it only waits for its (new) parent to reap it.
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_exited(server: Server, others: list[psutil.Process], deadline: float) -> None:
    while True:
        server.popen.poll()  # reaps the API server once it exits
        if server.popen.returncode is not None and all(map(_has_exited, others)):
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _kill_tree(server: Server, others: list[psutil.Process], group_is_ours: bool) -> None:
    if server.popen.poll() is None:
        server.popen.kill()
    for proc in others:
        if not _has_exited(proc):
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil refuses if the pid was reused
    # Anything started after the snapshot is still in the session's group.
    # Linux does not reuse a pid while it names a live process group, and the
    # group had members a moment ago, so the id still means this server.
    if group_is_ours:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.popen.wait(timeout=5)


def _wait_reaped(others: list[psutil.Process], deadline: float) -> None:
    # Children of the dead API server are reaped by init (or a subreaper),
    # which on some machines takes a second or two.
    pending = list(others)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if _pid_alive(p)]
        if pending:
            time.sleep(0.1)


def _pid_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


# Servers started and not yet stopped, so an interpreter exit stops them too.
_live: set[Server] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            stop_server(server, grace=2)
