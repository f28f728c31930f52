"""One server lifecycle: start a vLLM server, wait for its /health, stop its process tree.

`runtime` (the managed server), `repro`, `patched` and `swap` all start and stop
servers through here. A server runs in a session of its own, so its whole tree
(API server, EngineCore, Worker, multiprocessing's resource tracker) can be
found by its process group even after the API server died; every wait is
bounded, including the ones after a SIGKILL, and an interpreter exit stops the
servers this process still owns.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from wedgectl import exitcodes
from wedgectl.errors import WedgectlError

HEALTH_POLL_S = 0.5
HEALTH_REQUEST_S = 2.0  # one GET /health; a server that takes longer is not healthy yet
STOP_POLL_S = 0.05
KILL_WAIT_S = 5.0  # after SIGKILL, for the kernel to end what was killed
REAP_WAIT_S = 5.0  # then for init (or a subreaper) to reap the orphans: seconds on some machines
LOG_TAIL_LINES = 40


class ServerStartError(WedgectlError):
    """vLLM exited or never answered /health; the message ends with the log tail.

    `reason` is the same in one short clause, without the log ("it exited with code 1").
    """

    exit_code = exitcodes.SERVER_FAILED

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True)
class Command:
    """A server to start: its argv and complete environment, where it logs and where it answers."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    url: str  # the base URL its /health answers on
    log_path: Path  # appended to
    cwd: str | None = None
    tmp_dir: Path | None = None  # a folder of the server's own (its TMPDIR), removed when it stops


@dataclass(frozen=True, eq=False)
class Server:
    """A server this process started (in a session of its own, so its pid is its process group)."""

    pid: int
    url: str
    log_path: Path
    popen: subprocess.Popen
    started_at: float  # time.time() just before the launch
    tmp_dir: Path | None = None

    def tree_pids(self) -> tuple[int, ...]:
        """The API server and every live descendant, right now."""
        try:
            root = psutil.Process(self.pid)
            return (self.pid, *(p.pid for p in root.children(recursive=True)))
        except psutil.Error:
            return ()


@dataclass(frozen=True)
class Stopped:
    """How a tree went: seconds from SIGTERM until every process had exited, and whether it took SIGKILL."""

    seconds: float
    killed: bool


# ------------------------------------------------------------------ starting


def start_server(command: Command, health_timeout: float = 180) -> Server:
    """Launch `command` (owned) and return once GET /health answers 200.

    Raises ServerStartError, after tearing the tree down, when the process exits
    first or /health stays silent for `health_timeout` seconds; any other
    exception while it starts (Ctrl-C included) tears it down too.
    """
    server = launch(command)
    try:
        wait_healthy(server, health_timeout)
    except BaseException:
        stop_server(server, grace=5)
        raise
    return server


def launch(command: Command, owned: bool = True) -> Server:
    """Start `command` in a session of its own and return at once.

    An owned server is stopped when this interpreter exits unless it was
    stopped or detached before; one that is not (swap's, which must outlive
    wedgectl) is left to its caller.
    """
    command.log_path.parent.mkdir(parents=True, exist_ok=True)
    started_at = time.time()
    try:
        # The child keeps its own copy of the descriptor; ours closes at once.
        with open(command.log_path, "ab") as log:
            popen = subprocess.Popen(
                list(command.argv),
                cwd=command.cwd,
                env=dict(command.env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except BaseException:
        if command.tmp_dir is not None:
            shutil.rmtree(command.tmp_dir, ignore_errors=True)
        raise
    server = Server(popen.pid, command.url, command.log_path, popen, started_at, command.tmp_dir)
    if owned:
        _live.add(server)
    return server


def health_status(client: httpx.Client, url: str) -> int | None:
    """The status code of one GET url/health; None when nothing answered."""
    try:
        return client.get(f"{url}/health").status_code
    except httpx.HTTPError:
        return None


def health_client() -> httpx.Client:
    """A client for the local server: trust_env=False, since a proxy from the environment
    (HTTP_PROXY without a NO_PROXY for it) would turn a healthy local server into an error."""
    return httpx.Client(timeout=HEALTH_REQUEST_S, trust_env=False)


def wait_healthy(server: Server, timeout: float) -> None:
    """Poll /health until 200; ServerStartError when the process exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    with health_client() as client:
        while True:
            code = server.popen.poll()
            if code is not None:
                raise ServerStartError(
                    f"vLLM exited with code {code} before /health answered "
                    f"(log {server.log_path}):\n{log_tail(server.log_path)}",
                    reason=f"it exited with code {code}",
                )
            if health_status(client, server.url) == 200:
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"vLLM did not answer {server.url}/health within {timeout:.0f} s "
                    f"(log {server.log_path}):\n{log_tail(server.log_path)}",
                    reason=f"/health did not answer 200 within {timeout:.0f} s",
                )
            time.sleep(HEALTH_POLL_S)


def start_detached(argv: list[str]) -> subprocess.Popen:
    """A helper process that outlives wedgectl (its own session, no stdio): repro --keep's clients."""
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


# ------------------------------------------------------------------ stopping


def signal_server(server: Server, sig: signal.Signals) -> None:
    """Send `sig` to the API server alone, as an orchestrator does (repro's shutdown step)."""
    with contextlib.suppress(ProcessLookupError):
        server.popen.send_signal(sig)


def wait_exit(server: Server, timeout: float) -> float | None:
    """Seconds until the API server exited (reaped), or None when it outlived `timeout`."""
    start = time.monotonic()
    try:
        server.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - start


def stop_server(server: Server, grace: float = 10) -> float:
    """Tear a started server's whole tree down; return seconds until it had exited.

    SIGTERM goes to the API server only (vLLM stops its own engine processes);
    whatever of the tree still runs after `grace` seconds is SIGKILLed. Calling
    it again is harmless.
    """
    try:
        return stop_tree(server.pid, grace, popen=server.popen, started_at=server.started_at).seconds
    finally:
        if server.tmp_dir is not None:
            shutil.rmtree(server.tmp_dir, ignore_errors=True)
        _live.discard(server)


def detach(server: Server) -> None:
    """Stop owning a server: wedgectl's exit leaves it running (repro --keep, swap)."""
    _live.discard(server)


@contextlib.contextmanager
def running(command: Command, health_timeout: float = 180, grace: float = 10) -> Iterator[Server]:
    """A started server for the length of a with-block, stopped however the block ends."""
    server = start_server(command, health_timeout)
    try:
        yield server
    finally:
        stop_server(server, grace)


def stop_tree(
    pid: int,
    grace: float,
    *,
    popen: subprocess.Popen | None = None,
    extra: Iterable[int] = (),
    started_at: float | None = None,
) -> Stopped:
    """SIGTERM `pid`; SIGKILL what is left of its tree (and of `extra`) after `grace` seconds.

    With `popen` (a server started here, in a session of its own) the members
    of its process group count as its tree too, so orphans of an API server that
    died are found; `started_at` rules out a group id reused since. A zombie
    counts as exited; children of this process are reaped. The seconds returned
    run until every process had exited; after that it waits (bounded) for the
    orphans to be reaped, so their pids are gone when it returns.
    """
    start = time.monotonic()
    tree = _Tree(pid, popen, started_at)
    tree.collect(extra)
    # Only while the group has members is its id surely still this tree's.
    group_is_ours = popen is not None and (not tree.root_exited() or bool(tree.others))
    try:
        if not tree.root_exited():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        tree.wait_exited(start + grace)
    finally:
        # Also on KeyboardInterrupt mid-wait: nothing of the tree survives.
        killed = tree.kill(group_is_ours)
        if killed:
            tree.wait_exited(time.monotonic() + KILL_WAIT_S)
    seconds = time.monotonic() - start
    tree.wait_reaped(time.monotonic() + REAP_WAIT_S)
    return Stopped(seconds, killed)


class _Tree:
    """The processes of one server: its root (by pid, or our Popen) and the others, found once."""

    def __init__(self, pid: int, popen: subprocess.Popen | None, started_at: float | None) -> None:
        self.pid, self.popen = pid, popen
        self.root: psutil.Process | None = None
        with contextlib.suppress(psutil.Error):
            self.root = psutil.Process(pid)
        if started_at is None and self.root is not None:
            with contextlib.suppress(psutil.Error):
                started_at = self.root.create_time()
        self.started_at = started_at
        self.others: dict[int, psutil.Process] = {}

    def collect(self, extra: Iterable[int] = ()) -> None:
        """The root's descendants while it lives; members of its group (ours only); `extra`."""
        if self.root is not None and not self.root_exited():
            with contextlib.suppress(psutil.Error):
                for proc in self.root.children(recursive=True):
                    self.others.setdefault(proc.pid, proc)
        if self.popen is not None and self.started_at is not None:
            for proc in psutil.process_iter():
                if proc.pid == self.pid or proc.pid in self.others:
                    continue
                try:
                    # create_time rules out a group id reused after the server's end.
                    if os.getpgid(proc.pid) == self.pid and proc.create_time() >= self.started_at - 1:
                        self.others[proc.pid] = proc
                except (OSError, psutil.Error):
                    continue
        for other in extra:
            if other != self.pid and other not in self.others:
                with contextlib.suppress(psutil.Error):
                    self.others[other] = psutil.Process(other)

    def root_exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None  # reaps it once it exits
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, os.WNOHANG)  # our child (a swap's earlier server): leave no zombie
        return self.root is None or _has_exited(self.root)

    def all_exited(self) -> bool:
        return self.root_exited() and all(map(_has_exited, self.others.values()))

    def wait_exited(self, deadline: float) -> None:
        while not self.all_exited() and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)

    def kill(self, group_is_ours: bool) -> bool:
        """SIGKILL whatever has not exited; whether anything had to be."""
        if self.root is not None and not self.root_exited():
            # Children it started during the grace are in the tree too.
            self.collect()
        left = [p for p in self.others.values() if not _has_exited(p)]
        killed = not self.root_exited() or bool(left)
        if not self.root_exited():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self.popen is not None:
                    self.popen.kill()
                elif self.root is not None:
                    self.root.kill()  # psutil refuses if the pid was reused
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        # Anything started after the snapshot is still in the session's group. Linux does
        # not reuse a pid while it names a live process group, and the group had members a
        # moment ago, so the id still means this server.
        if group_is_ours:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        return killed

    def wait_reaped(self, deadline: float) -> None:
        pending = list(self.others.values())
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if _is_running(p)]
            if pending:
                time.sleep(0.1)


def _has_exited(proc: psutil.Process) -> bool:
    # A zombie has exited; it only waits for its (new) parent to reap it.
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


# ------------------------------------------------------------------ ports and logs


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (racy by nature; bind soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (TIME_WAIT sockets allowed, as servers do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("" if host in ("127.0.0.1", "localhost") else host, port))
        except OSError:
            return False
    return True


def wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    """Wait (bounded) until a stopped server's port can be bound again; whether it can."""
    deadline = time.monotonic() + timeout_s
    while not port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a server log (read from its last 64 KiB)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# Servers started and not yet stopped, so an interpreter exit stops them too.
_live: set[Server] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            stop_server(server, grace=2)
