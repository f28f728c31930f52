#!/usr/bin/env python3
"""pylockwait: blocking Python lock acquires per thread, via a uprobe on libpython's PyThread_acquire_lock_timed.

Optional (opt-in: `wedgectl probes --pylocks`, `--pylocks` here): a uprobe on a
shared library fires for *every* process mapping it, so each Python lock
acquire on the host takes a trap (~1-3 us) before the pid filter drops it.
Both probes' predicate is the tgid compare alone. Only blocking acquires
(timeout argument != 0: Lock.acquire(), with-blocks that contend,
Condition/Event/Queue waits) are timed, with a uretprobe, and only those that
outlast the threshold (--min-wait-ms, default 10) are counted, in kernel maps.

Per thread: the lock pointer of the acquire it is blocked in now (on Linux a
Python lock is a sem_t*, whose first word is the futex, so it equals the
futex address futexwait reports), when that began, how many blocking
acquires over the threshold and their total time; per (pid, lock): the last
thread that got it by such an acquire in the window.

The library is found in /proc/PID/maps (libpython3.X.so) or, for a static
interpreter, /proc/PID/exe. Overhead, measured with bench/probe_overhead.py
(~55k blocking acquires/s): with futexwait+offcpu, throughput 0.26-0.32 of
untraced; the uretprobe on a hot function is what costs. Hence opt-in.

Exit status: 0 traced; 2 usage; 3 no back-end can run here; 4 permission;
5 target gone; 6 the probe failed to start or to report.
"""

from __future__ import annotations

import sys
from typing import Any

from wedgectl.probes import _tool
from wedgectl.probes._window import Maps, Window, pair, rounded, table

NAME = "pylockwait"
SUMMARY = "blocking Python lock acquires per thread (uprobe on PyThread_acquire_lock_timed)"
SYMBOL = "PyThread_acquire_lock_timed"
TRACEPOINTS: tuple[str, ...] = ()
PYLOCKWAIT_OVERHEAD = ("worst case, ~55k blocking acquires/s plus every acquire on the host trapping: "
                       "throughput ratio 0.26-0.32 with futexwait+offcpu (measured before the threshold; the "
                       "trap is the cost); opt-in for that reason; bench/probe_overhead.py")
OVERHEAD = PYLOCKWAIT_OVERHEAD
MAPS = ("pl_at", "pl_n", "pl_ns", "pl_owner")

BPFTRACE_BEGIN = ""
# Repeated once per distinct library (__LIB__) the target pids map. The tgid filter is the
# whole predicate of both probes: a uprobe on a shared library fires for every process
# that maps it, and all another process pays is the trap and one compare. @pl_at[tid] =
# (start, lock) of the blocking acquire in progress; acquires shorter than __MIN_NS__
# (the threshold, --min-wait-ms) are not counted.
BPFTRACE_PROBES = """
uprobe:__LIB__:PyThread_acquire_lock_timed /__FILTER__/
{
  if (arg1 != 0) {
    @pl_at[tid] = (nsecs, (uint64)arg0);
  }
}

uretprobe:__LIB__:PyThread_acquire_lock_timed /__FILTER__/
{
  $at = @pl_at[tid];
  if ($at.0) {
    $d = nsecs - $at.0;
    if ($d >= __MIN_NS__) {
      @pl_n[tid] = count();
      @pl_ns[tid] = sum($d);
      if (retval == 1) { @pl_owner[pid, $at.1] = tid; }
    }
    delete(@pl_at[tid]);
  }
}
"""
BPFTRACE_END = ""

BCC_TEXT = """
struct pl_at_t { u64 since; u64 lock; };
struct pl_key2_t { u64 pid; u64 addr; };
BPF_HASH(pl_at, u64, struct pl_at_t, __MAX_ENTRIES__);
BPF_HASH(pl_n, u64, u64, __MAX_ENTRIES__);
BPF_HASH(pl_ns, u64, u64, __MAX_ENTRIES__);
BPF_HASH(pl_owner, struct pl_key2_t, u64, __MAX_ENTRIES__);

int pl_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32;
    if (!(__FILTER__) || PT_REGS_PARM2(ctx) == 0)
        return 0;
    u64 tid = (u32)id;
    struct pl_at_t at = {.since = bpf_ktime_get_ns(), .lock = PT_REGS_PARM1(ctx)};
    pl_at.update(&tid, &at);
    return 0;
}

int pl_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 pid = id >> 32;
    if (!(__FILTER__))
        return 0;
    u64 tid = (u32)id;
    struct pl_at_t *at = pl_at.lookup(&tid);
    if (!at)
        return 0;
    u64 d = bpf_ktime_get_ns() - at->since;
    if (d >= __MIN_NS__) {
        pl_n.increment(tid);
        pl_ns.increment(tid, d);
        if (PT_REGS_RC(ctx) == 1) {
            struct pl_key2_t k = {.pid = pid, .addr = at->lock};
            u64 t = tid;
            pl_owner.update(&k, &t);
        }
    }
    pl_at.delete(&tid);
    return 0;
}
"""
# (library, symbol, bcc function) attachments the bcc runner makes for each library
BCC_UPROBES = ((SYMBOL, "pl_enter", "pl_return"),)
BCC_CLEAR: tuple[str, ...] = ()

EPILOG = """examples:
    python -m wedgectl.probes.pylockwait -p 4101         # blocking Python lock acquires of pid 4101's tree, 5 s
    python -m wedgectl.probes.pylockwait -p 4101 --json  # JSON lines
    python -m wedgectl.probes.pylockwait -p 4101 --ebpf  # print the bpftrace program (with the library found)
"""


# --- reading the maps back ------------------------------------------------------------


def thread_fields(maps: Maps, w: Window, traced: bool) -> dict[int, dict[str, Any]]:
    """tid -> pylock_addr, pylock_waits, pylock_wait_s; {} where the uprobe did not run (no /proc view of it).

    Counts blocking acquires that outlasted the threshold: those that returned,
    and the one a thread is still in at the end when it already has.
    """
    if not traced:
        return {}
    at, n, ns = table(maps, "pl_at"), table(maps, "pl_n"), table(maps, "pl_ns")
    out: dict[int, dict[str, Any]] = {}
    for tid in w.end_states:
        addr = None
        waits = int(n.get(tid, 0))
        secs = ns.get(tid, 0) / 1e9
        since, lock = pair(at.get(tid))
        if since:
            addr = lock or None
            secs += max(0.0, w.end - max(since / 1e9, w.begin))
            waits += int(w.end - since / 1e9 >= w.min_wait_s)
        out[tid] = {"pylock_addr": addr, "pylock_waits": waits, "pylock_wait_s": rounded(min(secs, w.seconds))}
    return out


def main(argv: list[str] | None = None) -> int:
    return _tool.main(argv, (NAME,), prog="pylockwait", summary=SUMMARY, epilog=EPILOG)


if __name__ == "__main__":
    sys.exit(main())
