"""The managed vLLM runtime: venv install, tiny-model generator, server launcher."""

from wedgectl.runtime.install import (
    RuntimeInstallError,
    RuntimeMissing,
    cache_dir,
    install_runtime,
    runtime_dir,
    runtime_python,
)
from wedgectl.runtime.launcher import (
    Server,
    ServerSpec,
    ServerStartError,
    free_port,
    running_server,
    start_server,
    stop_server,
)
from wedgectl.runtime.tinymodel import ModelBuildError, ensure_tiny_model

__all__ = [
    "ModelBuildError",
    "RuntimeInstallError",
    "RuntimeMissing",
    "Server",
    "ServerSpec",
    "ServerStartError",
    "cache_dir",
    "ensure_tiny_model",
    "free_port",
    "install_runtime",
    "running_server",
    "runtime_dir",
    "runtime_python",
    "start_server",
    "stop_server",
]
