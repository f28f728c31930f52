#!/usr/bin/env python3
"""Measure what the wedge_engine plugin costs: the same workload on stock, patched and report-only vLLM servers,
side by side in one run.

The workload is C client threads sending the same completion back to back
(temperature 0, ignore_eos, fixed max_tokens) for a phase of S seconds after a
warm-up. The bench alternates the sides' phases, each round in another order
(stock, patched, report; then patched, report, stock; ...) so drift in the
host's load hits them alike, and prints each side's median throughput
(generated tokens/s, requests/s), request latency (p50, p95) and CPU time of
the server's processes per generated token, and the ratios patched/stock and
report/stock (goal: throughput >= 0.99). On a shared box wall-clock
throughput swings with other load; CPU per token, and the per-round ratios of
phases of the same round, are steadier.

Stock is upstream vLLM with no plugin loaded (``VLLM_PLUGINS=""``); patched
loads this checkout's engine/ (installed into a private folder on PYTHONPATH)
with ``WEDGE_ENGINE_FIXES=all``, which turns the engine's own report on too;
report loads the same plugin with ``WEDGE_ENGINE_REPORT=1`` and no fix (what
every `wedgectl repro` server runs): the report's stage hooks and its writer
thread alone. Each phase checks its server is the side it claims (the fixes'
heartbeat on /metrics for patched only; an engine report read for patched and
report, none for stock). --no-report leaves the report side out.

Then, on the admission-wedge configuration (4 KV blocks of 32, ``--max-model-len -1``,
``WEDGE_ENGINE_FAULT=admission-overhang``), it times the unadmittable request
(prompt 6 + max_tokens 110) from send to its HTTP error on a patched server,
at admission (the honest max_model_len) and on its first refusal by the
scheduler guard (``WEDGE_ENGINE_HONEST_MAX_MODEL_LEN=0``); and every server's
SIGTERM -> exit time.

    python bench/engine_overhead.py                          # 3 rounds of 20 s, 4 clients, one server at a time
    python bench/engine_overhead.py --rounds 5 --seconds 30 --clients 8
    python bench/engine_overhead.py --together               # every side's server up at once, phases alternate
    python bench/engine_overhead.py --no-report              # stock and patched only
    python bench/engine_overhead.py --python /venv/bin/python  # a GPU host's vLLM environment

By default one server runs at a time (each round restarts them; shared boxes
here allow one vLLM at a time); --together keeps all up, which needs a server's
memory per side and measures with less drift.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from wedgectl.lab.runtime.install import runtime_python  # noqa: E402
from wedgectl.lab.runtime import Server, ServerSpec, free_port, start_server, stop_server  # noqa: E402
from wedgectl.lab.runtime.tinymodel import ensure_tiny_model  # noqa: E402
from wedgectl.lab.engine_install import FIXES_ENV, REPORT_ENV  # noqa: E402
from wedgectl.collect.enginereport import read_engine_reports  # noqa: E402

ENGINE_DIR = Path(__file__).resolve().parents[1] / "engine"  # this checkout's plugin source

# Stock is upstream vLLM: no general plugin loads at all (VLLM_PLUGINS is an allow-list; "" allows none).
STOCK_ENV = {"VLLM_PLUGINS": ""}
PATCHED_ENV = dict(FIXES_ENV)
# The plugin with its report on and no fix: each process's stage hooks and report thread alone.
REPORT_ONLY_ENV = {**REPORT_ENV, "WEDGE_ENGINE_FIXES": "none"}
OVERHANG_FLAGS = ("--num-gpu-blocks-override", "4", "--max-model-len", "-1")
OVERHANG_ENV = {"WEDGE_ENGINE_FAULT": "admission-overhang", "WEDGE_ENGINE_FIXES": "all"}
UNADMITTABLE = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 110,
                "temperature": 0, "ignore_eos": True}


@dataclass
class Phase:
    side: str
    seconds: float
    requests: int
    tokens: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    all_tokens: int = 0  # warm-up included: what the CPU time below paid for
    cpu_s: float = float("nan")  # CPU seconds of the server's processes over the whole phase
    round: int = 0

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.cpu_s / self.all_tokens if self.all_tokens else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def latency(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_phase(url: str, side: str, clients: int, seconds: float, warmup: float, max_tokens: int) -> Phase:
    """C clients back to back; only requests that start and end inside the measured window count."""
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    t_start = time.monotonic() + warmup
    t_end = t_start + seconds
    lock = threading.Lock()
    phase = Phase(side, seconds, 0, 0)

    def client() -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                try:
                    r = c.post(f"{url}/v1/completions", json=body)
                    ok = r.status_code == 200
                    n = r.json()["usage"]["completion_tokens"] if ok else 0
                except (httpx.HTTPError, ValueError, KeyError):
                    ok, n = False, 0
                t1 = time.monotonic()
                with lock:
                    phase.all_tokens += n
                if t0 >= t_start and t1 <= t_end:
                    with lock:
                        if ok:
                            phase.requests += 1
                            phase.tokens += n
                            phase.latencies.append(t1 - t0)
                        else:
                            phase.errors += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return phase


def tree_cpu_s(server: Server) -> float:
    """User + system CPU seconds of the server's processes so far (API server, EngineCore, Worker)."""
    import psutil

    total = 0.0
    for pid in server.tree_pids():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measured_phase(server: Server, side: str, args: argparse.Namespace, round_: int = 0) -> Phase:
    cpu0 = tree_cpu_s(server)
    phase = run_phase(server.url, side, args.clients, args.seconds, args.warmup, args.max_tokens)
    phase.cpu_s = tree_cpu_s(server) - cpu0
    phase.round = round_
    check_side(server, side)
    return phase


def check_side(server: Server, side: str) -> None:
    """Refuse to report a phase whose server is not its side: the fixes' heartbeat on /metrics for patched
    only, an engine report (the plugin's, read as wedgectl reads it) for patched and report, none for stock."""
    has = "wedge_engine:steps_total" in httpx.get(f"{server.url}/metrics", timeout=10).text
    if has != (side == "patched"):
        raise SystemExit(f"bench: the {side} server {'lacks' if side == 'patched' else 'has'} the wedge_engine "
                         f"heartbeat; the comparison would be void")
    reported = any(r.report is not None for r in read_engine_reports(server.tree_pids()))
    if reported != (side != "stock"):
        raise SystemExit(f"bench: the {side} server {'writes' if reported else 'lacks'} the engine's own report; "
                         "the comparison would be void")


def sigterm_exit_s(server: Server, wait_s: float = 60) -> float | None:
    t0 = time.monotonic()
    os.kill(server.pid, signal.SIGTERM)
    try:
        server.popen.wait(timeout=wait_s)
    except Exception:
        return None
    return time.monotonic() - t0


def start(py: Path, model: Path, env: dict[str, str], log: Path, flags: tuple[str, ...] = ()) -> Server:
    log.unlink(missing_ok=True)
    return start_server(ServerSpec(model=model, port=free_port(), extra_args=flags, env=env), py, log)


def unadmittable_to_error(py: Path, model: Path, out: Path, honest: bool,
                          plugin_env: dict[str, str]) -> tuple[float | None, int | None, float | None]:
    """(seconds from send to the HTTP error, its status, SIGTERM -> exit) on a patched overhang server."""
    env = {**OVERHANG_ENV, **plugin_env}
    if not honest:
        env["WEDGE_ENGINE_HONEST_MAX_MODEL_LEN"] = "0"
    server = start(py, model, env, out / f"overhang-{'honest' if honest else 'guard'}.log", OVERHANG_FLAGS)
    try:
        t0 = time.monotonic()
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=UNADMITTABLE, timeout=60)
            elapsed, code = time.monotonic() - t0, r.status_code
        except httpx.HTTPError:
            elapsed, code = None, None
        exit_s = sigterm_exit_s(server)
    finally:
        stop_server(server, grace=10)
    return elapsed, code, exit_s


def hook_costs_us(n: int = 100_000) -> dict[str, float]:
    """What the fixes' wrappers add per call, in microseconds, timed in this process.

    The real wrappers (the fix modules' own code) are installed on small
    stand-ins for the vLLM classes they wrap, whose methods do nothing, so the
    difference wrapped - bare is exactly the fixes' work: per engine step
    (step recorder, schedule and update_from_output guards, with a request
    waiting that fits), per request output (the admission error check in
    RequestOutputCollector.put) and per request (AsyncLLM.add_request).
    """
    import asyncio
    import enum
    import tempfile
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    saved = dict(sys.modules)

    class RequestStatus(enum.IntEnum):
        WAITING = 1
        PREEMPTED = 6
        FINISHED_ERROR = 11

    def mod(name: str, **attrs: object) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class Spec:
        block_size = 32

    class Scheduler:
        def __init__(self) -> None:
            req = types.SimpleNamespace(request_id="r", status=RequestStatus.WAITING, num_tokens=70,
                                        num_prompt_tokens=6)
            self.waiting = type("Q", (), {"peek_request": lambda self: req, "__bool__": lambda self: True})()
            self.running, self.num_lookahead_tokens, self.connector = [1], 0, None
            manager = types.SimpleNamespace(kv_cache_spec=Spec(), block_size=32)
            self.kv_cache_manager = types.SimpleNamespace(
                block_pool=types.SimpleNamespace(num_gpu_blocks=4096),
                coordinator=types.SimpleNamespace(single_type_managers=(manager,)))

        def schedule(self, *args):
            return types.SimpleNamespace(total_num_scheduled_tokens=4)

        def update_from_output(self, a, b):
            return {}

        def add_request(self, request):
            pass

    class EngineCoreProc:
        def _process_engine_step(self):
            return True

    class Collector:
        def put(self, output):
            pass

    class AsyncLLM:
        def __init__(self) -> None:
            pass

        async def add_request(self, *args):
            return None

        async def check_health(self):
            return None

    class GracefulHTTPError(Exception):
        def __init__(self, message, http_status):
            super().__init__(message)

    originals = {
        "step": EngineCoreProc._process_engine_step, "schedule": Scheduler.schedule,
        "update": Scheduler.update_from_output, "put": Collector.put, "add": AsyncLLM.add_request,
    }
    try:
        for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"):
            mod(name)
        mod("vllm.v1.request", RequestStatus=RequestStatus)
        mod("vllm.v1.kv_cache_interface", is_full_attention_spec=lambda spec: isinstance(spec, Spec))
        mod("vllm.v1.core.sched.scheduler", Scheduler=Scheduler)
        mod("vllm.v1.engine.core", EngineCoreProc=EngineCoreProc, EngineCore=EngineCoreProc)
        mod("vllm.v1.engine.output_processor", RequestOutputCollector=Collector)
        mod("vllm.v1.engine.async_llm", AsyncLLM=AsyncLLM)
        mod("vllm.v1.engine.exceptions", EngineDeadError=RuntimeError)
        mod("vllm.exceptions", GracefulHTTPError=GracefulHTTPError)
        from wedge_engine import status
        from wedge_engine.fixes import _common, admission, watchdog

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "status")
            status.create(path)
            os.environ[status.STATUS_FILE_ENV] = path
            _common.install_step_recorder()
            admission._patch_scheduler()
            admission._patch_output_collector()
            watchdog._patch_api()

            def per_call(fn, bare) -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                wrapped = time.perf_counter() - t0
                t0 = time.perf_counter()
                for _ in range(n):
                    bare()
                return max(0.0, (wrapped - (time.perf_counter() - t0)) / n * 1e6)

            proc, sched, coll = EngineCoreProc(), Scheduler(), Collector()
            out = types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(finish_reason="length",
                                                                                      stop_reason=None)])
            costs = {
                "engine step": per_call(proc._process_engine_step, lambda: originals["step"](proc))
                + per_call(sched.schedule, lambda: originals["schedule"](sched))
                + per_call(lambda: sched.update_from_output(None, None),
                           lambda: originals["update"](sched, None, None)),
                "request output": per_call(lambda: coll.put(out), lambda: originals["put"](coll, out)),
            }
            llm = AsyncLLM()

            async def adds(fn, k: int) -> float:
                t0 = time.perf_counter()
                for _ in range(k):
                    await fn()
                return time.perf_counter() - t0

            k = n // 10
            wrapped = asyncio.run(adds(lambda: llm.add_request("r"), k))
            bare = asyncio.run(adds(lambda: originals["add"](llm, "r"), k))
            costs["request"] = max(0.0, (wrapped - bare) / k * 1e6)
            _common.unpatch_all()
            if _common._writer is not None:
                _common._writer.close()
                _common._writer = None
            os.environ.pop(status.STATUS_FILE_ENV, None)
    finally:
        for name in [m for m in sys.modules if m not in saved]:
            del sys.modules[name]
    return costs


def private_plugin(py: Path, out: Path) -> dict[str, str]:
    """Install this checkout's engine/ into a folder of its own; the env that makes a server load it.

    The runtime's site-packages may hold another version of the plugin (another
    checkout's tests reinstall theirs); PYTHONPATH comes first on sys.path, for
    the import and for the entry point, so the patched servers run exactly this code.
    """
    import shutil
    import subprocess
    import tempfile

    target = out / "plugin"
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="wedge-engine-") as tmp:
        src = Path(tmp) / "engine"
        shutil.copytree(ENGINE_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)],
                       check=True, capture_output=True, timeout=300)
    return {"PYTHONPATH": str(target)}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds at the start of each phase")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--together", action="store_true", help="keep every side's server up and alternate phases")
    ap.add_argument("--no-admission", action="store_true", help="skip the unadmittable-request timing")
    ap.add_argument("--no-report", action="store_true",
                    help="leave out the report side (the plugin with WEDGE_ENGINE_REPORT=1 and no fix)")
    ap.add_argument("--python", default=None, help="the vLLM environment's python (default: the managed runtime)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/wedgectl-bench"), help="folder for server logs")
    ap.add_argument("--json", action="store_true", help="also print one JSON object at the end")
    args = ap.parse_args()

    py = runtime_python(args.python)
    model = ensure_tiny_model(py)
    args.out.mkdir(parents=True, exist_ok=True)
    plugin_env = private_plugin(py, args.out)
    sides = {"stock": STOCK_ENV, "patched": {**PATCHED_ENV, **plugin_env}}
    if not args.no_report:
        sides["report"] = {**REPORT_ONLY_ENV, **plugin_env}
    phases: list[Phase] = []
    exits: dict[str, list[float]] = {side: [] for side in sides}

    def order(r: int) -> list[str]:
        """Round r's sides: the list rotated by r, so each side comes first, middle and last in turn."""
        names = list(sides)
        return names[r % len(names):] + names[:r % len(names)]

    def log(msg: str) -> None:
        print(f"bench: {msg}", file=sys.stderr, flush=True)

    if args.together:
        servers = {side: start(py, model, env, args.out / f"{side}.log") for side, env in sides.items()}
        try:
            for r in range(args.rounds):
                for side in order(r):
                    phases.append(measured_phase(servers[side], side, args, r))
                    log(f"round {r + 1} {side}: {phases[-1].tokens_per_s:.1f} tokens/s")
            for side, server in servers.items():
                e = sigterm_exit_s(server)
                if e is not None:
                    exits[side].append(e)
        finally:
            for server in servers.values():
                stop_server(server, grace=10)
    else:
        for r in range(args.rounds):
            for side in order(r):
                server = start(py, model, sides[side], args.out / f"{side}-{r}.log")
                try:
                    phases.append(measured_phase(server, side, args, r))
                    log(f"round {r + 1} {side}: {phases[-1].tokens_per_s:.1f} tokens/s")
                    e = sigterm_exit_s(server)
                    if e is not None:
                        exits[side].append(e)
                finally:
                    stop_server(server, grace=10)

    def side_stats(side: str) -> dict[str, float]:
        ps = [p for p in phases if p.side == side]
        return {
            "tokens_per_s": median([p.tokens_per_s for p in ps]),
            "requests_per_s": median([p.requests_per_s for p in ps]),
            "p50_s": median([p.latency(0.5) for p in ps]),
            "p95_s": median([p.latency(0.95) for p in ps]),
            "errors": sum(p.errors for p in ps),
            "cpu_ms_per_token": median([p.cpu_ms_per_token for p in ps]),
            "sigterm_exit_s": median(exits[side]),
        }

    stats = {side: side_stats(side) for side in sides}
    stock, patched = stats["stock"], stats["patched"]

    def ratios_to_stock(other: dict[str, float]) -> dict[str, float]:
        return {
            "throughput": other["tokens_per_s"] / stock["tokens_per_s"],
            "requests": other["requests_per_s"] / stock["requests_per_s"],
            "p50_latency": other["p50_s"] / stock["p50_s"],
            "p95_latency": other["p95_s"] / stock["p95_s"],
            "cpu_per_token": other["cpu_ms_per_token"] / stock["cpu_ms_per_token"],
        }

    ratios = ratios_to_stock(patched)
    report_ratios = ratios_to_stock(stats["report"]) if "report" in stats else {}
    print(f"workload: {args.clients} clients, max_tokens {args.max_tokens}, {args.rounds} rounds x "
          f"{args.seconds:g} s per side ({'all up' if args.together else 'one server at a time'})")
    print(f"{'':9}{'tokens/s':>9}{'req/s':>7}{'p50 s':>7}{'p95 s':>7}{'errors':>7}{'cpu ms/tok':>11}"
          f"{'SIGTERM->exit s':>16}")
    for side, st in stats.items():
        print(f"{side:9}{st['tokens_per_s']:9.1f}{st['requests_per_s']:7.2f}{st['p50_s']:7.3f}{st['p95_s']:7.3f}"
              f"{st['errors']:7d}{st['cpu_ms_per_token']:11.3f}{st['sigterm_exit_s']:16.2f}")
    for name, rs in (("patched", ratios), ("report", report_ratios)):
        if rs:
            print(f"{name}/stock: throughput {rs['throughput']:.3f} (goal >= 0.99), requests {rs['requests']:.3f}, "
                  f"p50 latency {rs['p50_latency']:.3f}, p95 latency {rs['p95_latency']:.3f}, "
                  f"CPU per token {rs['cpu_per_token']:.3f}")
    per_round = [f"{p.side[0]}{p.tokens_per_s:.0f}" for p in phases]
    print(f"per phase tokens/s: {' '.join(per_round)}")
    # Each round's phases are adjacent in time: their ratio to the round's stock phase cancels slow drift.
    for name, rs in (("patched", ratios), ("report", report_ratios)):
        if not rs and name != "patched":
            continue
        round_ratios = [mine.tokens_per_s / base.tokens_per_s for r in range(args.rounds)
                        for base in phases if base.round == r and base.side == "stock"
                        for mine in phases if mine.round == r and mine.side == name]
        rs["throughput_per_round_median"] = median(round_ratios)
        print(f"per round {name}/stock throughput: {' '.join(f'{x:.3f}' for x in round_ratios)} "
              f"(median {rs['throughput_per_round_median']:.3f})")
    costs = hook_costs_us()
    # At the stock rate: a step yields one token per running request; each token is one request output.
    steps_per_s = stock["tokens_per_s"] / max(1, args.clients)
    busy = (costs["engine step"] * steps_per_s + costs["request output"] * stock["tokens_per_s"]
            + costs["request"] * stock["requests_per_s"]) * 1e-6
    ratios["hook_time_share"] = busy
    print(f"fix wrappers: {costs['engine step']:.2f} us per engine step, {costs['request output']:.2f} us per "
          f"request output, {costs['request']:.2f} us per request = {100 * busy:.3f} % of one core at the "
          f"stock rate (an upper bound of their throughput cost)")

    admission = {}
    if not args.no_admission:
        for honest in (True, False):
            elapsed, code, exit_s = unadmittable_to_error(py, model, args.out, honest, plugin_env)
            where = "at admission (honest max_model_len)" if honest else "on first refusal (scheduler guard)"
            admission["admission" if honest else "first_refusal"] = {"error_s": elapsed, "status": code,
                                                                     "sigterm_exit_s": exit_s}
            shown = f"{elapsed:.3f} s" if elapsed is not None else "no answer"
            print(f"unadmittable 6+110 request -> HTTP {code} {where}: {shown}; SIGTERM -> exit "
                  f"{exit_s if exit_s is None else round(exit_s, 2)} s")
    if args.json:
        print(json.dumps({**stats, "ratios": ratios, "report_ratios": report_ratios, "admission": admission,
                          "phases": [{"side": p.side, "round": p.round, "tokens_per_s": p.tokens_per_s}
                                     for p in phases]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
