"""eBPF in process, with no tool and no child: an instruction assembler with named jump targets, the
bpf(2) calls (load a raw-tracepoint program, array maps, attach), the kernel's run-time statistics
of loaded programs (for bench/), and struct field offsets from the kernel's BTF. The rawtp back-end
(ebpfraw) builds its program from these."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Iterator, Union

BPF_NR = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
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
