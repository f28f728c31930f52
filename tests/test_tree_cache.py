"""top's TreeCache: the deployment's tree is walked again only when it is stale or a process of it
has gone, on real processes (a parent and two children)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from wedgectl.capture import tree as tree_cache
from wedgectl.capture.tree import TreeCache
from wedgectl.model.types import Role

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

    monkeypatch.setattr(tree_cache, "tree_roles", walk)
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


def test_a_tree_is_walked_again_every_full_every_s_and_for_another_root(tree, monkeypatch):
    root, kids = tree
    walks: list[int] = []
    monkeypatch.setattr(tree_cache, "tree_roles", lambda pid: walks.append(pid) or {root: Role.OTHER})
    # No full walk due yet, however slow a loaded host makes this: a look, not a walk
    cache = TreeCache(ttl_s=0.05, full_every_s=3600)
    cache.roles(root)
    time.sleep(0.1)
    cache.roles(root)
    assert len(walks) == 1 and cache.looks == 1  # stale: looked at, nothing of it new
    cache.full_every_s = 0.3
    time.sleep(0.3)
    cache.roles(root)
    assert len(walks) == 2  # a pid reused between two looks would not be new: a walk now and then
    cache.roles(kids[0])  # another root (a rediscovery): walked at once
    assert walks[-1] == kids[0]


SPAWNER = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])]
print(kids[0].pid, flush=True)
for line in sys.stdin:
    kids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
    print(kids[-1].pid, flush=True)
"""


def test_a_look_walks_only_when_a_process_of_the_deployment_started(monkeypatch):
    """A look every ttl_s reads the host's pid list and the parent of each pid new to it: a
    process started elsewhere on the host is not walked for; a child the deployment starts is
    found at the next look (real processes, the real walk)."""
    walks: list[int] = []
    real = tree_cache.tree_roles
    monkeypatch.setattr(tree_cache, "tree_roles", lambda pid: walks.append(pid) or real(pid))
    parent = subprocess.Popen([sys.executable, "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    elsewhere = None
    kids: list[int] = []
    try:
        first = int(parent.stdout.readline())
        kids.append(first)
        cache = TreeCache(ttl_s=0.2, full_every_s=600)
        listings: list[int] = []
        real_host = cache._host_pids
        monkeypatch.setattr(cache, "_host_pids", lambda: listings.append(1) or real_host())
        assert set(cache.roles(parent.pid)) == {parent.pid, first} and len(walks) == 1
        elsewhere = subprocess.Popen(["sleep", "60"])  # new on the host, wedgectl's child, not the tree's
        time.sleep(0.25)
        assert set(cache.roles(parent.pid)) == {parent.pid, first}
        assert len(walks) == 1 and cache.looks == 1
        parent.stdin.write("one more\n")
        parent.stdin.flush()
        second = int(parent.stdout.readline())
        kids.append(second)
        time.sleep(0.25)
        assert set(cache.roles(parent.pid)) == {parent.pid, first, second}
        assert len(walks) == 2 and cache.looks == 1
        assert len(listings) == 3  # the first walk, the look; the look that led to a walk lists /proc once
    finally:
        for p in (elsewhere, parent):
            if p is not None:
                p.kill()
                p.wait()
        for pid in kids:
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_fds_and_tcp_tables_are_read_at_the_walk_not_every_sample(monkeypatch):
    """top's fds memo: a Worker holds hundreds of fds, and a TCP table read walks the kernel's
    whole connection hash; each process's ports, connections and devices are read when the tree
    is walked (the memo cleared), and a refresh with every process kept reads neither its fds,
    nor wedgectl's own, nor a TCP table."""
    import os

    from wedgectl.collect import processes, procfs, sockets

    read: list[int] = []
    tables: list[int] = []
    real_links, real_own, real_table = procfs.fd_links, procfs.own_fd_links, sockets.TcpTables._table
    monkeypatch.setattr(procfs, "fd_links", lambda pid, root=procfs.PROC: read.append(pid) or real_links(pid, root))
    monkeypatch.setattr(procfs, "own_fd_links", lambda: read.append(os.getpid()) or real_own())
    monkeypatch.setattr(sockets.TcpTables, "_table", lambda self, pid: tables.append(pid) or real_table(self, pid))
    sleeper = subprocess.Popen(["sleep", "60"])
    me = sleeper.pid
    for role in (Role.WORKER, Role.API_SERVER):
        memo: dict = {}
        read.clear(), tables.clear()
        for _ in range(3):
            samples, _ = processes.sample_roles({me: role}, procfs.ThreadMemo(), memo)
            assert samples and samples[0].connections == 0
        # wedgectl's own sockets (before and after the table), then its: once
        assert read == [os.getpid(), os.getpid(), me] and me in memo
        # the namespace's table, asked for ours (both reads) and its, at the first sample only
        assert tables == [os.getpid(), os.getpid(), me]
        memo.clear()  # the walk
        processes.sample_roles({me: role}, procfs.ThreadMemo(), memo)
        assert read[3:] == [os.getpid(), os.getpid(), me]
    # A diagnose keeps no memo: every sample reads them.
    read.clear()
    for _ in range(2):
        processes.sample_roles({me: Role.API_SERVER})
    assert read.count(me) == 2
    sleeper.kill()
    sleeper.wait()


def test_a_cmdline_is_read_again_when_the_title_changes_not_every_sample(monkeypatch):
    """A cmdline read is a bounded read in a thread of its own: reused while the process keeps its
    start time and comm, read afresh once it retitles itself (comm and argv change together)."""
    from wedgectl.collect import processes, procread

    reads: list[int] = []
    real = procread.read_cmdline
    monkeypatch.setattr(procread, "read_cmdline", lambda pid, *a: reads.append(pid) or real(pid, *a))
    child = subprocess.Popen([sys.executable, "-c", TITLE_CHANGER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        first = processes.name_cmdline(child.pid)
        for _ in range(5):
            assert processes.name_cmdline(child.pid) == first
        assert reads == [child.pid]
        child.stdin.write("retitle\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "retitled"
        name, _argv = processes.name_cmdline(child.pid)
        assert name == "VLLM::Retitled" and reads == [child.pid, child.pid]
    finally:
        child.kill()
        child.wait()


TITLE_CHANGER = """
import ctypes, sys
print("ready", flush=True)
sys.stdin.readline()
ctypes.CDLL(None).prctl(15, b"VLLM::Retitled", 0, 0, 0)
print("retitled", flush=True)
sys.stdin.readline()
"""
