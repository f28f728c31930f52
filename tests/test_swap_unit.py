"""swap's safety on recorded /proc text and real files: supervisors, credentials, who may write the interpreter,
the restore script, and signals mid-swap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from wedgectl.model import exitcodes
from wedgectl.collect.target import (
    Credentials,
    Supervisor,
    detect_supervisor,
    parse_cgroup,
    parse_status_credentials,
    read_command,
    supervisor_from,
)
from wedgectl.lab.engine_install import recorded_version
from wedgectl.lab.swapsafety import SignalGuard, SwapInterrupted, path_risk, restore_script

NOBODY = 65534

# Recorded /proc/PID/cgroup texts.
SYSTEMD_V2 = "0::/system.slice/vllm-chat.service\n"
SYSTEMD_V1 = "12:pids:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n"
KUBE = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b.slice/cri-containerd-9f.scope\n"
DOCKER_V1 = "4:memory:/docker/3f9c2a\n1:name=systemd:/docker/3f9c2a\n"
SESSION = "0::/user.slice/user-1000.slice/session-4.scope\n"
USER_MANAGER = "0::/user.slice/user-1000.slice/user@1000.service\n"
STATUS = """Name:\tpython3
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4101
PPid:\t4000
Uid:\t65534\t65534\t65534\t65534
Gid:\t65533\t65533\t65533\t65533
Groups:\t65533 27 \n"""


def test_cgroup_paths_from_v1_and_v2_text():
    assert parse_cgroup(SYSTEMD_V2) == ("/system.slice/vllm-chat.service",)
    assert parse_cgroup(DOCKER_V1) == ("/docker/3f9c2a", "/docker/3f9c2a")


@pytest.mark.parametrize(("cgroup", "env", "ancestors", "kind", "hint"), [
    (SYSTEMD_V2, {}, [], "systemd", "systemctl restart vllm-chat.service"),
    (SYSTEMD_V1, {}, [], "systemd", "vllm.service"),
    (SESSION, {"INVOCATION_ID": "5e1f"}, [], "systemd", "INVOCATION_ID"),
    (KUBE, {}, [], "kubernetes", "kubectl set env deployment"),
    (SESSION, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, [], "kubernetes", "KUBERNETES_SERVICE_HOST"),
    (DOCKER_V1, {}, [], "container", "/docker/3f9c2a"),
    ("0::/\n", {}, ["tini", "containerd-shim-runc-v2"], "container", "containerd-shim-runc-v2 among its parents"),
    ("0::/\n", {}, ["conmon"], "container", "conmon"),
    ("0::/\n", {"SUPERVISOR_ENABLED": "1"}, [], "supervisord", "supervisorctl"),
    ("0::/\n", {}, ["sh", "supervisord"], "supervisord", "supervisord among its parents"),
    ("0::/\n", {}, ["runsv"], "runit", "runsv"),
])
def test_supervisor_is_named_with_its_evidence_and_what_to_do(cgroup, env, ancestors, kind, hint):
    found = supervisor_from(env, parse_cgroup(cgroup), ancestors, own_cgroups=("/",))
    assert found is not None and found.kind == kind
    assert hint in found.line and "WEDGE_ENGINE_FIXES=all" in found.line and "--force" in found.line


@pytest.mark.parametrize("cgroup", [SESSION, USER_MANAGER, "0::/\n"])
def test_no_supervisor_for_a_login_session_or_a_bare_host(cgroup):
    assert supervisor_from({"PATH": "/bin"}, parse_cgroup(cgroup), ["bash", "sshd"], ("/",)) is None


def test_a_cgroup_shared_with_wedgectl_says_nothing():
    # wedgectl and the server in one container (no cgroup namespace): the cgroup is not the server's supervisor.
    assert supervisor_from({}, parse_cgroup(DOCKER_V1), ["bash"], own_cgroups=parse_cgroup(DOCKER_V1)) is None


def _record(root: Path, pid: int, status: str, cgroup: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "status").write_text(status)
    (root / str(pid) / "cgroup").write_text(cgroup)


def test_detect_supervisor_reads_a_recorded_proc_tree(tmp_path):
    _record(tmp_path, 4101, STATUS, "0::/\n")
    _record(tmp_path, 4000, "Name:\ttini\nPPid:\t3990\n", "0::/\n")
    _record(tmp_path, 3990, "Name:\tcontainerd-shim\nPPid:\t1\n", "0::/\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/\n")
    found = detect_supervisor(4101, {}, tmp_path)
    assert found is not None and found.kind == "container" and "containerd-shim" in found.why
    (tmp_path / "3990" / "status").write_text("Name:\tsshd\nPPid:\t1\n")
    assert detect_supervisor(4101, {}, tmp_path) is None
    assert detect_supervisor(4101, {"INVOCATION_ID": "x"}, tmp_path).kind == "systemd"


def test_credentials_from_status_and_as_popen_arguments():
    creds = parse_status_credentials(STATUS)
    assert creds == Credentials(65534, 65533, (65533, 27))
    assert creds.popen_kwargs == {"user": 65534, "group": 65533, "extra_groups": [65533, 27]}
    assert Credentials(0, 0).popen_kwargs == {}  # root stays root: nothing to switch


def test_read_command_from_a_recorded_root(tmp_path):
    p = tmp_path / "77"
    p.mkdir()
    (p / "cmdline").write_bytes(b"/venv/bin/python\0-m\0vllm.entrypoints.openai.api_server\0--port\0\x38001\0")
    (p / "environ").write_bytes(b"A=1\0B=x=y\0")
    os.symlink("/srv", p / "cwd")
    assert read_command(77, tmp_path) == (["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                                           "--port", "8001"], {"A": "1", "B": "x=y"}, "/srv")


# ------------------------------------------------------------------ who may write the interpreter


@pytest.fixture
def tree(tmp_path):
    """A venv-like folder of nobody's own under the sticky /tmp (tmp_path's parents are root's 0700)."""
    root = Path(f"/tmp/wedgectl-unit-{os.getpid()}-{time.monotonic_ns()}")
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    for p in (root, root / "bin", python):
        os.chown(p, NOBODY, NOBODY)
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def test_an_interpreter_only_its_user_and_root_can_write_is_safe(tree):
    assert path_risk(str(tree / "bin" / "python"), NOBODY) is None
    assert path_risk(sys.executable, 0) is None


def test_a_world_writable_interpreter_or_folder_is_named(tree):
    python = tree / "bin" / "python"
    python.chmod(0o777)
    assert path_risk(str(python), NOBODY) == f"{python} is writable by every user"
    python.chmod(0o755)
    (tree / "bin").chmod(0o777)
    assert path_risk(str(python), NOBODY) == f"{tree / 'bin'} is writable by every user"


def test_an_interpreter_owned_by_a_third_user_is_named(tree):
    # Root may run nobody's interpreter as nobody; uid 1234 may not: nobody owns it.
    assert path_risk(str(tree / "bin" / "python"), 1234) == f"{tree / 'bin' / 'python'} is owned by uid {NOBODY}"


def test_a_link_to_a_writable_interpreter_is_followed(tree):
    target = tree / "real-python"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o777)
    link = tree / "bin" / "python3"
    link.symlink_to(target)
    assert path_risk(str(link), NOBODY) == f"{target} is writable by every user"


def test_the_plugin_version_is_read_from_the_dist_info_without_running_python(tmp_path):
    site = tmp_path / "lib" / "python3.12" / "site-packages" / "wedgectl_engine-0.2.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: wedgectl-engine\nVersion: 0.2.0\n")
    assert recorded_version(tmp_path / "bin" / "python") == ("0.2.0", str(site.parent))
    assert recorded_version(tmp_path / "nowhere" / "bin" / "python")[0] == ""


# ------------------------------------------------------------------ the restore script


def test_the_restore_script_starts_the_command_as_its_user_with_its_environment_alone(tree):
    log = tree / "restored.log"
    code = "import os, sys; print(os.getuid(), os.getgid(), sorted(os.environ.items()), sys.argv[1:], os.getcwd())"
    text = restore_script(["/usr/bin/python3", "-c", code, "a b", "$HOME"], {"SECRET_X": "it's one", "A": "1", "LC_ALL": "C"},
                          str(tree), str(log), Credentials(NOBODY, NOBODY, (NOBODY,)))
    script = tree / "restore.sh"
    script.write_text(text)
    subprocess.run(["sh", str(script)], check=True, timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (log.exists() and log.read_text()):
        time.sleep(0.05)
    assert log.read_text().strip() == (f"{NOBODY} {NOBODY} [('A', '1'), ('LC_ALL', 'C'), ('SECRET_X', \"it's one\")] "
                                       f"['a b', '$HOME'] {tree}")
    assert log.stat().st_uid == NOBODY  # opened by the restored server's user, not by root


# ------------------------------------------------------------------ signals mid-swap


def test_a_signal_during_a_step_is_raised_after_it_and_during_a_wait_at_once():
    with SignalGuard() as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # a step: not cut short
        with pytest.raises(SwapInterrupted) as got:
            guard.check()
        assert got.value.signum == signal.SIGTERM and str(got.value) == "SIGTERM"
        guard.check()  # raised once
        t0 = time.monotonic()
        with pytest.raises(SwapInterrupted):
            with guard.interruptible():
                signal.setitimer(signal.ITIMER_REAL, 0.1)
                signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGHUP))
                time.sleep(5)
        assert time.monotonic() - t0 < 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_refusal_exit_codes_are_distinct_and_documented():
    codes = {exitcodes.SWAP_FAILED, exitcodes.SWAP_UNSAFE, exitcodes.SWAP_SUPERVISED}
    assert len(codes) == 3
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for code in (exitcodes.SWAP_UNSAFE, exitcodes.SWAP_SUPERVISED):
        assert f"| {code} |" in readme


# ------------------------------------------------------------------ top's `w`


@pytest.mark.asyncio
@pytest.mark.parametrize("supervisor", [None, Supervisor("systemd", "cgroup /system.slice/vllm.service", "x")])
async def test_top_w_shows_the_plan_and_acts_only_after_y(monkeypatch, supervisor):
    from test_top import WEDGE, SIZE, ScriptedSource, until

    from wedgectl.lab import swap
    from wedgectl.store.bundle import read_bundle
    from wedgectl.tui import app as top_app
    from wedgectl.tui.app import make_app
    from wedgectl.tui.screens import ConfirmSwap

    plan = swap.SwapPlan(api_pid=4101, tree=(4101, 4102), argv=("/venv/bin/python", "-m", "vllm", "serve", "tiny",
                         "--api-key", "sk-never-shown"), cwd="/srv", env={"HF_TOKEN": "hf_never_shown"},
                         python="/venv/bin/python", url="http://127.0.0.1:8000", port=8000, host="127.0.0.1",
                         log_path=None, plugin="missing", plugin_ok=False, run_as=Credentials(NOBODY, NOBODY),
                         supervisor=supervisor)
    swapped = []
    monkeypatch.setattr(swap, "plan_swap", lambda pid: plan)
    monkeypatch.setattr(swap, "swap_deployment", lambda pid, progress=None, plan=None: swapped.append(plan)
                        or types.SimpleNamespace(ok=True, message="", new_pid=None))
    monkeypatch.setattr(top_app, "swap_available", lambda: True)
    app = make_app(ScriptedSource(read_bundle(WEDGE)), refresh_s=30)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.frame is not None)
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmSwap))
        shown = "\n".join(app.screen.lines)
        assert "processes to stop: 4101 4102" in shown and "uid 65534" in shown and "sk-never-shown" not in shown
        assert swapped == []  # the plan is on screen; nothing has happened
        refused = app.screen.refused
        await pilot.press("y")
        await pilot.pause()
        if supervisor is None:
            assert refused == ""
            await until(pilot, lambda: swapped == [plan])  # the swap acts on the plan that was shown
        else:
            assert "systemd" in refused and "--force" in refused
            await pilot.pause(0.5)
            assert swapped == []  # refused: y does nothing
