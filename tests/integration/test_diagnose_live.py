"""`wedgectl diagnose --pid / --url` against a real vLLM server and real misbehaving processes."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.model import exitcodes
from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.model.types import Role, VerdictKind

pytestmark = pytest.mark.integration


def wedgectl(*args: str, timeout: float = 120, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "wedgectl", *args], capture_output=True, text=True, timeout=timeout)


def diagnose_json(*args: str, **kw) -> tuple[int, dict]:
    r = wedgectl("diagnose", *args, "--json", **kw)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


class Stream:
    """Client threads sending completions back to back, as a steady load."""

    def __init__(self, url: str, threads: int = 2) -> None:
        self.url, self.stop, self.done = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                r = c.post(f"{self.url}/v1/completions", json={
                    "model": "tiny", "prompt": "The capital of France is", "max_tokens": 48,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200
                self.done += 1

    def __enter__(self) -> "Stream":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def test_idle_server_is_idle_with_stacks_of_every_process(vllm_server, tmp_path):
    rc, out = diagnose_json("--pid", str(vllm_server.pid), "--save-bundle", str(tmp_path / "idle.tar.gz"))
    assert out["verdict"] == "idle", out
    assert rc == 0
    b = read_bundle(tmp_path / "idle.tar.gz")
    roles = {p.pid: p.role for s in b.samples for p in s.processes}
    assert {Role.API_SERVER, Role.ENGINE_CORE, Role.WORKER} <= set(roles.values())
    dumped = {d.pid for s in b.samples for d in s.stacks if d.error is None and d.threads}
    for pid, role in roles.items():
        if role is not Role.OTHER:
            why = [f"{d.error}" for s in b.samples for d in s.stacks if d.pid == pid]
            assert pid in dumped, f"no stack for {role.value} pid {pid}: {why or 'no dump taken'}; notes {b.manifest.notes}"
    engine_dump = next(d for s in b.samples for d in s.stacks if roles.get(d.pid) is Role.ENGINE_CORE)
    names = {f["name"].rsplit(".", 1)[-1] for t in engine_dump.threads for f in t["frames"]}
    assert "run_busy_loop" in names  # the real EngineCore, not a guess from its title
    # Re-classifying the saved evidence gives the same answer.
    assert classify(b).verdict is VerdictKind.IDLE
    assert b.verdict is not None and b.verdict.verdict is VerdictKind.IDLE
    # The server's own log was found from its stdout and kept.
    assert any("Engine" in line or "Uvicorn" in line or "vLLM" in line for line in b.log_lines)


def test_steady_stream_is_progressing(vllm_server, tmp_path):
    with Stream(vllm_server.url) as load:
        time.sleep(1.0)
        rc, out = diagnose_json("--pid", str(vllm_server.pid), "--window", "4")
    assert load.done > 0
    assert out["verdict"] == "progressing", out
    assert rc == 0
    assert out["facts"]["tokens_per_s"] > 10


def test_any_pid_of_the_tree_finds_the_whole_deployment(vllm_server, tmp_path):
    engine = next(p for p in psutil.Process(vllm_server.pid).children(recursive=True) if "EngineCore" in p.name())
    rc, out = diagnose_json("--pid", str(engine.pid), "--window", "3", "--save-bundle", str(tmp_path / "b"))
    b = read_bundle(tmp_path / "b")
    assert vllm_server.pid in b.manifest.target.pids and engine.pid in b.manifest.target.pids
    assert b.manifest.target.url == vllm_server.url
    assert out["verdict"] == "idle"
    # the hypervisor's steal over the capture, read from this host's /proc/stat at its two ends
    host = b.manifest.host
    assert int(host["steal_cpus"]) == len([ln for ln in open("/proc/stat") if ln[:3] == "cpu" and ln[3:4].isdigit()])
    span = b.samples[-1].t - b.samples[0].t
    assert span <= float(host["steal_span_s"]) < span + 60 and 0 <= float(host["steal_s"]) <= float(host["steal_span_s"]) * int(host["steal_cpus"])


def test_url_alone_is_metrics_only(vllm_server):
    rc, out = diagnose_json("--url", vllm_server.url, "--window", "3")
    assert out["verdict"] == "idle"
    assert out["source"] == "url"


def test_without_cap_sys_ptrace_it_carries_on_and_says_why(vllm_server):
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed for this test")
    prefix = (setpriv, "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace")
    rc, out = diagnose_json("--pid", str(vllm_server.pid), "--window", "3", prefix=prefix)
    assert out["verdict"] == "idle"  # metrics and /proc stat still decide
    messages = " ".join(f["message"] for f in out["collector_failures"])
    assert "CAP_SYS_PTRACE" in messages


# ---------------------------------------------------------------- bad input


def test_not_a_vllm_process():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r = wedgectl("diagnose", "--pid", str(sleeper.pid))
        assert r.returncode == exitcodes.NOT_VLLM
        assert "not part of a vLLM deployment" in r.stderr and "Traceback" not in r.stderr
        assert sleeper.poll() is None  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()


# Killed after the first sample, or after the second: which one a loaded host's kill lands after is
# a race, and the answer must be the same either way (the target exited), never "inconclusive".
@pytest.mark.parametrize("kill_after", ["sample 1", "sample 2"])
def test_target_that_exits_mid_capture(tmp_path, kill_after):
    fake = Path(__file__).parent.parent / "targets" / "fake_vllm_serve.py"
    proc = subprocess.Popen([sys.executable, str(fake), "serve"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    diag = None
    try:
        ready = json.loads(proc.stdout.readline().split(" ", 1)[1])
        diag = subprocess.Popen(
            [sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(ready["api"]), "--window", "8",
             "--save-bundle", str(tmp_path / "partial")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        # Kill the target once the chosen sample is in.
        for line in diag.stderr:
            if kill_after in line:
                break
        # The whole deployment at once (its own session): killed one by one, a loaded host can
        # deschedule this test between the kills, and a sample in that gap sees an API server
        # whose engine died, which is a different answer (engine_dead) to a different question.
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = diag.communicate(timeout=60)
        assert diag.returncode == exitcodes.NO_SUCH_PROCESS, err
        assert "exited" in err and "Traceback" not in err
        assert (tmp_path / "partial" / "manifest.json").exists()  # what was collected is kept
    finally:
        if diag is not None and diag.poll() is None:
            diag.kill()
        proc.kill()
        proc.wait()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_url_that_never_answers_is_bounded(silent_port):
    t0 = time.monotonic()
    r = wedgectl("diagnose", "--url", f"http://127.0.0.1:{silent_port}", "--window", "2", timeout=60)
    assert r.returncode == exitcodes.UNREACHABLE, r.stderr
    assert time.monotonic() - t0 < 30
    assert "no answer within" in r.stderr.splitlines()[-1]


@pytest.fixture
def html_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            body = b"<html><body>not metrics</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_metrics_page_that_is_not_prometheus(html_server):
    r = wedgectl("diagnose", "--url", html_server, "--window", "2")
    assert r.returncode == exitcodes.BAD_METRICS, r.stderr
    assert "not Prometheus" in r.stderr


def _autogroup_nice(pid: int) -> int | None:
    """The nice of the autogroup `pid` is in; None for the init session's, the root task group, whose
    /proc/PID/autogroup reads empty (a runner started from init, as CI's may be, is in it)."""
    text = Path(f"/proc/{pid}/autogroup").read_text()
    return int(text.split("nice")[1]) if "nice" in text else None


def test_urgent_samples_in_a_session_of_its_own_and_passes_on_ctrl_c(silent_port):
    """--urgent where autogroup applies (this VM: on, every process in the root cgroup): the capture
    goes on in a child leading a session of its own, whose autogroup has nice -10, while the
    operator's session keeps its own; a SIGINT to the command (the terminal's foreground process)
    reaches the capture, and the command exits as the capture does."""
    from wedgectl.collect.procfs import autogroup_applies

    assert autogroup_applies(), "this host's kernel groups by session (kernel.sched_autogroup_enabled=1, root cgroup)"
    p = subprocess.Popen([sys.executable, "-m", "wedgectl", "diagnose", "--url", f"http://127.0.0.1:{silent_port}",
                          "--window", "30", "--urgent"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        child = None
        while child is None and time.monotonic() < deadline and p.poll() is None:
            kids = psutil.Process(p.pid).children()
            child = kids[0].pid if kids else None
            time.sleep(0.1)
        assert child is not None, p.communicate(timeout=30)
        while time.monotonic() < deadline and _autogroup_nice(child) != -10:
            time.sleep(0.1)  # the child writes its autogroup's nice just after setsid
        assert os.getsid(child) == child != os.getsid(p.pid)
        assert _autogroup_nice(child) == -10
        assert _autogroup_nice(p.pid) == _autogroup_nice(os.getpid())  # the session it came from is left as it was
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == exitcodes.INTERRUPTED, err  # the capture's Ctrl-C exit, passed back by the command
    assert err.strip().splitlines()[-1] == "wedgectl: interrupted", err  # said, not a silent 130
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_urgent_verdict_and_exit_code_come_back_through_the_session(vllm_server, tmp_path):
    rc, out = diagnose_json("--pid", str(vllm_server.pid), "--urgent", "--save-bundle", str(tmp_path / "u.tar.gz"))
    assert (out["verdict"], rc) == ("idle", 0)
    notes = read_bundle(tmp_path / "u.tar.gz").manifest.notes
    assert any("--urgent: sampling in a session of its own, autogroup nice -10" in n for n in notes), notes
