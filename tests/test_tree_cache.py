"""top's TreeCache: the deployment's tree is walked again only when it is stale or a process of it
has gone, on real processes (a parent and two children)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from wedgectl import sampler
from wedgectl.sampler import TreeCache
from wedgectl.types import Role

PARENT = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(120)
"""


@pytest.fixture
def tree():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    kids = [int(p) for p in proc.stdout.readline().split()]
    try:
        yield proc.pid, kids
    finally:
        for pid in kids:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.kill()
        proc.wait()


def test_the_tree_is_walked_once_while_it_is_fresh_and_whole(tree, monkeypatch):
    root, kids = tree
    walks: list[int] = []

    def walk(pid: int) -> dict[int, Role]:
        walks.append(pid)
        return {root: Role.OTHER, **{k: Role.OTHER for k in kids}}  # the roles; the pids are the real tree's

    monkeypatch.setattr(sampler, "tree_roles", walk)
    cache = TreeCache(ttl_s=60)
    for _ in range(5):
        assert set(cache.roles(root)) == {root, *kids}
    assert len(walks) == 1
    subprocess.run(["kill", "-9", str(kids[0])], check=True)
    deadline = time.monotonic() + 30
    while len(walks) == 1 and time.monotonic() < deadline:
        cache.roles(root)  # the kill lands when the kernel gets to it: a loaded host may take a while
        time.sleep(0.05)
    assert len(walks) == 2  # a process of it exited (a zombie, its parent not waiting): walked again
    cache.roles(root)
    assert len(walks) == 2  # and the new walk is trusted until it too goes stale


def test_a_stale_tree_is_walked_again(tree, monkeypatch):
    root, kids = tree
    walks: list[int] = []
    monkeypatch.setattr(sampler, "tree_roles", lambda pid: walks.append(pid) or {root: Role.OTHER})
    cache = TreeCache(ttl_s=0.2)
    cache.roles(root)
    time.sleep(0.3)
    cache.roles(root)
    assert len(walks) == 2
    cache.roles(kids[0])  # another root (a rediscovery): walked at once
    assert walks[-1] == kids[0]


def test_an_engines_fds_are_read_at_the_walk_and_the_api_servers_every_sample(monkeypatch):
    """top's fds memo: a Worker holds hundreds of fds; its ports and devices are read when the
    tree is walked, while the API server's client connections are read every sample."""
    import os

    from wedgectl.collect import processes, procfs

    read: list[int] = []
    real = procfs.fd_links
    monkeypatch.setattr(procfs, "fd_links", lambda pid, root=procfs.PROC: (pid != os.getpid() and read.append(pid)) or real(pid, root))
    sleeper = subprocess.Popen(["sleep", "60"])  # wedgectl's own fds are read too (its own sockets): not counted
    me = sleeper.pid
    memo: dict = {}
    for _ in range(3):
        processes.sample_roles({me: Role.WORKER}, procfs.ThreadMemo(), memo)
    assert read == [me] and me in memo  # read once, then kept
    read.clear()
    for _ in range(3):
        processes.sample_roles({me: Role.API_SERVER}, procfs.ThreadMemo(), memo)
    assert read == [me, me, me]  # the API server's every time
    sleeper.kill()
    sleeper.wait()
