"""Session fixtures for tests that drive a real vLLM server.

`vllm_python` finds the runtime: $WEDGECTL_VLLM_PYTHON (any existing vLLM
environment, e.g. a GPU host's) or the managed CPU runtime, installed on first
use (~80 s, ~3.4 GB under the wedgectl cache; WEDGECTL_NO_INSTALL=1 skips the
tests instead). `vllm_server` is one tiny-model server shared by the session:
started on first use, and again if a test left it dead. A parallel run puts
every test on it on one worker (tests/conftest.py, STOCK_TAG), so the run
starts it once. Tests must not stop it
or leave it wedged; a test that needs its own server (custom flags, a plugin, a
hang, a kill) starts one with `running_server`. A server start costs 20-40 s on
2 cores (minutes under load): use the shared one whenever a test only needs
*a* healthy or idle server.

`spawn` starts a test target from tests/targets (or any script that announces
through tests/targets/_announce.py) and returns a `Target` that reads what it
announces on its FIFO; every target and its children are SIGKILLed at teardown.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from wedgectl.lab.runtime import (
    RuntimeMissing,
    Server,
    ServerSpec,
    ensure_tiny_model,
    free_port,
    install_runtime,
    runtime_python,
    start_server,
    stop_server,
)

TARGETS = Path(__file__).resolve().parents[1] / "targets"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "integration: drives real processes (a real vLLM server, py-spy, /proc)",
    )
    config.addinivalue_line(
        "markers",
        "ends_admission_wedge: the test ends the shared admission wedge (runs last of the fixture's users)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use `admission_wedge` run one after another, from where the first of them stood,
    the one that ends the wedge last: its engine spins a core, and nothing else should run beside it."""
    users = [i for i in items if ADMISSION_WEDGE in getattr(i, "fixturenames", ())]
    if not users:
        return
    first = items.index(users[0])
    users.sort(key=lambda i: i.get_closest_marker("ends_admission_wedge") is not None)  # stable
    rest = [i for i in items if ADMISSION_WEDGE not in getattr(i, "fixturenames", ())]
    items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The shared admission wedge is stopped right after its last user, not at the session's end."""
    try:
        return (yield)
    finally:
        if _KEPT_WEDGE and (nextitem is None or ADMISSION_WEDGE not in getattr(nextitem, "fixturenames", ())):
            _KEPT_WEDGE[-1].stop()


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    explicit = os.environ.get("WEDGECTL_VLLM_PYTHON")
    if explicit:
        return runtime_python(explicit)
    try:
        return runtime_python()
    except RuntimeMissing as exc:
        if os.environ.get("WEDGECTL_NO_INSTALL"):
            pytest.skip(f"WEDGECTL_NO_INSTALL set: {exc}")
    return install_runtime(
        progress=lambda line: print(f"[wedgectl runtime] {line}", file=sys.stderr)
    )


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    return ensure_tiny_model(vllm_python)


class SharedServer:
    """The session's one stock tiny-model server: started on first use, stopped at the session's end, and
    started again when a test left it dead or not answering /health (the next test still gets a healthy one)."""

    def __init__(self, python: Path, model: Path, logs: Path) -> None:
        self.python, self.model, self.logs = python, model, logs
        self.starts = 0
        self.server: Server | None = None

    def _healthy(self, server: Server) -> bool:
        if server.popen.poll() is not None:
            return False
        try:
            with httpx.Client(timeout=10, trust_env=False) as client:
                return client.get(f"{server.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def get(self) -> Server:
        if self.server is not None and not self._healthy(self.server):
            self.stop()
        if self.server is None:
            self.starts += 1
            spec = ServerSpec(model=self.model, port=free_port())
            self.server = start_server(spec, self.python, self.logs / f"server.{self.starts}.log")
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            stop_server(self.server, grace=10)
            self.server = None


@pytest.fixture(scope="session")
def shared_vllm(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    shared = SharedServer(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm"))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def vllm_server(shared_vllm: SharedServer) -> Server:
    """The shared stock server (see SharedServer): a test may load it, never stop, wedge or modify it."""
    return shared_vllm.get()


ADMISSION_WEDGE = "admission_wedge"
_KEPT_WEDGE: list[KeptWedge] = []


class KeptWedge:
    """`wedgectl repro admission-wedge --keep --json`, run once: a real admission wedge that outlives the
    command (its clients held open by a detached `wedgectl.lab._hold`), shared by the tests that only read it
    (test_repros, test_top_live) and then the one that ends it (test_watch_prometheus). Another repro's name
    keeps that one the same way (test_unprivileged's engine deadlock)."""

    def __init__(self, python: Path, out: Path, name: str = "admission-wedge") -> None:
        proc = subprocess.run([sys.executable, "-m", "wedgectl", "repro", name, "--keep", "--json", "-q",
                               "--python", str(python), "--out", str(out)],
                              capture_output=True, text=True, timeout=480)
        self.confirmed_at = time.time()  # the wedge had begun by then (the repro diagnosed it)
        self.rc = proc.returncode
        try:
            self.out: dict = json.loads(proc.stdout)
        except ValueError:
            pytest.fail(f"repro --keep printed no JSON (rc {proc.returncode}): {proc.stderr[-3000:]}")
        if "pid" not in self.out:  # an error's JSON: say it, and what the command printed on the way
            pytest.fail(f"repro {name} --keep failed (rc {proc.returncode}): {self.out} {proc.stderr[-3000:]}")
        self.pid: int = self.out["pid"]
        self.url: str = self.out["url"]
        self.stopped = False

    def holders(self) -> list[psutil.Process]:
        """The detached processes holding the wedge's requests open."""
        out = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "wedgectl.lab._hold" in cmd and self.url in cmd:
                out.append(p)
        return out

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        holders = self.holders()
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the server runs in a session of its own: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass
        for h in holders:  # they exit once the server is gone; these are ours either way
            try:
                h.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(holders, timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)


@pytest.fixture(scope="session")
def admission_wedge(vllm_python: Path, shared_vllm: SharedServer,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeptWedge]:
    """The session's kept admission wedge (see KeptWedge); stopped after its last user. A test that ends it
    is marked `ends_admission_wedge`, so that it runs after the others.

    The worker's stock server (`vllm_server`, which the wedge's last user watches beside it) is started first:
    started beside the wedge's spinning engine, it took minutes (158 s of set-up, measured), and the engine
    spun all the while."""
    shared_vllm.get()
    wedge = KeptWedge(vllm_python, tmp_path_factory.mktemp("admission-wedge"))
    _KEPT_WEDGE.append(wedge)
    try:
        yield wedge
    finally:
        wedge.stop()
        _KEPT_WEDGE.remove(wedge)


@pytest.fixture(scope="module")
def deadlock_with_report(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeptWedge]:
    """`wedgectl repro engine-deadlock --keep --json`: a real engine deadlock with the engine's report (on in every
    repro), its clients held by a detached holder; root's verdict is the command's JSON (test_unprivileged)."""
    kept = KeptWedge(vllm_python, tmp_path_factory.mktemp("deadlock-report"), "engine-deadlock")
    try:
        yield kept
    finally:
        kept.stop()


@dataclass
class Target:
    """A running test target and the FIFO it announces on ('WORD {json}' lines, see _announce.py)."""

    proc: subprocess.Popen[bytes]
    fd: int
    stderr_path: Path
    buf: bytes = b""
    said: list[tuple[str, dict]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, word: str, timeout: float = 20.0) -> dict:
        """Wait for the target to announce WORD; its JSON payload."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                w, _, payload = line.decode().partition(" ")
                self.said.append((w, json.loads(payload or "{}")))
                if w == word:
                    return self.said[-1][1]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"target {self.pid} never said {word!r} (said {self.said})")
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 0.2))
            if ready:
                chunk = os.read(self.fd, 4096)
                if chunk:
                    self.buf += chunk
                    continue
            if self.proc.poll() is not None:
                err = self.stderr_path.read_text(errors="replace")
                raise RuntimeError(f"target exited {self.proc.returncode} before {word!r}: {err}")
            if ready:  # EOF before any writer connected: don't spin
                time.sleep(0.02)


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    for p in [proc, *kids]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)
    psutil.wait_procs(kids, timeout=5)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Target]]:
    """spawn(script, *args, prefix=(), stdin=DEVNULL) -> Target.

    `script` is a name under tests/targets or a path; `prefix` goes before the interpreter
    (setpriv, ...). The target's stderr goes to a file (a pipe nobody reads could fill and
    block it) and is shown if it exits before announcing.
    """
    started: list[Target] = []

    def start(script: str | Path, *args: str, prefix: tuple[str, ...] = (),
              stdin: int | None = subprocess.DEVNULL) -> Target:
        name = f"{Path(script).name}.{len(started)}"
        fifo = tmp_path / f"{name}.fifo"
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open before the target, so it never blocks
        stderr_path = tmp_path / f"{name}.stderr"
        with stderr_path.open("wb") as err:
            proc = subprocess.Popen(
                [*prefix, sys.executable, str(TARGETS / script), *args, str(fifo)],
                stdin=stdin, stdout=subprocess.DEVNULL, stderr=err, cwd=TARGETS,
                env={**os.environ, "PYTHONPATH": str(TARGETS)},  # scripts written by a test import _announce too
            )
        started.append(Target(proc, fd, stderr_path))
        return started[-1]

    yield start
    for t in started:
        _kill_tree(t.proc)
        os.close(t.fd)
        if t.proc.stdin:
            t.proc.stdin.close()
