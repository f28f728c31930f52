"""Where `wedgectl top`'s own CPU goes, part by part, against a serving vLLM server: the map for its 1 % goal.

    python bench/top_breakdown.py [--seconds 60] [--warmup 10] [--clients 2] [--max-tokens 64]
                                  [--refresh 1] [--pid PID] [--python PY]

bench/top_overhead.py gives the total (top's CPU beside the server's throughput, phases
alternated); this one says which part of top spends it. It starts one tiny-model vLLM
server (the managed runtime) with CLIENTS closed-loop clients, as top_overhead does, or
watches a running one (--pid), and runs the whole Textual app headless in this process
at 120x40 (the screen the app is laid out for). After WARMUP seconds (imports, discovery,
the first stack dump) it counts, for SECONDS:

- each part's CPU time (time.thread_time around the call, so a part is charged only the
  CPU its own thread used; the parts nest, as the indentation shows);
- the garbage collector's, from gc.callbacks (part of whatever part was running);
- py-spy's, the children's CPU (a stack dump is a py-spy run per process);
- the process's whole CPU (os.times), so what no part names (Textual's event loop, its
  timers, the start of each sample's threads) is the rest. The closed-loop clients run as
  threads of this process; their CPU (each thread's own clock) is left out of every row
  and printed apart.

Each row prints milliseconds of CPU per second of wall time (which, divided by 10, is a
percentage of one core) and milliseconds per call. The last lines set the total beside
the goal, <= 1 % of one core at a 1 s refresh, and beside the watched server's own CPU over
the same window (every process of its tree, read from the kernel), as a ratio.

What this is: a profile of one side, not an A/B comparison. A part's cost has no "without"
to set it against (top without its collector is not top); the comparison with and without
top attached is bench/top_overhead.py's, which alternates the phases in one run. The ratio
to the server's CPU printed here is measured in the same window, and says how large top's
share is beside the work it watches.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

# The parts, in the order printed: (label, depth, owner, attribute). Owners are looked up
# after import; each is wrapped where its callers look it up (a module attribute or a class).
PARTS = (
    ("collector tick (worker thread)", 0, "wedgectl.tui.source:Collector", "tick"),
    ("sample (LiveSource.take)", 1, "wedgectl.tui.source:LiveSource", "take"),
    ("/proc: processes and threads", 2, "wedgectl.collect.processes", "sample_roles"),
    ("threads (read_threads)", 3, "wedgectl.collect.procfs", "read_threads"),
    ("tree walk and fds (every 5 s)", 2, "wedgectl.capture.tree:TreeCache", "roles"),
    ("metrics parse (ScrapedSample.of)", 1, "wedgectl.tui.source:ScrapedSample", "of"),
    ("frame and live verdict (build_frame)", 1, "wedgectl.tui.source", "build_frame"),
    ("log tail", 1, "wedgectl.tui.source:LiveSource", "log_tail"),
    ("scrape /metrics (sample thread)", 0, "wedgectl.collect.scrape:Scraper", "metrics"),
    ("GET /health (sample thread)", 0, "wedgectl.collect.scrape:Scraper", "health"),
    ("frame to widgets (UI thread)", 0, "wedgectl.tui.app:TopApp", "on_frame_ready"),
    ("screen update (Textual compositor)", 0, "textual.screen:Screen", "_compositor_refresh"),
)


def _owner(spec: str) -> object:
    import importlib

    module, _, cls = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, cls) if cls else mod


class Meter:
    """thread_time around each part's calls, counted only while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.cpu: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.gc_s = 0.0
        self.gc_runs = 0
        self._gc_t0: dict[int, float] = {}

    def wrap(self, label: str, owner: object, name: str) -> None:
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        fn = raw.__func__ if kind is not None else raw
        meter = self

        @functools.wraps(fn)  # Textual reads a watcher's or handler's signature
        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if meter.on:
                    meter.cpu[label] += time.thread_time() - t0
                    meter.calls[label] += 1

        setattr(owner, name, kind(timed) if kind is not None else timed)

    def gc_callback(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._gc_t0[tid] = time.thread_time()
        elif tid in self._gc_t0 and self.on:
            self.gc_s += time.thread_time() - self._gc_t0.pop(tid)
            self.gc_runs += 1


def _process_cpu() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--refresh", type=float, default=1.0)
    ap.add_argument("--pid", type=int, help="watch this running vLLM API server (no server or load is started)")
    ap.add_argument("--python", help="a vLLM environment's python (default: the managed runtime)")
    args = ap.parse_args()

    from wedgectl.tui.headless import run_app_headless
    from wedgectl.tui.source import LiveSource

    meter = Meter()
    for label, _, owner, name in PARTS:
        meter.wrap(label, _owner(owner), name)
    gc.callbacks.append(meter.gc_callback)

    server = load = None
    pid = args.pid
    if pid is None:
        from top_overhead import Load  # this folder's: the same closed-loop clients

        from wedgectl.lab.runtime import ServerSpec, ensure_tiny_model, free_port, runtime_python, start_server

        py = runtime_python(args.python)
        spec = ServerSpec(model=ensure_tiny_model(py), port=free_port())
        log = Path(tempfile.mkdtemp(prefix="top-breakdown-")) / "server.log"
        print(f"starting vLLM (log {log}) ...", flush=True)
        server = start_server(spec, py, log)
        load = Load(server.url, args.clients, args.max_tokens)
        load.start()
        pid = server.pid

    from watch_overhead import tree_cpu_s  # a sibling script: bench/ is on sys.path when run as bench/top_breakdown.py

    window: dict[str, float] = {}

    def count() -> None:
        time.sleep(args.warmup)
        window["cpu0"], window["kids0"] = _process_cpu()
        window["load0"] = load.cpu() if load is not None else 0.0
        window["server0"] = tree_cpu_s(pid)
        window["t0"] = time.monotonic()
        meter.on = True
        time.sleep(args.seconds)
        meter.on = False
        window["cpu1"], window["kids1"] = _process_cpu()
        window["load1"] = load.cpu() if load is not None else 0.0
        window["server1"] = tree_cpu_s(pid)
        window["t1"] = time.monotonic()

    counter = threading.Thread(target=count, daemon=True)
    try:
        source = LiveSource.connect(pid=pid)
        counter.start()
        ticks, verdict = run_app_headless(source, args.warmup + args.seconds + 2 * args.refresh, args.refresh)
        counter.join()
    finally:
        if load is not None:
            load.close()
        if server is not None:
            from wedgectl.lab.runtime import stop_server

            stop_server(server, grace=5)

    wall = window["t1"] - window["t0"]
    # The closed-loop clients are threads of this process: their CPU is the load's, not top's.
    clients = window["load1"] - window["load0"]
    own, kids = window["cpu1"] - window["cpu0"] - clients, window["kids1"] - window["kids0"]

    def row(label: str, seconds: float, calls: int | None = None, depth: int = 0) -> None:
        per_call = f"{1000 * seconds / calls:8.2f}" if calls else f"{'':8}"
        print(f"{'  ' * depth + label:44} {1000 * seconds / wall:8.2f} {per_call} {calls if calls else '':>6}")

    print()
    print(f"top headless at 120x40, refresh {args.refresh:g} s, against pid {pid}"
          f"{f' ({args.clients} closed-loop clients)' if server else ''}; {wall:.0f} s counted after "
          f"{args.warmup:.0f} s; {ticks} frames in all, last verdict {verdict}")
    print(f"{'part':44} {'ms/s':>8} {'ms/call':>8} {'calls':>6}")
    named = 0.0
    for label, depth, _, _ in PARTS:
        row(label, meter.cpu[label], meter.calls[label], depth)
        named += meter.cpu[label] if depth == 0 else 0.0
    unseen = [label for label, _, _, _ in PARTS if not meter.calls[label]]
    if unseen:  # a part wrapped where its callers no longer look it up (moved or renamed) counts nothing
        print(f"  (never called, check PARTS against the code: {', '.join(unseen)})")
    row("garbage collector (within the parts)", meter.gc_s, meter.gc_runs)
    row("py-spy (stack dumps)", kids)
    row("the rest (event loop, timers, threads)", max(0.0, own - named))
    row("total", own + kids)
    if load is not None:
        row("(left out: the bench's own load clients)", clients)
    pct = 100 * (own + kids) / wall
    print(f"{'figure':34} {'measured':>9} {'goal':>6}")
    print(f"{'top CPU, % of one core':34} {pct:9.2f} {'<= 1':>6}   (refresh {args.refresh:g} s, app, in-process)")
    server_cpu = window["server1"] - window["server0"]
    if server_cpu > 0:
        print(f"{'server CPU, % of one core':34} {100 * server_cpu / wall:9.2f} {'':>6}   (its tree, same window)")
        print(f"{'top CPU / server CPU':34} {(own + kids) / server_cpu:9.4f} {'':>6}   (side by side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
