"""Shared by the test targets: tell the test a line, through a FIFO named in argv or stdout."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

_lock = threading.Lock()
_out: TextIO | None = None


def _fifo_path() -> str | None:
    for arg in sys.argv[1:]:
        try:
            if stat.S_ISFIFO(os.stat(arg).st_mode):
                return arg
        except OSError:
            continue
    return None


def announce(word: str, **info: object) -> None:
    """Write 'WORD {json}' as one line; the test reads it to learn the target's state.

    The FIFO stays open for later lines, so the test sees EOF only when we exit.
    """
    global _out
    line = f"{word} {json.dumps(info)}\n"
    with _lock:
        if _out is None:
            path = _fifo_path()
            _out = open(path, "w", buffering=1) if path else sys.stdout  # noqa: SIM115 - kept open
        _out.write(line)
        _out.flush()


def wait_until_parked(tid: int, timeout: float = 10.0) -> bool:
    """Poll our own /proc until thread ``tid`` sleeps in a futex (really blocked, not about to)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            wchan = Path(f"/proc/self/task/{tid}/wchan").read_text()
            state = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            wchan, state = "", ""
        if state == "S" and "futex" in wchan:
            return True
        time.sleep(0.01)
    return False
