"""A deployment's process tree, kept between samples (TreeCache), and the /proc reading of its processes."""

from __future__ import annotations

import os
import time

from wedgectl.capture.discover import Deployment, tree_roles
from wedgectl.collect import processes, procfs
from wedgectl.model.types import CollectorFailure, ProcessSample, Role


class TreeCache:
    """A deployment's processes and their roles, looked at again every `ttl_s` seconds, or at once
    when one of them has gone (exited, or its pid now another process's).

    A walk lists every process on the host (to find children) and reads each one's stat and the
    deployment's cmdlines: on a host with a thousand processes, a thousand reads for an answer
    that changes when a process of the deployment starts or exits. An exit is seen at every
    refresh (each member's start time, `_intact`); a start, at a look every `ttl_s`: the host's
    pid list, and the parent of each process new to it since the last look, a read each. Only
    a new process of the deployment (its parent a member, or a new member) means a walk; and a
    walk every `full_every_s` whatever the looks saw, for a pid reused between two looks. A
    member whose role was `other` (a process before its title was set) is asked again at each
    look. `top`, sampling every second for hours, keeps one; a diagnose capture walks at every
    sample (its samples are few, and a start-up adds processes between them). It also holds
    top's ThreadMemo (a thread that has not run since the last refresh is not read again) and
    the engine's and workers' ports and devices, read again at each look."""

    def __init__(self, ttl_s: float = 5.0, full_every_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self.full_every_s = full_every_s
        self._root: int | None = None
        self._roles: dict[int, Role] = {}
        self._starts: dict[int, int | None] = {}
        self._host: set[int] = set()  # the host's pids at the last walk or look
        self._at = float("-inf")  # the last walk or look
        self._walked_at = float("-inf")
        self.walks = 0
        self.looks = 0
        self.threads = procfs.ThreadMemo()  # and each thread's last sample, for one that has not run since
        self.fds: processes.FdsMemo = {}  # see sample_roles

    def roles(self, root_pid: int) -> dict[int, Role]:
        now = time.monotonic()
        if root_pid != self._root or now - self._walked_at >= self.full_every_s or not self._intact():
            self._walk(root_pid, now)
        elif now - self._at >= self.ttl_s:
            host = self._host_pids()
            if host is None or self._joined(host - self._host):
                self._walk(root_pid, now, host)
            else:
                self._host, self._at = host, now
                self.fds.clear()  # ports, clients and devices: read again, as at a walk
                self._ask_others_again()
                self.looks += 1
        return dict(self._roles)

    def _walk(self, root_pid: int, now: float, host: set[int] | None = None) -> None:
        # the host's pids read before the walk (the look's, where a look led to it): a process
        # started during it is new at the next look
        self._host = host if host is not None else self._host_pids() or set()
        self._roles = tree_roles(root_pid)
        self.fds.clear()
        self._starts = {pid: _start_ticks(pid) for pid in self._roles}
        self._root, self._at, self._walked_at = root_pid, now, now
        self.walks += 1

    def _host_pids(self) -> set[int] | None:
        try:
            return {int(name) for name in os.listdir(procfs.PROC) if name.isdigit()}
        except OSError:
            return None  # cannot tell: walk

    def _joined(self, new: set[int]) -> bool:
        """Whether a process new to the host is a child of the deployment's (a grandchild is
        seen through its parent, new too; one whose parent has exited is not the tree's, to the
        walk either)."""
        members = set(self._roles)
        for pid in new:
            stat, _ = procfs.read_process_stat(pid)
            if stat is not None and stat.ppid in members:
                return True
        return False

    def _ask_others_again(self) -> None:
        for pid, role in list(self._roles.items()):
            if role is not Role.OTHER:
                continue
            now = processes.role_of_pid(pid)
            if now is not None:  # gone: _intact sees it at the next refresh
                self._roles[pid] = now

    def _intact(self) -> bool:
        return all(_start_ticks(pid) == start for pid, start in self._starts.items())


def _start_ticks(pid: int) -> int | None:
    """The process's start time; None once it has exited (a zombie has, too)."""
    stat, _ = procfs.read_process_stat(pid)
    return None if stat is None or stat.state in ("Z", "X") else stat.starttime_ticks


def collect_processes(dep: Deployment,
                      tree: TreeCache | None = None) -> tuple[tuple[ProcessSample, ...], list[CollectorFailure]]:
    """Every process of the deployment read once, through `tree` when the caller keeps one."""
    if dep.root_pid is None:
        return processes.sample_roles({})
    if tree is None:
        return processes.sample_roles(tree_roles(dep.root_pid))
    return processes.sample_roles(tree.roles(dep.root_pid), tree.threads, tree.fds)
