"""The least that loads an eBPF program on a raw tracepoint, through bpf(2) itself.

For bench/probe_overhead.py --attach-points: what an attach point costs by itself, measured
with an empty program (return 0), so that no program written for it can cost less; and what
a program doing futexwait's work at the scheduler costs (futex_waits_program). A raw
tracepoint (BPF_PROG_TYPE_RAW_TRACEPOINT) skips the perf record a classic tracepoint fills
before its program runs; bpftrace 0.17, which the probes use, has no raw tracepoint probe, so
this goes to the kernel directly: BPF_PROG_LOAD, then BPF_RAW_TRACEPOINT_OPEN. Closing the
two descriptors detaches the program.

Needs root (or CAP_BPF + CAP_PERFMON). Linux only; the bpf(2) number is per machine.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

BPF_NR = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_PROG_LOAD = 5
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_MAP_TYPE_ARRAY = 2
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
ATTR_SIZE = 128  # union bpf_attr, zero-padded: the kernel reads the fields it knows
LOG_SIZE = 1 << 16


def insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction: opcode, dst/src registers in one byte, 16-bit offset, 32-bit immediate."""
    return struct.pack("<BBhi", op, (src << 4) | dst, off, imm)


EMPTY = insn(0xB7, 0, imm=0) + insn(0x95)  # r0 = 0; exit


# Helpers by number (include/uapi/linux/bpf.h)
MAP_LOOKUP_ELEM, KTIME_GET_NS, GET_CURRENT_TASK_BTF, TASK_PT_REGS = 1, 5, 158, 175

Item = Union[bytes, tuple]  # an instruction, ("label", name), or ("jump", op, dst, src, imm, label)


def assemble(items: list[Item]) -> bytes:
    """Instructions with named jump targets: ("label", name) marks a place, and
    ("jump", op, dst, src, imm, name) a conditional or plain jump to it."""
    at: dict[str, int] = {}
    n = 0
    for it in items:
        if isinstance(it, tuple) and it[0] == "label":
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


def mov(dst: int, src: int) -> bytes:
    return insn(0xBF, dst, src)


def mov_imm(dst: int, imm: int) -> bytes:
    return insn(0xB7, dst, imm=imm)


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
    return ("jump", {"==": 0x15, "!=": 0x55, "<": 0xA5}[op], dst, 0, imm, label)


_libc: ctypes.CDLL | None = None  # loaded at the first call, then kept: map reads call bpf(2) per key


def _bpf(cmd: int, attr: bytes) -> int:
    global _libc
    nr = BPF_NR.get(platform.machine())
    if nr is None:
        raise OSError(f"no bpf(2) number known for {platform.machine()}")
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    libc = _libc
    buf = ctypes.create_string_buffer(attr.ljust(ATTR_SIZE, b"\0"), ATTR_SIZE)
    fd = libc.syscall(nr, cmd, buf, ATTR_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def load(code: bytes = EMPTY) -> int:
    """A raw-tracepoint program's descriptor; OSError with the verifier's log when refused."""
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
        raise OSError(exc.errno, f"{exc.strerror}{': ' + verifier[-500:] if verifier else ''}") from None


def array_map(value_size: int, entries: int) -> int:
    """An array map (u32 index) of `entries` zeroed values; its descriptor."""
    return _bpf(BPF_MAP_CREATE, struct.pack("<IIIII", BPF_MAP_TYPE_ARRAY, 4, value_size, entries, 0))


def lookup(map_fd: int, key: bytes, value_size: int) -> bytes:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value_size)
    _bpf(BPF_MAP_LOOKUP_ELEM, struct.pack("<IIQQ", map_fd, 0, ctypes.addressof(k), ctypes.addressof(v)))
    return v.raw


def attach(prog_fd: int, tracepoint: str) -> int:
    """Attach a loaded program to a raw tracepoint (e.g. "sys_enter", "sched_switch"); the link's fd."""
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


# --- the kernel's BTF: where a field of one of its structs sits -----------------------------

_BTF_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}  # kind: bytes after the type record (INT, ARRAY, VAR, DECL_TAG)
_BTF_PER_MEMBER = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # STRUCT, UNION, ENUM, FUNC_PROTO, DATASEC, ENUM64


def btf_offsets(struct_name: str, fields: set[str], path: Path = Path("/sys/kernel/btf/vmlinux")) -> dict[str, int]:
    """Byte offsets of these direct fields of `struct struct_name` in the running kernel, from its
    BTF (the type section: a record per type, with a kind-dependent tail)."""
    data = path.read_bytes()
    magic, _, _, hdr_len, type_off, type_len, str_off, _ = struct.unpack_from("<HBBIIIII", data, 0)
    if magic != 0xEB9F:
        raise ValueError(f"{path}: not BTF")
    strings = hdr_len + str_off

    def name(off: int) -> str:
        return data[strings + off:data.index(b"\0", strings + off)].decode()

    pos, end = hdr_len + type_off, hdr_len + type_off + type_len
    while pos < end:
        name_off, info, _ = struct.unpack_from("<III", data, pos)
        pos += 12
        kind, vlen, bitfield_offsets = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        if kind == 4 and name(name_off) == struct_name:
            found = {}
            for i in range(vlen):
                m_name, _, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                if name(m_name) in fields:
                    found[name(m_name)] = (m_off & 0xFFFFFF if bitfield_offsets else m_off) // 8
            missing = fields - found.keys()
            if missing:
                raise ValueError(f"struct {struct_name} has no {', '.join(sorted(missing))}")
            return found
        pos += _BTF_EXTRA.get(kind, 0) + _BTF_PER_MEMBER.get(kind, 0) * vlen
    raise ValueError(f"no struct {struct_name} in {path}")


# --- futexwait's work at the scheduler ------------------------------------------------------

FUTEX_NR = {"x86_64": 202}
FUTEX_WAIT_CMDS = (0, 6, 9, 11, 13)  # as probes/futexwait.py: WAIT, LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2
SLOT = 40  # per thread: tid, since (ns, 0 = not in a wait), futex address, waits over the threshold, their ns
SLOTS = 1 << 16  # slot = tid & (SLOTS - 1); a thread whose slot another holds is not seen


def futex_waits_program(tgid: int, slots_fd: int, min_ns: int) -> bytes:
    """sched_switch, on the switch-out of a thread of `tgid` only. A thread that sleeps in a
    futex wait has (now, address) put in its slot. At its next switch-out, of any kind, that
    wait has ended: it ended when the thread got the CPU back, now less the CPU time it has run
    since (sum_exec_runtime - prev_sum_exec_runtime), and a wait that outlasted `min_ns` is
    counted and summed. Nothing runs when a thread is switched in, and another process's switch
    costs two loads and a compare. Fields from the kernel's BTF, read through the pointers
    bpf_get_current_task_btf and bpf_task_pt_regs give (the verifier checks each against it).
    x86_64 only (the futex syscall number and pt_regs)."""
    nr = FUTEX_NR.get(platform.machine())
    if nr is None:
        raise OSError(f"no futex syscall number known for {platform.machine()}")
    task = btf_offsets("task_struct", {"pid", "tgid", "se"})
    se = btf_offsets("sched_entity", {"sum_exec_runtime", "prev_sum_exec_runtime"})
    regs = btf_offsets("pt_regs", {"orig_ax", "si", "di"})
    ran, ran_before = task["se"] + se["sum_exec_runtime"], task["se"] + se["prev_sum_exec_runtime"]
    # r6 ctx (u64 args: preempt, prev, next, prev_state), r7 the task, r8 its tid, r9 its slot
    return assemble([
        mov(6, 1), call(GET_CURRENT_TASK_BTF), mov(7, 0),
        load32(1, 7, task["tgid"]), jump_if("!=", 1, tgid, "out"),
        load32(8, 7, task["pid"]),
        mov(1, 8), insn(0x57, 1, imm=SLOTS - 1), insn(0x63, 10, 1, -4),  # *(u32 *)(fp - 4) = tid & mask
        ld_map(1, slots_fd), mov(2, 10), insn(0x07, 2, imm=-4), call(MAP_LOOKUP_ELEM),
        jump_if("==", 0, 0, "out"), mov(9, 0),
        call(KTIME_GET_NS), store64(10, 0, -16),
        load64(1, 9, 0), ("jump", 0x5D, 1, 8, 0, "open"),  # the slot is another thread's
        load64(2, 9, 8), jump_if("==", 2, 0, "open"),  # no wait in progress
        load64(3, 7, ran), load64(4, 7, ran_before), insn(0x1F, 3, 4),  # CPU since it got the CPU back
        load64(0, 10, -16), insn(0x1F, 0, 2), mov_imm(1, 0), store64(9, 1, 8),  # now - since; wait over
        ("jump", 0x2D, 3, 0, 0, "open"),  # ran longer than that: the two clocks disagree, not counted
        insn(0x1F, 0, 3),  # the wait: back on a CPU - since
        jump_if("<", 0, min_ns, "open"),
        load64(1, 9, 24), insn(0x07, 1, imm=1), store64(9, 1, 24),
        load64(1, 9, 32), insn(0x0F, 1, 0), store64(9, 1, 32),
        ("label", "open"),
        load64(1, 6, 24), jump_if("==", 1, 0, "out"),  # preempted: runnable, not waiting
        mov(1, 7), call(TASK_PT_REGS),
        load64(1, 0, regs["orig_ax"]), jump_if("!=", 1, nr, "out"),
        load64(1, 0, regs["si"]), insn(0x57, 1, imm=0x7F),
        *[jump_if("==", 1, cmd, "wait") for cmd in FUTEX_WAIT_CMDS[:-1]],
        jump_if("!=", 1, FUTEX_WAIT_CMDS[-1], "out"),
        ("label", "wait"),
        load64(2, 0, regs["di"]), store64(9, 2, 16), store64(9, 8, 0), load64(1, 10, -16), store64(9, 1, 8),
        ("label", "out"), mov_imm(0, 0), insn(0x95)])


class FutexWaits:
    """futex_waits_program on sched_switch for tgid while open; waits() reads what it counted."""

    def __init__(self, tgid: int, min_ns: int) -> None:
        self.slots = array_map(SLOT, SLOTS)
        self.fds: list[int] = []
        try:
            self.fds.append(load(futex_waits_program(tgid, self.slots, min_ns)))
            self.fds.append(attach(self.fds[0], "sched_switch"))
        except BaseException:
            self.close()
            raise

    def waits(self, tids: list[int]) -> dict[int, tuple[int, int]]:
        """{tid: (waits over the threshold, their ns)} for these threads."""
        out = {}
        for tid in tids:
            slot_tid, _, _, n, ns = struct.unpack("<QQQQQ", lookup(self.slots, struct.pack("<I", tid & (SLOTS - 1)), SLOT))
            if slot_tid == tid and n:
                out[tid] = (n, ns)
        return out

    def __enter__(self) -> FutexWaits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in (*reversed(self.fds), self.slots):
            os.close(fd)
        self.fds = []
