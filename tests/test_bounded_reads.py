"""Every read of another process and every wait on one is bounded; every signal goes through collect.control.

A /proc file that blocks (a FIFO in a procfs-root seam stands in for the
cmdline of a process whose mmap lock a thread in state D holds) returns
within the bound; a py-spy that does not end after its kill is not waited
for without a bound; local HTTP ignores proxy variables.
"""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from wedgectl.collect import control, procread, pyspy
from wedgectl.collect.processes import name_cmdline, sample_process
from wedgectl.collect.scrape import probe_health, scrape_metrics
from wedgectl.lab.lifecycle import health_client, health_status
from wedgectl.collect.control import (TOOL_KILL_WAIT_S, ChildError, ChildTimeout, Delivery, Finished, Signal, Stream,
                                       handle_signals, run_bounded, spawn, stop_running_tools)
from wedgectl.model.types import FailureKind, Role


def _blocked_proc_root(tmp_path: Path, pid: int) -> Path:
    """A proc root where `pid`'s stat is real and its cmdline blocks on open (a FIFO with no writer)."""
    root = tmp_path / "proc"
    (root / str(pid)).mkdir(parents=True)
    shutil.copy(f"/proc/{pid}/stat", root / str(pid) / "stat")
    os.mkfifo(root / str(pid) / "cmdline")
    return root


def _release(path: Path) -> None:
    """Let the reader blocked on the FIFO at `path` go (it reads EOF), leaving an empty file there."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # the blocked open() counts as a reader
    os.unlink(path)
    path.write_bytes(b"")
    os.close(fd)


def test_a_blocking_cmdline_read_returns_within_its_bound(tmp_path):
    pid = 999_999_001  # no such process: only the seam's files exist
    root = tmp_path / "proc"
    (root / str(pid)).mkdir(parents=True)
    os.mkfifo(root / str(pid) / "cmdline")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        procread.read_cmdline(pid, root, timeout=0.3)
    assert time.monotonic() - t0 < 3.0  # bounded near its 0.3 s (a loaded host can hold any call ~1 s)
    # While that read is stuck, the next of the same process fails at once: no thread piles up.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still blocked"):
        procread.read_cmdline(pid, root, timeout=5)
    assert time.monotonic() - t0 < 2.0  # not the 5 s timeout (a loaded host can hold any call ~1 s)
    _release(root / str(pid) / "cmdline")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert procread.read_cmdline(pid, root, timeout=0.5) == []
            break
        except TimeoutError:
            time.sleep(0.05)
    else:
        pytest.fail("the process stayed marked as blocked after its read came back")


def test_sampling_a_process_whose_cmdline_blocks_reports_a_timeout(tmp_path):
    me = os.getpid()
    root = _blocked_proc_root(tmp_path, me)
    t0 = time.monotonic()
    sample, failures = sample_process(psutil.Process(me), Role.OTHER, with_threads=False, proc_root=root, timeout=0.3)
    assert time.monotonic() - t0 < 2.0
    assert any(f.kind is FailureKind.TIMEOUT and "cmdline" in f.message for f in failures), failures
    assert sample.state  # the rest of the sample is there
    # environ (swap's read) and maps (the /dev/shm record) of that process now fail at once
    for read in (procread.read_environ, procread.read_maps):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            read(me, root, timeout=5)
        assert time.monotonic() - t0 < 2.0  # not the 5 s timeout
    _release(root / str(me) / "cmdline")


def test_reads_are_capped_in_bytes(tmp_path):
    pid = 4242
    d = tmp_path / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes(b"a" * (procread.CMDLINE_CAP * 3))
    (d / "environ").write_bytes(b"K=" + b"v" * procread.ENVIRON_CAP + b"\0")
    argv = procread.read_cmdline(pid, tmp_path)
    assert len("".join(argv)) == procread.CMDLINE_CAP
    env, cut = procread.read_environ(pid, tmp_path)
    assert cut


def test_name_and_cmdline_read_as_psutil_reads_them():
    me = psutil.Process()
    assert name_cmdline(me.pid) == (me.name(), me.cmdline())
    assert procread.split_cmdline(b"VLLM::EngineCore_DP0 \0") == ["VLLM::EngineCore_DP0", ""]
    assert procread.split_cmdline(b"VLLM::Worker_TP0 x y") == ["VLLM::Worker_TP0", "x", "y"]
    assert procread.split_cmdline(b"python\0-m\0vllm\0") == ["python", "-m", "vllm"]


def test_mapped_paths_of_a_maps_text():
    text = ("7f00-7f10 rw-s 00000000 00:1a 12 /dev/shm/psm_1\n"
            "7f10-7f20 rw-s 00000000 00:1a 13 /dev/shm/psm_2 (deleted)\n"
            "7f20-7f30 r-xp 00000000 08:01 14 /usr/lib/libc.so.6\n"
            "7f30-7f40 rw-p 00000000 00:00 0 \n")
    assert procread.mapped_paths(text, "/dev/shm") == {"/dev/shm/psm_1"}


# ------------------------------------------------------------------ py-spy's wait after the kill


class _Unending:
    """A Popen whose child never ends, even after SIGKILL (py-spy stuck in the kernel on a target in D)."""

    def __init__(self, stand_in: subprocess.Popen) -> None:
        self.pid, self.stdout, self.stderr, self.returncode = stand_in.pid, None, None, None

    def communicate(self, timeout: float | None = None):
        time.sleep(timeout or 0)
        raise subprocess.TimeoutExpired("py-spy", timeout)

    def poll(self) -> None:
        return None


def test_a_pyspy_that_never_ends_after_its_kill_is_not_waited_for():
    stand_in = subprocess.Popen(["sleep", "60"])  # receives the (real) SIGKILL
    try:
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            run_bounded(["py-spy"], timeout=0.3, popen=lambda *a, **k: _Unending(stand_in))
        # Bounded, where an unbounded wait would never return; the slack is for a loaded host.
        assert time.monotonic() - t0 < 0.3 + TOOL_KILL_WAIT_S + 10.0
        assert stand_in.wait(timeout=30) == -signal.SIGKILL
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()


def test_a_pyspy_past_its_timeout_is_killed_and_reported(monkeypatch, tmp_path):
    slow = tmp_path / "py-spy"
    slow.write_text("#!/bin/sh\nsleep 30 &\nexec sleep 30\n")  # a grandchild keeps its pipes open
    slow.chmod(0o755)
    monkeypatch.setattr(pyspy, "find_pyspy", lambda: str(slow))
    t0 = time.monotonic()
    dump = pyspy.dump_stacks(os.getpid(), timeout=0.5)
    assert time.monotonic() - t0 < 0.5 + TOOL_KILL_WAIT_S + 10.0  # not the 30 s its children would take
    assert dump.error is not None and dump.error.startswith(FailureKind.TIMEOUT.value)


def test_a_timeout_keeps_the_output_read_before_the_kill():
    """The runtime install logs what pip printed before its step ran out of time (stderr merged)."""
    with pytest.raises(ChildTimeout) as caught:
        run_bounded(["/bin/sh", "-c", "echo half; echo err >&2; exec sleep 60"], timeout=2, stderr=Stream.STDOUT)
    assert caught.value.output.split() == ["half", "err"]
    assert isinstance(caught.value, subprocess.TimeoutExpired)  # the collectors' own except clauses still hold


def test_a_child_that_cannot_be_started_as_asked_is_a_child_error():
    """A failed switch of user comes from Popen as a SubprocessError: the layers above catch collect's own."""
    def refuses(*_a, **_k):
        raise subprocess.SubprocessError("Exception occurred in preexec_fn.")

    with pytest.raises(ChildError, match="preexec_fn"):
        run_bounded(["true"], timeout=5, popen=refuses)


def test_a_spawned_child_is_waited_for_with_a_bound_and_signalled_through_control():
    child = spawn(["sleep", "30"])
    try:
        with pytest.raises(ChildTimeout):
            child.wait(timeout=0.2)
        assert child.poll() is None and child.returncode is None
        assert child.signal(Signal.TERM) is Delivery.SENT
        assert child.wait(timeout=10) == -signal.SIGTERM
        assert child.signal(Signal.KILL) is Delivery.GONE  # reaped: its pid may be anyone's now
    finally:
        if child.poll() is None:
            child.signal(Signal.KILL)
            child.wait(timeout=10)


def test_signals_are_named_by_control_and_handlers_put_back():
    assert Signal.named("SIGTERM") is Signal.TERM and Signal.KILL.full_name == "SIGKILL"
    with pytest.raises(ValueError):
        Signal.named("SIGFOO")
    before = signal.getsignal(signal.SIGHUP)
    got: list[Signal] = []
    restore = handle_signals((Signal.HUP,), got.append)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        restore()
    assert got == [Signal.HUP] and signal.getsignal(signal.SIGHUP) is before


# Which modules may signal a process or import subprocess is checked by the import contracts
# (pyproject.toml) and tests/test_architecture.py.


# ------------------------------------------------------------------ local HTTP and proxies


class _Local(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_local_http_ignores_proxy_variables(monkeypatch):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Local)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    dead = "http://127.0.0.1:9"  # nothing listens: a client that took the proxy would fail
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("no_proxy", "")
    try:
        assert scrape_metrics(f"{url}/metrics").error is None
        assert probe_health(url)[0] == 200
        with health_client() as client:
            assert health_status(client, url) == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_tool_still_running_at_exit_is_killed_not_left_behind(tmp_path):
    """A capture that stops waiting for a tool (the window over while a stack burst still runs) leaves it on a
    daemon thread; at exit wedgectl kills it: a py-spy --native left behind would hold its target stopped. A real
    process whose daemon thread runs `sleep 60` under run_bounded exits at once, and the sleep with it."""
    pidfile = tmp_path / "pid"
    script = (
        "import threading, time, sys\n"
        "from wedgectl.collect.control import run_bounded\n"
        "threading.Thread(target=run_bounded, args=(['sh', '-c', 'echo $$ > %s; exec sleep 60'],),\n"
        "                 kwargs={'timeout': 60}, daemon=True).start()\n"
        "deadline = time.monotonic() + 30\n"
        "import os\n"
        "while not os.path.exists(%r) and time.monotonic() < deadline: time.sleep(0.05)\n" % (pidfile, str(pidfile)))
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], timeout=60, check=True, cwd=Path(__file__).parents[1])
    assert time.monotonic() - started < 30  # it did not wait out the tool's minute
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_stop_running_tools_ends_what_run_bounded_runs_and_nothing_else():
    """Only the tools run_bounded started: a child started otherwise is not its to end."""
    other = subprocess.Popen(["sleep", "30"])
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(_try_run(["sleep", "30"])), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not control._tools and time.monotonic() < deadline:  # in the registry once run_bounded has its Popen
        time.sleep(0.05)
    try:
        assert stop_running_tools() == 1
        t.join(timeout=10)
        assert done and isinstance(done[0], Finished) and done[0].returncode == -signal.SIGKILL
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def _try_run(cmd: list[str]) -> object:
    try:
        return run_bounded(cmd, timeout=30)
    except Exception as exc:  # noqa: BLE001 - the test reads what came back
        return exc
