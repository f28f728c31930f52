"""What `wedgectl watch` costs: its CPU per watched healthy server at the default cadence, as a ratio of one core.

    python bench/watch_overhead.py [--seconds 60] [--interval 5] [--settle 15] [--python PY]

Starts one tiny-model vLLM server (the managed runtime), keeps it under a light load (one
client, a short completion, a pause) so it is seen progressing, and runs `wedgectl watch
--pid` on it in a subprocess at the given cadence (default: watch's own default), scraped
by a pretend Prometheus every 15 s. After the settle time (imports, discovery, the first
ticks) the watcher's CPU is read from the kernel for its process and the children it reaped
(py-spy, when it escalates) over --seconds of wall time. The ratio is that CPU over the
wall time: 0.01 is 1 % of one core. The goal is under 1 %.

It also prints what the watcher saw (the verdict and whether it escalated): a healthy server
must stay on cheap ticks, or the number measures the wrong mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from wedgectl.lab.runtime import ServerSpec, ensure_tiny_model, free_port, runtime_python, start_server, stop_server

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
SCRAPE_EVERY_S = 15.0


def light_load(url: str, stop: threading.Event) -> int:
    """One completion every ~2 s until stop: a healthy server doing a little work."""
    done = 0
    with httpx.Client(timeout=60, trust_env=False) as c:
        while not stop.wait(2.0):
            try:
                r = c.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 16})
                done += r.status_code == 200
            except httpx.HTTPError:
                pass
    return done


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured wall time")
    ap.add_argument("--interval", type=float, default=5.0, help="watch --interval (its default is 5)")
    ap.add_argument("--settle", type=float, default=15.0, help="seconds left out at the start")
    ap.add_argument("--python", help="a vLLM environment's python (default: the managed runtime)")
    args = ap.parse_args(argv)

    py = runtime_python(args.python)
    spec = ServerSpec(model=ensure_tiny_model(py), port=free_port())
    with tempfile.TemporaryDirectory(prefix="wedgectl-watch-bench-") as tmp:
        server = start_server(spec, py, Path(tmp) / "server.log")
        stop = threading.Event()
        loader = threading.Thread(target=light_load, args=(server.url, stop), daemon=True)
        watch = None
        try:
            loader.start()
            port = free_port()
            watch = subprocess.Popen([sys.executable, "-m", "wedgectl", "watch", "--pid", str(server.pid),
                                      "--listen", f"127.0.0.1:{port}", "--interval", str(args.interval)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            me = psutil.Process(watch.pid)
            base = f"http://127.0.0.1:{port}"
            time.sleep(args.settle)
            c0, t0 = cpu_s(me), time.monotonic()
            escalated = 0
            verdicts: set[str] = set()
            with httpx.Client(timeout=5, trust_env=False) as c:
                while time.monotonic() - t0 < args.seconds:
                    c.get(f"{base}/metrics")  # what Prometheus costs it
                    for t in c.get(f"{base}/v1/targets").json()["targets"]:
                        verdicts.add(t["verdict"])
                        escalated += bool(t["escalated"])
                    time.sleep(min(SCRAPE_EVERY_S, max(0.0, args.seconds - (time.monotonic() - t0))))
            c1, t1 = cpu_s(me), time.monotonic()
        finally:
            stop.set()
            if watch is not None:
                watch.terminate()
                watch.wait(timeout=20)
            loader.join(timeout=65)
            stop_server(server, grace=5)
    ratio = (c1 - c0) / (t1 - t0)
    out = {"interval_s": args.interval, "wall_s": round(t1 - t0, 1), "watch_cpu_s": round(c1 - c0, 3),
           "servers": 1, "ratio_of_one_core": round(ratio, 5), "verdicts_seen": sorted(v for v in verdicts if v),
           "looks_escalated": escalated}
    print(json.dumps(out))
    print(f"wedgectl watch: {ratio * 100:.2f} % of one core per watched healthy server "
          f"at --interval {args.interval:g} (goal: under 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
