"""Session fixtures for tests that drive a real vLLM server.

`vllm_python` finds the runtime: $WEDGECTL_VLLM_PYTHON (any existing vLLM
environment, e.g. a GPU host's) or the managed CPU runtime, installed on first
use (~80 s, ~3.4 GB under the wedgectl cache; WEDGECTL_NO_INSTALL=1 skips the
tests instead). `vllm_server` is one tiny-model server shared by the session:
tests must not stop it or leave it wedged; a test that needs its own server
(custom flags, a plugin, a hang) starts one with `running_server`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from wedgectl.runtime import (
    RuntimeMissing,
    Server,
    ServerSpec,
    ensure_tiny_model,
    free_port,
    install_runtime,
    running_server,
    runtime_python,
)


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
            pytest.skip(str(exc))
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
