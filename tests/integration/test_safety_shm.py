"""A SIGKILLed tree leaves no /dev/shm segment behind, and a segment someone else still holds stays.

Before, control.stop_tree left every segment a killed vLLM tree had mapped
(psm_*, 160-250 MB each). Now it records the tree's /dev/shm mappings before
the first signal and, once the tree is gone, removes those no live process
maps or holds open. (On a real vLLM, forced: test_probes_engine's last test, on
its deadlocked server.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from wedgectl.collect import procread
from wedgectl.collect.control import stop_tree

pytestmark = pytest.mark.integration

# Maps each /dev/shm file named in argv (creating it if missing), ignores SIGTERM as a wedged
# server does, and (as "parent") starts a child that does the same; prints "ready" when all map them.
MAPPER = textwrap.dedent("""
    import mmap, os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    role, paths = sys.argv[1], sys.argv[2:]
    maps = []
    for p in paths:
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        maps.append(mmap.mmap(fd, 1 << 20))
        os.close(fd)  # the mapping alone holds it, as a psm_ segment is held
    if role == "parent":
        child = subprocess.Popen([sys.executable, __file__, "child", *paths], stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
    print("ready", flush=True)
    time.sleep(600)
""")


def _start(script: Path, role: str, *paths: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(script), role, *paths], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_sigkilled_tree_leaves_no_segment_and_keeps_one_held_elsewhere(tmp_path):
    script = tmp_path / "mapper.py"
    script.write_text(MAPPER)
    tag = uuid.uuid4().hex[:8]
    left = f"/dev/shm/wedgectl-test-{tag}-tree"  # mapped by the tree alone
    shared = f"/dev/shm/wedgectl-test-{tag}-shared"  # mapped by the tree and by an unrelated process
    holder = _start(script, "holder", shared)
    tree = _start(script, "parent", left, shared)
    try:
        kids = psutil.Process(tree.pid).children(recursive=True)
        assert kids, "the tree's child did not start"
        assert procread.shm_files_of([tree.pid, *(k.pid for k in kids)]) >= {left, shared}
        stopped = stop_tree(tree.pid, 0.5, popen=tree)
        assert stopped.killed  # SIGTERM was ignored: SIGKILL it took
        assert not psutil.pid_exists(kids[0].pid) or psutil.Process(kids[0].pid).status() == psutil.STATUS_ZOMBIE
        assert not os.path.exists(left)
        assert left in stopped.shm_removed
        assert os.path.exists(shared) and shared in stopped.shm_kept
        assert holder.poll() is None
    finally:
        for proc in (tree, holder):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for path in (left, shared):
            if os.path.exists(path):
                os.unlink(path)
