#!/usr/bin/env python3
"""offcpu: per-thread on-CPU, blocked and run-queue time of a process tree over a window.

Traces tracepoint:sched:sched_switch. A switch *out* of a target thread ends
its on-CPU interval and starts an off-CPU one, marked "preempted" when the
thread was still runnable (prev_state & 0xff == 0: R or R+) and "blocked"
otherwise; the switch back *in* ends it. So a spinning thread reads as on-CPU
(or run-queue, when the CPUs are contended) and a parked one as blocked,
without sampling stacks. No stack ids, no per-event output: only sums.

Which threads are targets: the out side is filtered on the current task's pid
(tgid) in the kernel; the in side, where only next_pid (a tid) is known, looks
the tid up in @oc_tgt, seeded at attach time with every thread of the target
pids that /proc lists (at most 2048; later threads join on their first switch
out). A thread with no switch in the window was on or off the whole window;
the collector decides which from /proc/PID/task/TID/schedstat.

Overhead: sched_switch fires for every context switch on the host; each
costs a pid compare and a hash lookup, a target's a few map updates. Measured
with bench/probe_overhead.py at ~500k switches/s (2 loaded vCPUs): throughput
0.81 of untraced, CPU per hand-off up 20-60 %, ~0.2-0.9 us per switch; with
futexwait, 0.60-0.74. A vLLM server switches ~10-15k times a second (measured
here): about 1 % of one CPU. Maps are bounded (--max-entries); the program
exits by itself after --duration seconds.

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
OFFCPU_OVERHEAD = ("worst case, ~500k context switches/s on 2 loaded vCPUs: throughput ratio 0.81, "
                   "CPU per hand-off ratio 0.61-0.83 (~0.2-0.9 us per switch); with futexwait 0.60-0.74; "
                   "bench/probe_overhead.py --each")
OVERHEAD = OFFCPU_OVERHEAD
MAPS = ("oc_on_since", "oc_off_since", "oc_preempted", "oc_oncpu_ns", "oc_offcpu_ns", "oc_runq_ns",
        "oc_nsleep", "oc_npreempt", "oc_lost")

# __SEED__ becomes "@oc_tgt[TID] = 1;" lines for the threads /proc lists at attach.
BPFTRACE_BEGIN = "__SEED__"
BPFTRACE_PROBES = """
tracepoint:sched:sched_switch
{
  // @t_live: set in BEGIN, cleared when the window's timer fires.
  // @oc_tgt[tid]: 1 = seeded, no event yet; 2 = seen. Only a thread's first event may
  // reach back to @t_begin; a later one whose other half is missing (a BPF program run
  // the kernel skipped) is dropped and counted in @oc_lost, never stretched.
  if ((__FILTER__) && @t_live) {
    $p = (uint64)args->prev_pid;
    $on = @oc_on_since[$p];
    if ($on == 0 && @oc_tgt[$p] != 2) { $on = @t_begin; }
    if ($on) { @oc_oncpu_ns[$p] = sum(nsecs - $on); } else { @oc_lost[$p] = count(); }
    @oc_tgt[$p] = 2;
    delete(@oc_on_since[$p]);
    @oc_off_since[$p] = nsecs;
    if ((args->prev_state & 0xff) == 0) {
      @oc_preempted[$p] = 1;
      @oc_npreempt[$p] = count();
    } else {
      delete(@oc_preempted[$p]);
      @oc_nsleep[$p] = count();
    }
  }
  $n = (uint64)args->next_pid;
  $t = @oc_tgt[$n];
  if ($t && @t_live) {
    $off = @oc_off_since[$n];
    if ($off == 0 && $t != 2) { $off = @t_begin; }
    if ($off) {
      if (@oc_preempted[$n]) {
        @oc_runq_ns[$n] = sum(nsecs - $off);
      } else {
        @oc_offcpu_ns[$n] = sum(nsecs - $off);
      }
    } else {
      @oc_lost[$n] = count();
    }
    @oc_tgt[$n] = 2;
    delete(@oc_off_since[$n]);
    delete(@oc_preempted[$n]);
    @oc_on_since[$n] = nsecs;
  }
}
"""
BPFTRACE_END = "  clear(@oc_tgt);\n"

BCC_TEXT = """
BPF_HASH(oc_tgt, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_on_since, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_off_since, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_preempted, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_oncpu_ns, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_offcpu_ns, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_runq_ns, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_nsleep, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_npreempt, u64, u64, __MAX_ENTRIES__);
BPF_HASH(oc_lost, u64, u64, __MAX_ENTRIES__);

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 begin = t_begin_ns();
    if (!begin)
        return 0;
    u64 pid = bpf_get_current_pid_tgid() >> 32;
    u64 now = bpf_ktime_get_ns();
    u64 one = 1, two = 2;
    if (__FILTER__) {
        u64 p = args->prev_pid;
        u64 *tg = oc_tgt.lookup(&p);
        u64 *on = oc_on_since.lookup(&p);
        u64 since = on ? *on : ((tg && *tg == 2) ? 0 : begin);
        if (since)
            oc_oncpu_ns.increment(p, now - since);
        else
            oc_lost.increment(p);
        oc_tgt.update(&p, &two);
        oc_on_since.delete(&p);
        oc_off_since.update(&p, &now);
        if ((args->prev_state & 0xff) == 0) {
            oc_preempted.update(&p, &one);
            oc_npreempt.increment(p);
        } else {
            oc_preempted.delete(&p);
            oc_nsleep.increment(p);
        }
    }
    u64 n = args->next_pid;
    u64 *t = oc_tgt.lookup(&n);
    if (t) {
        u64 *off = oc_off_since.lookup(&n);
        u64 since = off ? *off : (*t == 2 ? 0 : begin);
        if (!since)
            oc_lost.increment(n);
        else if (oc_preempted.lookup(&n))
            oc_runq_ns.increment(n, now - since);
        else
            oc_offcpu_ns.increment(n, now - since);
        oc_tgt.update(&n, &two);
        oc_off_since.delete(&n);
        oc_preempted.delete(&n);
        oc_on_since.update(&n, &now);
    }
    return 0;
}
"""
BCC_CLEAR = ("oc_tgt",)

EPILOG = """examples:
    python -m wedgectl.probes.offcpu -p 4101             # on/off-CPU time of pid 4101's threads (and children's), 5 s
    python -m wedgectl.probes.offcpu -p 4101 -d 2 --json # JSON lines
    python -m wedgectl.probes.offcpu -p 4101 --ebpf      # print the bpftrace program (no root needed)
"""


# --- reading the maps back ------------------------------------------------------------


def thread_fields(maps: Maps, w: Window, traced: bool) -> dict[int, dict[str, Any]]:
    """tid -> oncpu_s, offcpu_s and runq_s over the window.

    From the program's sums where it saw the thread switch; from schedstat's
    exact counters where it did not (no switch in the window, or traced is
    False), and where lost events (a program run the kernel skipped) leave the
    sums short of the window: they are never long.
    """
    window = w.seconds
    on_ns, off_ns, rq_ns = table(maps, "oc_oncpu_ns"), table(maps, "oc_offcpu_ns"), table(maps, "oc_runq_ns")
    on_since, off_since = table(maps, "oc_on_since"), table(maps, "oc_off_since")
    preempted, lost = table(maps, "oc_preempted"), table(maps, "oc_lost")
    out: dict[int, dict[str, Any]] = {}
    for tid, st in w.end_states.items():
        st0 = w.start_states.get(tid)
        on = off = rq = d_on = d_rq = None
        if st.oncpu_ns is not None and st.runq_ns is not None:
            base_on, base_rq = (st0.oncpu_ns or 0, st0.runq_ns or 0) if st0 is not None else (0, 0)
            d_on = min(window, max(0.0, (st.oncpu_ns - base_on) / 1e9))
            d_rq = min(window, max(0.0, (st.runq_ns - base_rq) / 1e9))
        seen = traced and any(tid in m for m in (on_ns, off_ns, rq_ns, on_since, off_since))
        if seen:
            on, off, rq = on_ns.get(tid, 0) / 1e9, off_ns.get(tid, 0) / 1e9, rq_ns.get(tid, 0) / 1e9
            if tid in on_since:
                on += max(0.0, w.end - on_since[tid] / 1e9)
            if tid in off_since:
                rest = max(0.0, w.end - off_since[tid] / 1e9)
                if tid in preempted:
                    rq += rest
                else:
                    off += rest
            if d_on is not None and d_rq is not None and (
                    tid in lost or abs(on + off + rq - window) > max(0.1, 0.1 * window)):
                on, rq = d_on, d_rq
                off = max(0.0, window - on - rq)
        elif d_on is not None and d_rq is not None:
            on, rq = d_on, d_rq
            off = max(0.0, window - on - rq)
        out[tid] = {"oncpu_s": rounded(on), "offcpu_s": rounded(off), "runq_s": rounded(rq)}
    return out


def main(argv: list[str] | None = None) -> int:
    return _tool.main(argv, (NAME,), prog="offcpu", summary=SUMMARY, epilog=EPILOG)


if __name__ == "__main__":
    sys.exit(main())
