"""How the README's test command shares its workers (tests/conftest.py, "parallel runs"): at most
SERVER_WORKERS of them in a unit that drives a vLLM server at once, the others on the rest meanwhile.

The run below is a real `pytest -n 3 --dist loadgroup`, in a subprocess, on a generated test folder whose
conftest.py loads this suite's own: its "server" modules use a fixture the suite counts as a server's
(`vllm_python`, here a stand-in that returns None), and every test logs when it ran."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _load_conftest():
    spec = importlib.util.spec_from_file_location("wedgectl_tests_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


suite = _load_conftest()
S = suite.SERVER_UNIT


@pytest.mark.parametrize(("queue", "holds", "elsewhere", "want"), [
    ([f"{S}a", "u"], False, 0, f"{S}a"),   # a free slot: the queue's order
    ([f"{S}a", "u"], False, 1, f"{S}a"),
    ([f"{S}a", "u"], False, 2, "u"),        # both slots taken: the first unit that is not a server's
    ([f"{S}a", f"{S}b"], False, 2, None),   # nothing it may take now
    ([f"{S}a", "u"], True, 2, f"{S}a"),     # it holds one already: taking another adds no server
    ([], False, 0, None),
])
def test_next_unit(queue: list[str], holds: bool, elsewhere: int, want: str | None) -> None:
    assert suite.next_unit(queue, holds, elsewhere, 2) == want


CONFTEST = f"""
import importlib.util, sys
import pytest
spec = importlib.util.spec_from_file_location("wedgectl_tests_conftest", {str(TESTS / "conftest.py")!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
pytest_configure = module.pytest_configure
pytest_collection_modifyitems = module.pytest_collection_modifyitems
pytest_xdist_make_scheduler = module.pytest_xdist_make_scheduler

@pytest.fixture
def vllm_python():
    return None
"""

TEST = """
import json, os, time

def _log(name, unit, began):
    with open(os.environ["UNITS_LOG"], "a") as f:
        f.write(json.dumps({{"test": name, "unit": unit, "began": began, "ended": time.monotonic(),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER")}}) + "\\n")

{tests}
"""

SERVER_TEST = """
def test_{n}(vllm_python):
    began = time.monotonic()
    time.sleep(1.0)
    _log("{module}::{n}", "server", began)
"""

LIGHT_TEST = """
def test_{n}():
    began = time.monotonic()
    time.sleep(0.3)
    _log("{module}::{n}", "light", began)
"""


def test_three_workers_run_two_server_units_at_most_and_the_rest_beside_them(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for m in range(4):
        module = f"test_server_{m}"
        body = "".join(SERVER_TEST.format(n=n, module=module) for n in range(2))
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(TEST.format(tests=body)))
    for m in range(4):
        module = f"test_light_{m}"
        body = "".join(LIGHT_TEST.format(n=n, module=module) for n in range(3))
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(TEST.format(tests=body)))
    log = tmp_path / "units.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in (suite.STRICT_ENV, "PYTEST_ADDOPTS")}
    env["UNITS_LOG"] = str(log)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", "--dist",
                        "loadgroup"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "20 passed" in r.stdout, r.stdout
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 20

    def overlapping(run: dict, others: list[dict]) -> list[dict]:
        return [o for o in others if o is not run and o["began"] < run["ended"] and run["began"] < o["ended"]]

    servers = [r for r in runs if r["unit"] == "server"]
    lights = [r for r in runs if r["unit"] == "light"]
    # never three server tests at once, and two at times (the cap is two, not one)
    events = sorted([(r["began"], 1) for r in servers] + [(r["ended"], -1) for r in servers])  # ends first on ties
    at_once = peak = 0
    for _, step in events:
        at_once += step
        peak = max(peak, at_once)
    assert peak == suite.SERVER_WORKERS, runs
    # a module is one unit: its tests ran on one worker
    for m in range(4):
        assert len({r["worker"] for r in runs if r["test"].startswith(f"test_server_{m}::")}) == 1
    # and the light tests ran while server units did, not after them all
    last_server_start = max(r["began"] for r in servers)
    assert any(overlapping(run, servers) for run in lights)
    assert min(r["began"] for r in lights) < last_server_start
