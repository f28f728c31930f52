"""What `wedgectl top` costs the server it watches: tokens/s with and without top attached, in one run.

    python bench/top_overhead.py [--rounds 10] [--phase-s 6] [--clients 2] [--max-tokens 64]
                                 [--refresh 1] [--mode app|collector|burn] [--burn-ms 14]
                                 [--same-priority] [--python PY]

Starts one tiny-model vLLM server (the managed runtime), drives a fixed closed-loop load
(CLIENTS threads, each sending the next completion as soon as the last returns) and
measures generation tokens/s by the server's own counter (vllm:generation_tokens_total).

top runs headless in a subprocess (`python -m wedgectl.tui.headless`: the whole Textual
app by default, at the default refresh, and at `wedgectl top`'s default priority, nice +5
and idle I/O; --same-priority keeps it at the server's), started once. Phases alternate between top
stopped (SIGSTOP: it costs nothing, holds nothing of the target) and top running
(SIGCONT), in ABBA order so a drift in the machine's other load cancels out. Each round
gives one ratio (with / without); the median ratio is the answer. Tokens per CPU second
of the server's processes is printed too: on a busy machine the throughput moves with
the share of the cores the server gets, while work per CPU second shows whether top
slows the server down by any other way (locks, ptrace). top's CPU (py-spy's included)
is read from the kernel for its process alone, over the phases it ran, and then over one
continuous stretch as long as those phases together, top never stopped: that is the figure
set beside the goal. Stopped and started, top's clocks run on while it is stopped, so what
it does by the clock (a stack dump every 60 s while healthy, a tree look every 5 s) falls
into its running phases twice as often as it does for a user.

--mode burn puts a control in top's place: a process that only burns --burn-ms of CPU
in one go each refresh (set it to what top used), at top's priority, and does nothing
else. Its throughput ratio is what any process that takes that much CPU from a saturated
host costs this server; what top costs beyond it is what it does besides (its scrapes,
its /proc reads, py-spy).

The goals: under 1 % throughput loss, and top itself under 1 % of one core at a 1 s refresh
(the last line prints that figure beside its goal). On a small shared machine other
processes move throughput by more than that from phase to phase: the spread of the
round ratios is printed so the median can be read against it.
"""

from __future__ import annotations

import argparse
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

from wedgectl.read.metrics import parse_metrics
from wedgectl.lab.runtime import ServerSpec, ensure_tiny_model, free_port, runtime_python, start_server, stop_server

SETTLE_S = 4.0  # top's start-up (imports, discovery, first stack dump) is left out of the phase
BURN = """
import os, sys, time
if sys.argv[3] == "nice":
    os.nice(5)
burn, refresh, end = float(sys.argv[1]) / 1000, float(sys.argv[2]), time.monotonic() + float(sys.argv[4])
due = time.monotonic()
while time.monotonic() < end:
    t = time.thread_time()
    while time.thread_time() - t < burn:
        pass
    due = max(due + refresh, time.monotonic())
    time.sleep(max(0.0, due - time.monotonic()))
"""
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


class Load:
    """CLIENTS closed-loop clients; counts completion tokens the server returned."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.tokens = 0
        self.errors = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                try:
                    r = client.post(f"{self.url}/v1/completions", json=body)
                    n = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
                except (httpx.HTTPError, ValueError, KeyError):
                    n = 0
                with self.lock:
                    self.tokens += n
                    self.errors += n == 0

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def cpu(self) -> float:
        """CPU seconds the client threads have used (so a bench running them in its own process can leave them out)."""
        total = 0.0
        for t in self.threads:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, TypeError):  # not started, or ended
                pass
        return total

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


def generated(url: str) -> float:
    """The server's generation token counter (one scrape: negligible next to the load)."""
    r = httpx.get(f"{url}/metrics", timeout=5)
    return parse_metrics(r.text).generation_tokens or 0.0


def phase(url: str, load: Load, seconds: float) -> float:
    """Tokens/s over `seconds`, by the server's counter."""
    t0, g0 = time.monotonic(), generated(url)
    time.sleep(seconds)
    t1, g1 = time.monotonic(), generated(url)
    return (g1 - g0) / (t1 - t0)


class Top:
    """One headless top watching pid, switched off (SIGSTOP) and on (SIGCONT) between phases."""

    def __init__(self, pid: int, refresh: float, mode: str, duration: float, same_priority: bool = False,
                 burn_ms: float = 14.0) -> None:
        cmd = [sys.executable, "-m", "wedgectl.tui.headless", "--pid", str(pid),
               "--duration", str(duration), "--refresh", str(refresh)]
        if mode == "app":
            cmd.append("--app")
        if same_priority:
            cmd.append("--same-priority")
        if mode == "burn":  # the control: the CPU alone, at the same priority
            cmd = [sys.executable, "-c", BURN, str(burn_ms), str(refresh), "same" if same_priority else "nice",
                   str(duration)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ps = psutil.Process(self.proc.pid)
        self.cpu_on_s = 0.0  # CPU used during the phases it ran
        time.sleep(SETTLE_S)  # imports, discovery, the first stack dump: not part of any phase
        if self.proc.poll() is not None:
            raise RuntimeError(f"top exited at start: {self.proc.stderr.read()[-600:]}")
        self.off()

    def cpu(self) -> float:
        c = self.ps.cpu_times()
        return c.user + c.system + c.children_user + c.children_system

    def on(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def off(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> str:
        self.on()
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def tree_cpu(pids: tuple[int, ...]) -> float:
    total = 0.0
    for pid in pids:
        try:
            c = psutil.Process(pid).cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def measure(url: str, load: Load, seconds: float, top: Top, with_top: bool, target: tuple[int, ...]) -> tuple[float,
                                                                                                              float]:
    """(tokens/s, tokens per CPU second of the server's processes) over one phase."""
    (top.on if with_top else top.off)()
    time.sleep(0.5)  # let a tick that was cut by SIGSTOP finish before counting
    c0, s0, g0, t0 = top.cpu(), tree_cpu(target), generated(url), time.monotonic()
    time.sleep(seconds)
    c1, s1, g1, t1 = top.cpu(), tree_cpu(target), generated(url), time.monotonic()
    if with_top:
        top.cpu_on_s += c1 - c0
    return (g1 - g0) / (t1 - t0), (g1 - g0) / (s1 - s0) if s1 > s0 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--phase-s", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--refresh", type=float, default=1.0)
    ap.add_argument("--mode", choices=("app", "collector", "burn"), default="app")
    ap.add_argument("--burn-ms", type=float, default=14.0, help="--mode burn: CPU ms burnt each refresh")
    ap.add_argument("--python", help="a vLLM environment's python (default: the managed runtime)")
    ap.add_argument("--same-priority", action="store_true", help="run top at the server's priority, not at nice +5")
    args = ap.parse_args()

    py = runtime_python(args.python)
    spec = ServerSpec(model=ensure_tiny_model(py), port=free_port())
    log = Path(tempfile.mkdtemp(prefix="top-overhead-")) / "server.log"
    print(f"starting vLLM (log {log}) ...", flush=True)
    server = start_server(spec, py, log)
    load = Load(server.url, args.clients, args.max_tokens)
    top = None
    without, with_, ratios, eff_ratios, eff_a, eff_b = [], [], [], [], [], []
    try:
        load.start()
        phase(server.url, load, 5.0)  # warm-up
        target = server.tree_pids()
        top = Top(server.pid, args.refresh, args.mode, duration=3 * args.rounds * (args.phase_s + 2) + 60,
                  same_priority=args.same_priority, burn_ms=args.burn_ms)
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # ABBA
            got = {w: measure(server.url, load, args.phase_s, top, w, target) for w in order}
            without.append(got[False][0])
            with_.append(got[True][0])
            eff_a.append(got[False][1])
            eff_b.append(got[True][1])
            ratios.append(got[True][0] / got[False][0] if got[False][0] else float("nan"))
            eff_ratios.append(got[True][1] / got[False][1] if got[False][1] else float("nan"))
            print(f"round {r + 1:2}: without top {got[False][0]:7.1f} tokens/s ({got[False][1]:6.1f}/server CPU s), "
                  f"with top {got[True][0]:7.1f} ({got[True][1]:6.1f}), ratio {ratios[-1]:.3f}", flush=True)
        top.on()
        time.sleep(1.0)  # the first tick after the last stop, late, is not counted
        c0, t0 = top.cpu(), time.monotonic()
        time.sleep(args.rounds * args.phase_s)
        continuous_s, continuous_cpu = time.monotonic() - t0, top.cpu() - c0
    finally:
        if top is not None:
            top.close()
        load.close()
        stop_server(server, grace=5)

    med, eff = statistics.median(ratios), statistics.median(eff_ratios)
    on_s = args.rounds * args.phase_s
    cores = psutil.cpu_count() or 1
    print()
    print(f"load: {args.clients} closed-loop clients, max_tokens {args.max_tokens}; top: {args.mode}, "
          f"refresh {args.refresh:g} s, {'same priority as the server' if args.same_priority else 'nice +5'}; "
          f"{args.rounds} rounds (ABBA) of 2 x {args.phase_s:.0f} s; "
          f"load average at the end {psutil.getloadavg()[0]:.1f} on {cores} cores")
    print(f"{'':12} {'tokens/s':>9} {'tokens per server CPU s':>24}")
    print(f"{'without top':12} {statistics.mean(without):9.1f} {statistics.mean(eff_a):24.1f}")
    print(f"{'with top':12} {statistics.mean(with_):9.1f} {statistics.mean(eff_b):24.1f}")
    print(f"throughput ratio with/without: median {med:.4f} (loss {100 * (1 - med):+.2f} %), "
          f"rounds {min(ratios):.3f} .. {max(ratios):.3f}")
    print(f"server efficiency ratio (tokens per server CPU s): median {eff:.4f} ({100 * (1 - eff):+.2f} %), "
          f"rounds {min(eff_ratios):.3f} .. {max(eff_ratios):.3f}")
    print(f"wedgectl top CPU over its running phases: {top.cpu_on_s:.2f} s over {on_s:.0f} s attached = "
          f"{100 * top.cpu_on_s / on_s:.2f} % of one core (py-spy included; its clocks ran while it was stopped)")
    cont = 100 * continuous_cpu / continuous_s
    print(f"wedgectl top CPU, never stopped: {continuous_cpu:.2f} s over {continuous_s:.0f} s = "
          f"{cont:.2f} % of one core, {cont / cores:.2f} % of the machine (py-spy included)")
    print(f"{'figure':34} {'measured':>9} {'goal':>6}")
    print(f"{'top CPU, % of one core':34} {cont:9.2f} {'<= 1':>6}   (refresh {args.refresh:g} s, {args.mode}, never "
          "stopped)")
    print(f"{'serving throughput ratio':34} {med:9.4f} {'>= 0.99':>6}")
    print(f"client errors: {load.errors}; server log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
