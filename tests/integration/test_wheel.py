"""wedgectl from its wheel, outside the checkout: the probes, the engine plugin's source and a real repro.

The wheel is built from this checkout and installed into a fresh venv under
tmp_path (its dependencies come from the package index, through pip's cache);
every command runs from a directory outside the checkout, with no PYTHONPATH,
so nothing can be imported from the source tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from wedgectl.lab.engine_install import engine_source_hash, engine_version
from wedgectl.model import exitcodes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 300
VENV_TIMEOUT_S = 120
INSTALL_TIMEOUT_S = 600  # the dependencies, from the index or pip's cache
REPRO_TIMEOUT_S = 600


class Installed:
    """A venv holding only the wheel, and a working directory outside the checkout."""

    def __init__(self, venv: Path, cwd: Path) -> None:
        self.venv, self.cwd = venv, cwd
        self.python = venv / "bin" / "python"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{self.env.get('PATH', os.defpath)}"

    def run(self, *argv: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), cwd=self.cwd, env={**self.env, **env}, capture_output=True,
                              text=True, timeout=timeout)

    def wedgectl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(str(self.venv / "bin" / "wedgectl"), *args, timeout=timeout)

    def python_c(self, code: str, timeout: float = 60, **env: str) -> str:
        r = self.run(str(self.python), "-c", code, timeout=timeout, **env)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()


def _checked(argv: list[str], timeout: float, cwd: Path) -> None:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(argv[:4])} ...: {r.stdout[-2000:]}{r.stderr[-2000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    _checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
              "-w", str(dist), str(ROOT)], BUILD_TIMEOUT_S, base)
    (wheel,) = dist.glob("wedgectl-*.whl")
    venv = base / "venv"
    _checked([sys.executable, "-m", "venv", str(venv)], VENV_TIMEOUT_S, base)
    _checked([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
              str(wheel)], INSTALL_TIMEOUT_S, base)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    yield Installed(venv, elsewhere)


def test_the_installed_wheel_imports_nothing_from_the_checkout(installed: Installed) -> None:
    paths = json.loads(installed.python_c(
        "import json, wedgectl, wedgectl.probes, wedgectl._engine, wedgectl.cli; "
        "print(json.dumps([m.__file__ for m in (wedgectl, wedgectl.probes, wedgectl._engine, wedgectl.cli)]))"
    ))
    site = str(installed.venv.resolve())
    assert all(str(Path(p).resolve()).startswith(site) for p in paths), paths
    assert not any(str(Path(p).resolve()).startswith(str(ROOT)) for p in paths), paths


def test_the_wheel_carries_the_whole_engine_plugin_source(installed: Installed) -> None:
    got = installed.python_c("from wedgectl.lab import engine_install as p; print(p.engine_version(), p.engine_source_hash())")
    assert got == f"{engine_version()} {engine_source_hash()}"  # the same files as the checkout's engine/


def test_the_wheel_carries_the_runbooks_watch_serves(installed: Installed) -> None:
    """The alert rules link to the watcher's /runbooks/: each page they name is in the wheel, as in docs/."""
    got = json.loads(installed.python_c(
        "import json; from wedgectl.watch.exposition import runbook; "
        "print(json.dumps({n: (runbook(n) or b'').decode() for n in "
        "('hang-admission-wedge.md', 'runbook-watch.md', 'design.md')}))"))
    assert got["hang-admission-wedge.md"] == (ROOT / "docs" / "hang-admission-wedge.md").read_text()
    assert got["runbook-watch.md"] == (ROOT / "docs" / "runbook-watch.md").read_text()
    assert got["design.md"] == ""  # not a runbook: not served


def test_the_wheel_installs_the_engine_plugin_into_a_python(installed: Installed, tmp_path: Path) -> None:
    # The wheel's own venv stands in for a server's environment: the plugin needs no vLLM to install.
    installed.python_c(
        "import sys; from pathlib import Path; from wedgectl.lab.engine_install import ensure_engine_plugin; "
        "ensure_engine_plugin(Path(sys.executable), print)",
        timeout=400, WEDGECTL_CACHE=str(tmp_path / "cache"),
    )
    got = installed.python_c(
        "import importlib.metadata as m; "
        "eps = [e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'wedge_engine']; "
        "import wedge_engine.fixes.watchdog as w; print(m.version('wedgectl-engine'), eps, w.__name__)"
    )
    assert got == f"{engine_version()} ['wedge_engine.plugin:register'] wedge_engine.fixes.watchdog"


def test_probes_from_the_wheel_say_what_the_checkout_says(installed: Installed) -> None:
    wheel = installed.wedgectl("probes", "--json")
    checkout = subprocess.run([sys.executable, "-m", "wedgectl", "probes", "--json"], capture_output=True,
                              text=True, timeout=120)
    assert wheel.returncode in (0, 3), wheel.stderr  # 0 an eBPF back-end can run, 3 only /proc
    assert wheel.returncode == checkout.returncode, (wheel.stderr, checkout.stderr)
    assert json.loads(wheel.stdout)["chosen"] == json.loads(checkout.stdout)["chosen"]
    text = installed.wedgectl("probes")
    assert text.returncode == wheel.returncode
    assert "procfs" in text.stdout  # the fallback is always listed, with why the others can or cannot run


def test_repro_from_the_wheel_and_exit_41_on_a_verdict_that_does_not_match(installed: Installed, vllm_python: Path,
                                                                          tmp_path: Path) -> None:
    """A real repro from the wheel: an idle server whose config expects an admission wedge. The run is whole
    (the server started, the capture diagnosed it idle, the bundle saved, the server torn down) and its exit is
    41, the documented code of a verdict that does not match (tests/test_exit_codes.py: the other 41). One
    server start serves both: the wheel's repro and the live exit 41 (test_exit_codes_live.py's others)."""
    # vllm_python: the managed runtime in the wedgectl cache, which the wheel's wedgectl finds by itself.
    cfg = tmp_path / "idle-expects-a-wedge.toml"
    cfg.write_text('name = "idle-expects-a-wedge"\nexpected = "admission_wedge"\n'
                   'description = "an idle server, whose repro expects an admission wedge"\n\n'
                   '[symptom]\nuntil = "idle"\ntimeout_s = 30\nsettle_s = 1\n')
    out = tmp_path / "out"
    r = installed.wedgectl("repro", str(cfg), "--json", "--quiet", "--out", str(out), timeout=REPRO_TIMEOUT_S)
    assert r.returncode == exitcodes.REPRO_FAILED == 41, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stdout.strip(), r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert (result["verdict"], result["expected"]) == ("idle", "admission_wedge"), result["summary"]
    assert isinstance(result["pid"], int) and result["url"].startswith("http://127.0.0.1:")
    assert Path(result["bundle"]) == out / "bundle.tar.gz" and Path(result["bundle"]).is_file()
    # torn down all the same
    assert not psutil.pid_exists(result["pid"]) or psutil.Process(result["pid"]).status() == psutil.STATUS_ZOMBIE
