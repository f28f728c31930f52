"""The rawtp back-end: futexwait's and offcpu's work on the raw sched_switch tracepoint, in-process.

No bpftrace, no compiler, no child process: the program is assembled here, loaded with
bpf(2) BPF_PROG_LOAD and attached with BPF_RAW_TRACEPOINT_OPEN; closing the two
descriptors detaches it, so it cannot outlive wedgectl (a SIGKILL closes them too).

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

import ctypes
import functools
import os
import platform
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

from wedgectl.collect.procfs import FUTEX_WAIT_CMDS, futex_syscall_numbers

BTF_PATH = Path("/sys/kernel/btf/vmlinux")
BPF_NR = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
PT_REGS_MACHINES = ("x86_64",)  # the program reads the syscall number and its arguments from x86_64's pt_regs
WAIT_CMDS = tuple(sorted(FUTEX_WAIT_CMDS))  # the futex commands that park the caller, as /proc's reader counts them
MIN_KERNEL = (5, 18)  # sched_switch's prev_state argument
PROBES = ("futexwait", "offcpu")

BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN = 0, 1, 2, 5, 17
BPF_PROG_GET_NEXT_ID, BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD, BPF_ENABLE_STATS = 11, 13, 15, 32
# struct bpf_prog_info up to recursion_misses; run_time_ns, run_cnt at 192
PROG_INFO_SIZE, PROG_INFO_RUN_TIME = 216, 192
BPF_MAP_TYPE_ARRAY = 2
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
ATTR_SIZE = 128  # union bpf_attr, zero-padded: the kernel reads the fields it knows
LOG_SIZE = 1 << 16

# Helpers by number (include/uapi/linux/bpf.h)
MAP_LOOKUP_ELEM, KTIME_GET_NS, GET_CURRENT_TASK_BTF, TASK_PT_REGS = 1, 5, 158, 175

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


# --- instructions ------------------------------------------------------------------------

def insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction: opcode, dst/src registers in one byte, 16-bit offset, 32-bit immediate."""
    return struct.pack("<BBhi", op, (src << 4) | dst, off, imm)


EMPTY = insn(0xB7, 0, imm=0) + insn(0x95)  # r0 = 0; exit

Item = Union[bytes, tuple]  # an instruction, ("label", name), or ("jump", op, dst, src, imm, label)

_JUMP_IMM = {"==": 0x15, "!=": 0x55, "<": 0xA5}
_JUMP_REG = {"==": 0x1D, "!=": 0x5D, "<": 0xAD, ">": 0x2D}


def assemble(items: Sequence[Item]) -> bytes:
    """Instructions with named jump targets: ("label", name) marks a place, and
    ("jump", op, dst, src, imm, name) a conditional or plain jump to it."""
    at: dict[str, int] = {}
    n = 0
    for it in items:
        if isinstance(it, tuple) and it[0] == "label":
            if it[1] in at:
                raise ValueError(f"label {it[1]!r} twice")
            at[it[1]] = n
        else:
            n += len(it) // 8 if isinstance(it, bytes) else 1
    out, n = [], 0
    for it in items:
        if isinstance(it, bytes):
            out.append(it)
            n += len(it) // 8
        elif it[0] == "jump":
            _, op, dst, src, imm, name = it
            out.append(insn(op, dst, src, at[name] - n - 1, imm))
            n += 1
    return b"".join(out)


def ld_map(reg: int, fd: int) -> bytes:
    """reg = the map of this descriptor (a two-slot load the kernel rewrites to the map's address)."""
    return insn(0x18, reg, 1, 0, fd) + insn(0, 0, 0, 0, 0)


def ld_imm64(reg: int, value: int) -> bytes:
    lo, hi = struct.unpack("<ii", struct.pack("<Q", value & (2**64 - 1)))
    return insn(0x18, reg, 0, 0, lo) + insn(0, 0, 0, 0, hi)


def mov(dst: int, src: int) -> bytes:
    return insn(0xBF, dst, src)


def mov_imm(dst: int, imm: int) -> bytes:
    return insn(0xB7, dst, imm=imm)


def add(dst: int, src: int) -> bytes:
    return insn(0x0F, dst, src)


def add_imm(dst: int, imm: int) -> bytes:
    return insn(0x07, dst, imm=imm)


def sub(dst: int, src: int) -> bytes:
    return insn(0x1F, dst, src)


def load64(dst: int, src: int, off: int) -> bytes:
    return insn(0x79, dst, src, off)


def load32(dst: int, src: int, off: int) -> bytes:
    return insn(0x61, dst, src, off)


def store64(dst: int, src: int, off: int) -> bytes:
    return insn(0x7B, dst, src, off)


def call(helper: int) -> bytes:
    return insn(0x85, imm=helper)


def jump_if(op: str, dst: int, imm: int, label: str) -> tuple:
    """if dst <op> imm goto label (unsigned compares)."""
    return ("jump", _JUMP_IMM[op], dst, 0, imm, label)


def jump_if_reg(op: str, dst: int, src: int, label: str) -> tuple:
    """if dst <op> src goto label (unsigned compares)."""
    return ("jump", _JUMP_REG[op], dst, src, 0, label)


def goto(label: str) -> tuple:
    return ("jump", 0x05, 0, 0, 0, label)


def label(name: str) -> tuple:
    return ("label", name)


def bump(slot: int, field: str, by: int | None = None) -> list[bytes]:
    """slot.field += 1 (by None) or += register `by`; r1 is used."""
    return [load64(1, slot, OFF[field]), add_imm(1, 1) if by is None else add(1, by), store64(slot, 1, OFF[field])]


# --- bpf(2) -------------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None  # loaded at the first call, then kept: a read calls bpf(2) per thread


def _bpf(cmd: int, attr: bytes) -> int:
    return _bpf_buf(cmd, ctypes.create_string_buffer(attr.ljust(ATTR_SIZE, b"\0"), ATTR_SIZE))


def _bpf_buf(cmd: int, buf: ctypes.Array) -> int:
    """bpf(2) on an attribute buffer the kernel may write back into (an id, a descriptor)."""
    global _libc
    nr = BPF_NR.get(platform.machine())
    if nr is None:
        raise OSError(f"no bpf(2) number known for {platform.machine()}")
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    fd = _libc.syscall(nr, cmd, buf, ATTR_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def load(code: bytes = EMPTY) -> int:
    """A raw-tracepoint program's descriptor; OSError with the verifier's last words when refused."""
    text = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(LOG_SIZE)
    # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf
    attr = struct.pack("<IIQQIIQ", BPF_PROG_TYPE_RAW_TRACEPOINT, len(code) // 8, ctypes.addressof(text),
                       ctypes.addressof(license_), 1, LOG_SIZE, ctypes.addressof(log))
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except OSError as exc:
        verifier = log.value.decode(errors="replace").strip()
        raise OSError(exc.errno, f"{exc.strerror}{': ' + verifier[-300:] if verifier else ''}") from None


def array_map(value_size: int, entries: int) -> int:
    """An array map (u32 index) of `entries` zeroed values; its descriptor."""
    return _bpf(BPF_MAP_CREATE, struct.pack("<IIIII", BPF_MAP_TYPE_ARRAY, 4, value_size, entries, 0))


def lookup(map_fd: int, index: int, value_size: int) -> bytes:
    k = ctypes.create_string_buffer(struct.pack("<I", index), 4)
    v = ctypes.create_string_buffer(value_size)
    _bpf(BPF_MAP_LOOKUP_ELEM, struct.pack("<IIQQ", map_fd, 0, ctypes.addressof(k), ctypes.addressof(v)))
    return v.raw


def update(map_fd: int, index: int, value: bytes) -> None:
    k = ctypes.create_string_buffer(struct.pack("<I", index), 4)
    v = ctypes.create_string_buffer(value, len(value))
    _bpf(BPF_MAP_UPDATE_ELEM, struct.pack("<IIQQQ", map_fd, 0, ctypes.addressof(k), ctypes.addressof(v), 0))


def attach(prog_fd: int, tracepoint: str) -> int:
    """Attach a loaded program to a raw tracepoint (e.g. "sched_switch"); the link's descriptor."""
    name = ctypes.create_string_buffer(tracepoint.encode())
    return _bpf(BPF_RAW_TRACEPOINT_OPEN, struct.pack("<QI", ctypes.addressof(name), prog_fd))


@contextmanager
def attached(tracepoints: tuple[str, ...], code: bytes = EMPTY) -> Iterator[None]:
    """The program on each of these raw tracepoints for the with-block; detached after, however it ends."""
    fds: list[int] = []
    try:
        for tp in tracepoints:
            fds.append(load(code))
            fds.append(attach(fds[-1], tp))
        yield
    finally:
        for fd in reversed(fds):
            os.close(fd)


# --- what the loaded programs cost: the kernel's own run-time statistics (bench/) ------------

def prog_ids() -> list[int]:
    """The ids of every BPF program loaded on the host, any loader's."""
    ids: list[int] = []
    at = 0
    while True:
        attr = ctypes.create_string_buffer(struct.pack("<III", at, 0, 0), ATTR_SIZE)
        try:
            _bpf_buf(BPF_PROG_GET_NEXT_ID, attr)
        except OSError:  # ENOENT: past the last one
            return ids
        at = struct.unpack_from("<I", attr.raw, 4)[0]
        ids.append(at)


def prog_run_time(prog_id: int) -> tuple[int, int] | None:
    """(ns spent in the program, times it ran) since it was loaded, counted while run_time_stats()
    is held by anyone; None if the program has gone."""
    try:
        fd = _bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("<III", prog_id, 0, 0))
    except OSError:
        return None
    try:
        info = ctypes.create_string_buffer(PROG_INFO_SIZE)
        _bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, PROG_INFO_SIZE, ctypes.addressof(info)))
        ns, runs = struct.unpack_from("<QQ", info.raw, PROG_INFO_RUN_TIME)
        return ns, runs
    finally:
        os.close(fd)


@contextmanager
def run_time_stats() -> Iterator[None]:
    """The kernel counts each program's run time while this is held (BPF_ENABLE_STATS; each run then
    pays two clock reads), and stops when it is released, however the block ends."""
    fd = _bpf(BPF_ENABLE_STATS, struct.pack("<I", 0))  # BPF_STATS_RUN_TIME
    try:
        yield
    finally:
        os.close(fd)


# --- the kernel's BTF: where a field of one of its structs sits -----------------------------

_BTF_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}  # kind: bytes after the type record (INT, ARRAY, VAR, DECL_TAG)
_BTF_PER_MEMBER = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # STRUCT, UNION, ENUM, FUNC_PROTO, DATASEC, ENUM64


def btf_offsets(wanted: dict[str, set[str]], data: bytes) -> dict[str, dict[str, int]]:
    """Byte offsets of these direct fields of these structs, from BTF `data` (the type section:
    a record per type, with a kind-dependent tail). One pass over the types. ValueError when a
    struct or field is missing, or the data is not BTF."""
    if len(data) < 24:
        raise ValueError("BTF too short")
    magic, _, _, hdr_len, type_off, type_len, str_off, _ = struct.unpack_from("<HBBIIIII", data, 0)
    if magic != 0xEB9F:
        raise ValueError("not BTF")
    strings = hdr_len + str_off

    def name(off: int) -> str:
        end = data.find(b"\0", strings + off)
        return data[strings + off:end if end >= 0 else len(data)].decode(errors="replace")

    found: dict[str, dict[str, int]] = {}
    pos, end = hdr_len + type_off, min(len(data), hdr_len + type_off + type_len)
    try:
        while pos + 12 <= end and len(found) < len(wanted):
            name_off, info, _ = struct.unpack_from("<III", data, pos)
            pos += 12
            kind, vlen, bitfield_offsets = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            if kind == 4 and (sname := name(name_off)) in wanted and sname not in found:
                fields = {}
                for i in range(vlen):
                    m_name, _, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                    if (n := name(m_name)) in wanted[sname]:
                        fields[n] = (m_off & 0xFFFFFF if bitfield_offsets else m_off) // 8
                missing = wanted[sname] - fields.keys()
                if missing:
                    raise ValueError(f"struct {sname} has no {', '.join(sorted(missing))}")
                found[sname] = fields
            pos += _BTF_EXTRA.get(kind, 0) + _BTF_PER_MEMBER.get(kind, 0) * vlen
    except struct.error:
        raise ValueError("BTF truncated") from None
    if missing_structs := wanted.keys() - found.keys():
        raise ValueError(f"no struct {', '.join(sorted(missing_structs))} in the BTF")
    return found


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
