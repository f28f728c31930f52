"""Seconds from `wedgectl diagnose` start to verdict, and wedgectl's CPU seconds, per repro.

    python bench/time_to_verdict.py [--runs 3] [--json] [NAME ...]

For each config: reproduce it on the real server (kept running), then run
`wedgectl diagnose --pid PID --json` RUNS times against it, timing each run and
reading the child's CPU time from the kernel (rusage: wedgectl and the py-spy and
probe children it waited for). Prints one row per config: the verdicts seen,
median wall seconds, median CPU seconds, the median seconds wedgectl's threads
spent runnable but waiting for a CPU (the kernel's schedstat run delay: on a
saturated host most of the wall time), and how many runs were right; with --json,
one object per config (name, expected, verdicts, median_s, median_cpu_s,
median_cpu_wait_s, right, runs, and the warm_ figures below) and a last object with the goals
and the host's load.

Side by side with each run, in the same loop: the same diagnose in one child process that
imported wedgectl once and calls its command line's entry point for each run (`warm_median_cpu_s`,
`warm_median_s`, `warm_right`): what a long-lived caller such as `wedgectl watch` pays per
capture. The cold and warm runs alternate (cold, then warm, run after run), so a drift in the
host's load falls on both; the table prints the cold/warm CPU ratio (`cold_over_warm_cpu`). The
one-shot CPU less the warm CPU is what the interpreter's start-up and the imports cost each run.

The goals (issue 14): median seconds to verdict <= 2.0 for idle, admission-wedge,
engine-deadlock and shutdown-hang; <= 3.0 for healthy and starved; <= 5.0 for
healthy-loaded (8 streams saturating the host); CPU <= 0.5 s per diagnose; every
verdict right. A loaded host moves the wall seconds; the load average is printed.

With --urgent, each run is followed by one of `diagnose --urgent` (above the server's
priority: in a session of its own with autogroup nice -10 where autogroup applies), and
the two medians are printed side by side: how much of the default's wall time is the
host's scheduling rather than wedgectl's work.

The engine's own report, on and off. Every repro runs the wedge_engine plugin's report
(WEDGE_ENGINE_REPORT=1: the repro's default, `wedgectl.lab.repro.repro_env`), so the figures
above are the report's. For each hang config (an expected verdict other than idle or
progressing), the same config is then reproduced again with the report off
(WEDGE_ENGINE_REPORT=0; the fault still applies) and diagnosed RUNS times the same way (cold
runs only), one server after the other so neither side's server loads the other's: the
table prints both medians and their ratio (`report_median_s`, `report_off_median_s`,
`report_over_off`, `report_off_verdicts`, `report_off_right` in --json). The goal for the
report side (issue 37): median <= 1.0 s for admission-wedge, engine-deadlock, shutdown-hang
and starved. With --no-report-off the second server is not started.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from wedgectl.collect import procfs
from wedgectl.lab.repro import find_config, run_repro

NAMES = ["idle", "healthy", "healthy-loaded", "admission-wedge", "engine-deadlock", "shutdown-hang", "starved"]
GOAL_S = {"idle": 2.0, "admission-wedge": 2.0, "engine-deadlock": 2.0, "shutdown-hang": 2.0,
          "healthy": 3.0, "starved": 3.0, "healthy-loaded": 5.0}
GOAL_CPU_S = 0.5
# With the engine's own report on (issue 37): the hang classes, decided from its first reading.
REPORT_GOAL_S = {"admission-wedge": 1.0, "engine-deadlock": 1.0, "shutdown-hang": 1.0, "starved": 1.0}
HEALTHY_VERDICTS = ("idle", "progressing")
REPORT_OFF = {"WEDGE_ENGINE_REPORT": "0"}


def _run_delays(pid: int, seen: dict[int, float]) -> None:
    """Each of pid's threads' run delay so far (schedstat's second field: seconds spent runnable,
    waiting for a CPU), into `seen` by tid; a thread gone since keeps its last reading."""
    for tid, (_, run_delay_ns, _) in procfs.thread_schedstats(pid).items():
        seen[tid] = run_delay_ns / 1e9


def timed_diagnose(pid: int, extra: tuple[str, ...] = ()) -> tuple[float, float, float, str]:
    """(wall s, CPU s of wedgectl and its children, s wedgectl waited for a CPU, verdict) of one
    `wedgectl diagnose --pid`. The wait is read from the kernel every 50 ms while it runs (every
    thread of the process, and of its child with --urgent): on a saturated host it, not wedgectl's
    own work, is most of the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "-q", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    waits: dict[int, float] = {}
    while p.poll() is None and time.monotonic() - t0 < 120:
        _run_delays(p.pid, waits)
        for kid in _children(p.pid):  # --urgent goes on in a child
            _run_delays(kid, waits)
        time.sleep(0.05)
    try:
        stdout, _ = p.communicate(timeout=max(1.0, 120 - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, _ = p.communicate()
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    try:
        verdict = json.loads(stdout)["verdict"]
    except (ValueError, KeyError):
        verdict = f"error {p.returncode}"
    return wall, cpu, sum(waits.values()), verdict


def warm_child(pid: int, runs: int) -> None:
    """In a child of the bench: import wedgectl once, print "ready", then for each line read
    from stdin (at most RUNS) run `diagnose --pid PID --json` through the same entry point
    (wedgectl.cli.main), printing one JSON line per run: wall s, CPU s (this process's threads
    and the py-spy and probe children it waited for, by rusage) and the verdict. What a
    long-lived caller pays per capture once loaded (`wedgectl watch` captures in-process at an
    episode's onset): the one-shot figure less the start-up."""
    import contextlib
    import io

    from wedgectl.cli import main as cli_main

    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    print("ready", flush=True)
    for _, _line in zip(range(runs), sys.stdin):
        out = io.StringIO()
        c0, t0 = cpu(), time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            cli_main(["diagnose", "--pid", str(pid), "--json", "-q"])
        wall, used = time.monotonic() - t0, cpu() - c0
        try:
            verdict = json.loads(out.getvalue())["verdict"]
        except (ValueError, KeyError):
            verdict = "error"
        print(json.dumps({"wall": wall, "cpu": used, "verdict": verdict}), flush=True)


class Warm:
    """The warm child (warm_child), started once per config and asked for one diagnose at a time,
    so its runs alternate with the cold ones."""

    def __init__(self, pid: int, runs: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--warm-child", str(pid), str(runs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.ready = self.proc.stdout.readline().strip() == "ready"  # imports done: they are not timed

    def run(self) -> tuple[float, float, str]:
        """(wall s, CPU s, verdict) of one in-process diagnose."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        if not self.ready:
            return float("nan"), float("nan"), f"error {self.proc.poll()}"
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            d = json.loads(self.proc.stdout.readline())
        except (OSError, ValueError):
            self.ready = False
            return float("nan"), float("nan"), f"error {self.proc.poll()}"
        return d["wall"], d["cpu"], d["verdict"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def kill_session(pid: int) -> None:
    """The kept server runs in its own session: end the whole group (its clients' holder too)."""
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # the server is our child: reap it, or it lingers as a zombie
        except ChildProcessError:
            break
        time.sleep(0.2)


def report_off_side(name: str, runs: int, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """The same config reproduced with the engine's report off (WEDGE_ENGINE_REPORT=0 over the repro's
    default, as tests/integration/test_unprivileged.py runs it), diagnosed `runs` times cold: the
    report_off_ keys of its row."""
    cfg = find_config(name)
    cfg = dataclasses.replace(cfg, env={**cfg.env, **REPORT_OFF})
    result = run_repro(cfg, out_dir=out / f"{name}-report-off", keep=True, progress=lambda m: None)
    try:
        got = [timed_diagnose(result.pid, extra) for _ in range(runs)]
    finally:
        kill_session(result.pid)
    walls, cpus, _, verdicts = zip(*got)
    return {"report_off_verdicts": list(verdicts), "report_off_median_s": round(statistics.median(walls), 2),
            "report_off_median_cpu_s": round(statistics.median(cpus), 3),
            "report_off_right": sum(v == cfg.expected for v in verdicts)}


def bench_config(name: str, runs: int, out: Path, extra: tuple[str, ...] = (), urgent: bool = False) -> dict:
    cfg = find_config(name)
    result = run_repro(cfg, out_dir=out / name, keep=True, progress=lambda m: None)
    grouped = []
    warm = []
    try:
        got = []
        warm_child = Warm(result.pid, runs)
        try:
            for _ in range(runs):  # cold, then (with --urgent) `diagnose --urgent`, then warm: interleaved
                got.append(timed_diagnose(result.pid, extra))
                if urgent:
                    grouped.append(timed_diagnose(result.pid, ("--urgent",)))
                warm.append(warm_child.run())
        finally:
            warm_child.close()
    finally:
        kill_session(result.pid)
    walls, cpus, waits, verdicts = zip(*got)
    row = {"name": name, "expected": cfg.expected, "verdicts": list(verdicts),
           "median_s": round(statistics.median(walls), 2), "median_cpu_s": round(statistics.median(cpus), 3),
           "median_cpu_wait_s": round(statistics.median(waits), 2),
           "right": sum(v == cfg.expected for v in verdicts), "runs": len(verdicts),
           "goal_s": GOAL_S.get(name), "load_avg": round(psutil.getloadavg()[0], 1),
           "priority": "same" if extra else "low",
           "warm_verdicts": [v for _, _, v in warm],
           "warm_median_s": round(statistics.median(w for w, _, _ in warm), 2),
           "warm_median_cpu_s": round(statistics.median(c for _, c, _ in warm), 3),
           "warm_right": sum(v == cfg.expected for _, _, v in warm)}
    row["cold_over_warm_cpu"] = (round(row["median_cpu_s"] / row["warm_median_cpu_s"], 2)
                                 if row["warm_median_cpu_s"] > 0 else None)
    if grouped:
        g_walls, _, g_waits, g_verdicts = zip(*grouped)
        row |= {"urgent_verdicts": list(g_verdicts),
                "urgent_median_s": round(statistics.median(g_walls), 2),
                "urgent_median_cpu_wait_s": round(statistics.median(g_waits), 2),
                "urgent_right": sum(v == cfg.expected for v in g_verdicts)}
    row["report"] = cfg.env.get("WEDGE_ENGINE_REPORT", "1") != "0"  # the repro's default: on
    row["report_goal_s"] = REPORT_GOAL_S.get(name)
    return row


def with_report_off(row: dict, runs: int, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """`row` (the report on) with the report-off side beside it and their ratio."""
    row = row | report_off_side(row["name"], runs, out, extra)
    row["report_median_s"] = row["median_s"]
    row["report_over_off"] = (round(row["median_s"] / row["report_off_median_s"], 2)
                              if row["report_off_median_s"] > 0 else None)
    return row


def autogroup_on() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def byte_compile() -> None:
    """Compile wedgectl's modules as a wheel install does (pip byte-compiles at install): run from a
    checkout with PYTHONDONTWRITEBYTECODE set, every diagnose would compile them again, a cost
    an installed wedgectl never pays."""
    import compileall

    import wedgectl

    compileall.compile_dir(str(Path(wedgectl.__file__).parent), quiet=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=NAMES)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object per config, then one with the goals")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--same-priority", action="store_true",
                    help="diagnose at the server's priority (default: nice +5, idle I/O, as shipped)")
    ap.add_argument("--urgent", action="store_true",
                    help="also time `diagnose --urgent` after each run (interleaved), side by side: above the "
                         "server's priority, in a session of its own where autogroup applies (docs/design.md)")
    ap.add_argument("--no-report-off", action="store_true",
                    help="skip the second server of each hang config with the engine's report off "
                         "(WEDGE_ENGINE_REPORT=0); default: diagnosed beside the report's, medians and ratio")
    ap.add_argument("--warm-child", nargs=2, type=int, metavar=("PID", "RUNS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warm_child:
        warm_child(*args.warm_child)
        return 0
    extra = ("--same-priority",) if args.same_priority else ()
    byte_compile()
    rows = []
    for name in args.names:
        row = bench_config(name, args.runs, args.out, extra, args.urgent)
        if not args.no_report_off and row["expected"] not in HEALTHY_VERDICTS and row["report"]:
            row = with_report_off(row, args.runs, args.out, extra)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{name:<16} expected {row['expected']:<16} verdicts {','.join(row['verdicts']):<50} "
                  f"wall {row['median_s']:5.2f} s  cpu {row['median_cpu_s']:5.2f} s  "
                  f"waited for a cpu {row['median_cpu_wait_s']:5.2f} s", flush=True)
            if "report_off_median_s" in row:
                print(f"{'':<16} report off: verdicts {','.join(row['report_off_verdicts'])} "
                      f"wall {row['report_off_median_s']:5.2f} s", flush=True)
            if "urgent_median_s" in row:
                print(f"{'':<16} --urgent: verdicts {','.join(row['urgent_verdicts'])} "
                      f"wall {row['urgent_median_s']:5.2f} s  "
                      f"waited for a cpu {row['urgent_median_cpu_wait_s']:5.2f} s",
                      flush=True)
    cores = psutil.cpu_count() or 1
    if args.json:
        print(json.dumps({"goals": {"median_s": GOAL_S, "median_cpu_s": GOAL_CPU_S, "report_median_s": REPORT_GOAL_S},
                          "cores": cores, "load_avg_end": round(psutil.getloadavg()[0], 1),
                          "autogroup": autogroup_on()}))
        return 0
    print()
    print(f"{'config':<16} {'median s':>9} {'goal s':>7} {'waited s':>9} {'median CPU s':>13} {'goal':>5} {'right':>6}"
          f"  {'warm CPU s':>10} {'warm s':>7} {'right':>6} {'cold/warm CPU':>13}  load")
    for r in rows:
        goal = f"{r['goal_s']:.1f}" if r["goal_s"] is not None else "-"
        print(f"{r['name']:<16} {r['median_s']:>9.2f} {goal:>7} {r['median_cpu_wait_s']:>9.2f} "
              f"{r['median_cpu_s']:>13.2f} "
              f"{GOAL_CPU_S:>5.1f} {r['right']:>3}/{r['runs']:<2}  {r['warm_median_cpu_s']:>10.2f} "
              f"{r['warm_median_s']:>7.2f} "
              f"{r['warm_right']:>3}/{r['runs']:<2} {r['cold_over_warm_cpu'] or float('nan'):>13.2f}  "
              f"{r['load_avg']:.1f} on {cores} cores")
    print("warm: the same diagnose, run after each cold one in one process that imported wedgectl once (what "
          "`wedgectl watch`'s onset capture pays); the one-shot CPU less the warm CPU is the start-up's share")
    compared = [r for r in rows if "report_off_median_s" in r]
    if compared:
        print()
        print("the engine's own report: on (WEDGE_ENGINE_REPORT=1, the repro's default; the rows above) beside off "
              "(=0), one server after the other:")
        print(f"{'config':<16} {'report s':>9} {'goal s':>7} {'right':>6}  {'off s':>7} {'right':>6}  "
              f"{'report/off':>10}")
        for r in compared:
            goal = f"{r['report_goal_s']:.1f}" if r["report_goal_s"] is not None else "-"
            ratio = r["report_over_off"]
            print(f"{r['name']:<16} {r['report_median_s']:>9.2f} {goal:>7} {r['right']:>3}/{r['runs']:<2}  "
                  f"{r['report_off_median_s']:>7.2f} {r['report_off_right']:>3}/{r['runs']:<2}  "
                  f"{ratio if ratio is not None else float('nan'):>10.2f}")
    if args.urgent:
        print()
        print("diagnose --urgent, each run right after one of the above (autogroup "
              f"{'on' if autogroup_on() else 'off'}):")
        print(f"{'config':<16} {'median s':>9} {'waited s':>9} {'right':>6}  {'default/urgent':>14}")
        for r in rows:
            ratio = r["median_s"] / r["urgent_median_s"] if r["urgent_median_s"] else float("nan")
            print(f"{r['name']:<16} {r['urgent_median_s']:>9.2f} {r['urgent_median_cpu_wait_s']:>9.2f} "
                  f"{r['urgent_right']:>3}/{r['runs']:<2}  {ratio:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
