"""Test target: N threads (argv[1], default 60 in all) parked on one Event, for timing read_threads.

Announces 'ready {"threads": N}' once all are parked. Usage: python many_threads.py N [FIFO]
"""

from __future__ import annotations

import sys
import threading

from _announce import announce, wait_until_parked


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 60
    gate = threading.Event()
    threads = [threading.Thread(target=gate.wait, name=f"idle-{i}", daemon=True) for i in range(total - 1)]
    for t in threads:
        t.start()
    for t in threads:
        wait_until_parked(t.native_id)
    announce("ready", threads=total)
    gate.wait()


if __name__ == "__main__":
    main()
