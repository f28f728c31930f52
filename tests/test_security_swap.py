"""swap runs none of another user's code as root, and takes no supervisor for vLLM's launcher (issue 33: 1, 6, 13).

1. The server's interpreter was run with `-c` / `-m pip` in wedgectl's own working folder, which
   both put first on sys.path: from a world-writable folder where nobody planted csv.py or
   textwrap.py, `swap` ran nobody's modules as root. Here the folder holds such modules (and
   sitecustomize.py, usercustomize.py, a pip/ package), each writing a marker when imported; the
   probes, the plugin install and a whole swap run from it, and no marker may appear.
13. The interpreter was resolved on the server's PATH at plan time, but Popen resolved argv[0] on
   that PATH again: a python put earlier on it after the plan ran instead.
6. A supervisor named like a server (`fake_serve.py serve`) whose children title themselves
   VLLM::APIServer was taken for vLLM's multi-API-server launcher, so swap planned to stop it, the
   sibling server with it, and start it again. vLLM's launcher is now known by what it runs (vLLM's
   CLI `serve`, by a Python), and one that starts an API server again is a supervisor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.model import exitcodes

from wedgectl.lab import swap
from wedgectl.collect import processes
from wedgectl.capture.discover import discover
from wedgectl.model.errors import NotVllm
from wedgectl.collect.control import free_port, stop_tree
from wedgectl.lab.engine_install import engine_version, ensure_engine_plugin, install_dir, installed_version

NOBODY = 65534
PLANTED = ("csv", "textwrap", "json", "sysconfig", "sitecustomize", "usercustomize", "email", "zipfile")


# ------------------------------------------------------------------ a folder full of planted modules


@pytest.fixture
def planted(monkeypatch):
    """A world-writable folder (1777) where nobody planted common modules and a pip/ package, each
    noting `ran-NAME` when imported; the test's working folder. Yields (folder, markers())."""
    folder = Path(tempfile.mkdtemp(prefix="wedgectl-planted-", dir="/tmp"))
    folder.chmod(0o1777)
    note = "import os\nopen(os.path.join({d!r}, 'ran-{n}'), 'w').write(str(os.getuid()))\n"
    files = [folder / f"{name}.py" for name in PLANTED]
    for path in files:
        path.write_text(note.format(d=str(folder), n=path.stem))
    pip = folder / "pip"
    pip.mkdir()
    (pip / "__init__.py").write_text(note.format(d=str(folder), n="pip"))
    (pip / "__main__.py").write_text(note.format(d=str(folder), n="pip-main"))
    for path in [*files, pip, pip / "__init__.py", pip / "__main__.py"]:
        os.chown(path, NOBODY, NOBODY)
    monkeypatch.chdir(folder)
    yield folder, lambda: sorted(p.name for p in folder.glob("ran-*"))
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A throwaway venv (with pip) of this interpreter: the server's environment."""
    root = tmp_path_factory.mktemp("server-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300, cwd="/")
    return root


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WEDGECTL_CACHE", str(tmp_path / "cache"))  # the install marker goes there


def purelib(venv: Path) -> str:
    return sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"]


def test_probes_and_the_plugin_install_import_nothing_from_the_working_folder(planted, venv):
    folder, markers = planted
    python = venv / "bin" / "python"
    assert Path.cwd() == folder
    where, before = install_dir(python), installed_version(python)
    try:
        ensure_engine_plugin(python, lambda _m: None)
    finally:
        assert markers() == []  # before: ran-csv, ran-sysconfig, ran-pip, ... as uid 0
    assert where == purelib(venv) and before in ("", engine_version())
    assert installed_version(python) == engine_version()
    assert list(Path(purelib(venv)).glob("wedgectl_engine-*.dist-info"))


def test_the_probe_reads_the_servers_pythonpath_and_pip_ignores_it(planted, venv, tmp_path):
    """Which plugin the server has is asked with its PYTHONPATH (it imports from there); pip runs isolated,
    so it installs where install_dir said (the checked site-packages), with the venv's own pip."""
    folder, markers = planted
    python = venv / "bin" / "python"
    site = tmp_path / "site"
    info = site / "wedgectl_engine-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wedgectl-engine\nVersion: 9.9.9\n")
    (site / "pip").mkdir()
    (site / "pip" / "__init__.py").write_text(f"open({str(folder / 'ran-pythonpath-pip')!r}, 'w')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}
    assert installed_version(python, env) == "9.9.9"
    assert install_dir(python, env) == purelib(venv)
    try:
        ensure_engine_plugin(python, lambda _m: None, env=env)  # 9.9.9 is not the carried one: installed
    finally:
        assert markers() == []
    assert installed_version(python) == engine_version()


def test_a_relative_interpreter_is_the_callers_and_still_runs_from_root(planted, venv, monkeypatch):
    folder, markers = planted
    monkeypatch.chdir(venv)
    assert install_dir("bin/python") == purelib(venv)
    assert markers() == []


# ------------------------------------------------------------------ the interpreter checked is the one launched

SERVER = textwrap.dedent('''
    """A stand-in API server (`x_serve.py serve --port N`): /health, and /who for what runs it."""
    import http.server, json, os, signal, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"pid": os.getpid(), "executable": sys.executable, "prefix": sys.prefix,
                               "fixes": os.environ.get("WEDGE_ENGINE_FIXES")}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')

DECOY = "#!/bin/sh\necho \"$0 $*\" > {marker}\nexec {real} \"$@\"\n"


def _wait_health(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/who", timeout=2, trust_env=False)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


@pytest.mark.parametrize("probe", [True, False], ids=["plugin-probed", "plugin-known"])
def test_swap_from_a_planted_folder_launches_the_checked_interpreter_by_its_path(planted, venv, tmp_path, probe):
    """probe: swap asks the interpreter about the plugin (from the planted folder); else the plan says it
    is there, and only the launch is under test."""
    folder, markers = planted
    decoys = tmp_path / "decoys"  # earlier on the server's PATH; empty when planned
    decoys.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "fake_serve.py").write_text(SERVER)
    port = free_port()
    env = {"PATH": f"{decoys}:{venv / 'bin'}:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    server = subprocess.Popen(["python3", "fake_serve.py", "serve", "--port", str(port)], cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    new_pid = None
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_health(url)["prefix"] == str(venv)
        plan = swap.plan_swap(server.pid)
        assert plan.python == str(venv / "bin" / "python3") and plan.argv[0] == "python3"
        assert plan.supervisor is None
        if not probe:
            plan = dataclasses.replace(plan, plugin_ok=True)
        # After the plan, a python3 lands earlier on the server's PATH.
        marker = tmp_path / "decoy-ran"
        decoy = decoys / "python3"
        decoy.write_text(DECOY.format(marker=marker, real=sys.executable))
        decoy.chmod(0o755)
        result = swap.swap_deployment(server.pid, plan=plan, stop_grace_s=2.0, health_timeout_s=60)
        new_pid = result.new_pid
        assert not marker.exists()  # before: the decoy ran, as root
        assert markers() == []  # the probe (and any install) imported nothing planted
        assert result.ok, result.message
        who = _wait_health(url)
        assert who["pid"] == new_pid and who["fixes"] == "all"
        assert psutil.Process(new_pid).cmdline()[0] == plan.python == plan.launch_argv[0]
        assert who["executable"] == plan.python and who["prefix"] == str(venv)
    finally:
        if server.poll() is None:
            stop_tree(server.pid, 1.0)
        if new_pid:
            stop_tree(new_pid, 2.0)


def test_the_interpreter_is_resolved_in_the_servers_folder_never_in_wedgectls(tmp_path, monkeypatch):
    server_cwd = tmp_path / "srv"
    (server_cwd / "bin").mkdir(parents=True)
    python = server_cwd / "bin" / "python3"
    python.symlink_to(sys.executable)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "bin").mkdir(parents=True)
    (elsewhere / "bin" / "python3").symlink_to(sys.executable)
    monkeypatch.chdir(elsewhere)
    assert swap.resolve_interpreter(["bin/python3"], {}, str(server_cwd)) == str(python)
    assert swap.resolve_interpreter(["python3"], {"PATH": "bin"}, str(server_cwd)) == str(python)
    assert swap.resolve_interpreter(["python3"], {"PATH": f":{tmp_path}"}, str(server_cwd / "bin")) == str(python)


# ------------------------------------------------------------------ a supervisor that looks like a server

# Starts two API servers that title themselves (prctl, as setproctitle's comm) VLLM::APIServer_<i>,
# each listening on 127.0.0.1, and starts one again whenever it dies; prints their pids as JSON lines.
SUPERVISOR = textwrap.dedent('''
    import ctypes, json, os, signal, socket, sys, time
    libc = ctypes.CDLL(None)

    def child(i):
        libc.prctl(15, f"VLLM::APIServer_{i}".encode(), 0, 0, 0)
        libc.prctl(1, 9, 0, 0, 0)  # SIGKILL when the supervisor dies
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        while True:
            signal.pause()

    def start(i):
        pid = os.fork()
        if pid == 0:
            try:
                child(i)
            finally:
                os._exit(0)
        return pid

    kids = {start(i): i for i in range(2)}
    while True:
        print(json.dumps(sorted(kids, key=kids.get)), flush=True)
        pid, _ = os.wait()
        i = kids.pop(pid, None)
        if i is not None:
            time.sleep(0.2)
            kids[start(i)] = i
''')


class Supervised:
    def __init__(self, argv: list[str], cwd: Path) -> None:
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}  # no INVOCATION_ID, no KUBERNETES_*
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.children = self.next_children()

    def next_children(self) -> list[int]:
        line = self.proc.stdout.readline()
        assert line, "the supervisor exited"
        kids = json.loads(line)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until both have titled themselves
            if all(psutil.Process(k).name().startswith("VLLM::APIServer") for k in kids):
                return kids
            time.sleep(0.05)
        raise AssertionError("children never titled themselves")

    def restart_first(self) -> list[int]:
        os.kill(self.children[0], signal.SIGKILL)
        self.children = self.next_children()
        return self.children

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_tree(self.proc.pid, 1.0)
        self.proc.stdout.close()


@pytest.fixture
def supervised(tmp_path):
    started: list[Supervised] = []

    def start(script_name: str, *args: str) -> Supervised:
        script = tmp_path / script_name
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(SUPERVISOR)
        started.append(Supervised([sys.executable, str(script), *args], tmp_path))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def test_a_supervisor_named_like_a_server_is_no_launcher_and_swap_refuses_its_servers(supervised):
    sup = supervised("fake_serve.py", "serve")
    one, other = sup.children
    for server in (one, other):
        dep = discover(pid=server)
        assert dep.root_pid == server and dep.api_pid == server  # before: the supervisor was the root
        assert sup.proc.pid not in dep.pids and not ({one, other} - {server}) & set(dep.pids)
    plan = swap.plan_swap(one)
    assert plan.api_pid == one and plan.tree == (one,)
    assert plan.supervisor is not None and plan.supervisor.kind == "launcher"
    assert str(sup.proc.pid) in plan.supervisor.why
    with pytest.raises(swap.SwapRefused) as refused:
        swap.swap_deployment(one, plan=plan)
    assert refused.value.exit_code == exitcodes.SWAP_SUPERVISED
    assert psutil.pid_exists(one) and psutil.pid_exists(other) and sup.proc.poll() is None
    with pytest.raises(NotVllm) as err:  # the supervisor itself: which of its servers?
        discover(pid=sup.proc.pid)
    assert str(one) in str(err.value) and str(other) in str(err.value)


def test_vllms_own_cli_is_the_launcher_until_it_starts_a_server_again(supervised, monkeypatch):
    sup = supervised("bin/vllm", "serve", "tiny", "--api-server-count", "2")
    one, other = sup.children
    for server in (one, other):
        dep = discover(pid=server)
        assert dep.root_pid == sup.proc.pid and {one, other} <= set(dep.pids)
    plan = swap.plan_swap(one)
    assert plan.api_pid == sup.proc.pid and plan.supervisor is None
    # vLLM's launcher never starts an API server again: one that does is a supervisor.
    monkeypatch.setattr(processes, "RESTART_SPREAD_S", 0.5, raising=False)
    time.sleep(1.0)
    again, other_again = sup.restart_first()
    assert other_again == other
    dep = discover(pid=again)
    assert dep.root_pid == again and sup.proc.pid not in dep.pids
    plan = swap.plan_swap(again)
    assert plan.api_pid == again and plan.supervisor is not None and "again" in plan.supervisor.why


def test_one_api_server_only_is_no_launcher(supervised):
    sup = supervised("bin/vllm", "serve", "tiny", "--api-server-count=1")
    one, _ = sup.children
    assert discover(pid=one).root_pid == one  # vLLM's CLI told to run one runs it in itself


def test_the_cli_is_matched_on_its_argv_not_its_title():
    assert processes.vllm_cli_serve(["/v/bin/python3", "/v/bin/vllm", "serve", "m", "-asc", "4"]) == ["m", "-asc", "4"]
    assert processes.vllm_cli_serve(["python", "-m", "vllm.entrypoints.cli.main", "serve"]) == []
    assert processes.vllm_cli_serve(["/v/bin/python3 /v/bin/vllm serve"]) is None  # a title written over argv
    assert processes.vllm_cli_serve(["python", "/x/fake_serve.py", "serve"]) is None
    assert processes.vllm_cli_serve(["python", "/v/bin/vllm", "bench"]) is None


RUNNER = textwrap.dedent('''
    """A shell-like parent: starts two API servers ARGS apart in time, then waits."""
    import json, subprocess, sys, time
    target, models = sys.argv[1], sys.argv[2:]
    kids = []
    for i, model in enumerate(models):
        if i:
            time.sleep(1.2)
        p = subprocess.Popen([sys.executable, target, "serve", model], stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert line.startswith("ready"), line
        kids.append(p.pid)
    print(json.dumps(kids), flush=True)
    time.sleep(600)
''')


@pytest.mark.parametrize("models, supervisor", [(["/models/a", "/models/b"], False),
                                                (["/models/a", "/models/a"], True)])
def test_a_parent_that_started_different_servers_apart_restarted_nothing(tmp_path, monkeypatch, models, supervisor):
    """A shell or a test runner that started two servers some time apart is no supervisor (a run of
    the suite, whose pytest had started servers for half an hour, was refused every swap); one that
    started the same server again is."""
    monkeypatch.setattr(processes, "RESTART_SPREAD_S", 0.5)
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    targets = Path(__file__).parent / "targets"
    runner = subprocess.Popen([sys.executable, str(script), str(targets / "fake_vllm_serve.py"), *models],
                              cwd=targets, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        kids = json.loads(runner.stdout.readline())
        found = processes.server_supervisor(kids[0])
        if supervisor:
            assert found is not None and found[0] == runner.pid and "again" in found[1], found
        else:
            assert found is None, found
    finally:
        stop_tree(runner.pid, 1.0)
        runner.stdout.close()
