"""Unit tests for the bounded-shutdown fix: signal chaining, failing requests, closing connections, the hard exit."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"
sys.path.insert(0, str(ENGINE))

from wedge_engine import capability  # noqa: E402
from wedge_engine.fixes import _common, shutdown  # noqa: E402


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    shutdown.reset()
    monkeypatch.setattr(shutdown, "_hard_exit_at", lambda deadline: None)  # never os._exit in this process
    yield
    shutdown.reset()
    _common.unpatch_all()


def test_chain_runs_ours_first_then_vllms(monkeypatch):
    order = []
    monkeypatch.setattr(shutdown, "on_signal", lambda signum: order.append(("ours", signum)))
    chained = shutdown.chain_signal_callback(signal.SIGTERM, lambda *a: order.append(("vllm", a)))
    chained("x")
    assert order == [("ours", signal.SIGTERM), ("vllm", ("x",))]
    assert shutdown.chain_signal_callback(signal.SIGTERM, chained) is chained  # not twice


def test_other_signals_are_left_alone():
    cb = lambda: None  # noqa: E731
    assert shutdown.chain_signal_callback(signal.SIGUSR1, cb) is cb


def test_patched_asyncio_loop_chains_sigterm(monkeypatch):
    seen = []
    monkeypatch.setattr(shutdown, "on_signal", lambda signum: seen.append("ours"))
    assert "asyncio unix loop add_signal_handler" in shutdown._patch_loops()

    async def go():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: seen.append("vllm"))
        try:
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    asyncio.run(go())
    assert seen == ["ours", "vllm"]


class Queue:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


class FakeLLM:
    def __init__(self, *ids):
        self.queues = {i: Queue() for i in ids}
        self.output_processor = types.SimpleNamespace(
            request_states={i: types.SimpleNamespace(queue=q) for i, q in self.queues.items()})
        self.aborted = []

    async def abort(self, ids, internal=False):
        self.aborted.append(list(ids))


class Transport:
    def __init__(self):
        self.closed = False

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


def test_begin_fails_requests_and_closes_connections(monkeypatch):
    llm = FakeLLM("a", "b")
    monkeypatch.setattr(_common, "async_llms", lambda: [llm])
    monkeypatch.setattr(shutdown, "ServerShuttingDown", lambda message: RuntimeError(message))
    conns = [types.SimpleNamespace(transport=Transport()) for _ in range(2)]
    server = types.SimpleNamespace(server_state=types.SimpleNamespace(connections=set(range(0))))
    server.server_state.connections = conns  # a list stands in for uvicorn's set
    monkeypatch.setattr(shutdown._state, "servers", [server])
    shutdown._state.bound_s = 2.0

    async def go():
        shutdown.on_signal(signal.SIGTERM)
        await asyncio.sleep(shutdown._state.grace_s + 0.1)

    asyncio.run(go())
    assert shutdown._state.signal_name == "SIGTERM"
    assert [str(x) for q in llm.queues.values() for x in q.items] == [
        "server shutting down (SIGTERM): the request was aborted by the wedge_engine bounded shutdown; "
        "retry on another instance"] * 2
    assert llm.aborted == [["a", "b"]]
    assert all(c.transport.closed for c in conns) and shutdown._state.closed == 2


def test_second_signal_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(shutdown, "hard_exit", lambda why: exits.append(why))
    monkeypatch.setattr(_common, "async_llms", lambda: [])
    shutdown.on_signal(signal.SIGTERM)
    assert exits == []
    shutdown.on_signal(signal.SIGINT)
    assert exits and "second signal (SIGINT)" in exits[0]


def test_server_shutdown_is_capped_to_what_is_left(monkeypatch):
    calls = []

    class Server:
        def __init__(self):
            self.config = types.SimpleNamespace(timeout_graceful_shutdown=None)

        async def shutdown(self, sockets=None):
            calls.append(self.config.timeout_graceful_shutdown)

    launcher = types.ModuleType("vllm.entrypoints.launchers.launcher")
    launcher.NoSignalServer = Server
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.launchers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.launchers.launcher", launcher)
    monkeypatch.setattr(_common, "async_llms", lambda: [])
    shutdown._state.bound_s = 10.0
    assert shutdown._patch_server() == ["NoSignalServer.__init__", "NoSignalServer.shutdown"]
    server = Server()
    assert server in set(shutdown._state.servers)
    shutdown._state.started = time.monotonic() - 4  # the signal came 4 s ago
    asyncio.run(server.shutdown())
    assert 4.5 < calls[0] <= 5.0  # 10 - 4 - 1 s margin


CHILD = textwrap.dedent("""
    import asyncio, signal, sys, time
    sys.path.insert(0, {engine!r})
    from wedge_engine.fixes import shutdown
    shutdown._state.bound_s = {bound}
    shutdown.ServerShuttingDown = RuntimeError
    shutdown._patch_loops()

    async def main():
        loop = asyncio.get_running_loop()
        # vLLM's own handler: starts a shutdown that, like the measured hang, never ends.
        loop.add_signal_handler(signal.SIGTERM, lambda: print("vllm handler", flush=True))
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def _child(bound: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD.format(engine=str(ENGINE), bound=bound)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_hard_exit_when_the_bound_passes():
    p = _child(bound=1.0)
    try:
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        p.kill()
    out, err = p.communicate()
    assert code == shutdown.HARD_EXIT_CODE
    assert 0.9 <= elapsed < 2.5
    assert "vllm handler" in out  # vLLM's handler still ran after ours
    assert "hard exit" in err


def test_second_sigterm_exits_at_once():
    p = _child(bound=30.0)
    try:
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        p.kill()
    assert code == shutdown.HARD_EXIT_CODE and elapsed < 2.0


def test_before_no_signal_server_the_plain_uvicorn_server_is_capped(monkeypatch):
    """vLLM before 0.29 serves a plain uvicorn.Server (vllm/entrypoints/launcher.py's serve_http): the same
    cap goes on it."""
    calls = []

    class Server:
        def __init__(self):
            self.config = types.SimpleNamespace(timeout_graceful_shutdown=30.0)

        async def shutdown(self, sockets=None):
            calls.append(self.config.timeout_graceful_shutdown)

    old_launcher = types.ModuleType("vllm.entrypoints.launcher")
    old_launcher.serve_http = lambda *a, **k: None
    for name in ("vllm", "vllm.entrypoints"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.launcher", old_launcher)
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.launchers", None)  # no such package: import fails
    uvicorn = types.ModuleType("uvicorn")
    uvicorn.Server = Server
    monkeypatch.setitem(sys.modules, "uvicorn", uvicorn)
    monkeypatch.setattr(_common, "async_llms", lambda: [])
    assert capability.check(shutdown.SERVER) is None and capability.check(shutdown.NO_SIGNAL_SERVER) is not None
    shutdown._state.bound_s = 10.0
    assert shutdown._patch_server() == ["uvicorn.Server.__init__", "uvicorn.Server.shutdown"]
    server = Server()
    assert server in set(shutdown._state.servers)
    shutdown._state.started = time.monotonic() - 4
    asyncio.run(server.shutdown())
    assert 4.5 < calls[0] <= 5.0  # min(30, 10 - 4 - 1)
