"""The rawtp back-end: futexwait's and offcpu's work on the raw sched_switch tracepoint, in-process.

No bpftrace, no compiler, no child process: the program is assembled here, loaded with
bpf(2) BPF_PROG_LOAD and attached with BPF_RAW_TRACEPOINT_OPEN; closing the two
descriptors detaches it, so it cannot outlive wedgectl (a SIGKILL closes them too). The
instructions, the bpf(2) calls and the BTF reader it is built with are `collect.bpf`'s.

Why the scheduler and not the futex syscall: on the futex storm an *empty* program on the
futex syscall tracepoints already costs 11-15 % of throughput (every syscall on the host
takes the slow path, and each futex call fills a perf record), while one on raw
sched_switch costs 0-2 % (bench/probe_overhead.py --attach-points). A futex wait long
enough to matter always shows at the scheduler: the thread sleeps in FUTEX_WAIT and is
switched out, and is switched back in when woken.

What runs, on the switch-out of a thread of the target tgids only (another process's switch
costs a helper call, a load and a compare per tgid), with one array slot per thread:

- the clock: "now" is the scheduler's, read from the task switching out, with no helper call:
  when it last got a CPU (sched_info.last_arrival) plus the CPU time it has run since
  (se.sum_exec_runtime - se.prev_sum_exec_runtime, both brought up to date on the way out).
  The first switch-out of one of wedgectl's own threads after the attach also reads
  bpf_ktime_get_ns into a one-entry epoch map: read() turns the program's times into
  CLOCK_MONOTONIC ones with it.
- futexwait: a thread that goes to sleep (not preempted; prev_state interruptible or
  uninterruptible, not stopped or traced) inside the futex syscall with a wait op has (now,
  address, its CPU time) put in its slot. At its next switch-out, of any kind, that wait has
  ended: it ended when the thread last got a CPU (sched_info.last_arrival). A wait that
  outlasted the threshold is counted and summed; one that ended before it began (the clocks
  disagree) is not counted. A wait whose thread was woken and ran on to the detach without
  another switch-out is closed by read(), against /proc's read at the end (ended_wait_ns).
  A thread already in a futex wait when the program attached (read from
  /proc/PID/task/TID/syscall) gets its slot seeded: the program notes when that wait ended,
  and read() counts it from the attach as "carried", as the tracepoint version counts it.
- offcpu: what the time since the thread's previous switch-out holds beyond its CPU time and
  its run-queue time (se.sum_exec_runtime, sched_info.run_delay), it spent blocked; blocks
  over the threshold are counted and summed.

What it does not do: FUTEX_WAKE calls (who woke which address) are not traced, so the wake
table is empty and each thread's wakes are unknown (None), not zero; nor pylockwait (a
uprobe). Fields are read through bpf_get_current_task_btf and bpf_task_pt_regs at the
offsets the kernel's BTF (/sys/kernel/btf/vmlinux) gives, and the verifier checks each load
against it. Needs x86_64 (the futex syscall number, pt_regs), Linux 5.18 or later (the
tracepoint's prev_state argument; the helpers are 5.11 and 5.15), BTF, and root or
CAP_BPF + CAP_PERFMON.

A slot is tid % modulus, the modulus picked so that the threads present at the attach each
get their own; a thread that appears later and lands on a slot another holds goes uncounted,
and is reported (read(): "slot_lost"; its waits read as unknown). Limits: prev_sum_exec_runtime
is the fair class's, so a real-time thread's "now" runs ahead and its waits are not counted
("clocks disagree") or counted short; a wait split inside one syscall (a spurious wake-up, a restart) counts as two,
or, if
resumed through restart_syscall, not at all.
"""

from __future__ import annotations

import functools
import os
import platform
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from wedgectl.collect.bpf import (
    GET_CURRENT_TASK_BTF, KTIME_GET_NS, MAP_LOOKUP_ELEM, TASK_PT_REGS, Item, add, add_imm, array_map, assemble,
    attach, call, goto, insn, jump_if, jump_if_reg, label, ld_imm64, ld_map, load, load32, load64, lookup, mov,
    mov_imm, store64, sub, update,
)
# bench/ and the tests reach these through this module, beside the program they measure
from wedgectl.collect.bpf import attached as attached, btf_offsets, prog_ids as prog_ids
from wedgectl.collect.bpf import prog_run_time as prog_run_time, run_time_stats as run_time_stats
from wedgectl.collect.procfs import FUTEX_WAIT_CMDS, futex_syscall_numbers

BTF_PATH = Path("/sys/kernel/btf/vmlinux")
PT_REGS_MACHINES = ("x86_64",)  # the program reads the syscall number and its arguments from x86_64's pt_regs
WAIT_CMDS = tuple(sorted(FUTEX_WAIT_CMDS))  # the futex commands that park the caller, as /proc's reader counts them
MIN_KERNEL = (5, 18)  # sched_switch's prev_state argument
PROBES = ("futexwait", "offcpu")

# One slot per thread, u64 fields in this order.
FIELDS = ("tid", "since", "addr", "nwaits", "wait_ns", "carried_open", "carried_end", "seen",
          "oc_at", "oc_run", "oc_rq", "oc_nblocked", "oc_blocked_ns", "open_ran")
# The clock epoch: one entry, (CLOCK_MONOTONIC ns, the scheduler's clock ns) read together, at a
# switch-out of one of wedgectl's own threads: how read() turns the program's times into monotonic ones.
EPOCH = ("mono", "sched")
OFF = {name: 8 * i for i, name in enumerate(FIELDS)}
SLOT = 8 * len(FIELDS)
MAX_SLOTS = 1 << 16  # 7.3 MB of kernel memory at most
MODULUS_TRIES = 512
EPOCH_WAIT_S = 1.0  # for the program's first run on one of wedgectl's own threads (a 1 ms sleep gives one)


def bump(slot: int, field: str, by: int | None = None) -> list[bytes]:
    """slot.field += 1 (by None) or += register `by`; r1 is used."""
    return [load64(1, slot, OFF[field]), add_imm(1, 1) if by is None else add(1, by), store64(slot, 1, OFF[field])]


PROGRAM_FIELDS = {
    "task_struct": {"pid", "tgid", "se", "sched_info"},
    "sched_entity": {"sum_exec_runtime", "prev_sum_exec_runtime"},
    "sched_info": {"run_delay", "last_arrival"},
    "pt_regs": {"orig_ax", "si", "di"},
}


@functools.lru_cache(maxsize=1)
def kernel_offsets(path: Path = BTF_PATH) -> dict[str, int]:
    """The offsets the program reads, flattened (e.g. "ran": task_struct.se + sched_entity.sum_exec_runtime)."""
    o = btf_offsets(PROGRAM_FIELDS, path.read_bytes())
    task, se = o["task_struct"], o["sched_entity"]
    return {"pid": task["pid"], "tgid": task["tgid"],
            "ran": task["se"] + se["sum_exec_runtime"], "ran_before": task["se"] + se["prev_sum_exec_runtime"],
            "run_delay": task["sched_info"] + o["sched_info"]["run_delay"],
            "arrived": task["sched_info"] + o["sched_info"]["last_arrival"],
            "orig_ax": o["pt_regs"]["orig_ax"], "si": o["pt_regs"]["si"], "di": o["pt_regs"]["di"]}


# --- the program --------------------------------------------------------------------------

def now_into(dst: int, tmp: int, o: dict[str, int]) -> list[bytes]:
    """dst = the scheduler's clock at this switch-out, with no helper call: when the task (r7) last
    got a CPU (sched_info.last_arrival) plus the CPU time it has run since then (se.sum_exec_runtime
    - se.prev_sum_exec_runtime, both brought up to date on the way out). tmp is used."""
    return [load64(dst, 7, o["ran"]), load64(tmp, 7, o["ran_before"]), sub(dst, tmp),
            load64(tmp, 7, o["arrived"]), add(dst, tmp)]


def sched_program(tgids: Sequence[int], slots_fd: int, modulus: int, min_ns: int, probes: Iterable[str],
                  offsets: dict[str, int], futex_nr: int, wait_cmds: Sequence[int], epoch_fd: int,
                  own_tgid: int) -> bytes:
    """The sched_switch program (see the module's text). Registers: r6 the tracepoint's arguments
    (u64 each: preempt, prev, next, prev_state), r7 the task switching out, r8 its tid, r9 its slot;
    the stack holds the slot index (fp-4), the epoch's index (fp-8) and now (fp-16). Times are the
    scheduler's clock (now_into), read from the task, not bpf_ktime_get_ns: that helper was 40-80 ns
    of each run on the futex storm (bench/probe_overhead.py --attach-points). The first switch-out
    of one of wedgectl's own threads (own_tgid) records both clocks in the epoch map."""
    probes = set(probes)
    fw, oc = "futexwait" in probes, "offcpu" in probes
    o = offsets
    items: list[Item] = [
        mov(6, 1), call(GET_CURRENT_TASK_BTF), mov(7, 0),
        load32(1, 7, o["tgid"]), jump_if("!=", 1, int(own_tgid), "filter"),
        # wedgectl's own thread: the epoch, once (the helper's cost is paid here only)
        mov_imm(1, 0), insn(0x63, 10, 1, -8),
        ld_map(1, epoch_fd), mov(2, 10), add_imm(2, -8), call(MAP_LOOKUP_ELEM),
        jump_if("==", 0, 0, "reload"), mov(9, 0),
        load64(1, 9, 0), jump_if("!=", 1, 0, "reload"),
        call(KTIME_GET_NS), store64(9, 0, 0), *now_into(1, 2, o), store64(9, 1, 8),
        label("reload"),
        load32(1, 7, o["tgid"]),
        label("filter"),
        *[jump_if("==", 1, int(t), "in") for t in tgids], goto("out"),
        label("in"),
        load32(8, 7, o["pid"]),
        mov(1, 8), insn(0x97, 1, imm=modulus), insn(0x63, 10, 1, -4),  # *(u32 *)(fp - 4) = tid % modulus
        ld_map(1, slots_fd), mov(2, 10), add_imm(2, -4), call(MAP_LOOKUP_ELEM),
        jump_if("==", 0, 0, "out"), mov(9, 0),
        *now_into(1, 2, o), store64(10, 1, -16),
        load64(1, 9, OFF["tid"]), jump_if_reg("==", 1, 8, "mine"),
        # another thread's slot: this one goes uncounted (read() names it), the holder keeps its counts
        jump_if("!=", 1, 0, "out"),
        # an empty slot: this thread takes it, with nothing open
        store64(9, 8, OFF["tid"]),
        goto("fresh"),
        label("mine"),
    ]
    if fw:  # the wait this thread slept in has ended: when it last got a CPU
        items += [
            load64(0, 7, o["arrived"]),
            load64(5, 9, OFF["carried_open"]), jump_if("!=", 5, 0, "fw_carried"),
            load64(2, 9, OFF["since"]), jump_if("==", 2, 0, "fw_done"),
            mov_imm(1, 0), store64(9, 1, OFF["since"]),
            jump_if_reg("<", 0, 2, "fw_done"),  # back before it began: the clocks disagree, not counted
            sub(0, 2),  # the wait
            ld_imm64(4, min_ns), jump_if_reg("<", 0, 4, "fw_done"),
            *bump(9, "wait_ns", 0), *bump(9, "nwaits"), goto("fw_done"),
            # a wait in progress at the attach: read() counts it from there, in the monotonic clock
            label("fw_carried"), mov_imm(1, 0), store64(9, 1, OFF["carried_open"]), store64(9, 0, OFF["carried_end"]),
            label("fw_done"),
        ]
    if oc:  # what the time since its last switch-out holds beyond CPU and run-queue time, it was blocked
        items += [
            load64(1, 9, OFF["oc_at"]), jump_if("==", 1, 0, "fresh"),
            load64(2, 10, -16), sub(2, 1),  # elapsed
            load64(3, 7, o["ran"]), load64(4, 9, OFF["oc_run"]), sub(3, 4),
            load64(4, 7, o["run_delay"]), load64(5, 9, OFF["oc_rq"]), sub(4, 5), add(3, 4),  # used
            ld_imm64(4, min_ns), add(4, 3), jump_if_reg("<", 2, 4, "fresh"),  # elapsed < used + threshold
            sub(2, 3), *bump(9, "oc_blocked_ns", 2), *bump(9, "oc_nblocked"),
        ]
    items += [label("fresh")]
    if oc:
        items += [load64(1, 10, -16), store64(9, 1, OFF["oc_at"]), load64(1, 7, o["ran"]), store64(9, 1, OFF["oc_run"]),
                  load64(1, 7, o["run_delay"]), store64(9, 1, OFF["oc_rq"])]
    items += [mov_imm(1, 1), store64(9, 1, OFF["seen"])]
    if fw:  # a thread that goes to sleep inside a futex wait opens one
        items += [
            # asleep, not preempted on the way (ctx[0]) and not stopped or traced (a stop is no futex wait)
            load64(1, 6, 0), jump_if("!=", 1, 0, "out"),
            load64(1, 6, 24), insn(0x57, 1, imm=0xF), jump_if("==", 1, 0, "out"),
            jump_if("==", 1, 1, "asleep"), jump_if("==", 1, 2, "asleep"), jump_if("!=", 1, 3, "out"),
            label("asleep"),
            mov(1, 7), call(TASK_PT_REGS),
            load64(1, 0, o["orig_ax"]), jump_if("!=", 1, futex_nr, "out"),
            load64(1, 0, o["si"]), insn(0x57, 1, imm=0x7F),
            *[jump_if("==", 1, cmd, "wait") for cmd in wait_cmds], goto("out"),
            label("wait"),
            load64(2, 0, o["di"]), store64(9, 2, OFF["addr"]), load64(1, 10, -16), store64(9, 1, OFF["since"]),
            load64(1, 7, o["ran"]), store64(9, 1, OFF["open_ran"]),
        ]
    items += [label("out"), mov_imm(0, 0), insn(0x95)]
    return assemble(items)


def pick_modulus(tids: Iterable[int], most: int = MAX_SLOTS, tries: int = MODULUS_TRIES) -> int:
    """The slot count (slot = tid % it) at most `most` under which these threads share no slot, or,
    where none of `tries` candidates does, the one under which the fewest do."""
    tids = sorted(set(tids))
    best, best_shared = most, len(tids)
    for m in range(most, max(1, most - tries), -1):
        shared = len(tids) - len({t % m for t in tids})
        if shared < best_shared:
            best, best_shared = m, shared
        if shared == 0:
            break
    return best


def ended_wait_ns(since: int, ran_at_open: int, t_end: int, ran_end: int | None) -> int | None:
    """A wait opened at `since` (its thread had run `ran_at_open` CPU ns) whose thread was woken and
    ran on to `t_end` without being switched out again: it ended when the thread got the CPU back,
    t_end less the CPU time it ran since (schedstat's `ran_end`, read just after). None where that
    cannot be told (no CPU figures, or ones that disagree with the span)."""
    if not ran_at_open or ran_end is None or ran_end < ran_at_open:
        return None
    back = t_end - (ran_end - ran_at_open)
    return back - since if back >= since else None


def kernel_too_old(release: str) -> bool:
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return False  # an unknown release: the load says
    return (major, minor) < MIN_KERNEL


def unsupported(probes: Iterable[str], machine: str, release: str) -> str | None:
    """Why this host or probe set cannot use rawtp, or None (privilege and BTF are checked elsewhere)."""
    if extra := [p for p in probes if p not in PROBES]:
        return f"runs {' and '.join(PROBES)} only, not {', '.join(extra)}"
    if machine not in PT_REGS_MACHINES or futex_syscall_numbers(machine) is None:
        return f"x86_64 only (the futex syscall number and pt_regs), not {machine}"
    if kernel_too_old(release):
        return f"needs Linux {MIN_KERNEL[0]}.{MIN_KERNEL[1]} or later (sched_switch's prev_state), not {release}"
    return None


def _futex_nr(machine: str) -> int:
    numbers = futex_syscall_numbers(machine)
    if numbers is None:
        raise OSError(f"no futex syscall number known for {machine}")
    return numbers[0]


@functools.lru_cache(maxsize=8)
def trial(probes: tuple[str, ...]) -> None:
    """Load the program once, on a small map, and unload it: OSError (with the verifier's words) or
    ValueError (the BTF) where this kernel will not take it. Nothing is attached. Cached: a kernel
    that took it once takes it again."""
    machine = platform.machine()
    if (why := unsupported(probes, machine, platform.release())) is not None:
        raise OSError(why)
    slots = array_map(SLOT, 64)
    try:
        epoch = array_map(8 * len(EPOCH), 1)
        try:
            os.close(load(sched_program([os.getpid()], slots, 64, 0, probes, kernel_offsets(), _futex_nr(machine),
                                        WAIT_CMDS, epoch, os.getpid())))
        finally:
            os.close(epoch)
    finally:
        os.close(slots)


class SchedProbe:
    """The program on sched_switch for these tgids from construction until detach(); read() then
    returns what it counted, as the maps futexwait's and offcpu's parsers read."""

    def __init__(self, tgids: Sequence[int], probes: Sequence[str], min_ns: int, seeds: dict[int, tuple[int, int]],
                 tids: Iterable[int] = ()) -> None:
        """seeds: tid -> (futex address, CPU ns it had run, from schedstat) of each thread in a futex wait
        at the attach: its wait is carried."""
        machine = platform.machine()
        if (why := unsupported(probes, machine, platform.release())) is not None:
            raise OSError(why)
        self.probes = tuple(p for p in probes if p in PROBES)
        self.modulus = pick_modulus([*tids, *seeds])
        self.shared = self._shared([*tids, *seeds])
        self._lock = threading.Lock()
        self.fds: list[int] = []
        self.slots: int | None = array_map(SLOT, self.modulus)
        self.epoch: int | None = None
        self.t_end: int | None = None
        self.min_ns = max(0, int(min_ns))
        try:
            self.epoch = array_map(8 * len(EPOCH), 1)
            code = sched_program(tgids, self.slots, self.modulus, self.min_ns, self.probes, kernel_offsets(),
                                 _futex_nr(machine), WAIT_CMDS, self.epoch, os.getpid())
            self.instructions = len(code) // 8
            self.fds.append(load(code))
            # a carried wait counts from here (CLOCK_MONOTONIC); the seeds go in just before the attach
            self.seeded_at = time.monotonic_ns()
            if "futexwait" in self.probes:
                for tid, (addr, ran) in seeds.items():
                    update(self.slots, tid % self.modulus,
                           self.slot_bytes(tid=tid, addr=addr, carried_open=1, open_ran=ran))
            self.fds.append(attach(self.fds[0], "sched_switch"))
            self.t_begin = time.monotonic_ns()
            self.offset = self._clock_offset()
        except BaseException:
            self.close()
            raise

    def _clock_offset(self, within_s: float = EPOCH_WAIT_S) -> int:
        """CLOCK_MONOTONIC less the scheduler's clock, from the epoch the program records at a
        switch-out of one of this process's threads: this thread's sleeps give it one."""
        assert self.epoch is not None
        deadline = time.monotonic() + within_s
        while True:
            time.sleep(0.001)
            mono, sched = struct.unpack(f"<{len(EPOCH)}Q", lookup(self.epoch, 0, 8 * len(EPOCH)))
            if mono:
                return mono - sched
            if time.monotonic() > deadline:
                raise OSError(f"the program did not run in {within_s:g} s (no switch-out of wedgectl's own thread)")

    def _shared(self, tids: list[int]) -> set[int]:
        by: dict[int, list[int]] = {}
        for t in set(tids):
            by.setdefault(t % self.modulus, []).append(t)
        return {t for group in by.values() if len(group) > 1 for t in group}

    @staticmethod
    def slot_bytes(**values: int) -> bytes:
        return struct.pack(f"<{len(FIELDS)}Q", *(values.get(f, 0) for f in FIELDS))

    def detach(self) -> None:
        """Take the program off the tracepoint (idempotent, from any thread); the counts stay readable."""
        with self._lock:
            fds, self.fds = self.fds, []
            if fds:
                self.t_end = time.monotonic_ns()
            for fd in reversed(fds):
                os.close(fd)

    @property
    def attached(self) -> bool:
        return bool(self.fds)

    def read(self, ends: dict[int, tuple[int | None, int | None]]) -> dict[str, Any]:
        """The maps as the bpftrace back-end prints them, for these threads: fw_at (tid -> (start,
        address) of a wait in progress, (0, address) for a thread seen since the attach), fw_nwaits,
        fw_wait_ns, fw_carried, oc_nblocked, oc_blocked_ns; t_begin and t_end; "untraced" (the maps
        this back-end has no way to fill) and "slot_lost" (threads whose slot another thread held).

        ends: tid -> (the futex address it waits on at the end, None if none; its CPU ns then, from
        schedstat) as /proc read it after the detach. A wait the program opened closes only at the
        thread's next switch-out: one whose thread was woken and ran on to the detach without
        another is closed here, where the end read shows it no longer in that wait (ended_wait_ns)."""
        if self.slots is None:
            raise OSError("the probe's map is closed")
        maps: dict[str, Any] = {n: {} for n in ("fw_at", "fw_nwaits", "fw_wait_ns", "fw_carried",
                                               "oc_nblocked", "oc_blocked_ns")}
        t_end = self.t_end if self.t_end is not None else time.monotonic_ns()
        lost = set(self.shared)
        for tid in sorted(ends):
            v = dict(zip(FIELDS, struct.unpack(f"<{len(FIELDS)}Q", lookup(self.slots, tid % self.modulus, SLOT))))
            if v["tid"] != tid:
                if v["tid"] or tid in self.shared:
                    lost.add(tid)
                continue
            ncarried = 0
            if v["carried_end"]:  # a wait in progress at the attach, ended when its thread got a CPU back
                d = v["carried_end"] + self.offset - self.seeded_at
                if d >= self.min_ns:
                    v["wait_ns"] += d
                    ncarried += 1
            # a wait still open in the program, monotonic: carried ones from the attach
            since = self.seeded_at if v["carried_open"] else v["since"] + self.offset if v["since"] else 0
            waiting_on, ran_end = ends[tid]
            if since and waiting_on != v["addr"]:  # woken since, and never switched out after
                d = ended_wait_ns(since, v["open_ran"], t_end, ran_end)
                if d is not None and d >= self.min_ns:
                    v["wait_ns"] += d
                    if v["carried_open"]:
                        ncarried += 1
                    else:
                        v["nwaits"] += 1
                since, v["carried_open"], v["seen"] = 0, 0, 1
            if "futexwait" in self.probes and v["seen"]:
                maps["fw_at"][tid] = (0 if v["carried_open"] else since, v["addr"])
            for name, value in (("fw_nwaits", v["nwaits"]), ("fw_wait_ns", v["wait_ns"]), ("fw_carried", ncarried),
                                ("oc_nblocked", v["oc_nblocked"]), ("oc_blocked_ns", v["oc_blocked_ns"])):
                if value:
                    maps[name][tid] = value
        maps["t_begin"] = self.t_begin
        maps["t_end"] = t_end
        maps["untraced"] = ("fw_wakes", "fw_woken")
        maps["slot_lost"] = tuple(sorted(lost & set(ends)))
        return maps

    def describe(self) -> str:
        return (f"rawtp: {' + '.join(self.probes)} on raw sched_switch, {self.instructions} instructions, "
                f"{self.modulus} slots of {SLOT} bytes")

    def close(self) -> None:
        self.detach()
        for fd in (self.slots, self.epoch):
            if fd is not None:
                os.close(fd)
        self.slots = self.epoch = None

    def __enter__(self) -> SchedProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
