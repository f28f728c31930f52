"""Process control: spawning children, the bounded child runner, the one signal sender, stopping a process tree, ports.

The only code that starts, signals or waits on a process, and the only one that installs signal
handlers; the layers above name signals, streams and failures in this module's own words (`Signal`,
`Stream`, `ChildError`, `ChildTimeout`, `Child`), never subprocess's, signal's or psutil's. Every
wait is bounded, the ones after a SIGKILL included: a child reading a target in state D (py-spy,
bpftrace) can itself block in the kernel. A signal goes only to the process that was planned (its
start time checked, a pidfd where the kernel has them), never to whoever holds its pid now.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, Protocol

import psutil

from wedgectl.collect import procfs, procread, shm

_log = logging.getLogger(__name__)

STOP_POLL_S = 0.05
KILL_WAIT_S = 5.0  # after SIGKILL, for the kernel to end what was killed
TOOL_KILL_WAIT_S = 2.0  # for a tool (py-spy, bpftrace) to end after the SIGKILL that follows its timeout
REAP_WAIT_S = 5.0  # then for init (or a subreaper) to reap the orphans: seconds on some machines


class Signal(enum.IntEnum):
    """The signals wedgectl sends or handles, by their short names (Signal.TERM is SIGTERM)."""

    INT = signal.SIGINT
    TERM = signal.SIGTERM
    HUP = signal.SIGHUP
    QUIT = signal.SIGQUIT
    KILL = signal.SIGKILL

    @property
    def full_name(self) -> str:
        """The name the kernel's headers use: "SIGTERM"."""
        return f"SIG{self.name}"

    @classmethod
    def named(cls, name: str) -> Signal:
        """The signal a configuration names ("SIGTERM"); ValueError for one it does not know."""
        for sig in cls:
            if sig.full_name == name:
                return sig
        raise ValueError(f"unknown signal {name!r}")


class Stream(enum.Enum):
    """Where a child's stdin or stderr goes."""

    NULL = subprocess.DEVNULL  # /dev/null
    PIPE = subprocess.PIPE  # read back by the caller
    STDOUT = subprocess.STDOUT  # stderr only: merged into stdout


class ChildError(subprocess.SubprocessError):
    """A child could not be run to its end: it could not be started as asked (a failed switch of
    user), or it ran past its bound (ChildTimeout). An OSError (no such file) stays one."""


class ChildTimeout(ChildError, subprocess.TimeoutExpired):
    """A child ran past its bound; `output` and `stderr` hold what it wrote before the kill."""


class Finished(subprocess.CompletedProcess[str]):
    """A child run to its end: its `returncode`, and its `stdout` and `stderr` as text."""


def _fd(stream: Stream | int | IO[Any] | None) -> int | IO[Any] | None:
    return stream.value if isinstance(stream, Stream) else stream


@dataclass(frozen=True)
class Stopped:
    """How a tree went: seconds from SIGTERM until every process had exited, and whether it took SIGKILL."""

    seconds: float
    killed: bool
    refused: tuple[str, ...] = ()  # signals not sent: the pid had been reused since it was planned
    shm_removed: tuple[str, ...] = ()  # /dev/shm files the tree left and no live process holds
    shm_kept: tuple[str, ...] = ()  # the tree's /dev/shm files left in place: still held, or unsure


class Delivery(enum.Enum):
    """What became of one signal."""

    SENT = "sent"
    GONE = "gone"  # the process had exited (a zombie counts as sent)
    REUSED = "reused"  # refused: the pid names another process than the one planned
    DENIED = "denied"  # no permission


@dataclass(frozen=True)
class Planned:
    """A process as it was when planned: its pid and its start time (procfs.start_ticks).

    A pid alone may name another process by the time the signal goes: the
    planned one exited and the kernel handed its number on.
    """

    pid: int
    start_ticks: int | None

    @classmethod
    def now(cls, pid: int) -> Planned:
        return cls(pid, procfs.start_ticks(pid))

    @property
    def reuse_note(self) -> str:
        return (f"pid {self.pid} was not signalled: it started at tick {procfs.start_ticks(self.pid)}, "
                f"not {self.start_ticks} as planned, so it is another process now")


def send_signal(target: Planned, sig: int, *, group: bool = False) -> Delivery:
    """The one place wedgectl signals a process: `sig` to `target` if it is still the planned process.

    The pid's start time must match the plan; otherwise the signal is refused
    and logged (Delivery.REUSED). A pidfd, where the kernel has them, pins the
    process between that check and the signal. With `group`, `sig` goes to the
    process group the planned process leads; its members keep the group id
    from being handed on, so a group whose leader has exited is still its.
    """
    pidfd = None
    if not group and hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(target.pid)
        except ProcessLookupError:
            return Delivery.GONE
        except OSError:
            pidfd = None  # a kernel without pidfds: the check and the kill are then two steps
    try:
        now = procfs.start_ticks(target.pid)
        if now is None and not group:
            return Delivery.GONE
        if now is not None and now != target.start_ticks:
            _log.warning("%s", target.reuse_note)
            return Delivery.REUSED
        if group:
            os.killpg(target.pid, sig)
        elif pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(target.pid, sig)
    except ProcessLookupError:
        return Delivery.GONE
    except PermissionError:
        return Delivery.DENIED
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return Delivery.SENT


class _Started(Protocol):
    """A child this process started: a Child, or a Popen (the collectors' own)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


def signal_child(popen: _Started, sig: int) -> Delivery:
    """`sig` to a child this process started, unless it was reaped (then its pid may be anyone's)."""
    if popen.poll() is not None:
        return Delivery.GONE
    # Not reaped: the pid is still this child's, so its start time now is the planned one.
    return send_signal(Planned.now(popen.pid), sig)


def run_bounded(cmd: list[str], *, timeout: float, env: Mapping[str, str] | None = None,
                stdin: Stream | int | None = None, stderr: Stream | int = Stream.PIPE, cwd: str | None = None,
                user: int | None = None, group: int | None = None, extra_groups: list[int] | None = None,
                popen: Callable[..., subprocess.Popen] = subprocess.Popen, kill_wait: float = TOOL_KILL_WAIT_S,
                **_run_kwargs: Any) -> Finished:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=...), whose wait after the kill is
    bounded too (`kill_wait`): a tool reading a target in state D (py-spy, bpftrace) can itself block
    in the kernel, and subprocess.run waits for a killed child without a bound. `user`, `group` and
    `extra_groups` run it as the target's user (`Credentials.popen_kwargs`); `stderr=Stream.STDOUT`
    merges the streams. Raises ChildTimeout with the output read before the kill (a child that
    outlives `kill_wait` is left to the kernel), ChildError when it could not be started as asked."""
    try:
        proc = popen(cmd, stdout=subprocess.PIPE, stderr=_fd(stderr), text=True, env=env, stdin=_fd(stdin),
                     cwd=cwd, user=user, group=group, extra_groups=extra_groups)
    except subprocess.SubprocessError as exc:
        raise ChildError(str(exc)) from exc
    with _tools_lock:
        _tools.add(proc)
    try:
        return _finish_bounded(proc, cmd, timeout, kill_wait)
    finally:
        with _tools_lock:
            _tools.discard(proc)


# The tools run_bounded is running now (py-spy, bpftrace, ...): a capture that stops waiting for one (the
# window over while an early stack burst still runs) leaves it to its own timeout, and stop_running_tools
# ends them at exit.
_tools: set[subprocess.Popen] = set()
_tools_lock = threading.Lock()


@atexit.register
def stop_running_tools() -> int:
    """SIGKILL every tool child still running: at exit, none outlives wedgectl. A `py-spy --native` dump holds
    its target stopped (state t) while it unwinds, seconds on a loaded host: left behind, it would pause the
    server after wedgectl had gone. Killed, the kernel detaches it and the target runs on. How many."""
    with _tools_lock:
        left = list(_tools)
    killed = 0
    for proc in left:
        with contextlib.suppress(Exception):  # a test's stand-in for Popen, or reaped meanwhile
            if signal_child(proc, signal.SIGKILL) is Delivery.SENT:
                killed += 1
    return killed


def _finish_bounded(proc: subprocess.Popen, cmd: list[str], timeout: float, kill_wait: float) -> Finished:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_child(proc, signal.SIGKILL)
        out = err = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, err = proc.communicate(timeout=kill_wait)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        raise ChildTimeout(cmd, timeout, output=out, stderr=err) from None
    return Finished(cmd, proc.returncode, out, err)


class Child:
    """A child started by `spawn`: its pid, its exit status once it has one, and the one way to signal it."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once reaped (minus the signal that ended it), else None."""
        return self._popen.returncode

    def poll(self) -> int | None:
        """Its exit status if it has exited (and reap it), else None."""
        return self._popen.poll()

    def wait(self, timeout: float) -> int:
        """Its exit status, waiting at most `timeout` seconds for it; ChildTimeout past them."""
        try:
            return self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ChildTimeout(exc.cmd, timeout) from None

    def signal(self, sig: Signal) -> Delivery:
        """`sig` to it, unless it was reaped (see signal_child)."""
        return signal_child(self._popen, sig)


def spawn(argv: list[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
          executable: str | None = None, stdout: IO[Any] | Stream = Stream.NULL,
          stderr: IO[Any] | Stream = Stream.NULL, new_session: bool = True,
          preexec: Callable[[], None] | None = None, user: int | None = None, group: int | None = None,
          extra_groups: list[int] | None = None) -> Child:
    """Start `argv` and return at once: stdin /dev/null, stdout and stderr as asked (a file, NULL, or
    stderr=Stream.STDOUT), in a session of its own unless `new_session` is False. `user`, `group` and
    `extra_groups` as in run_bounded; `preexec` runs in the child after the switch of user. OSError when
    it cannot be started, ChildError when it could not be started as asked."""
    try:
        popen = subprocess.Popen(argv, executable=executable, cwd=cwd, env=None if env is None else dict(env),
                                 stdin=subprocess.DEVNULL, stdout=_fd(stdout), stderr=_fd(stderr),
                                 start_new_session=new_session, preexec_fn=preexec, user=user, group=group,
                                 extra_groups=extra_groups)
    except subprocess.SubprocessError as exc:
        raise ChildError(str(exc)) from exc
    return Child(popen)


def handle_signals(sigs: Iterable[Signal], handler: Callable[[Signal], None]) -> Callable[[], None]:
    """Call `handler` when one of `sigs` comes (from the main thread only, as Python allows); return
    what puts the handlers there before back. An exception `handler` raises is raised wherever the
    main thread was when the signal came."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        handler(Signal(signum))

    old = {sig: signal.signal(sig, on_signal) for sig in sigs}

    def restore() -> None:
        for sig, was in old.items():
            signal.signal(sig, was)

    return restore


def handle_interrupt_unless_handled(handler: Callable[[Signal], None]) -> bool:
    """Call `handler` on SIGINT instead of raising KeyboardInterrupt there, unless something other
    than Python's default already handles it (an embedding program); whether it was set."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    handle_signals((Signal.INT,), handler)
    return True


def tree_pids(pid: int) -> tuple[int, ...]:
    """`pid` and every live descendant of it, right now; () when it is gone or cannot be read."""
    try:
        root = psutil.Process(pid)
        return (pid, *(p.pid for p in root.children(recursive=True)))
    except psutil.Error:
        return ()


def children_running(argv: Iterable[str], since: float) -> list[int]:
    """Our own children started at or after `since` (a unix time) that run `argv`."""
    want = list(argv)
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.create_time() >= since - 1 and child.cmdline() == want:
                found.append(child.pid)
    return found


def stop_tree(
    pid: int,
    grace: float,
    *,
    popen: _Started | None = None,
    extra: Iterable[int] = (),
    started_at: float | None = None,
    planned: Mapping[int, int] | None = None,
) -> Stopped:
    """SIGTERM `pid`; SIGKILL what is left of its tree (and of `extra`) after `grace` seconds.

    With `popen` (a server started here, in a session of its own) the members
    of its process group count as its tree too, so orphans of an API server that
    died are found; `started_at` rules out a group id reused since. `planned`
    holds the start times (procfs.start_ticks) the pids had when the stop was
    planned: a pid that started at another time since is refused, never
    signalled (see `send_signal`). A zombie counts as exited; children of this
    process are reaped. The seconds returned run until every process had
    exited; after that it waits (bounded) for the orphans to be reaped, so
    their pids are gone when it returns, and removes the /dev/shm files the
    tree mapped that are its own (its uid's, made since it started) and no live
    process holds any more (a SIGKILLed vLLM leaves its shared memory behind);
    another user's file it mapped is kept, and so is an older one (shm.remove_unheld).
    """
    start = time.monotonic()
    tree = _Tree(pid, popen, started_at, planned or {})
    tree.collect(extra)
    left_shm = procread.shm_files_of(tree.live_pids())  # before any signal: the tree maps them now
    owners, since = tree.identity()  # whose files, made since when, the tree's own can be
    # Only while the group has members is its id surely still this tree's.
    group_is_ours = popen is not None and (not tree.root_exited() or bool(tree.others))
    try:
        if not tree.root_exited():
            tree.signal_root(signal.SIGTERM)
        tree.wait_exited(start + grace)
    finally:
        # Also on KeyboardInterrupt mid-wait: nothing of the tree survives.
        killed = tree.kill_left(group_is_ours)
        if killed:
            tree.wait_exited(time.monotonic() + KILL_WAIT_S)
    seconds = time.monotonic() - start
    tree.wait_reaped(time.monotonic() + REAP_WAIT_S)
    removed, kept = shm.remove_unheld(left_shm, owners, since)
    return Stopped(seconds, killed, tuple(tree.refused), removed, kept)


class _Tree:
    """The processes of one server: its root (by pid, or our Popen) and the others, found once,
    each with the start time every signal to it is checked against."""

    def __init__(self, pid: int, popen: _Started | None, started_at: float | None,
                 planned: Mapping[int, int]) -> None:
        self.pid, self.popen, self.planned = pid, popen, planned
        self.refused: list[str] = []
        self.ticks: dict[int, int | None] = {}
        self.root: psutil.Process | None = None
        if self._admit(pid):
            with contextlib.suppress(psutil.Error):
                self.root = psutil.Process(pid)
        if started_at is None and self.root is not None:
            with contextlib.suppress(psutil.Error):
                started_at = self.root.create_time()
        self.started_at = started_at
        self.others: dict[int, psutil.Process] = {}

    def _admit(self, pid: int) -> bool:
        """Note the pid's start time; False (and the refusal noted) when it is not the planned one."""
        now = procfs.start_ticks(pid)
        want = self.planned.get(pid, now)
        if now is not None and now != want:
            self.refused.append(Planned(pid, want).reuse_note)
            _log.warning("%s", self.refused[-1])
            return False
        self.ticks[pid] = want
        return now is not None

    def identity(self) -> tuple[frozenset[int], float | None]:
        """(the effective uids of the tree's live processes, when the tree started: the earliest of
        their start times and the launch); read before any signal. What is unreadable counts for
        nothing: no uid, no start, no file removed for it."""
        procs = ([self.root] if self.root is not None and not self.root_exited() else []) + [
            p for p in self.others.values() if not _has_exited(p)]
        uids: set[int] = set()
        starts = [self.started_at] if self.started_at is not None else []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                uids.add(proc.uids().effective)
                starts.append(proc.create_time())
        return frozenset(uids), (min(starts) if starts and uids else None)

    def live_pids(self) -> list[int]:
        root = [self.pid] if self.root is not None and not self.root_exited() else []
        return root + [p for p, proc in self.others.items() if not _has_exited(proc)]

    def collect(self, extra: Iterable[int] = ()) -> None:
        """The root's descendants while it lives; members of its group (ours only); `extra`."""
        found: list[psutil.Process] = []
        if self.root is not None and not self.root_exited():
            with contextlib.suppress(psutil.Error):
                found += self.root.children(recursive=True)
        if self.popen is not None and self.started_at is not None:
            for proc in psutil.process_iter():
                try:
                    # create_time rules out a group id reused after the server's end.
                    if os.getpgid(proc.pid) == self.pid and proc.create_time() >= self.started_at - 1:
                        found.append(proc)
                except (OSError, psutil.Error):
                    continue
        for other in extra:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(other))
        for proc in found:
            if proc.pid != self.pid and proc.pid not in self.others and proc.pid not in self.ticks:
                if self._admit(proc.pid):
                    self.others[proc.pid] = proc

    def root_exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None  # reaps it once it exits
        if self.root is None:
            return True  # gone, or the pid is another process's now: never reap that one
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, os.WNOHANG)  # our child (a swap's earlier server): leave no zombie
        return _has_exited(self.root)

    def all_exited(self) -> bool:
        return self.root_exited() and all(map(_has_exited, self.others.values()))

    def wait_exited(self, deadline: float) -> None:
        while not self.all_exited() and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)

    def signal_root(self, sig: int) -> None:
        if self.popen is not None:
            signal_child(self.popen, sig)
        elif self.root is not None:
            self._send(self.pid, sig)

    def _send(self, pid: int, sig: int, group: bool = False) -> None:
        if send_signal(Planned(pid, self.ticks.get(pid)), sig, group=group) is Delivery.REUSED:
            self.refused.append(Planned(pid, self.ticks.get(pid)).reuse_note)

    def kill_left(self, group_is_ours: bool) -> bool:
        """SIGKILL whatever has not exited; whether anything had to be."""
        if self.root is not None and not self.root_exited():
            # Children it started during the grace are in the tree too.
            self.collect()
        left = [p for p in self.others.values() if not _has_exited(p)]
        killed = not self.root_exited() or bool(left)
        if not self.root_exited():
            self.signal_root(signal.SIGKILL)
        for proc in left:
            self._send(proc.pid, signal.SIGKILL)
        # Anything started after the snapshot is still in the session's group. Linux does
        # not reuse a pid while it names a live process group, and the group had members a
        # moment ago, so the id still means this server.
        if group_is_ours:
            self._send(self.pid, signal.SIGKILL, group=True)
        return killed

    def wait_reaped(self, deadline: float) -> None:
        pending = list(self.others.values())
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if _is_running(p)]
            if pending:
                time.sleep(0.1)


def runs_as_planned(pid: int, planned_ticks: int | None) -> bool:
    """pid runs and is the process planned on: its start time (procfs.start_ticks) is still `planned_ticks`;
    a zombie has exited."""
    now = procfs.start_ticks(pid)
    if now is None or planned_ticks is None or now != planned_ticks:
        return False
    try:
        return not _has_exited(psutil.Process(pid))
    except psutil.Error:
        return False


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


def detach_into_own_session() -> None:
    """Go on in a child that leads a session of its own (and, with autogroup, a scheduling group
    of its own); the caller's process waits for it and exits with its status, never returning.

    setsid() refuses a process group leader, which a command started from a shell is, hence
    the fork (no new interpreter: the child is this one, before any thread starts). The
    terminal's signals reach the parent, the foreground process: SIGINT, SIGTERM, SIGHUP and
    SIGQUIT are passed on to the child (send_signal), which handles them as it would have."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.setsid()
        return

    planned = Planned.now(child)  # ours and not yet reaped: its pid cannot name another process

    def forward(signum: int, _frame: object) -> None:
        send_signal(planned, signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    _, status = os.waitpid(child, 0)  # a forwarded signal does not end the wait (PEP 475 retries it)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))
