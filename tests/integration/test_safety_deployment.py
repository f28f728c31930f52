"""The deployment is the API server that owns a pid and its descendants: nothing above, nothing beside.

A supervisor that looks like vLLM (its script under a `/vllm/` folder, a
`ray::Supervisor` title) runs two stand-in API servers (tests/targets/
fake_vllm_serve.py). Before, discovery climbed into the supervisor, so
diagnose, top and swap saw both servers and the supervisor as one deployment
and reported the other server's URL. Pid reuse: a pid planned for a signal and
handed on since to another process is never signalled.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from wedgectl.store.bundle import read_bundle
from wedgectl.collect import procfs
from wedgectl.collect.processes import deployment_root, process_tree
from wedgectl.capture.discover import discover
from wedgectl.model.errors import NotVllm
from wedgectl.collect.control import Delivery, Planned, send_signal, stop_tree
from wedgectl.tui.source import find_servers

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).resolve().parents[1] / "targets"

# A supervisor as ray or a home-made one runs: it titles itself `ray::Supervisor`
# (comm, as setproctitle's prctl does), lives under a folder named vllm, and
# starts two API servers, each with its own engine and worker.
SUPERVISOR = textwrap.dedent(f"""
    import ctypes, json, subprocess, sys, threading
    from _announce import announce
    ctypes.CDLL(None).prctl(15, b"ray::Supervisor", 0, 0, 0)
    children = [subprocess.Popen([sys.executable, {str(TARGETS / "fake_vllm_serve.py")!r}, "serve"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    servers = [json.loads(c.stdout.readline().split(" ", 1)[1]) for c in children]
    announce("ready", servers=servers)
    threading.Event().wait()
""")

# vLLM's multi-API-server launcher (`vllm serve --api-server-count 2`): a `serve` process whose
# spawned children title themselves VLLM::APIServer_<i> (v1/utils.run_api_server_worker_proc).
LAUNCHER = textwrap.dedent("""
    import ctypes, multiprocessing as mp, socket, threading
    from _announce import announce

    def api_server(i, q):
        ctypes.CDLL(None).prctl(15, f"VLLM::APIServer_{i}".encode(), 0, 0, 0)
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # die with the launcher
        q.put(mp.current_process().pid)
        threading.Event().wait()

    if __name__ == "__main__":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        for i in range(2):
            ctx.Process(target=api_server, args=(i, q)).start()
        announce("ready", launcher=mp.current_process().pid, servers=sorted(q.get(timeout=60) for _ in range(2)),
                 port=sock.getsockname()[1])
        threading.Event().wait()
""")


def tree_of(pid: int) -> set[int]:
    return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}


@pytest.fixture
def supervised(spawn, tmp_path):
    """(supervisor pid, [server info, server info]) with every process of both servers up."""
    script = tmp_path / "opt" / "vllm" / "supervisor.py"
    script.parent.mkdir(parents=True)
    script.write_text(SUPERVISOR)
    target = spawn(script)
    servers = target.expect("ready", timeout=120)["servers"]
    assert psutil.Process(target.pid).name() == "ray::Supervisor"
    return target.pid, servers


def test_discovery_from_one_server_sees_only_its_tree_and_its_url(supervised):
    supervisor, (one, other) = supervised
    for start in (one["api"], one["engine"], one["worker"]):
        dep = discover(pid=start)
        assert dep.root_pid == one["api"] and dep.api_pid == one["api"], (start, dep)
        assert set(dep.pids) == tree_of(one["api"])
        assert supervisor not in dep.pids and other["api"] not in dep.pids
        assert dep.base_url == f"http://127.0.0.1:{one['port']}"
        assert set(dep.start_ticks) == set(dep.pids)  # what a later signal is checked against
    assert deployment_root(other["worker"]).pid == other["api"]
    assert {p.pid for p in process_tree(other["engine"])} == tree_of(other["api"])


def test_the_supervisor_is_no_deployment_and_top_lists_each_server(supervised):
    supervisor, (one, other) = supervised
    with pytest.raises(NotVllm) as err:
        discover(pid=supervisor)
    assert str(one["api"]) in str(err.value) and str(other["api"]) in str(err.value)
    ours = {s.pid: s for s in find_servers() if s.pid in (supervisor, one["api"], other["api"])}
    assert set(ours) == {one["api"], other["api"]}
    assert ours[one["api"]].url == f"http://127.0.0.1:{one['port']}"


def test_swap_plans_to_stop_only_its_own_server(supervised):
    from wedgectl.lab.swap import plan_swap

    supervisor, (one, other) = supervised
    plan = plan_swap(one["engine"])
    assert plan.api_pid == one["api"]
    assert set(plan.tree) == tree_of(one["api"])
    assert plan.port == one["port"]
    assert set(plan.start_ticks) >= set(plan.tree)


def test_diagnose_reports_its_own_server(supervised, tmp_path):
    supervisor, (one, other) = supervised
    subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(one["worker"]), "--window", "3",
                    "--save-bundle", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    target = read_bundle(tmp_path / "b").manifest.target
    assert target.url == f"http://127.0.0.1:{one['port']}"
    assert set(target.pids) <= tree_of(one["api"]) and one["api"] in target.pids


def test_multi_api_server_launcher_is_one_deployment(spawn, tmp_path):
    # vLLM's CLI by what it runs (a python running a `vllm` script given `serve`), not a `*_serve.py`
    # lookalike: a supervisor may be named so (issue 33, tests/test_security_swap.py).
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(LAUNCHER)
    info = spawn(script, "serve", "--api-server-count", "2").expect("ready", timeout=120)
    for server in info["servers"]:
        dep = discover(pid=server)
        assert dep.root_pid == info["launcher"]
        assert set(info["servers"]) <= set(dep.pids)
        assert dep.base_url == f"http://127.0.0.1:{info['port']}"
    assert [s.pid for s in find_servers() if s.pid in (info["launcher"], *info["servers"])] == [info["launcher"]]


# ------------------------------------------------------------------ pid reuse


def _reuse_pid(pid: int, tries: int = 50) -> subprocess.Popen | None:
    """Start a process that gets `pid` (ns_last_pid, root only), or None if others' forks win the race."""
    for _ in range(tries):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(["sleep", "60"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_a_planned_pid_handed_on_since_is_never_signalled():
    first = subprocess.Popen(["sleep", "60"])
    planned = Planned.now(first.pid)
    assert planned.start_ticks == procfs.start_ticks(first.pid)
    first.kill()
    first.wait()
    time.sleep(0.02)  # let the start-time clock tick past the first process's
    second = _reuse_pid(first.pid)
    if second is None:
        pytest.fail("could not get the pid handed on (ns_last_pid not writable, or a busy host)")
    try:
        assert send_signal(planned, signal.SIGKILL) is Delivery.REUSED
        stopped = stop_tree(first.pid, 0.2, planned={first.pid: planned.start_ticks})
        assert stopped.refused and str(first.pid) in stopped.refused[0]
        assert second.poll() is None  # the new holder of the pid lives on
    finally:
        second.kill()
        second.wait()


def test_a_start_time_that_differs_is_refused_and_the_same_one_signalled():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        ticks = procfs.start_ticks(proc.pid)
        assert ticks is not None
        assert send_signal(Planned(proc.pid, ticks - 1), signal.SIGTERM) is Delivery.REUSED
        time.sleep(0.2)
        assert proc.poll() is None
        assert send_signal(Planned(proc.pid, ticks), signal.SIGTERM) is Delivery.SENT
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert send_signal(Planned(proc.pid, ticks), signal.SIGTERM) is Delivery.GONE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

