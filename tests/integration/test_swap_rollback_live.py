"""Swap's rollback on a real vLLM (issue 34): the patched server fails its start for real, and the original
command comes back, serving, as exactly the command it was.

The failure is one a deployment can carry without knowing: a fix setting in its environment,
WEDGE_ENGINE_STARTUP_S=1, left over from a test run. The stock server ignores it (no fix is on); swap keeps the
deployment's per-fix settings, so the patched server's start-up deadline (wedge_engine.fixes.startup) fails
vLLM's real wait for its engine core after 1 s, and that API server exits non-zero. swap must then stop what
is left of it, start the original command again, and exit 43.

Every process the deployment ever runs (the original, the patched server, the rollback, and every EngineCore
they spawn) carries a tag in its environment, which swap keeps: the test finds them in /proc by it, and kills
whatever of them is left on every path. The deployment is started from a shell, as a person or a script
starts one; the session's shared server is the bystander: another vLLM on the same host, a child of the same
pytest. swap must touch neither.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.model import exitcodes
from wedgectl.collect.target import read_command
from wedgectl.lab.lifecycle import Server, running
from wedgectl.collect.control import free_port, stop_tree
from wedgectl.lab.patched import STARTUP_FAILED_LINE
from wedgectl.lab.engine_install import ensure_engine_plugin
from wedgectl.lab.runtime import ServerSpec
from wedgectl.lab.runtime.launcher import server_command

pytestmark = pytest.mark.integration

TAG_ENV = "WEDGECTL_TEST_DEPLOYMENT"
FIXES_ENV = "WEDGE_ENGINE_FIXES"
SWAP_TIMEOUT_S = 900  # stop + a failed start + a full start of vLLM, on a loaded 2-core host
MARKER = "the original command is running again as pid "


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def _tagged(tag: str) -> dict[int, tuple[float, bool]]:
    """Every live process whose environment carries `tag`, and their descendants (an EngineCore's title,
    set by vLLM, overwrites what /proc shows of its environment): pid -> (create time, fixes on)."""
    found: dict[int, tuple[float, bool]] = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get(TAG_ENV) != tag:
                continue
            fixes = bool(env.get(FIXES_ENV))
            for member in _tree(proc):
                if member.status() != psutil.STATUS_ZOMBIE:
                    found.setdefault(member.pid, (member.create_time(), fixes))
        except psutil.Error:
            continue
    return found


def _alive(pid: int, created: float) -> bool:
    """Whether the process `pid` that started at `created` still runs (a reused pid is another process)."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _identity(server: Server) -> dict[int, float]:
    """pid -> create time of a server's whole tree, right now."""
    ids = {}
    for pid in server.tree_pids():
        try:
            ids[pid] = psutil.Process(pid).create_time()
        except psutil.Error:
            continue
    return ids


class _Watch:
    """Every process the tagged deployment ever runs, noted twice a second: pid -> (create time, fixes on).
    An EngineCore orphaned by its API server is no longer under a tagged process: noted before, it is still
    checked (and stopped) by its pid and create time."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.seen: dict[int, tuple[float, bool]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def look(self) -> dict[int, tuple[float, bool]]:
        now = _tagged(self.tag)
        for pid, what in now.items():
            self.seen.setdefault(pid, what)
        return now

    def _run(self) -> None:
        while not self._done.wait(0.5):
            self.look()

    def patched(self) -> dict[int, float]:
        return {pid: created for pid, (created, fixes) in self.seen.items() if fixes}

    def close(self) -> None:
        """Stop watching; stop whatever of the deployment is left: roots by stop_tree, then SIGKILL."""
        self._done.set()
        self._thread.join(timeout=30)
        left = self.look()
        for pid in left:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).ppid() not in left:
                    stop_tree(pid, 10.0)
        for pid, (created, _fixes) in {**self.seen, **self.look()}.items():
            if _alive(pid, created):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def watch() -> Iterator[_Watch]:
    watching = _Watch(uuid.uuid4().hex)
    try:
        yield watching
    finally:
        watching.close()


def test_a_patched_vllm_that_fails_its_start_is_rolled_back_to_the_original(
        vllm_python: Path, tiny_model: Path, tmp_path: Path, vllm_server: Server, watch: _Watch) -> None:
    ensure_engine_plugin(vllm_python, lambda _m: None)
    bystander = _identity(vllm_server)
    assert bystander, "the shared server has no process tree"
    log = tmp_path / "server.log"
    spec = ServerSpec(model=tiny_model, port=free_port(),
                      env={TAG_ENV: watch.tag, "WEDGE_ENGINE_STARTUP_S": "1"})
    command = server_command(spec, vllm_python, log)
    # Started from a shell that waits for it: its parent is not pytest, which also runs the bystander
    # (a parent of two API servers is a launcher to swap, which then refuses without --force: exit 45).
    command = replace(command, argv=("/bin/sh", "-c", '"$@"; exit $?', "deployment", *command.argv))
    with running(command) as shell:
        api = psutil.Process(shell.pid).children()[0].pid
        original = read_command(api)
        assert original[0] == list(command.argv[4:])
        old_tree = {pid: t for pid, t in _identity(shell).items() if pid != shell.pid}
        assert FIXES_ENV not in original[1] and original[1]["WEDGE_ENGINE_STARTUP_S"] == "1"
        log_before = log.stat().st_size
        swap = [sys.executable, "-m", "wedgectl", "swap", "--pid", str(api), "--quiet",
                "--stop-grace", "5", "--health-timeout", "300"]
        t0 = time.monotonic()
        r = subprocess.run(swap, capture_output=True, text=True, timeout=SWAP_TIMEOUT_S)
        took = time.monotonic() - t0
        new_log = log.read_bytes()[log_before:].decode(errors="replace")
        why = (f"exit {r.returncode} after {took:.0f} s\n{r.stdout}{r.stderr}\n"
               f"--- log since the swap:\n{new_log[-4000:]}")
        print(f"swap rolled back in {took:.1f} s wall:\n{r.stdout}")

        # 43, said in one line: what failed and that the original runs again, as which pid.
        assert r.returncode == exitcodes.SWAP_FAILED, why
        assert r.stderr == "", why  # --quiet: no progress, no traceback
        headline = [line for line in r.stdout.splitlines() if line and not line.startswith(" ")]
        assert len(headline) == 1, why
        assert headline[0].startswith("swap failed: the patched server did not become healthy (it exited with code")
        assert MARKER in headline[0], why
        back = int(headline[0].split(MARKER, 1)[1].split()[0])

        # It failed for the reason set up, in a real vLLM: its own start-up deadline, logged by that server.
        assert f"{STARTUP_FAILED_LINE} 1 s" in new_log, why
        patched = watch.patched()
        assert len(patched) >= 2, f"the patched API server and its EngineCore were never seen: {patched}\n{why}"
        assert back not in patched and back not in old_tree

        # Nothing of the patched server is left, nor of the old tree; what the deployment runs now is the
        # rollback's tree and nothing else, the fixes off.
        assert [pid for pid, created in patched.items() if _alive(pid, created)] == [], why
        assert [pid for pid, created in old_tree.items() if _alive(pid, created)] == [], why
        now = watch.look()
        rollback = {p.pid for p in _tree(psutil.Process(back)) if _alive(p.pid, p.create_time())}
        assert set(now) == rollback and len(rollback) >= 2, why  # the API server and its EngineCore at least
        assert not any(fixes for _created, fixes in now.values()), why

        # The rollback runs the very command that ran before: argv (/proc/PID/cmdline), environment, folder.
        assert read_command(back) == original
        with open(f"/proc/{back}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[:-1] == [a.encode() for a in original[0]]

        # And serves: a real completion.
        c = httpx.post(f"{spec.url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4,
                             "temperature": 0, "ignore_eos": True})
        assert c.status_code == 200, c.text
        assert c.json()["usage"]["completion_tokens"] == 4, c.text

        # The shell that ran the deployment ended by itself once its server had (no signal of swap's), and
        # the other vLLM on this host was not touched: the same processes, still serving.
        assert shell.popen.wait(timeout=30) >= 0, why
        assert _identity(vllm_server) == bystander
        assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200
        assert not set(bystander) & set(watch.seen)

        stop_tree(back, 15.0)  # before `running` removes the TMPDIR it shares with the original
        assert watch.look() == {}
