"""Session fixtures for tests that drive a real vLLM server.

`vllm_python` finds the runtime: $WEDGECTL_VLLM_PYTHON (any existing vLLM
environment, e.g. a GPU host's) or the managed CPU runtime, installed on first
use (~80 s, ~3.4 GB under the wedgectl cache; WEDGECTL_NO_INSTALL=1 skips the
tests instead). `vllm_server` is one tiny-model server shared by the session:
tests must not stop it or leave it wedged; a test that needs its own server
(custom flags, a plugin, a hang) starts one with `running_server`.

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

import psutil
import pytest

from wedgectl.lab.runtime import (
    RuntimeMissing,
    Server,
    ServerSpec,
    ensure_tiny_model,
    free_port,
    install_runtime,
    running_server,
    runtime_python,
)

TARGETS = Path(__file__).resolve().parents[1] / "targets"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "integration: drives real processes (a real vLLM server, py-spy, /proc)",
    )


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


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    spec = ServerSpec(model=tiny_model, port=free_port())
    with running_server(spec, vllm_python, log_path) as server:
        yield server


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
