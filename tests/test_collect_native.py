"""py-spy --native gets the time native unwinding takes on a loaded host (seam: the command runner)."""

from __future__ import annotations

import os
import subprocess

from wedgectl.collect import pyspy


def _runner(seen: dict):
    def run(cmd, **kwargs):
        seen.update(cmd=cmd, timeout=kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, 0, stdout="[]", stderr="")
    return run


def test_native_dump_waits_longer_and_is_not_nonblocking():
    seen: dict = {}
    pyspy.dump_stacks(os.getpid(), native=True, nonblocking=False, runner=_runner(seen))
    assert seen["timeout"] == pyspy.NATIVE_TIMEOUT_S and "--native" in seen["cmd"] and "--nonblocking" not in seen["cmd"]


def test_python_dump_keeps_its_short_bound():
    seen: dict = {}
    pyspy.dump_stacks(os.getpid(), runner=_runner(seen))
    assert seen["timeout"] == 5.0 and "--nonblocking" in seen["cmd"]
