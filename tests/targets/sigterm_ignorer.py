"""Test target: ignores SIGTERM (the handler logs and returns) and cannot exit, because a
non-daemon thread waits on an Event forever and the main thread returns into the
interpreter's join of that thread.

Announces 'ready {"main": TID, "waiter": TID}' once both are parked, and 'sigterm {"n": N}'
each time the handler runs. Usage: python sigterm_ignorer.py [FIFO]
"""

from __future__ import annotations

import signal
import sys
import threading

from _announce import announce, wait_until_parked

forever = threading.Event()
received = 0


def on_sigterm(signum: int, frame: object) -> None:
    global received
    received += 1
    print(f"sigterm_ignorer: SIGTERM #{received}, ignoring", file=sys.stderr, flush=True)
    announce("sigterm", n=received)


def report_when_parked(main_tid: int, waiter_tid: int) -> None:
    # a daemon thread keeps running while threading._shutdown joins the waiter
    if wait_until_parked(waiter_tid) and wait_until_parked(main_tid):
        announce("ready", main=main_tid, waiter=waiter_tid)


def main() -> None:
    signal.signal(signal.SIGTERM, on_sigterm)
    waiter = threading.Thread(target=forever.wait, name="waiter")  # non-daemon
    waiter.start()
    main_tid = threading.main_thread().native_id
    threading.Thread(
        target=report_when_parked, args=(main_tid, waiter.native_id), name="reporter", daemon=True
    ).start()
    # returning lets the interpreter join 'waiter' in threading._shutdown: forever


if __name__ == "__main__":
    main()
