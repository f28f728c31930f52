"""top's ThreadMemo on real threads of a real process: a thread that has not run since the last
read is reused (one read of its schedstat), one that ran is read again."""

from __future__ import annotations

import subprocess
import sys
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


def test_a_parked_thread_is_reused_and_a_running_one_read_again():
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True)
    try:
        spinner, parked_tid = (int(x) for x in proc.stdout.readline().split())
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
    finally:
        proc.kill()
        proc.wait()


def test_without_switches_a_thread_reads_the_same_but_for_its_switch_counts():
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True)
    try:
        _, parked_tid = (int(x) for x in proc.stdout.readline().split())
        # On a loaded host the parked thread may not have reached its wait yet: wait (bounded)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            full = {t.tid: t for t in procfs.read_threads(proc.pid)[0]}
            if full[parked_tid].state == "S" and (full[parked_tid].voluntary_switches or 0) > 0:
                break
            time.sleep(0.05)
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
    finally:
        proc.kill()
        proc.wait()
