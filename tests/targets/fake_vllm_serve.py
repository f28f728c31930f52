"""Test target: a stand-in vLLM deployment for the process-tree collectors.

`python fake_vllm_serve.py serve [FIFO]` looks like an API server (a `_serve.py`
launcher given `serve`), listens on 127.0.0.1, holds one established connection
to itself, and spawns (multiprocessing "spawn", as vLLM does) an engine titled
VLLM::EngineCore_DP0 which spawns a worker titled VLLM::Worker_TP0. The titles
are set with prctl(PR_SET_NAME) only: comm (psutil's name()) shows them, cut to
15 characters, while the cmdline stays multiprocessing's spawn_main line.

Announces 'ready {"api": PID, "engine": PID, "worker": PID, "port": N}'.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import signal
import socket
import threading

from _announce import announce

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def _title(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # never outlive the test's target


def worker_main(pids: mp.Queue) -> None:
    _title("VLLM::Worker_TP0")
    pids.put(("worker", mp.current_process().pid))
    threading.Event().wait()


def engine_main(pids: mp.Queue) -> None:
    _title("VLLM::EngineCore_DP0")
    ctx = mp.get_context("spawn")
    ctx.Process(target=worker_main, args=(pids,), name="worker").start()
    pids.put(("engine", mp.current_process().pid))
    threading.Event().wait()


def main() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    ctx = mp.get_context("spawn")
    pids: mp.Queue = ctx.Queue()
    ctx.Process(target=engine_main, args=(pids,), name="engine").start()
    got = dict(pids.get(timeout=30) for _ in range(2))
    announce("ready", api=mp.current_process().pid, port=server.getsockname()[1], **got)
    threading.Event().wait()
    del client, accepted


if __name__ == "__main__":
    main()
