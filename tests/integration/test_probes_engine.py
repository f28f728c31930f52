"""The real probe on the repro'd engine deadlock: a vLLM server whose Worker parks forever in execute_model.

One server (the engine-deadlock repro's fault: WEDGE_ENGINE_FAULT=model-stall
after 3 steps, no engine report), two completions in flight; once the
generation counter froze with requests running, the probes run on the whole
tree. The Worker thread parked in the fault's Event.wait must show the futex
address /proc shows, a wait as long as the stall has lasted (the fault logs
the moment it parks), and no FUTEX_WAKE on that address in the window. Then
`wedgectl diagnose --ebpf on --json` must carry the same facts. The same
deadlock, as nobody (no ptrace, no report), says what would decide it. The
server is always stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from nobody import diagnose_as_nobody, engine_lines
from wedgectl.classify import confidence as C
from wedgectl.lab.lifecycle import Server
from wedgectl.model import exitcodes
from wedgectl.store.bundle import to_jsonable
from wedgectl.collect import ebpf, ebpfhost, procfs, procread, pyspy
from wedgectl.collect.control import Planned, send_signal, stop_tree
from wedgectl.collect.processes import process_tree, role_of
from wedgectl.read.metrics import MetricsParseError, parse_metrics
from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.classify.probefacts import probe_evidence
from wedgectl.lab.runtime import ServerSpec, ensure_tiny_model, free_port, start_server, stop_server
from wedgectl.model.types import ProcessSample, Role, Sample, VerdictKind

from test_probes_live import NO_EBPF, Steal, assert_wait_spans  # noqa: E402  (same folder; pytest puts it on sys.path)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STALL_LINE = "wedge_engine: model-stall: execute_model blocks forever now"


def _metrics(client: httpx.Client, url: str):
    try:
        r = client.get(f"{url}/metrics")
        return parse_metrics(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, MetricsParseError):
        return None


def _send(url: str, results: list) -> None:
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}
    try:
        with httpx.Client(timeout=httpx.Timeout(600, connect=5)) as c:
            results.append(c.post(f"{url}/v1/completions", json=body).status_code)
    except httpx.HTTPError as exc:  # the server is stopped under it at the end
        results.append(type(exc).__name__)


def _stalled_thread(worker_pid: int) -> int | None:
    """The Worker thread blocked in the fault's wrapper, found by its Python stack."""
    dump = pyspy.dump_stacks(worker_pid)
    for thread in dump.threads:
        if any("execute_model_then_stall" in f for f in pyspy.frame_names(thread)):
            return int(thread["os_thread_id"])
    return None


@dataclass
class Stalled:
    """The module's engine deadlock: its server, the moment the fault parked the Worker (bracketed by the last
    poll of the log that did not see the line and the one that did), the host's steal since, its clients."""

    server: Server
    log: Path
    t_unseen: float
    t_stall: float
    steal: Steal
    results: list


@pytest.fixture(scope="module")
def stalled(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stalled]:
    """One server (the engine-deadlock repro's fault: WEDGE_ENGINE_FAULT=model-stall after 3 steps, no engine
    report), two completions in flight, kept until the generation counter froze with requests running."""
    ensure_engine_plugin(vllm_python, print)
    spec = ServerSpec(model=ensure_tiny_model(vllm_python), port=free_port(),
                      env={"WEDGE_ENGINE_FAULT": "model-stall", "WEDGE_ENGINE_FAULT_AFTER_STEPS": "3",
                           "WEDGE_ENGINE_REPORT": "0"})
    log = tmp_path_factory.mktemp("stalled") / "server.log"
    server = start_server(spec, vllm_python, log)
    try:
        results: list = []
        for _ in range(2):
            threading.Thread(target=_send, args=(server.url, results), daemon=True).start()
        # the moment the fault parks the Worker: when its log line appears (polled every 0.1 s)
        t_stall = None
        t_unseen, steal = time.monotonic(), Steal()  # the last poll that did not see the line: the park came after it
        history: list[float] = []
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if t_stall is None:
                    polled = time.monotonic()
                    if STALL_LINE in log.read_text(errors="replace"):
                        t_stall = time.monotonic()
                    else:
                        t_unseen = polled
                if t_stall is not None:
                    m = _metrics(client, server.url)
                    if m is not None:
                        history.append(m.generation_tokens or 0)
                        frozen = len(history) >= 8 and len(set(history[-8:])) == 1
                        if frozen and (m.running or 0) >= 1:
                            break
                time.sleep(0.1)
        assert t_stall is not None, f"the fault never fired; log tail:\n{log.read_text()[-3000:]}"
        assert results == [], f"a request finished: {results}"
        yield Stalled(server, log, t_unseen, t_stall, steal, results)
    finally:
        stop_server(server, grace=10)


@pytest.mark.skipif(NO_EBPF is not None, reason=f"eBPF: {NO_EBPF}")
def test_probe_on_the_engine_deadlock(stalled: Stalled) -> None:
    server, t_unseen, t_stall, steal = stalled.server, stalled.t_unseen, stalled.t_stall, stalled.steal
    tree = process_tree(server.pid)
    worker = next(p.pid for p in tree if role_of(p) is Role.WORKER)
    tid = _stalled_thread(worker)
    assert tid is not None, "no Worker thread in execute_model_then_stall"
    time.sleep(2.0)  # let the deadlock last a little longer than the attach

    pids = [p.pid for p in tree]
    t_call = time.monotonic()
    records, failures = ebpf.run_probes(pids, 3.0, backend="bpftrace")
    t_done, stolen = time.monotonic(), steal.since()
    assert not [f for f in failures if f.kind.value not in ("gone",)], failures
    header, *rest = to_jsonable(records)
    threads = {r["tid"]: r for r in rest}
    t = threads[tid]
    lasted = t_done - t_stall
    print(f"stalled Worker thread {tid}: {t}\nstall lasted {lasted:.2f} s; header {header}")
    proc_addr = next(x.futex_addr for x in procfs.read_threads(worker)[0] if x.tid == tid)
    assert header["backend"] == "bpftrace" and worker in header["pids"]
    assert t["futex_addr"] == proc_addr is not None
    assert t["parked_throughout"] and t["wait_source"] == "sched"
    # it logs, then parks: allow it a second from the line to the wait on a loaded host
    assert_wait_spans(t["wait_s"], (t_unseen, t_stall + 1.0), (t_call + header["window_s"], t_done),
                      short_by=stolen)
    assert t["wakes_on_addr"] == 0 and t["waits"] == 0
    assert t["oncpu_s"] < 0.05 and t["offcpu_s"] > 0.9 * t["window_s"]
    assert not any(w["addr"] == proc_addr and w["pid"] == worker for w in header["wakes"])

    # the classifier's evidence from it (the stalled thread is the Worker's main thread here)
    sample = Sample(t=time.time(), processes=tuple(ProcessSample(pid=p, ppid=0, role=role_of(psutil.Process(p)),
                                                                 name="") for p in pids),
                    probes=records)
    evidence = probe_evidence([sample])
    assert tid == worker, (tid, worker)  # the fault parks the Worker's main thread, whose tid is its pid
    assert any(e.what.startswith(f"Worker main thread (tid {tid}) parked") for e in evidence), \
        [e.what for e in evidence]

    # and through the CLI: diagnose --ebpf on --json carries the per-thread facts
    r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(server.pid), "--json",
                        "--window", "4", "--no-stacks", "--ebpf", "on"], capture_output=True, text=True,
                       timeout=180, cwd=REPO)
    payload = json.loads(r.stdout)
    d = {x["tid"]: x for x in payload["probes"] if x.get("kind") == "thread"}[tid]
    # the Worker parked in execute_model with two requests in flight: the engine-deadlock repro's verdict
    deadlock = VerdictKind.ENGINE_DEADLOCK
    assert (payload["verdict"], r.returncode) == (deadlock.value, exitcodes.for_verdict(deadlock)), \
        (payload["summary"], r.stderr[-2000:])
    # diagnose takes the first back-end that runs (rawtp here): it sees no wake calls, so "unknown"
    assert d["futex_addr"] == proc_addr and d["wakes_on_addr"] == (None if d["backend"] == "rawtp" else 0)
    assert d["parked_throughout"] and d["backend"] in ebpfhost.EBPF_BACKENDS
    assert d["wait_s"] >= lasted - steal.since()


def test_without_the_report_nobody_is_told_what_would_decide(stalled: Stalled) -> None:
    """The same deadlock as nobody, where neither ptrace nor an engine report gives the engine's side: no verdict
    the report would decide, and the evidence says what could not be read and what would decide it."""
    rc, out = diagnose_as_nobody(stalled.server.pid)
    assert engine_lines(out) == [] and out["rule"] != "live_engine_report_deadlock"
    said = " | ".join(e["what"] for e in out["evidence"] if e["source"] == "wedgectl")
    assert "py-spy was refused ptrace access" in said and "no engine report was read" in said, said
    assert "WEDGE_ENGINE_REPORT=1" in said and "CAP_SYS_PTRACE" in said, said
    # never surer than the report makes it (test_unprivileged: the same deadlock with the report, as nobody)
    assert out["confidence"] <= C.DEADLOCK_ENGINE_REPORT_CERTAIN, (out["rule"], out["confidence"])


def test_a_forced_sigkill_of_the_deadlock_leaves_none_of_its_psm_segments(stalled: Stalled) -> None:
    """The module's last user of its server ends it as an operator ends a hung one, by force: every process of the
    tree stopped first (so that none runs its own clean-up), then stop_tree's SIGKILL. None of the /dev/shm
    segments the tree had mapped (psm_*, 160-250 MB each) is left (test_safety_shm: a segment held elsewhere
    stays). The fixture's own stop after it finds nothing to do."""
    server = stalled.server
    pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
    segments = {p for p in procread.shm_files_of(pids) if os.path.basename(p).startswith("psm_")}
    assert segments, "vLLM mapped no psm_ segment: nothing to check"
    for pid in pids:
        send_signal(Planned.now(pid), signal.SIGSTOP)
    stopped = stop_tree(server.pid, 0.5, popen=server.popen, started_at=server.started_at)
    assert stopped.killed
    assert [p for p in segments if os.path.exists(p)] == [], stopped
    assert set(stopped.shm_removed) >= segments
