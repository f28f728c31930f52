"""Parent watch: prevents the orphaned engine, EngineCore and Workers that outlive a killed API server.

The hang: when the API server is SIGKILLed (the OOM killer, ``kill -9``, a
crashed supervisor), vLLM 0.32's EngineCore is reparented and lives on: nothing
in it watches its parent (its busy loop blocks on ``input_queue.get``, its
input thread on a zmq poll; ``run_engine_core``'s SIGTERM handler is reached
only by a signal). Its Workers exit only when the EngineCore closes their death
pipe (``WorkerProc.monitor_death_pipe``). The orphans keep their memory, the
accelerator and its memory, so the next start fails or lands on a
half-occupied device.

With this fix, in every EngineCore and Worker, a daemon thread checks once a
second whether the process's parent changed (``os.getppid()``: a reparented
process gets init's or a subreaper's pid). When it did, it logs why, sends the
process SIGTERM (vLLM's own shutdown, which stops the Workers), and if the
process still lives ``GRACE_S`` later (a start-up or a step that never returns
ignores that flag) SIGKILLs its descendants and exits with code 1.

Cost when nothing is wrong: one getppid() a second per process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from wedge_engine.capability import Needs

logger = logging.getLogger("vllm.wedge_engine")

# Nothing of vLLM: a thread that watches os.getppid().
REQUIRES: tuple[Needs, ...] = ()
OPTIONAL: tuple[Needs, ...] = ()

POLL_S = 1.0
GRACE_S = 5.0
EXIT_CODE = 1

_active: set[str] = set()


def _kill_descendants() -> None:
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # psutil missing or the table unreadable: exiting matters more
        pass


def _exit_now(code: int) -> None:
    os._exit(code)


def watch_parent(parent: int, role: str, *, getppid: Callable[[], int] = os.getppid,
                 kill: Callable[[int, int], None] = os.kill, exit_: Callable[[int], None] = _exit_now,
                 poll_s: float = POLL_S, grace_s: float = GRACE_S, stop: threading.Event | None = None) -> None:
    """Block until `parent` is no longer this process's parent, then end the process (see module doc)."""
    stop = stop or threading.Event()
    while not stop.is_set():
        now = getppid()
        if now != parent:
            logger.error("wedge_engine: the %s's parent (pid %d) is gone (now %d): exiting, "
                         "or it would live on as an orphan holding memory and the device", role, parent, now)
            kill(os.getpid(), signal.SIGTERM)
            if stop.wait(grace_s):
                return
            logger.error("wedge_engine: the %s did not exit within %g s of SIGTERM; killing its children and exiting",
                         role, grace_s)
            _kill_descendants()
            exit_(EXIT_CODE)
            return
        stop.wait(poll_s)


def activate(settings: object, role: str) -> str | None:
    if role not in ("engine", "worker") or _active:
        return None
    parent = os.getppid()
    name = "EngineCore" if role == "engine" else "Worker"
    threading.Thread(target=watch_parent, args=(parent, name), name="wedge-parent-watch", daemon=True).start()
    _active.add(role)
    return f"exits when its parent (pid {parent}) dies"


def is_active() -> bool:
    return bool(_active)
