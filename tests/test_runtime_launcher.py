"""The lifecycle (start_server / stop_server) against a fake vLLM: a real process tree, no vLLM.

The fake "python" is a script that takes the launcher's argv, forks children
like vLLM's EngineCore and Worker, and answers GET /health; its environment
chooses how it misbehaves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from wedgectl.lab.lifecycle import ServerStartError, stop_server
from wedgectl.collect.control import KILL_WAIT_S, free_port, stop_tree
from wedgectl.lab.runtime.launcher import ServerSpec, running_server, start_server

FAKE_VLLM = textwrap.dedent(
    f"""\
    #!{sys.executable}
    import http.server, os, signal, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = os.environ.get("FAKE_MODE", "ok")
    print("fake vllm starting", args[:3], flush=True)
    if mode == "crash":
        print("ValueError: no such model", flush=True)
        sys.exit(3)

    up_r, up_w = os.pipe()

    def child(depth):
        if os.environ.get("FAKE_CHILD_IGNORES_TERM"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if depth and os.fork() == 0:
            child(depth - 1)
        if not depth:
            os.write(up_w, b"up")
        while True:
            time.sleep(1)

    if os.fork() == 0:
        child(1)  # an "EngineCore" with a "Worker" below it
    # Like vLLM: the API server serves once its engine is up (the "Worker" forked), never before; on a loaded
    # host /health once answered while the "EngineCore" had yet to fork its "Worker"
    os.close(up_w)
    os.read(up_r, 2)
    def shutdown(signum, frame):
        # Like vLLM: on SIGTERM the API server takes its engine down with it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(0, signal.SIGTERM)

    signal.signal(signal.SIGTERM, shutdown)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "never-healthy":
        time.sleep(600)
    if mode in ("slow-start", "chatty"):  # a start that keeps logging: slow-start answers after 8 s
        t0 = time.monotonic()
        while mode == "chatty" or time.monotonic() - t0 < 8:
            print("fake vllm still loading", flush=True)
            time.sleep(0.3)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_VLLM)
    path.chmod(0o755)
    return path


def spec(tmp_path: Path, **env: str) -> ServerSpec:
    return ServerSpec(model=tmp_path / "model", port=free_port(), env=env)


def wait_gone(pids: tuple[int, ...], timeout: float = 5) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p)]
        time.sleep(0.05)
    return alive


def test_start_waits_for_health_and_stop_kills_the_tree(
    fake_python: Path, tmp_path: Path
) -> None:
    server = start_server(spec(tmp_path), fake_python, tmp_path / "log", health_timeout=20)
    try:
        pids = server.tree_pids()
        assert len(pids) == 3
        # [interpreter, fake-python, _serve.py, "serve", model, ...]
        assert psutil.Process(server.pid).cmdline()[3:5] == ["serve", str(tmp_path / "model")]
    finally:
        seconds = stop_server(server, grace=30)
    # The fake dies on the first SIGTERM: its root's own signal ended it, not the SIGKILL after grace. How
    # soon is the host's business (2.2 s on a loaded CI host).
    assert server.popen.returncode == -signal.SIGTERM
    assert seconds < 30
    assert [p for p in pids if psutil.pid_exists(p)] == []
    assert not server.tmp_dir.exists()
    assert "fake vllm starting" in (tmp_path / "log").read_text()


def test_stop_sigkills_what_ignores_sigterm(fake_python: Path, tmp_path: Path) -> None:
    server = start_server(
        spec(tmp_path, FAKE_MODE="ignore-term", FAKE_CHILD_IGNORES_TERM="1"),
        fake_python, tmp_path / "log", health_timeout=20,
    )
    pids = server.tree_pids()
    seconds = stop_server(server, grace=0.5)
    assert 0.5 <= seconds < 0.5 + KILL_WAIT_S
    assert server.popen.returncode == -signal.SIGKILL
    assert [p for p in pids if psutil.pid_exists(p)] == []


def test_stop_kills_children_the_api_server_left_behind(
    fake_python: Path, tmp_path: Path
) -> None:
    # The API server exits on SIGTERM, its children do not: they are orphans
    # by the time grace runs out, and must still be killed.
    server = start_server(
        spec(tmp_path, FAKE_CHILD_IGNORES_TERM="1"), fake_python, tmp_path / "log",
        health_timeout=20,
    )
    pids = server.tree_pids()
    stop_server(server, grace=0.5)
    assert [p for p in pids if psutil.pid_exists(p)] == []


def test_start_fails_fast_when_the_server_exits(fake_python: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ServerStartError) as failure:
        start_server(spec(tmp_path, FAKE_MODE="crash"), fake_python, tmp_path / "log")
    assert time.monotonic() - started < 10
    assert "exited with code 3" in str(failure.value)
    assert "no such model" in str(failure.value)  # the log tail


def test_start_times_out_and_cleans_up(fake_python: Path, tmp_path: Path) -> None:
    # 3 s: its log must first grow within the cap's 9 s (a loaded host took over 2 s to start the fake at 1 s)
    with pytest.raises(ServerStartError, match="its log silent for 3 s") as failure:
        start_server(spec(tmp_path, FAKE_MODE="never-healthy"), fake_python,
                     tmp_path / "log", health_timeout=3)
    assert "fake vllm starting" in str(failure.value)
    leftovers = [
        p for p in psutil.process_iter(["cmdline"])
        if str(fake_python) in " ".join(p.info["cmdline"] or ())
    ]
    assert wait_gone(tuple(p.pid for p in leftovers)) == []


def test_a_start_whose_log_still_grows_is_waited_for(fake_python: Path, tmp_path: Path) -> None:
    """A loaded host makes every phase of start-up slower: the quiet timeout counts from the log's
    last growth, so a start still logging is not killed at health_timeout."""
    started = time.monotonic()
    server = start_server(spec(tmp_path, FAKE_MODE="slow-start"), fake_python, tmp_path / "log", health_timeout=4)
    try:
        assert time.monotonic() - started >= 8  # twice health_timeout: waited because the log grew
    finally:
        stop_server(server, grace=2)


def test_a_start_that_logs_forever_is_capped(fake_python: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="still growing at the cap of 12 s"):
        start_server(spec(tmp_path, FAKE_MODE="chatty"), fake_python, tmp_path / "log", health_timeout=4)
    assert time.monotonic() - started < 30


def test_running_server_stops_on_keyboard_interrupt(fake_python: Path, tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        with running_server(spec(tmp_path), fake_python, tmp_path / "log",
                            health_timeout=20, grace=2) as server:
            pids = server.tree_pids()
            raise KeyboardInterrupt
    assert [p for p in pids if psutil.pid_exists(p)] == []


def test_interrupt_during_health_wait_leaves_nothing(fake_python: Path, tmp_path: Path) -> None:
    # Simulate Ctrl-C arriving while start_server polls /health.
    seen: list[int] = []

    def interrupt_soon() -> None:
        # Once the server and its children are up (polled, not slept for: a loaded host can take
        # seconds to start them), or after 30 s, whatever has started by then.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen.clear()
            for proc in psutil.Process().children():
                try:  # another test's child may be a zombie or gone by now: not ours to judge
                    if "fake-python" in " ".join(proc.cmdline()):
                        seen.extend([proc.pid, *(c.pid for c in proc.children(recursive=True))])
                except psutil.Error:
                    continue
            if len(seen) > 1:
                break
            time.sleep(0.1)
        signal.raise_signal(signal.SIGINT)

    threading.Thread(target=interrupt_soon, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        start_server(spec(tmp_path, FAKE_MODE="never-healthy"), fake_python,
                     tmp_path / "log", health_timeout=30)
    assert seen
    assert [p for p in seen if psutil.pid_exists(p)] == []


def test_stop_finds_orphans_of_a_crashed_api_server(fake_python: Path, tmp_path: Path) -> None:
    server = start_server(spec(tmp_path), fake_python, tmp_path / "log", health_timeout=20)
    pids = server.tree_pids()
    os.kill(server.pid, signal.SIGKILL)  # its "EngineCore" and "Worker" live on
    server.popen.wait(timeout=5)
    assert wait_gone(pids[1:], timeout=0.5) == list(pids[1:])
    stop_server(server, grace=1)
    assert [p for p in pids if psutil.pid_exists(p)] == []
    assert stop_server(server) < 5  # a second stop is harmless: it sends nothing and waits out no grace (10 s)


def test_health_wait_ignores_a_proxy_in_the_environment(
    fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A proxy nobody listens on: had the health client trusted the environment, /health would never answer.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with running_server(spec(tmp_path), fake_python, tmp_path / "log", health_timeout=20, grace=2) as server:
        assert server.popen.poll() is None


def test_stop_tree_of_a_process_we_did_not_start_spares_its_process_group(tmp_path: Path) -> None:
    # No Popen, no session of its own: the pid and its descendants go, never the group it shares with us.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = subprocess.Popen([sys.executable, "-c", "import os, time; os.fork(); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process(child.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = (child.pid, *(p.pid for p in psutil.Process(child.pid).children()))
        assert len(pids) == 2
        stopped = stop_tree(child.pid, grace=0.5)
        # SIGTERM ends the root; its forked child is not signalled by it, so it takes the SIGKILL.
        assert stopped.killed and 0.5 <= stopped.seconds < 5
        assert wait_gone(pids) == []
        assert bystander.poll() is None and os.getpgid(bystander.pid) == os.getpgrp()
    finally:
        bystander.kill()
        bystander.wait(timeout=5)
