"""Test target: two threads deadlocked on two threading.Locks taken in opposite order.

Announces 'ready {"a": TID, "b": TID}' once both threads are parked in the
second acquire. Usage: python deadlock.py [FIFO]
"""

from __future__ import annotations

import sys
import threading
import time

from _announce import announce, wait_until_parked

lock_a = threading.Lock()
lock_b = threading.Lock()
both_hold_one = threading.Barrier(2)


def take_a_then_b() -> None:
    with lock_a:
        both_hold_one.wait()
        lock_b.acquire()  # DEADLOCK-LINE


def take_b_then_a() -> None:
    with lock_b:
        both_hold_one.wait()
        lock_a.acquire()  # DEADLOCK-LINE


def acquire_lines() -> set[int]:
    """Line numbers of the two second acquires (the tests look for them in py-spy's frames)."""
    mark = "# DEADLOCK" + "-LINE"
    return {n for n, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith(mark)}


def main() -> None:
    a = threading.Thread(target=take_a_then_b, name="worker-a")
    b = threading.Thread(target=take_b_then_a, name="worker-b")
    a.start()
    b.start()
    # a thread parked in the barrier also sleeps in a futex: first wait for both
    # frames to reach the second acquire, then for both to be parked there
    lines = acquire_lines()
    while True:
        frames = sys._current_frames()
        fa, fb = frames.get(a.ident), frames.get(b.ident)
        if fa and fb and fa.f_lineno in lines and fb.f_lineno in lines:
            break
        time.sleep(0.01)
    if wait_until_parked(a.native_id) and wait_until_parked(b.native_id):
        announce("ready", a=a.native_id, b=b.native_id, lines=sorted(lines))
    a.join()


if __name__ == "__main__":
    main()
