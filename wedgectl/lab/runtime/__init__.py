"""The managed vLLM runtime: venv install, tiny-model generator, the server it serves (started by lifecycle)."""

from wedgectl.lab.runtime.install import (
    RuntimeInstallError,
    RuntimeMissing,
    cache_dir,
    install_runtime,
    runtime_dir,
    runtime_python,
)
from wedgectl.lab.lifecycle import Server, ServerStartError, stop_server
from wedgectl.collect.control import free_port
from wedgectl.lab.runtime.launcher import ServerSpec, running_server, start_server
from wedgectl.lab.runtime.tinymodel import ModelBuildError, ensure_tiny_model

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
