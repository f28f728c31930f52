"""Read processes and threads from /proc without ever stopping the target.

One module per concern, their public names re-exported here (``procfs.read_threads``):
- `parse`: pure parsers of one /proc file's text (stat, wchan, syscall and futex(2), status, sched,
  schedstat, io), so unit tests feed recorded text;
- `stat`: one process's stat line, RSS, bytes read (io), owner, start time and open files; the host's
  boot time;
- `threads`: every thread of a process (`read_threads`) and top's `ThreadMemo`;
- `sched`: the scheduler's view of a thread at a probe window's edges, and a main thread's quiet
  and run delay;
- `clock`: each CPU's scheduler clock against CLOCK_MONOTONIC, carried forward by steal time;
- `cgroup`: a process's cpu cgroup and its CPU limit;
- `autogroup`: this process's session group, and the one write here: its nice.

The readers take a ``proc_root`` so tests can point them at a recorded tree.
"""

from __future__ import annotations

from wedgectl.collect.procfs._files import COLLECTOR, PROC, CLK_TCK, PAGE_SIZE
from wedgectl.collect.procfs.parse import (
    FUTEX_PRIVATE_FLAG, FUTEX_CLOCK_REALTIME, FUTEX_WAIT_CMDS, futex_syscall_numbers, decode_futex_op,
    is_futex_wait_op, StatFields, parse_stat, parse_wchan, parse_syscall, futex_from_syscall, parse_ctxt_switches,
    thread_from_texts, parse_exec_start, parse_schedstat, parse_io,
)
from wedgectl.collect.procfs.stat import (
    PF_EXITING, fd_links, innermost_pid, kill_pending, owner_uids, start_ticks, ProcessStat, read_process_stat,
    read_rss, read_io, BOOT_TTL_S, boot_time,
)
from wedgectl.collect.procfs.threads import ThreadMemo, own_fd_links, read_threads
from wedgectl.collect.procfs.clock import (
    CLOCK_READS, CLOCK_READ_TIGHT_S, CLOCK_SLEEP_S, offset_from_reads, sched_clock_offsets, cpu_steal_s,
    SchedClock, CLOCK,
)
from wedgectl.collect.procfs.sched import (
    own_run_delay_s, thread_schedstats, ThreadSched, sched_from_texts, read_thread_scheds, main_thread_quiet_s,
    main_thread_sched,
)
from wedgectl.collect.procfs.cgroup import cpu_cgroup, CGROUP_ROOT, read_cpu_limit
from wedgectl.collect.procfs.autogroup import autogroup_applies, set_own_autogroup_nice

__all__ = [
    "COLLECTOR", "PROC", "CLK_TCK", "PAGE_SIZE", "FUTEX_PRIVATE_FLAG", "FUTEX_CLOCK_REALTIME", "FUTEX_WAIT_CMDS",
    "futex_syscall_numbers", "decode_futex_op", "is_futex_wait_op", "StatFields", "parse_stat", "parse_wchan",
    "parse_syscall", "futex_from_syscall", "parse_ctxt_switches", "thread_from_texts", "parse_exec_start",
    "parse_schedstat", "parse_io",
    "PF_EXITING", "fd_links", "innermost_pid", "kill_pending", "owner_uids", "start_ticks",
    "ProcessStat", "read_process_stat",
    "read_rss", "read_io", "BOOT_TTL_S", "boot_time", "ThreadMemo", "own_fd_links", "read_threads", "CLOCK_READS",
    "CLOCK_READ_TIGHT_S", "CLOCK_SLEEP_S", "offset_from_reads", "sched_clock_offsets", "cpu_steal_s", "SchedClock",
    "CLOCK", "own_run_delay_s", "thread_schedstats", "ThreadSched", "sched_from_texts", "read_thread_scheds",
    "main_thread_quiet_s", "main_thread_sched", "cpu_cgroup", "CGROUP_ROOT", "read_cpu_limit", "autogroup_applies",
    "set_own_autogroup_nice",
]
