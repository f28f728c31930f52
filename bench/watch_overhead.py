"""What `wedgectl watch` costs: the server's CPU with and without watch attached, and watch's own, in one run.

    python bench/watch_overhead.py [--rounds 4] [--phase-s 15] [--interval 5] [--settle 15] [--python PY]

Starts one tiny-model vLLM server (the managed runtime) and keeps it under a light load (one
client, a short completion every ~2 s) so it is seen progressing. `wedgectl watch --pid` runs
on it in a subprocess at the given cadence (default: watch's own default), started once and,
after the settle time (imports, discovery, the first ticks), left out of nothing but the
phases it is stopped in. Phases alternate between watch stopped (SIGSTOP: it holds nothing of
the target and costs nothing) and watch running (SIGCONT), in ABBA order so a drift in the
machine's other load cancels out; while it runs, a pretend Prometheus scrapes it every 15 s.

Each phase reads, from the kernel: the server's CPU (every process of its tree) and, in the
running phases, watch's (its process and the py-spy children it reaped). It prints, side by
side:

- the server's CPU per second without watch and with it, and their ratio per round (median
  and spread): what watching costs the server (its scrapes answered, its /proc read); the
  light load's own swing is larger than watch's cost, so read the median against the spread;
- watch's own CPU over the running phases, as a ratio of one core: 0.01 is 1 %. The goal is
  under 1 % per watched healthy server.

It also prints what the watcher saw (the verdict and whether it escalated): a healthy server
must stay on cheap ticks, or the numbers measure the wrong mode.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
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


def tree_cpu_s(root: int) -> float:
    """CPU seconds of root and every live descendant (the server's API server, EngineCore, Workers)."""
    total = 0.0
    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return total
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds (each: one phase stopped, one running)")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds per phase")
    ap.add_argument("--interval", type=float, default=5.0, help="watch --interval (its default is 5)")
    ap.add_argument("--settle", type=float, default=15.0, help="seconds left out at the start")
    ap.add_argument("--python", help="a vLLM environment's python (default: the managed runtime)")
    args = ap.parse_args(argv)

    py = runtime_python(args.python)
    spec = ServerSpec(model=ensure_tiny_model(py), port=free_port())
    ratios: list[float] = []
    off_rates: list[float] = []
    on_rates: list[float] = []
    watch_cpu = watch_wall = 0.0
    escalated = 0
    verdicts: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="wedgectl-watch-bench-") as tmp:
        server = start_server(spec, py, Path(tmp) / "server.log")
        stop = threading.Event()
        loader = threading.Thread(target=light_load, args=(server.url, stop), daemon=True)
        watch = None
        try:
            loader.start()
            port = free_port()
            errors = Path(tmp) / "watch.err"
            with errors.open("w") as err:
                watch = subprocess.Popen([sys.executable, "-m", "wedgectl", "watch", "--pid", str(server.pid),
                                          "--listen", f"127.0.0.1:{port}", "--interval", str(args.interval)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            me = psutil.Process(watch.pid)
            base = f"http://127.0.0.1:{port}"
            time.sleep(args.settle)
            if watch.poll() is not None:
                tail = errors.read_text().strip().splitlines()[-5:]
                print(f"wedgectl watch exited {watch.returncode} during the settle time:", *tail, sep="\n  ")
                return 1

            def phase(running: bool) -> float:
                """The server's CPU per second over one phase, watch running or stopped."""
                nonlocal watch_cpu, watch_wall, escalated
                watch.send_signal(signal.SIGCONT if running else signal.SIGSTOP)
                s0, w0, t0 = tree_cpu_s(server.pid), cpu_s(me), time.monotonic()
                if running:
                    with httpx.Client(timeout=5, trust_env=False) as c:
                        while (left := args.phase_s - (time.monotonic() - t0)) > 0:
                            c.get(f"{base}/metrics")  # what Prometheus costs it
                            for t in c.get(f"{base}/v1/targets").json()["targets"]:
                                verdicts.add(t["verdict"])
                                escalated += bool(t["escalated"])
                            time.sleep(min(SCRAPE_EVERY_S, left))
                else:
                    time.sleep(args.phase_s)
                s1, w1, t1 = tree_cpu_s(server.pid), cpu_s(me), time.monotonic()
                if running:
                    watch_cpu += w1 - w0
                    watch_wall += t1 - t0
                return (s1 - s0) / (t1 - t0)

            for i in range(args.rounds):
                order = (False, True) if i % 2 == 0 else (True, False)  # ABBA
                got = {running: phase(running) for running in order}
                off_rates.append(got[False])
                on_rates.append(got[True])
                if got[False] > 0:
                    ratios.append(got[True] / got[False])
            watch.send_signal(signal.SIGCONT)
        finally:
            stop.set()
            if watch is not None:
                watch.send_signal(signal.SIGCONT)
                watch.terminate()
                watch.wait(timeout=20)
            loader.join(timeout=65)
            stop_server(server, grace=5)
    own = watch_cpu / watch_wall if watch_wall else float("nan")
    ratio = statistics.median(ratios) if ratios else float("nan")
    out = {"interval_s": args.interval, "rounds": args.rounds, "phase_s": args.phase_s, "servers": 1,
           "server_cpu_per_s_without": round(statistics.median(off_rates), 4) if off_rates else None,
           "server_cpu_per_s_with": round(statistics.median(on_rates), 4) if on_rates else None,
           "server_cpu_ratio_with_over_without": round(ratio, 4),
           "server_cpu_ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)] if ratios else None,
           "watch_wall_s": round(watch_wall, 1), "watch_cpu_s": round(watch_cpu, 3),
           "ratio_of_one_core": round(own, 5), "verdicts_seen": sorted(v for v in verdicts if v),
           "looks_escalated": escalated}
    print(json.dumps(out))
    if ratios:
        print(f"server CPU with watch / without: {ratio:.3f} (median of {len(ratios)} ABBA rounds, "
              f"spread {min(ratios):.3f}-{max(ratios):.3f}; without: {statistics.median(off_rates):.3f} CPU s/s)")
    print(f"wedgectl watch: {own * 100:.2f} % of one core per watched healthy server "
          f"at --interval {args.interval:g} (goal: under 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
