"""The lanes of a parallel run (tests/conftest.py, LaneScheduling): real pytest runs under xdist, in a subprocess,
on a generated folder whose conftest.py loads this suite's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from test_skip_policy import CONFTEST, policy as suite

LANES_CONFTEST = CONFTEST + "pytest_xdist_make_scheduler = module.pytest_xdist_make_scheduler\n"

# each test notes the worker it ran on and when; the integration ones last long enough for the units to run beside
# them. Two units keep a "spinning hang" (fixtures named as the suite's are): the wedge's two tests, the collective's.
# The integration tests that ask for `vllm_python` (directly or through a fixture) are the ones on a vLLM server;
# the light ones ask for none.
RECORD = """
import json, os, time
import pytest

def record(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["LANES_OUT"], "a") as out:
        out.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"], start, time.monotonic()]) + "\\n")

@pytest.fixture(scope="session")
def vllm_python():
    return "python"

@pytest.fixture(scope="session")
def shared_vllm(vllm_python):
    return "stock"

@pytest.fixture(scope="session")
def admission_wedge(shared_vllm):
    return "wedge"

@pytest.fixture(scope="module")
def hung_tp2(vllm_python):
    return "tp2"
"""
def kept_hang_module(fixture: str, *names: str) -> str:
    """A generated integration module whose tests all use one kept-hang fixture, each noting `name`."""
    tests = "".join(f"def test_{name}({fixture}):\n    record({name!r}, 1.0)\n\n" for name in names)
    return "import pytest\nfrom conftest import record\npytestmark = pytest.mark.integration\n\n" + tests


def _run(tmp_path: Path, *args: str, workers: str | None) -> tuple[subprocess.CompletedProcess[str], list]:
    (tmp_path / "conftest.py").write_text(LANES_CONFTEST + textwrap.dedent(RECORD))
    (tmp_path / "test_live.py").write_text("import pytest\nfrom conftest import record\n"
                                           "pytestmark = pytest.mark.integration\n" +
                                           "".join(f"def test_i{n}(vllm_python):\n    record('i{n}', 1.0)\n"
                                                   for n in range(4)) +
                                           # a parametrized one, a unit of its own: xdist's scope is its whole id
                                           "@pytest.mark.parametrize('k', [4, 5])\n"
                                           "def test_p(k, vllm_python):\n    record(f'i{k}', 1.0)\n")
    (tmp_path / "test_stock.py").write_text("import pytest\nfrom conftest import record\n"
                                            "pytestmark = pytest.mark.integration\n" +
                                            "".join(f"def test_s{n}(shared_vllm):\n    record('s{n}', 0.5)\n"
                                                    for n in range(3)))
    (tmp_path / "test_light.py").write_text("import pytest\nfrom conftest import record\n"
                                            "pytestmark = pytest.mark.integration\n" +
                                            "".join(f"def test_l{n}():\n    record('l{n}', 0.2)\n" for n in range(2)))
    (tmp_path / "test_spinning.py").write_text(kept_hang_module("admission_wedge", "w0", "w1"))
    (tmp_path / "test_collective.py").write_text(kept_hang_module("hung_tp2", "c0", "c1"))
    for m in range(4):
        (tmp_path / f"test_unit{m}.py").write_text("from conftest import record\n" + "".join(
            f"def test_u{m}_{n}():\n    record('u{m}_{n}', 0.1)\n" for n in range(2)))
    out = tmp_path / "lanes.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in (suite.LANES_ENV, "PYTEST_ADDOPTS")}
    env["LANES_OUT"] = str(out)
    if workers is not None:
        env[suite.LANES_ENV] = workers
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--dist", "loadgroup", *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ran = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return r, ran


def _where(ran: list) -> dict[str, str]:
    return {name: worker for name, worker, _start, _end in ran}


def _span(ran: list, prefix: str) -> tuple[float, float]:
    times = [(start, end) for name, _worker, start, end in ran if name.startswith(prefix)]
    return min(t[0] for t in times), max(t[1] for t in times)


def test_integration_units_keep_to_their_workers_and_the_units_run_beside_them(tmp_path: Path) -> None:
    r, ran = _run(tmp_path, "-n", "3", workers="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "23 passed" in r.stdout
    where = _where(ran)
    integration = [f"i{n}" for n in range(6)] + ["w0", "w1", "c0", "c1", "s0", "s1", "s2"]
    assert {where[name] for name in integration} == {"gw0"}  # one lane for the integration units on vLLM
    units = {where[f"u{m}_{n}"] for m in range(4) for n in range(2)}
    assert units <= {"gw0", "gw1", "gw2"} and units & {"gw1", "gw2"}, ran  # the unit tests beside them
    # the light integration units go to the unit lanes once their unit tests are out (gw0 has 10 s of work before it
    # would reach them)
    assert {where["l0"], where["l1"]} & {"gw1", "gw2"}, ran


def test_two_integration_workers_by_default(tmp_path: Path) -> None:
    r, ran = _run(tmp_path, "-n", "4", workers=None)
    assert r.returncode == 0, r.stdout + r.stderr
    where = _where(ran)
    integration = [f"i{n}" for n in range(6)] + ["c0", "c1"]
    stock = ["s0", "s1", "s2", "w0", "w1"]  # the wedge's tests are on the stock server too, as the suite's are
    assert {where[name] for name in integration + stock} == {"gw0", "gw1"}, ran  # both integration workers, only
    assert {where[name] for name in stock} == {"gw0"}, ran  # one stock server for the run: the first worker's
    assert {where["l0"], where["l1"]} <= {"gw0", "gw1", "gw2", "gw3"}, ran  # the light ones ran, on any worker
    assert suite.integration_workers({}) == suite.INTEGRATION_WORKERS == 2
    # the two spinning hangs' units never ran at the same time, though two workers took integration units
    wedge, collective = _span(ran, "w"), _span(ran, "c")
    assert wedge[1] <= collective[0] or collective[1] <= wedge[0], (wedge, collective)


def test_a_bad_number_of_integration_workers_is_a_usage_error(tmp_path: Path) -> None:
    r, ran = _run(tmp_path, "-n", "2", workers="none")
    assert r.returncode == 4 and ran == [], r.stdout + r.stderr
    assert "WEDGECTL_INTEGRATION_WORKERS must be a whole number of workers, not 'none'" in r.stderr


def test_a_long_node_id_gives_a_short_unit_name_of_its_own() -> None:
    # a hostile-input test's 100 KB parameter: xdist puts the group in PYTEST_CURRENT_TEST beside the node id, and
    # two 100 KB copies in one environment string pass exec's limit (128 KiB) for every process the test starts
    a, b = "tests/test_x.py::test_y[" + "[" * 100_000 + "]", "tests/test_x.py::test_y[" + "[" * 99_999 + "]"
    assert len(suite.bounded(a)) < 2 * suite.UNIT_NAME_MAX and suite.bounded(a) != suite.bounded(b)
    assert suite.bounded("tests/test_x.py::test_y[1]") == "tests/test_x.py::test_y[1]"
