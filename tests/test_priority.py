"""diagnose's low priority: nice +NICE and the idle I/O class, given back when the kernel keeps it
off a CPU too long (priority.restore_priority_if_starved). Each case runs in a child: priorities
are per process, and the test run must not be left niced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, os, sys
from wedgectl.collect import priority
from wedgectl.collect import procfs
start = os.getpriority(os.PRIO_PROCESS, 0)
delays = iter(json.loads(sys.argv[1]))
real = procfs.own_run_delay_s()
procfs.own_run_delay_s = lambda: next(delays)
problems = priority.lower_priority()
out = {"start": start, "real_delay": real, "problems": problems, "after_lower": os.getpriority(os.PRIO_PROCESS, 0),
       "said": [], "nice": []}
for _ in range(int(sys.argv[2])):
    out["said"].append(priority.restore_priority_if_starved())
    out["nice"].append(os.getpriority(os.PRIO_PROCESS, 0))
print(json.dumps(out))
"""


def run(delays: list[float], checks: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(delays), str(checks)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_capture_that_waits_too_long_for_a_cpu_gets_its_priority_back():
    from wedgectl.collect.priority import NICE, STARVED_S

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
    from wedgectl.collect.priority import NICE

    out = run([5.0, 5.1, 5.2, 5.3], 3)
    assert out["said"] == [None, None, None] and out["nice"] == [out["start"] + NICE] * 3


def test_the_nice_is_given_back_once_the_target_is_sampled():
    # diagnose gives it back after the capture: classify, print and exit are its own work
    code = ("import os; from wedgectl.collect import priority; s = os.getpriority(os.PRIO_PROCESS, 0); priority.lower_priority(); "
            "low = os.getpriority(os.PRIO_PROCESS, 0); err = priority.restore_priority(); "
            "print(low - s, os.getpriority(os.PRIO_PROCESS, 0) - s, err, priority.restore_priority(), sep='|')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    from wedgectl.collect.priority import NICE

    low, back, err, again = r.stdout.strip().split("|")
    assert int(low) == NICE and again == "None"
    assert (int(back), err) == ((0, "None") if os.geteuid() == 0 else (NICE, err))


# --urgent (priority.raise_priority): which scheduling group the kernel puts wedgectl in.

V1 = "9:name=systemd:/\n4:memory:/process_api/83707dcfe83d\n2:cpuacct:/\n1:cpu:/\n0::/\n"  # recorded: this project's VM
V1_JOINT = "12:cpu,cpuacct:/docker/4f1c\n1:name=systemd:/docker/4f1c\n"
V2 = "0::/user.slice/user-0.slice/session-3.scope\n"


def test_the_cpu_cgroup_is_read_from_v1_or_v2_lines():
    from wedgectl.collect.procfs import cpu_cgroup

    assert cpu_cgroup(V1) == "/"
    assert cpu_cgroup(V1_JOINT) == "/docker/4f1c"
    assert cpu_cgroup(V2) == "/user.slice/user-0.slice/session-3.scope"
    assert cpu_cgroup("0::/\n") == "/"
    assert cpu_cgroup("garbage\n\n3:memory:/x\n") is None


def _proc(tmp_path, enabled: str | None, cgroup: str):
    root = tmp_path / "proc"
    (root / "self").mkdir(parents=True)
    (root / "self" / "cgroup").write_text(cgroup)
    if enabled is not None:
        (root / "sys" / "kernel").mkdir(parents=True)
        (root / "sys" / "kernel" / "sched_autogroup_enabled").write_text(enabled + "\n")
    return root


def test_autogroup_applies_only_when_on_and_in_the_root_cpu_cgroup(tmp_path):
    from wedgectl.collect.procfs import autogroup_applies

    assert autogroup_applies(_proc(tmp_path / "a", "1", V1))
    assert not autogroup_applies(_proc(tmp_path / "b", "0", V1))  # switched off
    assert not autogroup_applies(_proc(tmp_path / "c", "1", V1_JOINT))  # a container: cpu.weight decides
    assert not autogroup_applies(_proc(tmp_path / "d", "1", V2))  # a systemd session scope
    assert not autogroup_applies(_proc(tmp_path / "e", None, V1))  # a kernel without autogroup


def test_the_own_autogroup_nice_is_written_or_its_error_said(tmp_path):
    from wedgectl.collect.procfs import set_own_autogroup_nice

    root = _proc(tmp_path, "1", V1)
    (root / "self" / "autogroup").write_text("/autogroup-7 nice 0\n")
    assert set_own_autogroup_nice(-10, root) is None
    assert (root / "self" / "autogroup").read_text().startswith("-10")
    (root / "self" / "autogroup").unlink()
    (root / "self" / "autogroup").mkdir()  # unwritable: the reason comes back, nothing raises
    assert "/proc/self/autogroup" in set_own_autogroup_nice(-10, root)
