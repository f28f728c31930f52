"""A CPU cgroup limit for tests and fixture recorders that starve a real engine of CPU (root only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


class CgroupCpuLimit:
    """A CPU cgroup limited to QUOTA_US per PERIOD_US (what a container's CPU limit does, set far too
    low), cgroup v1's cpu controller or v2's cpu.max; processes moved in keep their threads together."""

    QUOTA_US, PERIOD_US = 1000, 1_000_000  # 1 ms a second, unless given

    def __init__(self, quota_us: int = QUOTA_US, period_us: int = PERIOD_US) -> None:
        self.quota_us, self.period_us = quota_us, period_us
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        self.v1 = (v1 / "cpu.cfs_quota_us").exists()
        self.root = v1 if self.v1 else v2
        self.dir = self.root / f"wedgectl-test-{os.getpid()}"

    def __enter__(self) -> CgroupCpuLimit:
        try:
            if not self.v1:
                if "cpu" not in (self.root / "cgroup.controllers").read_text().split():
                    raise OSError("no cpu controller in cgroup v2")
                (self.root / "cgroup.subtree_control").write_text("+cpu")
            self.dir.mkdir()
            if self.v1:
                (self.dir / "cpu.cfs_period_us").write_text(str(self.period_us))
                (self.dir / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            else:
                (self.dir / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
        except OSError as exc:
            self.dir.rmdir() if self.dir.exists() else None
            pytest.skip(f"cannot set a CPU limit on this host: {exc}")
        return self

    def add(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc: object) -> None:
        for line in (self.dir / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(line)
            except OSError:
                pass  # gone meanwhile
        self.dir.rmdir()
