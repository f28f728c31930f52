"""The client side of a kept repro: holds the workload's requests open after wedgectl exits.

    python -m wedgectl.lab._hold URL PID CONFIG.toml RESULTS.json [HOLD_S]

`wedgectl repro NAME --keep` runs the workload in this detached process, so the hung server
keeps its hung requests (a closed connection makes vLLM abort the request and the hang goes
away). It exits when HOLD_S passes (default 1 h), the server's process PID is gone, or it is sent
SIGTERM (a repro without --keep stops it so, before it stops the server: the results it writes last
are the workload's against the live server, not the refusals of one shutting down); not when
/metrics stops answering, since a server in a shutdown hang closed its listener but lives on.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from wedgectl.collect.control import Signal, handle_signals
from wedgectl.collect.processes import is_alive
from wedgectl.lab.lifecycle import health_client
from wedgectl.lab.repro import Workload, load_config, scrape_snapshot


def main(argv: list[str]) -> int:
    url, pid, cfg_path, results = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    hold_s = float(argv[4]) if len(argv) > 4 else 3600.0
    cfg = load_config(cfg_path)
    workload = Workload(url, cfg, hold_s=hold_s)
    workload.start_now()
    stopped = threading.Event()
    handle_signals((Signal.TERM,), lambda _sig: stopped.set())
    deadline = time.monotonic() + hold_s
    with health_client() as client:
        while time.monotonic() < deadline and is_alive(pid) and not stopped.is_set():
            snap = scrape_snapshot(client, url)
            if snap is not None:
                workload.start_later(snap.generation_tokens or 0)
            results.write_text(json.dumps(workload.results, indent=2))
            stopped.wait(1.0)
    workload.drain(join_s=0)  # no new request from here; what is recorded now is final
    results.write_text(json.dumps(workload.results, indent=2))
    workload.stop(join_s=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
