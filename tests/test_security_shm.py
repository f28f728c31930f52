"""/dev/shm cleanup removes only the stopped tree's own files (issue 33: 9).

stop_tree removed every /dev/shm file the stopped tree had mapped and no one
else held: a root-owned 0644 file that a nobody-owned target had only mapped
for reading went too (root passes the sticky bit). Now a file goes only if it
is owned by the tree's uid and was made no earlier than the tree started; the
others are kept, and reported in Stopped.shm_kept.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
import uuid

import pytest

from wedgectl.collect import shm
from wedgectl.collect.control import stop_tree

NOBODY = 65534
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
SIZE = 4096

# Maps a file it may only read (root's), an older file of its own user's, and one it makes itself.
MAPPER = textwrap.dedent("""
    import mmap, os, sys, time
    theirs, older, own = sys.argv[1:4]
    maps = []
    fd = os.open(theirs, os.O_RDONLY)
    maps.append(mmap.mmap(fd, 4096, prot=mmap.PROT_READ))
    os.close(fd)
    fd = os.open(older, os.O_RDWR)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
    fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)  # the mappings alone hold them
    print("ready", flush=True)
    time.sleep(600)
""")


def _make(path: str, mode: int, owner: int = 0) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, SIZE)
    os.fchmod(fd, mode)
    if owner:
        os.fchown(fd, owner, owner)
    os.close(fd)


@pytest.fixture
def names():
    tag = uuid.uuid4().hex[:8]
    made = {k: f"/dev/shm/wedgectl-test-{tag}-{k}" for k in ("theirs", "older", "own", "link")}
    yield made
    for path in made.values():
        if os.path.lexists(path):
            os.unlink(path)


def test_stop_tree_removes_the_trees_own_file_and_keeps_roots_and_an_older_one(names):
    theirs, older, own = names["theirs"], names["older"], names["own"]
    _make(theirs, 0o644)  # root's, readable by all
    _make(older, 0o600, NOBODY)  # nobody's, made before the tree started
    time.sleep(1.5)  # a start time read from /proc is floored to the boot second: be clear of it
    proc = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-c", MAPPER, theirs, older, own], cwd="/",
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert os.stat(own).st_uid == NOBODY
        stopped = stop_tree(proc.pid, 2.0, popen=proc)
        assert proc.poll() is not None
        assert os.path.exists(theirs)  # before: root's file was removed
        assert os.path.exists(older)
        assert not os.path.exists(own)
        assert stopped.shm_removed == (own,)
        assert set(stopped.shm_kept) == {theirs, older}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_only_regular_files_of_the_owners_made_since_go(names):
    since = time.time() - 1
    for key, owner in (("theirs", 0), ("own", NOBODY), ("older", NOBODY)):
        _make(names[key], 0o600, owner)
    os.symlink(names["own"], names["link"])
    old = os.stat(names["older"]).st_ctime
    removed, kept = shm.remove_unheld([names["theirs"], names["own"], names["link"]], {NOBODY}, since)
    assert removed == (names["own"],)
    assert set(kept) == {names["theirs"], names["link"]}
    assert os.path.lexists(names["link"]) and os.path.exists(names["theirs"])
    removed, kept = shm.remove_unheld([names["older"]], {NOBODY}, old + 5)  # a tree started after it
    assert removed == () and kept == (names["older"],)
    removed, kept = shm.remove_unheld([names["older"]], {NOBODY}, None)  # start unknown: nothing goes
    assert removed == () and os.path.exists(names["older"])
