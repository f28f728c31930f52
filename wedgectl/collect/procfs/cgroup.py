"""A process's cpu cgroup, and the CPU limit set on it with how often it was throttled."""

from __future__ import annotations

from pathlib import Path

from wedgectl.collect.procfs._files import PROC, read_or_none, read_text
from wedgectl.model.types import CpuLimit


def _cgroup_lines(text: str) -> tuple[str | None, str | None]:
    """(v1 cpu controller's path, v2 path) in a /proc/PID/cgroup text."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


def cpu_cgroup(text: str) -> str | None:
    """The cpu controller's cgroup path in a /proc/PID/cgroup text: the v1 line naming `cpu`
    among its controllers, else the v2 line (`0::PATH`); None when neither is there."""
    v1, v2 = _cgroup_lines(text)
    return v1 if v1 is not None else v2


CGROUP_ROOT = Path("/sys/fs/cgroup")


def _stat_counts(text: str) -> tuple[int, int] | None:
    """(nr_periods, nr_throttled) from a cpu.stat text."""
    got = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("nr_periods", "nr_throttled"):
            got[key] = int(value)
    return (got["nr_periods"], got["nr_throttled"]) if len(got) == 2 else None


def read_cpu_limit(pid: int, proc_root: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> CpuLimit | None:
    """The CPU limit of pid's cgroup and how often it was throttled (CpuLimit); None with no limit
    set on it, or where its cgroup is not to be read (another cgroup namespace's path, no cpu
    controller mounted). v1's controller mounts as cpu or cpu,cpuacct; v2's files sit in the
    unified tree. Read from the process's own cgroup: a limit set only on a parent is not seen."""
    text = read_or_none(proc_root / str(pid) / "cgroup")
    if text is None:
        return None
    v1, v2 = _cgroup_lines(text)
    try:
        if v1 is not None:
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                d = f"{cgroup_root}/{mount}/{v1.strip('/')}".rstrip("/")
                stat = read_or_none(Path(d + "/cpu.stat"))
                if stat is None:
                    continue
                quota = int(read_text(d + "/cpu.cfs_quota_us"))
                period = int(read_text(d + "/cpu.cfs_period_us"))
                counts = _stat_counts(stat)
                return CpuLimit(quota, period, *counts) if quota > 0 and period > 0 and counts else None
        if v2 is not None:
            d = f"{cgroup_root}/{v2.strip('/')}".rstrip("/")
            limit, stat = read_or_none(Path(d + "/cpu.max")), read_or_none(Path(d + "/cpu.stat"))
            if limit is None or stat is None:
                return None
            quota_text, period_text = (limit.split() + ["100000"])[:2]
            counts = _stat_counts(stat)
            if quota_text == "max" or counts is None:
                return None
            return CpuLimit(int(quota_text), int(period_text), *counts)
    except (OSError, ValueError):
        return None
    return None
