#!/usr/bin/env python3
"""futexwait: per-thread futex waits of a process tree, and who called FUTEX_WAKE on which address.

Traces tracepoint:syscalls:sys_enter_futex and sys_exit_futex, filtered in the
kernel to the target pids. Per thread: the futex address and start time of
the wait it is in now, how many waits it began and how long it spent waiting
in the window; per (pid, address): which threads called a wake op on it, how
often, and how many waiters those calls woke.

A thread parked since *before* the probe attached fires no sys_enter_futex in
the window. Its wait start comes from /proc/PID/task/TID/sched `se.exec_start`
(the last time it ran, on the scheduler's clock, calibrated per CPU against
CLOCK_MONOTONIC): see wedgectl/collect/ebpf.py and probes/README.md.

Overhead, measured with bench/probe_overhead.py (4 Python thread pairs
ping-ponging through queue.Queue, ~440k futex calls/s, 2 vCPUs loaded by other
work): throughput 0.88 of untraced, CPU per hand-off up 6-50 %, i.e. ~0.1-0.6
us per futex call. While attached, every syscall on the host takes the slow
path of syscall tracing, and a non-target call costs a pid compare. A vLLM
server makes a few thousand futex calls a second: well under 1 % of a CPU. Maps are bounded (--max-entries, default 4096 per map); a full
map drops new keys and the result says so. The program exits by itself after
--duration seconds (an in-kernel interval probe), so a killed wedgectl never
leaves it attached.

Exit status: 0 traced; 2 usage; 3 no back-end can run here (reason printed);
4 permission (needs root, or CAP_BPF + CAP_PERFMON); 5 target gone;
6 the probe failed to start or to report.
"""

from __future__ import annotations

import argparse
import sys

NAME = "futexwait"
SUMMARY = "futex waits per thread (address, start, count, total) and FUTEX_WAKE calls per address"
TRACEPOINTS = ("syscalls:sys_enter_futex", "syscalls:sys_exit_futex")
FUTEXWAIT_OVERHEAD = ("worst case, 4 Python thread pairs at ~440k futex calls/s on 2 loaded vCPUs: "
                      "throughput ratio 0.88 traced/untraced, CPU per hand-off ratio 0.66-0.94 "
                      "(~0.1-0.6 us per call); bench/probe_overhead.py --each")
OVERHEAD = FUTEXWAIT_OVERHEAD

# futex(2) commands (op & 0x7f: the private flag is 128, FUTEX_CLOCK_REALTIME 256)
WAIT_CMDS = (0, 6, 9, 11, 13)  # WAIT, LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2
WAKE_CMDS = (1, 3, 4, 5, 7, 10, 12)  # WAKE, REQUEUE, CMP_REQUEUE, WAKE_OP, UNLOCK_PI, WAKE_BITSET, CMP_REQUEUE_PI

# Map names the program fills; the collector reads them by these names.
MAPS = ("fw_wait_since", "fw_wait_addr", "fw_nwaits", "fw_wait_ns", "fw_carried",
        "fw_wakes", "fw_woken", "fw_busy")


def _any_of(var: str, values: tuple[int, ...]) -> str:
    return " || ".join(f"{var} == {v}" for v in values)


# bpftrace text. __FILTER__ becomes the pid predicate ("pid == 4101 || pid == 4102"),
# tested first so other processes' calls cost one compare. @t_live is set by the BEGIN
# block the collector adds once every probe is attached (so nothing half-attached
# counts) and cleared when the window's timer fires (so nothing after it counts).
BPFTRACE_BEGIN = ""
BPFTRACE_PROBES = """
tracepoint:syscalls:sys_enter_futex /(__FILTER__) && @t_live/
{
  $cmd = args->op & 0x7f;
  $addr = (uint64)args->uaddr;
  if (__IS_WAIT__) {
    @fw_wait_since[tid] = nsecs;
    @fw_wait_addr[tid] = $addr;
    @fw_nwaits[tid] = count();
  } else {
    @fw_busy[tid] = $addr + 1;
    if (__IS_WAKE__) {
      @fw_wakes[pid, $addr, tid] = count();
      if ($cmd == 5) { @fw_wakes[pid, (uint64)args->uaddr2, tid] = count(); }
    }
  }
}

tracepoint:syscalls:sys_exit_futex /(__FILTER__) && @t_live/
{
  $since = @fw_wait_since[tid];
  $busy = @fw_busy[tid];
  if ($since) {
    @fw_wait_ns[tid] = sum(nsecs - $since);
    delete(@fw_wait_since[tid]);
    delete(@fw_wait_addr[tid]);
  } else {
    if ($busy) {
      if (args->ret > 0) { @fw_woken[pid, $busy - 1] = sum(args->ret); }
      delete(@fw_busy[tid]);
    } else {
      // a wait that began before the probe attached has ended: count its part in the window
      @fw_wait_ns[tid] = sum(nsecs - @t_begin);
      @fw_carried[tid] = count();
    }
  }
}
""".replace("__IS_WAIT__", _any_of("$cmd", WAIT_CMDS)).replace("__IS_WAKE__", _any_of("$cmd", WAKE_CMDS))
BPFTRACE_END = "  clear(@fw_busy);\n"

# bcc text (used where bcc can compile: kernel headers present). Same maps, same
# meaning; keys of several fields are structs the collector flattens to tuples.
BCC_TEXT = """
struct fw_key3_t { u64 pid; u64 addr; u64 tid; };
struct fw_key2_t { u64 pid; u64 addr; };
BPF_HASH(fw_wait_since, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_wait_addr, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_nwaits, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_wait_ns, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_carried, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_busy, u64, u64, __MAX_ENTRIES__);
BPF_HASH(fw_wakes, struct fw_key3_t, u64, __MAX_ENTRIES__);
BPF_HASH(fw_woken, struct fw_key2_t, u64, __MAX_ENTRIES__);

TRACEPOINT_PROBE(syscalls, sys_enter_futex)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32, tid = (u32)id;
    if (!(__FILTER__) || !t_begin_ns())
        return 0;
    int cmd = args->op & 0x7f;
    u64 addr = (u64)args->uaddr;
    u64 now = bpf_ktime_get_ns();
    if (__IS_WAIT__) {
        fw_wait_since.update(&tid, &now);
        fw_wait_addr.update(&tid, &addr);
        fw_nwaits.increment(tid);
        return 0;
    }
    u64 busy = addr + 1;
    fw_busy.update(&tid, &busy);
    if (__IS_WAKE__) {
        struct fw_key3_t k = {.pid = pid, .addr = addr, .tid = tid};
        fw_wakes.increment(k);
        if (cmd == 5) {
            struct fw_key3_t k2 = {.pid = pid, .addr = (u64)args->uaddr2, .tid = tid};
            fw_wakes.increment(k2);
        }
    }
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32, tid = (u32)id;
    u64 begin = t_begin_ns();
    if (!begin || !(__FILTER__))
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 *since = fw_wait_since.lookup(&tid);
    if (since) {
        u64 d = now - *since;
        fw_wait_ns.increment(tid, d);
        fw_wait_since.delete(&tid);
        fw_wait_addr.delete(&tid);
        return 0;
    }
    u64 *busy = fw_busy.lookup(&tid);
    if (busy) {
        if (args->ret > 0) {
            struct fw_key2_t k = {.pid = pid, .addr = *busy - 1};
            fw_woken.increment(k, args->ret);
        }
        fw_busy.delete(&tid);
        return 0;
    }
    fw_wait_ns.increment(tid, now - begin);
    fw_carried.increment(tid);
    return 0;
}
""".replace("__IS_WAIT__", _any_of("cmd", WAIT_CMDS)).replace("__IS_WAKE__", _any_of("cmd", WAKE_CMDS))
BCC_CLEAR = ("fw_busy",)

EPILOG = """examples:
    ./futexwait.py -p 4101              # futex waits of pid 4101 and its children, 5 s
    ./futexwait.py -p 4101,4107 -d 10   # these two processes only, 10 s
    ./futexwait.py -p 4101 --json       # one JSON object per thread (and a header)
    ./futexwait.py -p 4101 --backend procfs   # no eBPF: /proc's view, wait durations from se.exec_start
    ./futexwait.py -p 4101 --ebpf       # print the bpftrace program and exit (no root needed)
    ./futexwait.py -p 4101 --ebpf --backend bcc   # print the BPF C text for bcc
"""


def parse_args(argv: list[str] | None = None, prog: str = "futexwait.py", epilog: str = EPILOG,
               description: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=description or SUMMARY, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--pid", required=True,
                   help="pid(s) to trace, comma-separated; each one's descendants are traced too")
    p.add_argument("-d", "--duration", type=float, default=5.0, help="seconds to trace (default 5, at most 300)")
    p.add_argument("--backend", choices=("auto", "bcc", "bpftrace", "procfs"), default="auto",
                   help="force a back-end (default: the best this host supports)")
    p.add_argument("--max-entries", type=int, default=4096, help="entries per BPF map (default 4096)")
    p.add_argument("--no-children", action="store_true", help="trace the given pids only, not their descendants")
    p.add_argument("--json", action="store_true", help="print JSON lines: a header, then one object per thread")
    p.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None, probes: tuple[str, ...] = (NAME,), **kw) -> int:
    args = parse_args(argv, **kw)
    try:
        from wedgectl.collect import ebpf
    except ImportError:  # pragma: no cover - run from a checkout without wedgectl installed
        sys.path.insert(0, __file__.rsplit("/", 2)[0])
        from wedgectl.collect import ebpf
    return ebpf.tool_main(args, probes)


if __name__ == "__main__":
    sys.exit(main())
