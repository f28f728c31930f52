#!/usr/bin/env python3
"""offcpu: per-thread on-CPU, blocked and run-queue time of a process tree over a window.

Traces tracepoint:sched:sched_switch, filtered in the kernel to the target
pids first: the tracepoint fires in the context of the thread switching out,
so the filter is on its tgid and another process's switch costs one compare.
For a target thread switching out, the program reads the kernel's own
counters of that thread (se.sum_exec_runtime: on-CPU ns; sched_info.run_delay:
ns runnable but waiting for a CPU) and compares them with its previous
switch-out: what the elapsed time holds beyond those two, the thread spent
blocked. Blocks that outlast the threshold (--min-wait-ms, default 10) are
counted and summed per thread; shorter ones leave nothing. One map read and
one write per switch-out of a target thread, nothing on a switch in.

The window's on-CPU and run-queue times are the same counters read through
/proc/PID/task/TID/schedstat at the window's edges (exact, the kernel's own
accounting); blocked time is the rest of the window, and never less than the
long blocks the program summed.

Overhead: bench/probe_overhead.py measures it side by side in one run, on a
futex storm and on a serving vLLM server (--vllm); the figures it printed
here are in OVERHEAD. Maps are bounded (--max-entries); the program exits by
itself after --duration seconds.

Exit status: 0 traced; 2 usage; 3 no back-end can run here; 4 permission;
5 target gone; 6 the probe failed to start or to report.
"""

from __future__ import annotations

import sys
from typing import Any

from wedgectl.probes import _tool
from wedgectl.probes._window import Maps, Window, rounded, table

NAME = "offcpu"
SUMMARY = "on-CPU, blocked (off-CPU) and run-queue time per thread over the window"
TRACEPOINTS = ("sched:sched_switch",)
OFFCPU_OVERHEAD = ("runs on target switch-outs only: futex storm, ~400k switches/s on 2 loaded vCPUs, "
                   "throughput ratio (paired) 0.99 on rawtp, 0.92-0.93 on bpftrace; serving vLLM (tiny model, 4 "
                   "streams): 0.92-1.11 "
                   "on a host whose untraced rounds swung 3x; bench/probe_overhead.py --each --vllm")
OVERHEAD = OFFCPU_OVERHEAD
MAPS = ("oc_out", "oc_nblocked", "oc_blocked_ns")

# @oc_out[tid] = (time, on-CPU ns, run-queue ns) at the thread's last switch-out. The
# subtraction is arranged so that nothing goes below zero (the values are unsigned).
BPFTRACE_BEGIN = ""
BPFTRACE_PROBES = """
tracepoint:sched:sched_switch /__FILTER__/
{
  $run = curtask->se.sum_exec_runtime;
  $rq = curtask->sched_info.run_delay;
  $last = @oc_out[tid];
  if ($last.0) {
    $elapsed = nsecs - $last.0;
    $used = ($run - $last.1) + ($rq - $last.2);
    if ($elapsed >= $used + __MIN_NS__) {
      @oc_nblocked[tid] = count();
      @oc_blocked_ns[tid] = sum($elapsed - $used);
    }
  }
  @oc_out[tid] = (nsecs, $run, $rq);
}
"""
BPFTRACE_END = ""

BCC_TEXT = """
#include <linux/sched.h>
struct oc_out_t { u64 at; u64 run; u64 rq; };
BPF_HASH(oc_out, u64, struct oc_out_t, __MAX_ENTRIES__);
BPF_HASH(oc_nblocked, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_blocked_ns, u64, u64, __MAX_ENTRIES__);

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32;
    if (!(__FILTER__))
        return 0;
    u64 tid = (u32)id;
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    struct oc_out_t now = {.at = bpf_ktime_get_ns()};
    bpf_probe_read_kernel(&now.run, sizeof(now.run), &task->se.sum_exec_runtime);
    bpf_probe_read_kernel(&now.rq, sizeof(now.rq), &task->sched_info.run_delay);
    struct oc_out_t *last = oc_out.lookup(&tid);
    if (last && last->at) {
        u64 elapsed = now.at - last->at;
        u64 used = (now.run - last->run) + (now.rq - last->rq);
        if (elapsed >= used + __MIN_NS__) {
            oc_nblocked.increment(tid);
            oc_blocked_ns.increment(tid, elapsed - used);
        }
    }
    oc_out.update(&tid, &now);
    return 0;
}
"""
BCC_CLEAR: tuple[str, ...] = ()

EPILOG = """examples:
    python -m wedgectl.probes.offcpu -p 4101             # on/off-CPU time of pid 4101's threads (and children's), 5 s
    python -m wedgectl.probes.offcpu -p 4101 -d 2 --json # JSON lines
    python -m wedgectl.probes.offcpu -p 4101 --ebpf      # print the bpftrace program (no root needed)
"""


# --- reading the maps back ------------------------------------------------------------


def thread_fields(maps: Maps, w: Window, traced: bool) -> dict[int, dict[str, Any]]:
    """tid -> oncpu_s, offcpu_s and runq_s over the window.

    On-CPU and run-queue time are schedstat's counters at the window's edges
    (the ones the program reads too), clipped to the window; blocked is the
    rest of it, and at least the long blocks the program summed (all there is
    where schedstat cannot be read).
    """
    window = w.seconds
    blocked = table(maps, "oc_blocked_ns") if traced else {}
    out: dict[int, dict[str, Any]] = {}
    for tid, st in w.end_states.items():
        st0 = w.start_states.get(tid)
        on = off = rq = None
        long_blocks = min(window, blocked.get(tid, 0) / 1e9)
        if st.oncpu_ns is not None and st.runq_ns is not None:
            base_on, base_rq = (st0.oncpu_ns or 0, st0.runq_ns or 0) if st0 is not None else (0, 0)
            on = min(window, max(0.0, (st.oncpu_ns - base_on) / 1e9))
            rq = min(window - on, max(0.0, (st.runq_ns - base_rq) / 1e9))
            off = max(long_blocks, window - on - rq)
        elif tid in blocked:
            off = long_blocks
        out[tid] = {"oncpu_s": rounded(on), "offcpu_s": rounded(off), "runq_s": rounded(rq)}
    return out


def main(argv: list[str] | None = None) -> int:
    return _tool.main(argv, (NAME,), prog="offcpu", summary=SUMMARY, epilog=EPILOG)


if __name__ == "__main__":
    sys.exit(main())
