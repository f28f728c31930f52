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
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING
from dataclasses import dataclass
from pathlib import Path

from wedgectl.model import exitcodes

from wedgectl.collect import procfs
from wedgectl.collect.target import Credentials, PopenUser
from wedgectl.model.errors import WedgectlError
from wedgectl.collect.control import Child, ChildTimeout, Signal, Stream, children_running, spawn, stop_tree
from wedgectl.collect.control import tree_pids as _tree_pids

if TYPE_CHECKING:  # httpx is imported where a server is started and waited on, not by diagnose
    import httpx

HEALTH_POLL_S = 0.5
HEALTH_CAP_FACTOR = 3  # wait_healthy's bound on a start whose log keeps growing: 3 x its quiet timeout
HEALTH_PROGRESS_S = 30.0  # wait_healthy's progress line: one per 30 s
HEALTH_REQUEST_S = 2.0  # one GET /health; a server that takes longer is not healthy yet
LOG_TAIL_LINES = 40
_log = logging.getLogger(__name__)


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
    run_as: Credentials | None = None  # swap: start it as the target's user, the log opened as that user
    # The file to execute (absolute), where argv[0] must not be looked up again on the env's PATH (swap).
    executable: str | None = None


@dataclass(frozen=True, eq=False)
class Server:
    """A server this process started (in a session of its own, so its pid is its process group)."""

    pid: int
    url: str
    log_path: Path
    popen: Child  # the handle control.spawn gave: poll, a bounded wait, and the one way to signal it
    started_at: float  # time.time() just before the launch
    tmp_dir: Path | None = None
    start_ticks: int | None = None  # procfs.start_ticks: what every signal to it checks

    def tree_pids(self) -> tuple[int, ...]:
        """The API server and every live descendant, right now."""
        return _tree_pids(self.pid)


# ------------------------------------------------------------------ starting


def start_server(command: Command, health_timeout: float = 180,
                 progress: Callable[[str], None] | None = None) -> Server:
    """Launch `command` (owned) and return once GET /health answers 200.

    Raises ServerStartError, after tearing the tree down, when the process exits
    first or /health stays silent for `health_timeout` seconds; any other
    exception while it starts (Ctrl-C included) tears it down too.
    """
    server = launch(command)
    try:
        wait_healthy(server, health_timeout, progress)
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
    as_user: PopenUser = command.run_as.popen_kwargs if command.run_as is not None else {}
    preexec = None
    if not as_user:
        command.log_path.parent.mkdir(parents=True, exist_ok=True)
    else:  # root never opens (or creates) a log the user chose: the child does, as the user
        preexec = _log_opener(command.log_path)
    started_at = time.time()
    try:
        # The child keeps its own copy of the descriptor; ours closes at once.
        with open(os.devnull if as_user else command.log_path, "ab") as log:
            popen = spawn(
                list(command.argv),
                executable=command.executable,
                cwd=command.cwd,
                env=command.env,
                stdout=log,
                stderr=Stream.STDOUT,
                preexec=preexec,
                user=as_user.get("user"),
                group=as_user.get("group"),
                extra_groups=as_user.get("extra_groups"),
            )
    except BaseException:
        # A Ctrl-C can land after the fork but before the spawn returns: the child, in a session of
        # its own, would live on with nobody holding its pid.
        for pid in children_running(command.argv, started_at):
            stop_tree(pid, grace=0, started_at=started_at)
        if command.tmp_dir is not None:
            shutil.rmtree(command.tmp_dir, ignore_errors=True)
        raise
    try:
        server = Server(popen.pid, command.url, command.log_path, popen, started_at, command.tmp_dir,
                        procfs.start_ticks(popen.pid))
    except BaseException:  # Ctrl-C again: the tree is ours and nobody else will stop it
        stop_tree(popen.pid, grace=0, popen=popen, started_at=started_at)
        raise
    if owned:
        _live.add(server)
    return server


def _log_opener(path: Path) -> Callable[[], None]:
    """Run in the child after its switch to the user: open the log as that user onto stdout and stderr."""
    target = os.fsencode(path)

    def open_log() -> None:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    return open_log


def health_status(client: httpx.Client, url: str) -> int | None:
    """The status code of one GET url/health; None when nothing answered."""
    import httpx

    try:
        return client.get(f"{url}/health").status_code
    except httpx.HTTPError:
        return None


def health_client() -> httpx.Client:
    """A client for the local server: trust_env=False, since a proxy from the environment
    (HTTP_PROXY without a NO_PROXY for it) would turn a healthy local server into an error."""
    import httpx

    return httpx.Client(timeout=HEALTH_REQUEST_S, trust_env=False)


def wait_healthy(server: Server, timeout: float, progress: Callable[[str], None] | None = None) -> None:
    """Poll /health until 200; ServerStartError when the process exits, or when its log has not
    grown for `timeout` seconds.

    A start whose log still grows is still starting: on a loaded host (the normal case) loading,
    compiling and profiling all take longer, and a fixed deadline would kill a server that was
    about to answer. The wait is capped at HEALTH_CAP_FACTOR x `timeout` all the same. Every
    HEALTH_PROGRESS_S it tells `progress` how long it has waited and the log's last line.
    """
    start = time.monotonic()
    told = start
    last_growth, size = start, _log_size(server.log_path)
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
            now = time.monotonic()
            grown = _log_size(server.log_path)
            if grown > size:
                last_growth, size = now, grown
            if progress is not None and now - told >= HEALTH_PROGRESS_S:
                told = now
                last = log_tail(server.log_path, lines=1).strip()
                progress(f"still starting after {now - start:.0f} s; log: {last[-120:] or '(empty)'}")
            quiet = now - last_growth >= timeout
            if quiet or now - start >= HEALTH_CAP_FACTOR * timeout:
                why = (f"its log silent for {timeout:.0f} s" if quiet
                       else f"its log still growing at the cap of {HEALTH_CAP_FACTOR * timeout:.0f} s")
                raise ServerStartError(
                    f"vLLM did not answer {server.url}/health after {now - start:.0f} s of start-up, "
                    f"{why} (log {server.log_path}):\n{log_tail(server.log_path)}",
                    reason=f"/health did not answer 200 after {now - start:.0f} s, {why}",
                )
            time.sleep(HEALTH_POLL_S)


def _log_size(path: Path | None) -> int:
    try:
        return os.stat(path).st_size if path is not None else 0
    except OSError:
        return 0


def start_detached(argv: list[str]) -> Child:
    """A helper process that outlives wedgectl (its own session, no stdio): repro --keep's clients."""
    return spawn(argv)


# ------------------------------------------------------------------ stopping


def signal_server(server: Server, sig: Signal) -> None:
    """Send `sig` to the API server alone, as an orchestrator does (repro's shutdown step)."""
    server.popen.signal(sig)


def wait_exit(server: Server, timeout: float) -> float | None:
    """Seconds until the API server exited (reaped), or None when it outlived `timeout`."""
    start = time.monotonic()
    try:
        server.popen.wait(timeout=timeout)
    except ChildTimeout:
        return None
    return time.monotonic() - start


def stop_server(server: Server, grace: float = 10) -> float:
    """Tear a started server's whole tree down; return seconds until it had exited.

    SIGTERM goes to the API server only (vLLM stops its own engine processes);
    whatever of the tree still runs after `grace` seconds is SIGKILLed. Calling
    it again is harmless.
    """
    try:
        planned = {server.pid: server.start_ticks} if server.start_ticks is not None else None
        return stop_tree(server.pid, grace, popen=server.popen, started_at=server.started_at,
                         planned=planned).seconds
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


# ------------------------------------------------------------------ logs


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


