"""Test target: a thread in a long *timed* futex wait (Event.wait(timeout=...)).

After a blocking (ptrace) py-spy dump the kernel resumes that wait through
restart_syscall, which is what the procfs collector must still read as futex.
Announces 'ready {"waiter": TID}'. Usage: python timed_waiter.py [FIFO]
"""

from __future__ import annotations

import threading

from _announce import announce, wait_until_parked


def main() -> None:
    gate = threading.Event()
    waiter = threading.Thread(target=gate.wait, args=(3600.0,), name="timed-waiter", daemon=True)
    waiter.start()
    wait_until_parked(waiter.native_id)
    announce("ready", waiter=waiter.native_id)
    gate.wait()


if __name__ == "__main__":
    main()
