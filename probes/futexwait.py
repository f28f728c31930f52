#!/usr/bin/env python3
"""futexwait: per-thread futex waits of a process tree, and who called FUTEX_WAKE on which address.

Traces tracepoint:syscalls:sys_enter_futex and sys_exit_futex; each probe's
predicate is the target pids' tgid compare and nothing else. Per futex call
the program writes the call's (start, address) on entry and reads it on exit;
only waits that outlast the threshold (--min-wait-ms, default 10) are counted
and summed, in kernel maps. Per thread: the futex address and start time of
the wait it is in now, how many waits over the threshold it made and how long
it spent in them in the window; per (pid, address): which threads called a
wake op on it, how often, and how many waiters those calls woke.

A thread parked since *before* the probe attached fires no sys_enter_futex in
the window. Its wait start comes from /proc/PID/task/TID/sched `se.exec_start`
(the last time it ran, on the scheduler's clock, calibrated per CPU against
CLOCK_MONOTONIC): see wedgectl/collect/procfs/sched.py and clock.py, and probes/README.md.

Overhead (bench/probe_overhead.py, side by side in one run): on its worst
case, 4 Python thread pairs handing off through queue.Queue at ~300-400k
futex calls/s, throughput is 0.71-0.84 of untraced on a 2-vCPU host loaded by
other work (0.89 on the same host idle), and the same two tracepoints with an empty program cost as much
(0.83-0.89): the cost is the syscall tracepoints themselves (while attached,
every syscall on the host takes the slow path, and each futex call fills a
perf trace record), not the program, which runs one map write and one read
per call. The cost scales with the host's syscall rate and the target's futex
rate; on a serving vLLM server see OVERHEAD. Probing futex_wait/futex_wake
instead would skip the syscall path, but the reference kernel has no kprobe
events (no kprobe_events in tracefs) and bpftrace 0.17 no kfunc probes on it,
so the syscall tracepoints are the one attach point there for bpftrace and
bcc. The rawtp back-end (wedgectl/collect/ebpfraw.py) does the wait counting
on the raw sched_switch tracepoint instead, at 0.91-0.98 on the same storm,
without the wake table. Maps are bounded (--max-entries,
default 4096 per map); a full map drops new keys and the result says so. The program exits by itself after
--duration seconds (an in-kernel interval probe), so a killed wedgectl never
leaves it attached.

Exit status: 0 traced; 2 usage; 3 no back-end can run here (reason printed);
4 permission (needs root, or CAP_BPF + CAP_PERFMON); 5 target gone;
6 the probe failed to start or to report.
"""

from __future__ import annotations

import sys
from typing import Any

from wedgectl.probes import _tool
from wedgectl.probes._window import Maps, Window, pair, rounded, table
from wedgectl.model.types import WakeCall

NAME = "futexwait"
SUMMARY = "futex waits per thread (address, start, count, total) and FUTEX_WAKE calls per address"
TRACEPOINTS = ("syscalls:sys_enter_futex", "syscalls:sys_exit_futex")
FUTEXWAIT_OVERHEAD = ("futex storm, ~300-450k futex calls/s on 2 vCPUs: throughput ratio 0.91-0.98 on rawtp "
                      "(sched_switch), 0.71-0.89 on bpftrace/bcc, as much as an empty program on their syscall "
                      "tracepoints costs; serving vLLM "
                      "(tiny model, 4 streams): ratio 0.99-1.04, within that host's noise; "
                      "bench/probe_overhead.py --each --vllm")
OVERHEAD = FUTEXWAIT_OVERHEAD

# futex(2) commands (op & 0x7f: the private flag is 128, FUTEX_CLOCK_REALTIME 256)
WAIT_CMDS = (0, 6, 9, 11, 13)  # WAIT, LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2
WAKE_CMDS = (1, 3, 4, 5, 7, 10, 12)  # WAKE, REQUEUE, CMP_REQUEUE, WAKE_OP, UNLOCK_PI, WAKE_BITSET, CMP_REQUEUE_PI

# Map names the program fills; the collector reads them by these names.
MAX_WAKES_REPORTED = 256
MAPS = ("fw_at", "fw_nwaits", "fw_wait_ns", "fw_carried", "fw_wakes", "fw_woken")


def _any_of(var: str, values: tuple[int, ...]) -> str:
    return " || ".join(f"{var} == {v}" for v in values)


# bpftrace text. __FILTER__ becomes the tgid predicate ("pid == 4101 || pid == 4102"): the
# whole predicate, so another process's call costs one compare and nothing else.
# Per call the program does one map write on entry and one read on exit; waits shorter than
# __MIN_NS__ (the threshold, --min-wait-ms) end there. @fw_at[tid] = (start, addr) of the
# call in progress, start 0 for a wake op; it is never deleted (the next call of the same
# thread overwrites it), and which entry is a wait still in progress at the end of the
# window is decided against /proc's read of the thread then. An exit with no entry is a
# call that began before the attach: a wait "carried" into the window.
BPFTRACE_BEGIN = ""
BPFTRACE_PROBES = """
tracepoint:syscalls:sys_enter_futex /__FILTER__/
{
  $cmd = args->op & 0x7f;
  if (__IS_WAIT__) {
    @fw_at[tid] = (nsecs, (uint64)args->uaddr);
  } else {
    @fw_at[tid] = ((uint64)0, (uint64)args->uaddr);
    if (__IS_WAKE__) {
      @fw_wakes[pid, (uint64)args->uaddr, tid] = count();
      if ($cmd == 5) { @fw_wakes[pid, (uint64)args->uaddr2, tid] = count(); }
    }
  }
}

tracepoint:syscalls:sys_exit_futex /__FILTER__/
{
  $at = @fw_at[tid];
  if ($at.0) {
    $d = nsecs - $at.0;
    if ($d >= __MIN_NS__) {
      @fw_nwaits[tid] = count();
      @fw_wait_ns[tid] = sum($d);
    }
  } else {
    if ($at.1) {
      if (args->ret > 0) { @fw_woken[pid, $at.1] = sum(args->ret); }
    } else {
      // a wait that began before the probe attached has ended: count its part in the window
      $b = @t_begin;
      $d = nsecs - $b;
      if ($b && $d >= __MIN_NS__) {
        @fw_wait_ns[tid] = sum($d);
        @fw_carried[tid] = count();
      }
      @fw_at[tid] = ((uint64)0, (uint64)1);
    }
  }
}
""".replace("__IS_WAIT__", _any_of("$cmd", WAIT_CMDS)).replace("__IS_WAKE__", _any_of("$cmd", WAKE_CMDS))
BPFTRACE_END = ""

# bcc text (used where bcc can compile: kernel headers present). Same maps, same
# meaning; keys of several fields are structs the collector flattens to tuples.
BCC_TEXT = """
struct fw_at_t { u64 since; u64 addr; };
struct fw_key3_t { u64 pid; u64 addr; u64 tid; };
struct fw_key2_t { u64 pid; u64 addr; };
BPF_HASH(fw_at, u64, struct fw_at_t, __MAX_ENTRIES__);
BPF_HASH(fw_nwaits, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_wait_ns, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_carried, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_wakes, struct fw_key3_t, u64, __MAX_ENTRIES__);
BPF_HASH(fw_woken, struct fw_key2_t, u64, __MAX_ENTRIES__);

TRACEPOINT_PROBE(syscalls, sys_enter_futex)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32;
    if (!(__FILTER__))
        return 0;
    u64 tid = (u32)id;
    int cmd = args->op & 0x7f;
    struct fw_at_t at = {.since = 0, .addr = (u64)args->uaddr};
    if (__IS_WAIT__) {
        at.since = bpf_ktime_get_ns();
    } else if (__IS_WAKE__) {
        struct fw_key3_t k = {.pid = pid, .addr = at.addr, .tid = tid};
        fw_wakes.increment(k);
        if (cmd == 5) {
            struct fw_key3_t k2 = {.pid = pid, .addr = (u64)args->uaddr2, .tid = tid};
            fw_wakes.increment(k2);
        }
    }
    fw_at.update(&tid, &at);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32;
    if (!(__FILTER__))
        return 0;
    u64 tid = (u32)id;
    u64 now = bpf_ktime_get_ns();
    struct fw_at_t *at = fw_at.lookup(&tid);
    if (at && at->since) {
        u64 d = now - at->since;
        if (d >= __MIN_NS__) {
            fw_nwaits.increment(tid);
            fw_wait_ns.increment(tid, d);
        }
        return 0;
    }
    if (at && at->addr) {
        if (args->ret > 0) {
            struct fw_key2_t k = {.pid = pid, .addr = at->addr};
            fw_woken.increment(k, args->ret);
        }
        return 0;
    }
    u64 begin = t_begin_ns();
    if (begin && now - begin >= __MIN_NS__) {
        fw_wait_ns.increment(tid, now - begin);
        fw_carried.increment(tid);
    }
    struct fw_at_t done = {.since = 0, .addr = 1};
    fw_at.update(&tid, &done);
    return 0;
}
""".replace("__IS_WAIT__", _any_of("cmd", WAIT_CMDS)).replace("__IS_WAKE__", _any_of("cmd", WAKE_CMDS))
BCC_CLEAR: tuple[str, ...] = ()

EPILOG = """examples:
    python -m wedgectl.probes.futexwait -p 4101              # pid 4101 and its children, 5 s
    python -m wedgectl.probes.futexwait -p 4101,4107 -d 10   # these two processes only, 10 s
    python -m wedgectl.probes.futexwait -p 4101 --json       # a JSON header, then one object per thread
    python -m wedgectl.probes.futexwait -p 4101 --backend procfs   # no eBPF: /proc's view, no wakes
    python -m wedgectl.probes.futexwait -p 4101 --ebpf       # print the bpftrace program (no root needed)
    python -m wedgectl.probes.futexwait -p 4101 --ebpf --backend bcc   # print the BPF C text for bcc
"""


# --- reading the maps back ------------------------------------------------------------


def thread_fields(maps: Maps, w: Window, traced: bool) -> dict[int, dict[str, Any]]:
    """tid -> the ThreadProbe fields this probe fills: the wait each thread is in at the end of the window.

    traced is False where the program did not run (the procfs back-end): the
    address and start then come from /proc alone, and waits and wakes are None.
    A wait the tracepoint saw begin, and that /proc still shows at the end on
    the same address, starts at its tracepoint; one begun before the attach
    starts at se.exec_start (calibrated), or, without it, at the window.
    waits and total_wait_s count only waits that outlasted the threshold.
    """
    wakes: dict[tuple[int, int], dict[int, int]] = {}
    for key, calls in table(maps, "fw_wakes").items():
        if isinstance(key, tuple) and len(key) == 3:
            wakes.setdefault((key[0], key[1]), {})[key[2]] = int(calls)
    wakes_traced = "fw_wakes" not in maps.get("untraced", ())  # rawtp sees no FUTEX_WAKE: unknown, not 0
    lost = set(maps.get("slot_lost", ()))  # rawtp: threads whose map slot another held, not traced
    at_map = table(maps, "fw_at")
    nwaits, carried, wait_ns = table(maps, "fw_nwaits"), table(maps, "fw_carried"), table(maps, "fw_wait_ns")
    out: dict[int, dict[str, Any]] = {}
    all_traced = traced
    for tid, st in w.end_states.items():
        traced = all_traced and tid not in lost
        st0 = w.start_states.get(tid)
        addr = start = None
        source = ""
        ref = w.end
        since, at_addr = pair(at_map.get(tid)) if traced else (0, 0)
        if since and st.in_futex_wait and st.futex_addr in (None, at_addr):
            addr, start, source = at_addr or st.futex_addr, since / 1e9, "tracepoint"
            ref = max(w.end, start)
        elif st.in_futex_wait:
            addr, ref = st.futex_addr, w.end_read_at
            es = w.exec_start_mono(st)
            if es is not None:
                start, source = es, "sched"
            elif st0 is not None and st0.in_futex_wait and st0.futex_addr == addr:
                start, source = w.begin, "window"
        ran = None
        if st0 is not None and st0.exec_start_s is not None and st.exec_start_s is not None:
            ran = st0.exec_start_s != st.exec_start_s
        events = traced and (tid in at_map or tid in nwaits or tid in carried)
        parked = bool(addr is not None and source in ("sched", "window") and st0 is not None
                      and st0.in_futex_wait and st0.futex_addr == addr and ran is not True and not events)
        waits = total = wake_calls = None
        wakers: tuple[int, ...] = ()
        if traced:
            waits = int(nwaits.get(tid, 0))
            total = wait_ns.get(tid, 0) / 1e9
            if start is not None:
                total += max(0.0, min(w.end, ref) - max(start, w.begin))
                waits += int(source == "tracepoint" and ref - start >= w.min_wait_s)
            total = min(total, w.seconds)
            if addr is not None and wakes_traced:
                by = wakes.get((st.pid, addr), {})
                wake_calls, wakers = sum(by.values()), tuple(sorted(by))
        out[tid] = {
            "futex_addr": addr,
            "wait_s": rounded(max(0.0, ref - start)) if start is not None else None,
            "wait_started": rounded(start + w.wall_offset, 3) if start is not None else None,
            "wait_source": source, "parked_throughout": parked,
            "waits": waits, "total_wait_s": rounded(total), "wakes_on_addr": wake_calls, "wakers": wakers,
        }
    return out


def wake_table(maps: Maps, most: int = MAX_WAKES_REPORTED) -> tuple[WakeCall, ...]:
    """Who called a wake op on which address, most calls first."""
    woken = table(maps, "fw_woken")
    rows = [WakeCall(pid=k[0], addr=k[1], waker=k[2], calls=int(calls), woken=int(woken.get((k[0], k[1]), 0)))
            for k, calls in table(maps, "fw_wakes").items() if isinstance(k, tuple) and len(k) == 3]
    rows.sort(key=lambda r: (-r.calls, r.pid, r.addr, r.waker))
    return tuple(rows[:most])


def main(argv: list[str] | None = None) -> int:
    return _tool.main(argv, (NAME,), prog="futexwait", summary=SUMMARY, epilog=EPILOG)


if __name__ == "__main__":
    sys.exit(main())
