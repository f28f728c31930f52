"""The least that loads an eBPF program on a raw tracepoint, through bpf(2) itself.

For bench/probe_overhead.py --attach-points: what an attach point costs by itself, measured
with an empty program (return 0), so that no program written for it can cost less. A raw
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
from typing import Iterator

BPF_NR = {"x86_64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
BPF_PROG_LOAD = 5
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
ATTR_SIZE = 128  # union bpf_attr, zero-padded: the kernel reads the fields it knows
LOG_SIZE = 1 << 16


def insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction: opcode, dst/src registers in one byte, 16-bit offset, 32-bit immediate."""
    return struct.pack("<BBhi", op, (src << 4) | dst, off, imm)


EMPTY = insn(0xB7, 0, imm=0) + insn(0x95)  # r0 = 0; exit


def _bpf(cmd: int, attr: bytes) -> int:
    nr = BPF_NR.get(platform.machine())
    if nr is None:
        raise OSError(f"no bpf(2) number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
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
