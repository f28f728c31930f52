"""Seconds from `wedgectl diagnose` start to verdict, and wedgectl's CPU seconds, per repro.

    python bench/time_to_verdict.py [--runs 3] [NAME ...]

For each config: reproduce it on the real server (kept running), then run
`wedgectl diagnose --pid PID --json` RUNS times against it, timing each run and
reading the child's CPU time from the kernel (rusage). Prints one row per
config: the verdicts seen, median wall seconds, median CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from wedgectl.repro import find_config, run_repro

NAMES = ["idle", "healthy", "admission-wedge", "engine-deadlock", "shutdown-hang", "starved"]


def timed_diagnose(pid: int) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "-q"],
                       capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    verdict = json.loads(r.stdout)["verdict"] if r.stdout.strip() else f"error {r.returncode}"
    return wall, cpu, verdict


def kill_session(pid: int) -> None:
    """The kept server runs in its own session: end the whole group."""
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=NAMES)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    rows = []
    for name in args.names:
        cfg = find_config(name)
        result = run_repro(cfg, out_dir=args.out / name, keep=True, progress=lambda m: None)
        try:
            runs = [timed_diagnose(result.pid) for _ in range(args.runs)]
        finally:
            kill_session(result.pid)
        walls, cpus, verdicts = zip(*runs)
        rows.append((name, cfg.expected, verdicts, statistics.median(walls), statistics.median(cpus)))
        print(f"{name:<16} expected {cfg.expected:<16} verdicts {','.join(verdicts):<50} "
              f"wall {statistics.median(walls):5.2f} s  cpu {statistics.median(cpus):5.2f} s", flush=True)
    print()
    print(f"{'config':<16} {'median s to verdict':>20} {'median CPU s':>14} {'matched':>8}")
    for name, expected, verdicts, wall, cpu in rows:
        print(f"{name:<16} {wall:>20.2f} {cpu:>14.2f} {sum(v == expected for v in verdicts):>5}/{len(verdicts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
