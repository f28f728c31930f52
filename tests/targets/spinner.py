"""Test target: one thread spinning in a pure-Python loop, forever.

Announces 'ready {"spinner": TID}' once the loop has run. Usage: python spinner.py [FIFO]
"""

from __future__ import annotations

import threading

from _announce import announce

started = threading.Event()


def spin() -> None:
    n = 0
    while True:
        n += 1
        if n == 100_000:
            started.set()


def main() -> None:
    t = threading.Thread(target=spin, name="spinner", daemon=True)
    t.start()
    started.wait()
    announce("ready", spinner=t.native_id)
    t.join()


if __name__ == "__main__":
    main()
