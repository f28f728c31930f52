"""The wedge_engine plugin as wedgectl carries it: its source, its install into a server's python, and "fixes on".

The plugin is its own distribution (`wedgectl-engine`, import name
`wedge_engine`), installed into the *server's* environment, never into
wedgectl's. wedgectl's wheel carries its source as the package
`wedgectl._engine` (top-level `engine/` in a checkout), so `repro`, `patched`
and `swap` can build and install it from a wheel install as from a clone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from wedgectl.model import exitcodes
from wedgectl.collect.target import Credentials, PopenUser
from wedgectl.model.errors import WedgectlError
from wedgectl.collect.control import ChildTimeout, Finished, Stream, run_bounded

DISTRIBUTION = "wedgectl-engine"
SOURCE_PACKAGE = "wedgectl._engine"

# "The fixes on": what turns every wedge_engine fix on in a server. swap adds
# only this (a deployment's own per-fix settings stay); repro --patched adds
# patched_env()'s bounds as well.
FIXES_ENV = {"WEDGE_ENGINE_FIXES": "all"}
# The engine's own report alone (no fix): stage, scheduler summary, request samples (engine/README.md).
REPORT_ENV = {"WEDGE_ENGINE_REPORT": "1"}
# Variables that make the plugin do something: the fixes, and a repro's injected fault.
ACTIVE_ENV = ("WEDGE_ENGINE_FIXES", "WEDGE_ENGINE_FAULT")

# Bounds a patched repro server runs with. The watchdog limit is small so a repro
# ends quickly, and larger than any healthy gap between model steps here.
WATCHDOG_S = 8.0
SHUTDOWN_S = 10.0

PIP_TIMEOUT_S = 300
PROBE_TIMEOUT_S = 60
# How the server's interpreter is run: by its absolute path, from "/", never from wedgectl's own
# folder: with -c or -m it would first import what anyone planted there (csv.py, sitecustomize.py,
# a pip/ package), as whoever it runs as. pip, and the question where it installs, run isolated
# (-I: no working folder on sys.path, no PYTHON* variables, no user site-packages), so pip installs
# into the interpreter's own prefix, the site-packages swapsafety.path_risk checked, never into a
# user site or a PYTHONPATH folder nothing checked. The question which plugin the server has is
# asked with the server's own environment (its PYTHONPATH and user site count: the server imports
# from them) and PYTHONSAFEPATH=1 (-P from Python 3.11, where `-P` itself would fail on 3.10; there
# the folder first on sys.path is "/", which only root can write).
ISOLATED = "-I"
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}
NEUTRAL_CWD = "/"
# Copied from the source into the build folder; what pip leaves behind is not.
_SOURCE_SUFFIXES = (".py", ".toml", ".md")
_SKIP_NAMES = ("build", "__pycache__")


class PluginInstallError(WedgectlError):
    exit_code = exitcodes.REPRO_FAILED


def patched_env(watchdog_s: float = WATCHDOG_S, shutdown_s: float = SHUTDOWN_S) -> dict[str, str]:
    """The fixes on, with the watchdog and shutdown bounds a patched repro checks against."""
    return {
        **FIXES_ENV,
        "WEDGE_ENGINE_WATCHDOG_S": f"{watchdog_s:g}",
        "WEDGE_ENGINE_SHUTDOWN_S": f"{shutdown_s:g}",
    }


# ------------------------------------------------------------------ the packaged source


def engine_source() -> Traversable:
    """The plugin's source tree (pyproject.toml, wedge_engine/) as this wedgectl carries it."""
    return resources.files(SOURCE_PACKAGE)


def _source_files(root: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    """(relative path, file) for every source file under root, in a stable order."""
    for item in sorted(root.iterdir(), key=lambda t: t.name):
        if item.name in _SKIP_NAMES or item.name.endswith(".egg-info"):
            continue
        rel = f"{prefix}{item.name}"
        if item.is_dir():
            yield from _source_files(item, rel + "/")
        elif item.name.endswith(_SOURCE_SUFFIXES):
            yield rel, item


def engine_version(source: Traversable | None = None) -> str:
    """The version in the carried source's pyproject.toml; "" when unreadable."""
    source = source or engine_source()
    try:
        data = tomllib.loads(source.joinpath("pyproject.toml").read_text())
        return str(data["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return ""


def engine_source_hash(source: Traversable | None = None) -> str:
    """A digest of the plugin's sources: a change reinstalls it even at the same version."""
    h = hashlib.sha256()
    for rel, item in _source_files(source or engine_source()):
        if rel.endswith((".py", ".toml")):
            h.update(rel.encode())
            h.update(item.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ the install


def interpreter(python: str | os.PathLike[str]) -> str:
    """`python` as the absolute path every run uses: resolved once here, never looked up again on a
    PATH or against another working folder (a relative one is the caller's, as given)."""
    return os.path.abspath(os.fspath(python))


def run_python(python: str | os.PathLike[str], args: list[str], *, timeout: float,
               env: dict[str, str] | None = None, run_as: Credentials | None = None,
               isolated: bool = True) -> Finished:
    """Run the server's interpreter by its absolute path, from NEUTRAL_CWD, as `run_as` when given:
    isolated (-I), or with `env` (os.environ when None) and SAFE_PATH_ENV. OSError or ChildTimeout
    as run_bounded."""
    if not isolated:
        env = {**(os.environ if env is None else env), **SAFE_PATH_ENV}
    return run_bounded([interpreter(python), *([ISOLATED] if isolated else []), *args], timeout=timeout,
                       env=env, stdin=Stream.NULL, cwd=NEUTRAL_CWD, **_as(run_as))


def installed_version(python: str | os.PathLike[str], env: dict[str, str] | None = None,
                      run_as: Credentials | None = None) -> str:
    """The plugin version `python`'s environment has, as the server with `env` would import it; "" when
    none. OSError or ChildTimeout when the interpreter cannot be asked. `run_as`: the server's user,
    so its code never runs as root."""
    r = run_python(python, ["-c", f"import importlib.metadata as m; print(m.version({DISTRIBUTION!r}))"],
                   timeout=PROBE_TIMEOUT_S, env=env, run_as=run_as, isolated=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def install_dir(python: str | os.PathLike[str], env: dict[str, str] | None = None,
                run_as: Credentials | None = None) -> str:
    """Where pip (isolated) installs into `python`'s environment (its purelib); "" when it cannot be asked."""
    try:
        r = run_python(python, ["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       timeout=PROBE_TIMEOUT_S, env=env, run_as=run_as)
    except (OSError, ChildTimeout):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def recorded_version(python: str | os.PathLike[str]) -> tuple[str, str]:
    """(version, where) of the plugin's dist-info beside a venv's `python`, read without running it;
    ("", what was looked at) when none is found there."""
    prefix = Path(python).parent.parent
    lib = prefix / "lib"
    try:
        site_dirs = sorted(lib.glob("python3*/site-packages")) + sorted(lib.glob("python3*/dist-packages"))
        for site in site_dirs:
            for info in sorted(site.glob("wedgectl_engine-*.dist-info")):
                for line in (info / "METADATA").read_text(errors="replace").splitlines()[:20]:
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip(), str(site)
    except OSError:
        pass
    return "", f"{lib}/python3*/site-packages"


def _as(run_as: Credentials | None) -> PopenUser:
    return run_as.popen_kwargs if run_as is not None else {}


def _marker(python: Path) -> Path:
    """Where we note which plugin sources were installed into that interpreter's environment."""
    from wedgectl.lab.runtime.install import cache_dir

    key = hashlib.sha256(str(Path(python).absolute()).encode()).hexdigest()[:16]
    return cache_dir() / "engine-installed" / f"{key}.txt"


def ensure_engine_plugin(python: Path, progress: Callable[[str], None], env: dict[str, str] | None = None,
                         run_as: Credentials | None = None) -> None:
    """Install the carried plugin into the server's environment unless that exact source is there.

    With `run_as` (the server's user) the interpreter and pip run as that user, never as root,
    with `env` (the server's environment, less what makes the plugin act). Both run from "/", by the
    interpreter's absolute path, pip isolated (run_python).
    """
    python = Path(interpreter(python))
    marker = _marker(python)
    marker.parent.mkdir(parents=True, exist_ok=True)
    # One install at a time into one environment: two repros started together would otherwise both
    # --force-reinstall, one pip removing the files the other's server is importing.
    with _locked(marker.with_suffix(".lock"), PIP_TIMEOUT_S + 60):
        _ensure_locked(python, marker, progress, env, run_as)


@contextmanager
def _locked(path: Path, wait_s: float) -> Iterator[None]:
    """An exclusive flock on `path` (created 0600), waited for at most `wait_s`: past it, PluginInstallError."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PluginInstallError(f"another install of the engine plugin held {path} for over "
                                             f"{wait_s:.0f} s") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def _ensure_locked(python: Path, marker: Path, progress: Callable[[str], None], env: dict[str, str] | None,
                   run_as: Credentials | None) -> None:
    source = engine_source()
    want = engine_version(source)
    digest = engine_source_hash(source)
    noted = marker.read_text().strip() if marker.exists() else ""
    if (installed_version(python, env, run_as) == want and noted == digest
            and not os.environ.get("WEDGECTL_REINSTALL_ENGINE")):
        return
    if not want:
        raise PluginInstallError(f"this wedgectl carries no engine plugin source ({SOURCE_PACKAGE}); "
                                 f"install {DISTRIBUTION} into {python}'s environment")
    progress(f"installing the engine plugin into {python}")
    with tempfile.TemporaryDirectory(prefix="wedge-engine-") as tmp:
        # Build from a copy: pip leaves build/ and egg-info behind in the folder it builds,
        # and an installed wheel's folder may not be writable.
        build = Path(tmp) / "engine"
        for rel, item in _source_files(source):
            dest = build / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(item.read_bytes())
        if run_as is not None and run_as.popen_kwargs:
            _hand_over(Path(tmp), run_as)  # pip, as the server's user, writes build/ beside the copy
        try:
            r = run_python(python, ["-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "--force-reinstall",
                                    str(build)], timeout=PIP_TIMEOUT_S, env=env, run_as=run_as)
        except ChildTimeout:
            raise PluginInstallError(f"pip did not install the engine plugin within {PIP_TIMEOUT_S} s") from None
    if r.returncode != 0:
        raise PluginInstallError(f"pip could not install the engine plugin: {r.stderr.strip().splitlines()[-1:]}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(digest + "\n")


def _hand_over(root: Path, run_as: Credentials) -> None:
    """Give a private build folder (ours, fresh, no links) to the user pip runs as."""
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            os.chown(name, run_as.uid, run_as.gid, follow_symlinks=False)
