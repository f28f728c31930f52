"""diagnose's low priority: nice +NICE and the idle I/O class, given back when the kernel keeps it
off a CPU too long (sampler.restore_priority_if_starved). Each case runs in a child: priorities
are per process, and the test run must not be left niced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, os, sys
from wedgectl import sampler
from wedgectl.collect import procfs
start = os.getpriority(os.PRIO_PROCESS, 0)
delays = iter(json.loads(sys.argv[1]))
real = procfs.own_run_delay_s()
procfs.own_run_delay_s = lambda: next(delays)
problems = sampler.lower_priority()
out = {"start": start, "real_delay": real, "problems": problems, "after_lower": os.getpriority(os.PRIO_PROCESS, 0),
       "said": [], "nice": []}
for _ in range(int(sys.argv[2])):
    out["said"].append(sampler.restore_priority_if_starved())
    out["nice"].append(os.getpriority(os.PRIO_PROCESS, 0))
print(json.dumps(out))
"""


def run(delays: list[float], checks: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(delays), str(checks)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_capture_that_waits_too_long_for_a_cpu_gets_its_priority_back():
    from wedgectl.sampler import NICE, STARVED_S

    # run delay at lower_priority, then at three checks: under the limit, over it, later still
    out = run([10.0, 10.0 + STARVED_S / 2, 10.0 + STARVED_S + 0.5, 30.0], 3)
    assert isinstance(out["real_delay"], float) and out["real_delay"] >= 0  # the kernel's figure is read
    assert out["after_lower"] == out["start"] + NICE and not out["problems"]
    assert out["said"][0] is None and out["nice"][0] == out["start"] + NICE  # not yet: still below the server
    if os.geteuid() == 0:  # CAP_SYS_NICE: a nice can be lowered again
        assert "back at nice" in out["said"][1] and out["nice"][1] == out["start"]
    else:
        assert "could not return" in out["said"][1] and out["nice"][1] == out["start"] + NICE
    assert out["said"][2] is None and out["nice"][2] == out["nice"][1]  # asked once


def test_a_capture_that_gets_its_share_stays_below_the_server():
    from wedgectl.sampler import NICE

    out = run([5.0, 5.1, 5.2, 5.3], 3)
    assert out["said"] == [None, None, None] and out["nice"] == [out["start"] + NICE] * 3


def test_the_nice_is_given_back_once_the_target_is_sampled():
    # diagnose gives it back after the capture: classify, print and exit are its own work
    code = ("import os; from wedgectl import sampler; s = os.getpriority(os.PRIO_PROCESS, 0); sampler.lower_priority(); "
            "low = os.getpriority(os.PRIO_PROCESS, 0); err = sampler.restore_priority(); "
            "print(low - s, os.getpriority(os.PRIO_PROCESS, 0) - s, err, sampler.restore_priority(), sep='|')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    from wedgectl.sampler import NICE

    low, back, err, again = r.stdout.strip().split("|")
    assert int(low) == NICE and again == "None"
    assert (int(back), err) == ((0, "None") if os.geteuid() == 0 else (NICE, err))
