"""The managed vLLM runtime: venv install, tiny-model generator, the server it serves (started by lifecycle)."""

from wedgectl.runtime.install import (
    RuntimeInstallError,
    RuntimeMissing,
    cache_dir,
    install_runtime,
    runtime_dir,
    runtime_python,
)
from wedgectl.lifecycle import Server, ServerStartError, free_port, stop_server
from wedgectl.runtime.launcher import ServerSpec, running_server, start_server
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
