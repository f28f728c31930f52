"""The managed runtime's vLLM server: what to serve and with which flags and environment.

Starting, health-waiting and stopping are `wedgectl.lab.lifecycle`'s; this module
turns a `ServerSpec` into the command it starts.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from wedgectl.lab.lifecycle import Command, Server, running, start_server as start_command
from wedgectl.lab.runtime.install import cache_dir
from wedgectl.lab.runtime.traits import Traits, traits_of

SERVE_SCRIPT = Path(__file__).with_name("_serve.py")

# Flags that make the tiny model serve on a small CPU box and start quickly.
# --block-size: CPU attention needs a multiple of 32 (16 fails with
#   "No common block size").
# --enforce-eager: skips torch.compile and its warm-up. Time to /health on
#   2 cores, tiny model: 43 s cold / 27 s warm (compile cache filled) without
#   it, 22 s / 17 s with it; generation speed is about the same.
# --max-model-len 512: small KV footprint; the tiny model allows 4096.
CPU_SERVE_DEFAULTS: tuple[str, ...] = (
    "--dtype", "bfloat16",
    "--block-size", "32",
    "--max-model-len", "512",
    "--enforce-eager",
)


@dataclass(frozen=True)
class ServerSpec:
    """What to serve and how. `extra_args` come last, so they override defaults."""

    model: Path
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "tiny"
    defaults: tuple[str, ...] = CPU_SERVE_DEFAULTS
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve_args(spec: ServerSpec) -> list[str]:
    """argv after the interpreter and _serve.py."""
    return [
        "serve", str(spec.model),
        "--host", spec.host,
        "--port", str(spec.port),
        "--served-model-name", spec.served_model_name,
        *spec.defaults,
        *spec.extra_args,
    ]


def server_env(
    spec: ServerSpec,
    tmp_dir: Path,
    base: Mapping[str, str] | None = None,
    traits: Traits | None = None,
) -> dict[str, str]:
    """The server's environment: `base`, offline and CPU defaults, then spec.env.

    A setting that only some releases accept is set only where `traits` (read from the environment's
    vLLM source) says this one does; without traits, vLLM's own default stands."""
    env = dict(os.environ if base is None else base)
    defaults = {
        # vLLM writes a torch.compile cache under ~/.cache/vllm otherwise.
        "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # GiB of KV cache on CPU; the default (4+) is far more than needed.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
    }
    if traits is not None and traits.omp_nobind:
        # "auto" pins every server's Worker to the same core (core 0 of 2
        # here), so two servers on one box starve each other; one unpinned
        # thread is all the tiny model needs. (0.20.0 fails to start with it.)
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    for key, value in defaults.items():
        env.setdefault(key, value)
    # Log lines must reach the file as they are written: other tools tail it.
    env["PYTHONUNBUFFERED"] = "1"
    # The server starts in the caller's folder, and the processes vLLM spawns run `python -c`, which puts
    # that folder first on sys.path: never import from it (Python 3.11+; _serve.py drops its own folder).
    env["PYTHONSAFEPATH"] = "1"
    # vLLM leaves /tmp/vllm_dist_* files behind; give it a folder we remove.
    env["TMPDIR"] = str(tmp_dir)
    env.update(spec.env)
    return env


def server_command(
    spec: ServerSpec, python: str | os.PathLike[str], log_path: str | os.PathLike[str]
) -> Command:
    """The command that serves `spec` with the runtime's `python`, with a fresh TMPDIR of its own."""
    # Short path on purpose: ZMQ ipc:// socket paths live here (108-byte limit).
    tmp_dir = Path(tempfile.mkdtemp(prefix="wedgectl-vllm-"))
    return Command(
        argv=(str(python), str(SERVE_SCRIPT), *serve_args(spec)),
        env=server_env(spec, tmp_dir, traits=traits_of(python)),
        url=spec.url,
        log_path=Path(log_path),
        tmp_dir=tmp_dir,
    )


def start_server(
    spec: ServerSpec,
    python: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    health_timeout: float = 180,
    progress: Callable[[str], None] | None = None,
) -> Server:
    """Launch vLLM and return once GET /health answers 200.

    Raises lifecycle.ServerStartError (after tearing the tree down) if the
    process exits first or its log stays silent for `health_timeout` seconds
    (see lifecycle.wait_healthy); `progress` hears every 30 s how it goes.
    """
    return start_command(server_command(spec, python, log_path), health_timeout, progress)


def running_server(
    spec: ServerSpec,
    python: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    health_timeout: float = 180,
    grace: float = 10,
) -> contextlib.AbstractContextManager[Server]:
    """A started server for the length of a with-block, stopped however the block ends."""
    return running(server_command(spec, python, log_path), health_timeout, grace)
