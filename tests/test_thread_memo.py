"""top's ThreadMemo on real threads of a real process: a thread that has not run since the last
read is reused (one read of its schedstat), one that ran is read again."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import socket
import subprocess
import sys
import threading
import time

from wedgectl.collect import procfs

TARGET = """
import threading, time, os
stop = threading.Event()
ids = {}
def spin():
    ids["spinner"] = threading.get_native_id()
    while not stop.is_set():
        pass
def park():
    ids["parked"] = threading.get_native_id()
    stop.wait()
threading.Thread(target=spin, daemon=True).start()
threading.Thread(target=park, daemon=True).start()
while len(ids) < 2:
    time.sleep(0.01)
print(ids["spinner"], ids["parked"], flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _running(source: str, **kw):
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True, **kw)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _parked(pid: int, tid: int) -> dict:
    """Every thread of pid once `tid` has reached its wait: on a loaded host a thread may not have
    got there yet when it is first read (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        full = {t.tid: t for t in procfs.read_threads(pid)[0]}
        if full[tid].state == "S" and (full[tid].voluntary_switches or 0) > 0 or time.monotonic() > deadline:
            return full
        time.sleep(0.05)


def test_a_parked_thread_is_reused_and_a_running_one_read_again():
    with _running(TARGET) as proc:
        spinner, parked_tid = (int(x) for x in proc.stdout.readline().split())
        _parked(proc.pid, parked_tid)
        memo = procfs.ThreadMemo()
        first, _ = procfs.read_threads(proc.pid, unchanged=memo)
        # On a loaded host the spinner can sit runnable for a while without a CPU: wait (bounded)
        # until the kernel shows it ran, rather than for a fixed time.
        ran = procfs.thread_schedstats(proc.pid)[spinner]
        deadline = time.monotonic() + 30
        while procfs.thread_schedstats(proc.pid)[spinner][0] == ran[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        second, _ = procfs.read_threads(proc.pid, unchanged=memo)
        by_tid = {t.tid: t for t in first}
        again = {t.tid: t for t in second}
        assert again[parked_tid] is by_tid[parked_tid]  # not read again: the same sample
        assert again[spinner] is not by_tid[spinner]
        assert again[spinner].utime_s + again[spinner].stime_s > 0
        assert memo.hits >= 1
        # without the memo, a read gives the same answer for the parked thread
        plain, _ = procfs.read_threads(proc.pid)
        parked = next(t for t in plain if t.tid == parked_tid)
        was = by_tid[parked_tid]
        assert parked.state == was.state == "S"
        assert parked.futex_addr == was.futex_addr and was.futex_addr is not None  # parked on its Event


def test_without_switches_a_thread_reads_the_same_but_for_its_switch_counts():
    with _running(TARGET) as proc:
        _, parked_tid = (int(x) for x in proc.stdout.readline().split())
        full = _parked(proc.pid, parked_tid)
        lean = {t.tid: t for t in procfs.read_threads(proc.pid, switches=False)[0]}
        assert set(full) == set(lean)
        assert full[parked_tid].voluntary_switches is not None and full[parked_tid].voluntary_switches > 0
        assert lean[parked_tid].voluntary_switches is None and lean[parked_tid].nonvoluntary_switches is None
        for field in ("comm", "state", "wchan", "syscall_nr", "futex_addr", "futex_op"):
            assert getattr(lean[parked_tid], field) == getattr(full[parked_tid], field), field
        assert lean[parked_tid].futex_addr is not None  # parked on its Event
        # top's memo keeps a lean read: the parked thread is reused on the next read
        memo = procfs.ThreadMemo()
        first = {t.tid: t for t in procfs.read_threads(proc.pid, unchanged=memo, switches=False)[0]}
        again = {t.tid: t for t in procfs.read_threads(proc.pid, unchanged=memo, switches=False)[0]}
        assert again[parked_tid] is first[parked_tid]


# A process whose threads exit, one a line on its stdin; the main thread prints their tids.
EXITING = """
import sys, threading
gates, ids = [], []
def park(gate):
    ids.append(threading.get_native_id())
    gate.wait()
for _ in range(2):
    gates.append(threading.Event())
    threading.Thread(target=park, args=(gates[-1],)).start()
while len(ids) < 2:
    pass
print(*ids, flush=True)
for gate in gates:
    sys.stdin.readline()
    gate.set()
sys.stdin.readline()
"""


def _own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_thread_files_are_read_through_held_descriptors_and_closed_with_their_threads():
    with _running(EXITING, stdin=subprocess.PIPE) as proc:
        first_tid, second_tid = (int(x) for x in proc.stdout.readline().split())
        gc.collect()
        fds0 = _own_fds()
        memo = procfs.ThreadMemo()
        threads, _ = procfs.read_threads(proc.pid, unchanged=memo, switches=False)
        tids = {t.tid for t in threads}
        assert {first_tid, second_tid} <= tids
        # each thread read whole is held open: schedstat, stat, wchan and syscall
        assert memo.held == 4 * len(tids) == _own_fds() - fds0
        # a held file reads afresh: the main thread's CPU time, read through its held stat, grows
        main = next(t for t in threads if t.tid == proc.pid)
        proc.stdin.write("\n")  # the first thread exits; the main thread runs to read the line
        proc.stdin.flush()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            read, failures = procfs.read_threads(proc.pid, unchanged=memo, switches=False)
            now = {t.tid: t for t in read}
            if first_tid not in now:
                break
            time.sleep(0.05)
        # (a CI run once found the second thread gone too: whether the target was still alive, and what the read
        # reported, tell a target that saw its stdin end from a read that dropped a live thread)
        assert first_tid not in now and second_tid in now, (proc.poll(), failures, sorted(now))
        assert memo.held == 4 * len(now) == _own_fds() - fds0  # the exited thread's four are closed
        assert now[proc.pid] is not main  # it ran (read the line): read again, through its held files
        # the same answer as a plain read, field by field: the two reads are moments apart, and a
        # thread can be running at one and sleeping at the other, so a pair read back to back that
        # agrees is looked for (a memo that read stale files would never agree)
        fields = ("comm", "state", "futex_addr", "syscall_nr")

        def differ() -> list[tuple[int, str]]:
            held = {t.tid: t for t in procfs.read_threads(proc.pid, unchanged=memo, switches=False)[0]}
            plain = {t.tid: t for t in procfs.read_threads(proc.pid, switches=False)[0]}
            assert set(plain) == set(held) == set(now)
            return [(tid, f) for tid, t in plain.items() for f in fields if getattr(held[tid], f) != getattr(t, f)]

        for _ in range(50):
            if not (mismatch := differ()):
                break
            time.sleep(0.02)
        assert not mismatch
        # the process gone: every descriptor is closed at the next read, which finds nothing
        proc.stdin.write("\n\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
        gone, failures = procfs.read_threads(proc.pid, unchanged=memo, switches=False)
        memo.forget_others([])
        assert gone == () and failures and memo.held == 0 and _own_fds() == fds0


def test_held_descriptors_stay_within_the_budget_and_go_with_the_memo():
    with _running(TARGET) as proc:
        proc.stdout.readline()
        gc.collect()  # another test's memo, still referenced by its traceback, closes now, not below
        fds0 = _own_fds()
        small = procfs.ThreadMemo(max_fds=5)
        lean = {t.tid: t for t in procfs.read_threads(proc.pid, unchanged=small, switches=False)[0]}
        assert small.held == 5 == _own_fds() - fds0  # the rest are opened for each read
        plain = {t.tid: t for t in procfs.read_threads(proc.pid, switches=False)[0]}
        assert set(lean) == set(plain) and len(plain) >= 3
        again = {t.tid: t for t in procfs.read_threads(proc.pid, unchanged=small, switches=False)[0]}
        assert set(again) == set(plain) and small.held == 5
        del small, lean, again
        gc.collect()
        assert _own_fds() == fds0  # closed when the memo is collected
        # the default budget: half the soft limit on open files, at most 4096
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert procfs.ThreadMemo().max_fds == min(4096, soft // 2)


def test_own_fd_links_leave_out_the_held_thread_files_and_nothing_else():
    """wedgectl reads its own socket fds at each sample of sockets: the thread files its memo holds
    (hundreds in top) are not read, and every other fd, a socket among them, is."""
    memo = procfs.ThreadMemo()
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    sock = socket.socket()
    try:
        procfs.read_threads(os.getpid(), unchanged=memo, switches=False)
        assert memo.held >= 8  # two threads at least, four files each
        own = procfs.own_fd_links()
        full = procfs.fd_links(os.getpid())
        assert f"socket:[{os.fstat(sock.fileno()).st_ino}]" in own
        assert sum("/task/" in link for link in full) == memo.held
        assert not any("/task/" in link for link in own)
        assert sorted(own) == sorted(link for link in full if "/task/" not in link)
    finally:
        sock.close()
        stop.set()
        helper.join()
        memo.close()
    assert memo.held == 0 and procfs.own_fd_links() == procfs.fd_links(os.getpid())
