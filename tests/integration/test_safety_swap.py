"""swap stays in its deployment's rights (issue 11), on real processes: a server running as nobody, supervisors,
interrupted swaps (one on a real vLLM), the restore script, and /health with a dead proxy in the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.model import exitcodes

from wedgectl.lab import swap
from wedgectl.collect.target import read_command
from wedgectl.lab.lifecycle import health_client, health_status
from wedgectl.collect.control import free_port, stop_tree
from wedgectl.lab.engine_install import engine_version, ensure_engine_plugin
from wedgectl.render.text import render_swap
from wedgectl.lab.runtime import ServerSpec, running_server

pytestmark = pytest.mark.integration

NOBODY = 65534
# The nobody server runs the system python (the managed runtime lives in root's 0700 home).
SYSTEM_PYTHON = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(f'python{sys.version_info[0]}.{sys.version_info[1]}')"],
                               capture_output=True, text=True, check=True).stdout.strip()
# A stand-in API server (a `*_serve.py` given `serve` is one to discovery): /health answers with who it is.
SERVE = '''
import http.server, json, os, signal, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
fixed = bool(os.environ.get("WEDGE_ENGINE_FIXES"))
once = os.environ.get("FAKE_ONCE")  # the original command starts only while this file is absent
if once and not fixed and os.path.exists(once):
    sys.exit(3)
if once:
    open(once, "w").close()
if fixed and os.environ.get("FAKE_FAIL_WHEN_FIXED"):
    sys.exit(3)
if fixed:
    time.sleep(float(os.environ.get("FAKE_FIXED_START_S", "0")))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"pid": os.getpid(), "uid": os.getuid(), "fixes": os.environ.get("WEDGE_ENGINE_FIXES"),
                           "argv": sys.argv}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _wait_health(url: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"{url}/health", timeout=1).json()
        except (httpx.HTTPError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{url}/health never answered")


def _swapped(result) -> list[int]:
    return [result.new_pid] if result is not None and result.new_pid else []


@pytest.fixture
def fake(tmp_path: Path) -> Iterator:
    """start(**env) -> (popen, url): the stand-in server as root, in a session of its own."""
    script = tmp_path / "fake_serve.py"
    script.write_text(SERVE)
    started: list[int] = []

    def start(**env: str):
        port = free_port()
        p = subprocess.Popen([sys.executable, str(script), "serve", "--port", str(port), "--api-key", "sk-hidden1"],
                             cwd=tmp_path, env={"PATH": os.environ["PATH"], **env}, start_new_session=True,
                             stdout=open(tmp_path / "fake.log", "ab"), stderr=subprocess.STDOUT)
        started.append(p.pid)
        url = f"http://127.0.0.1:{port}"
        _wait_health(url)
        return p, url

    yield start
    for pid in started:
        stop_tree(pid, 1.0)


# ------------------------------------------------------------------ a server running as nobody


@pytest.fixture
def nobody_server(request: pytest.FixtureRequest) -> Iterator:
    """A server run as nobody by an interpreter in a venv nobody owns; bin/python notes each uid it runs as.

    The plugin's dist-info is on the server's PYTHONPATH (remove it to make swap install the plugin); its
    pip finds no index, so an install fails without touching the network. Parametrized with "root-log",
    its output goes to a file root opened for it (root-owned, as a careless launcher leaves it).
    """
    root = Path(tempfile.mkdtemp(prefix="wedgectl-nobody-", dir="/tmp"))
    root.chmod(0o755)
    (root / "bin").mkdir()
    (root / "lib" / SYSTEM_PYTHON / "site-packages").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = true\n")
    python = root / "bin" / "python"
    python.write_text(f'#!/bin/bash\nid -u >> {root}/uids\nexec -a "$0" /usr/bin/python3 "$@"\n')
    python.chmod(0o755)
    (root / "http_serve.py").write_text(SERVE)
    info = root / "site" / f"wedgectl_engine-{engine_version()}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: wedgectl-engine\nVersion: {engine_version()}\n")
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(root)], check=True)
    port = free_port()
    stdout = subprocess.DEVNULL
    if getattr(request, "param", None) == "root-log":
        stdout = open(root / "server.log", "ab")  # noqa: SIM115 - handed to the server
    p = subprocess.Popen([str(python), str(root / "http_serve.py"), "serve", "--port", str(port)], cwd=root,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root / "site"), "HF_TOKEN": "hf_nobodys",
                              "PIP_NO_INDEX": "1", "HOME": str(root)},
                         user=NOBODY, group=NOBODY, extra_groups=[], start_new_session=True,
                         stdout=stdout, stderr=subprocess.STDOUT)
    if stdout is not subprocess.DEVNULL:
        stdout.close()  # the server holds its own copy
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_health(url)["uid"] == NOBODY
        yield p, url, root
    finally:
        stop_tree(p.pid, 1.0)
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _uids(root: Path) -> list[str]:
    return (root / "uids").read_text().split()


def test_dry_run_runs_nothing_of_a_nobody_server(nobody_server):
    p, url, root = nobody_server
    assert _uids(root) == [str(NOBODY)]  # its own start
    result = swap.swap_deployment(p.pid, dry_run=True)
    assert result.ok and result.plan.run_as.uid == NOBODY
    assert _uids(root) == [str(NOBODY)]  # before: the plan ran bin/python as root ("0" noted)
    assert "uid 65534" in "\n".join(render_swap(result))


def test_a_swap_runs_the_interpreter_and_the_new_server_as_nobody(nobody_server):
    p, url, root = nobody_server
    result = None
    try:
        result = swap.swap_deployment(p.pid, stop_grace_s=2.0, health_timeout_s=30)
        assert result.ok, result.message
        new = psutil.Process(result.new_pid)
        assert new.uids().real == NOBODY and new.gids().real == NOBODY  # before: 0 and 0
        assert _wait_health(url)["uid"] == NOBODY
        log = os.readlink(f"/proc/{result.new_pid}/fd/1")
        assert log == result.log_path and os.stat(log).st_uid == NOBODY  # before: a root-owned log
        assert "0" not in _uids(root) and len(_uids(root)) >= 3  # start, the plugin probe, the new server
    finally:
        for pid in _swapped(result):
            stop_tree(pid, 2.0)


@pytest.mark.parametrize("nobody_server", ["root-log"], indirect=True)
def test_a_log_the_user_cannot_write_is_not_appended_to_as_root(nobody_server):
    p, url, root = nobody_server
    old_log = root / "server.log"
    old_log.write_bytes(b"root's line\n")
    old_log.chmod(0o644)
    result = None
    try:
        result = swap.swap_deployment(p.pid, stop_grace_s=2.0, health_timeout_s=30)
        assert result.ok, result.message
        assert result.plan.log_path == str(old_log) and result.log_path != str(old_log)
        assert old_log.read_bytes() == b"root's line\n" and old_log.stat().st_uid == 0  # before: root appended
        new_log = os.readlink(f"/proc/{result.new_pid}/fd/1")
        assert new_log == result.log_path and os.stat(new_log).st_uid == NOBODY
    finally:
        for pid in _swapped(result):
            stop_tree(pid, 2.0)


def test_pip_runs_as_the_server_user(nobody_server):
    p, url, root = nobody_server
    subprocess.run(["rm", "-rf", *map(str, (root / "site").glob("wedgectl_engine-*"))], check=True)
    with pytest.raises(swap.SwapError, match="cannot install the plugin.*nothing was stopped") as got:
        swap.swap_deployment(p.pid, stop_grace_s=2.0, health_timeout_s=30)
    assert got.value.exit_code == exitcodes.SWAP_FAILED
    assert "0" not in _uids(root) and len(_uids(root)) >= 4  # start, probe, install folder, pip; before: pip as 0
    assert _wait_health(url)["pid"] == p.pid


def test_world_writable_site_packages_are_refused_before_pip(nobody_server):
    p, url, root = nobody_server
    subprocess.run(["rm", "-rf", *map(str, (root / "site").glob("wedgectl_engine-*"))], check=True)
    site = root / "lib" / SYSTEM_PYTHON / "site-packages"
    site.chmod(0o777)
    with pytest.raises(swap.SwapRefused, match="writable by every user") as got:
        swap.swap_deployment(p.pid, stop_grace_s=2.0, health_timeout_s=30)
    assert got.value.exit_code == exitcodes.SWAP_UNSAFE and str(site) in str(got.value)
    assert "0" not in _uids(root) and _wait_health(url)["pid"] == p.pid


def test_a_world_writable_interpreter_is_refused_with_its_exit_code(nobody_server):
    p, url, root = nobody_server
    (root / "bin" / "python").chmod(0o777)
    r = subprocess.run([sys.executable, "-m", "wedgectl", "swap", "--pid", str(p.pid), "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == exitcodes.SWAP_UNSAFE, r.stderr  # before: 0, and the plan ran it as root
    assert len(r.stderr.strip().splitlines()) == 1 and "writable by every user" in r.stderr
    assert _uids(root) == [str(NOBODY)]
    assert _wait_health(url)["pid"] == p.pid


# ------------------------------------------------------------------ supervisors


@pytest.mark.parametrize(("env", "kind"), [({"INVOCATION_ID": "0f1e2d"}, "systemd"),
                                           ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, "kubernetes")])
def test_a_supervised_server_is_not_swapped_without_force(fake, env, kind):
    p, url = fake(**env)
    r = subprocess.run([sys.executable, "-m", "wedgectl", "swap", "--pid", str(p.pid), "--stop-grace", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == exitcodes.SWAP_SUPERVISED, r.stderr  # before: swapped, racing the supervisor
    assert kind in r.stderr and "WEDGE_ENGINE_FIXES=all" in r.stderr and "--force" in r.stderr
    assert _wait_health(url)["pid"] == p.pid and p.poll() is None
    assert swap.swap_deployment(p.pid, dry_run=True, force=True).plan.supervisor.kind == kind


# ------------------------------------------------------------------ interrupted swaps


def _swap_cli(pid: int, *flags: str) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """`wedgectl swap` as a process; its stderr lines, and an event set once it starts the patched server."""
    proc = subprocess.Popen([sys.executable, "-m", "wedgectl", "swap", "--pid", str(pid), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    starting = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "starting the same command" in line:
                starting.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, lines, starting


def _stdout_at_exit(proc: subprocess.Popen, timeout: float) -> str:
    """The swap's stdout once it has exited. Its stderr is _swap_cli's reader's alone: communicate()
    would read it too, and close it under that thread (an I/O error in the thread, lines lost)."""
    proc.wait(timeout=timeout)  # its stdout is a few lines: no pipe fills while it runs
    assert proc.stdout is not None
    return proc.stdout.read()


def _restarted_pid(out: str) -> int:
    marker = "the original command is running again as pid "
    assert marker in out, out
    return int(out.split(marker, 1)[1].split()[0])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_signal_mid_swap_brings_the_original_back(fake, sig):
    p, url = fake(FAKE_FIXED_START_S="30")  # the patched server is slow: the signal comes while it starts
    original = read_command(p.pid)
    proc, lines, starting = _swap_cli(p.pid, "--stop-grace", "2", "--health-timeout", "60")
    back = None
    try:
        assert starting.wait(30), "".join(lines)
        time.sleep(0.5)
        proc.send_signal(sig)
        out = _stdout_at_exit(proc, 30)
        assert proc.returncode == exitcodes.INTERRUPTED, out + "".join(lines)  # before: killed, old server gone
        back = _restarted_pid(out)
        seen = _wait_health(url, 10)
        assert seen["pid"] == back and seen["fixes"] is None
        assert read_command(back) == (original[0], original[1], original[2])
    finally:
        proc.kill()
        if back:
            stop_tree(back, 2.0)


def test_when_the_original_cannot_come_back_the_restore_script_is_exact(fake, tmp_path):
    once = tmp_path / "started-once"
    p, url = fake(FAKE_ONCE=str(once), FAKE_FAIL_WHEN_FIXED="1", HF_TOKEN="hf_restore")
    original = read_command(p.pid)
    result = swap.swap_deployment(p.pid, stop_grace_s=1.0, health_timeout_s=10)
    back = None
    try:
        assert not result.ok and result.rolled_back and result.restore_script
        script = Path(result.restore_script)
        assert f"sh {script}" in result.message and f"sh {script}" in "\n".join(render_swap(result))
        assert "hf_restore" not in result.message and (script.stat().st_mode & 0o777) == 0o600
        once.unlink()  # whatever kept it from starting is mended: the printed command restores it
        subprocess.run(["sh", str(script)], check=True, timeout=10)
        back = _wait_health(url)["pid"]
        assert read_command(back) == original  # the same argv, environment and folder
    finally:
        for pid in [*_swapped(result), *([back] if back else [])]:
            stop_tree(pid, 2.0)


def test_sigterm_mid_swap_of_a_real_vllm_restores_the_stock_server(vllm_python, tiny_model, tmp_path):
    ensure_engine_plugin(vllm_python, lambda _m: None)
    spec = ServerSpec(model=tiny_model, port=free_port())
    back = None
    with running_server(spec, vllm_python, tmp_path / "server.log") as server:
        original = read_command(server.pid)
        proc, lines, starting = _swap_cli(server.pid, "--stop-grace", "5", "--health-timeout", "300")
        try:
            assert starting.wait(60), "".join(lines)
            time.sleep(1.0)  # the patched vLLM is loading
            proc.send_signal(signal.SIGTERM)
            out = _stdout_at_exit(proc, 300)
            assert proc.returncode == exitcodes.INTERRUPTED, out + "".join(lines)
            back = _restarted_pid(out)
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            argv, env, cwd = read_command(back)
            assert (argv, cwd) == (original[0], original[2]) and "WEDGE_ENGINE_FIXES" not in env
            assert env == original[1]
        finally:
            proc.kill()
            if back:
                stop_tree(back, 10.0)


# ------------------------------------------------------------------ /health and proxies


def test_a_dead_proxy_in_the_environment_does_not_make_a_healthy_server_look_dead(vllm_server, monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens on the discard port
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with httpx.Client(timeout=2) as honours_env, pytest.raises(httpx.HTTPError):
        honours_env.get(f"{vllm_server.url}/health")  # what a proxy-honouring wait would see
    with health_client() as client:
        assert health_status(client, vllm_server.url) == 200
