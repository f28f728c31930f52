"""The run's check for vLLM servers left behind (tests/conftest.py, "servers left behind"): a real pytest run, in a
subprocess, on a generated test folder whose conftest.py loads this suite's own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_skip_policy import CONFTEST, policy as suite  # the same generated folder's conftest.py


LEAKY = """
import subprocess, time

def test_leaves_one():
    subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 300"])
    time.sleep(0.5)

def test_stops_its_own():
    p = subprocess.Popen(["bash", "-c", "exec -a VLLM::Worker sleep 300"])
    time.sleep(0.5)
    p.kill()
    p.wait()
"""


@pytest.mark.parametrize("parallel", [(), ("-n", "2")])
def test_a_vllm_process_a_run_leaves_behind_fails_it_and_is_stopped(tmp_path: Path, parallel: tuple[str, ...]) -> None:
    """The run's own leftovers only: a process it started that is still a vLLM process at its end (here one that
    takes vLLM's EngineCore title) fails it; one its test stopped does not; and the leftover is killed."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY))
    env = {k: v for k, v in os.environ.items() if k not in (suite.STRICT_ENV, "PYTEST_ADDOPTS")}
    env["WEDGECTL_LEAK_WAIT_S"] = "2"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "2 passed" in r.stdout, r.stdout + r.stderr
    left = [line for line in r.stdout.splitlines() if line.startswith("LEFT RUNNING")]
    assert len(left) == 1 and "VLLM::EngineCore" in left[0], r.stdout
    pid = int(left[0].split()[3].rstrip(":"))
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:  # reaped by init once killed; a zombie until then
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        assert not os.path.exists(f"/proc/{pid}"), "the leftover was not stopped"
