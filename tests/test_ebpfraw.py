"""The rawtp back-end without loading anything: its assembler, the kernel's BTF read for field
offsets (this host's real /sys/kernel/btf/vmlinux where there is one, and hostile bytes), the
slot modulus, what the back-end check says on recorded host trees, and futexwait's parse of
what rawtp reports (no wake tracing: wakes unknown, not zero)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from wedgectl.collect import ebpfhost, ebpfraw
from wedgectl.collect.ebpf import combine
from wedgectl.collect.ebpfhost import Host
from wedgectl.collect.procfs import ThreadSched
from wedgectl.probes._window import Window
from wedgectl.model.types import ThreadSample

BTF = Path("/sys/kernel/btf/vmlinux")


def _decode(code: bytes) -> list[tuple[int, int, int, int, int]]:
    """(opcode, dst, src, offset, imm) per 8-byte instruction."""
    out = []
    for i in range(0, len(code), 8):
        op, regs, off, imm = struct.unpack_from("<BBhi", code, i)
        out.append((op, regs & 0xF, regs >> 4, off, imm))
    return out


def test_assemble_resolves_jumps_forward_and_over_wide_loads() -> None:
    code = ebpfraw.assemble([
        ebpfraw.jump_if("==", 1, 7, "end"),   # 0
        ebpfraw.ld_imm64(2, 1 << 40),          # 1-2: two slots
        ebpfraw.goto("end"),                   # 3
        ebpfraw.mov_imm(0, 1),                 # 4
        ebpfraw.label("end"),
        ebpfraw.mov_imm(0, 0), ebpfraw.insn(0x95),  # 5, 6
    ])
    ins = _decode(code)
    assert len(ins) == 7
    assert ins[0][0] == 0x15 and ins[0][3] == 4  # 0 + 1 + 4 = 5
    assert ins[3][0] == 0x05 and ins[3][3] == 1  # 3 + 1 + 1 = 5
    lo, hi = ins[1][4], ins[2][4]
    assert (hi << 32) | (lo & 0xFFFFFFFF) == 1 << 40


def test_ld_imm64_carries_values_past_32_bits_and_assemble_refuses_a_label_twice() -> None:
    for value in (0, 10_000_000, 300 * 10**9, 2**63 + 5):
        ins = _decode(ebpfraw.ld_imm64(4, value))
        assert ins[0][:2] == (0x18, 4)
        assert ((ins[1][4] & 0xFFFFFFFF) << 32) | (ins[0][4] & 0xFFFFFFFF) == value
    with pytest.raises(ValueError, match="twice"):
        ebpfraw.assemble([ebpfraw.label("a"), ebpfraw.label("a")])


OFFSETS = {"pid": 1264, "tgid": 1268, "ran": 232, "ran_before": 240, "run_delay": 1016, "arrived": 1040,
           "orig_ax": 120, "si": 104, "di": 112}  # as kernel_offsets() read them on a 6.18 x86_64 kernel


def test_sched_program_filters_each_tgid_first_and_carries_the_threshold() -> None:
    code = ebpfraw.sched_program([4101, 4102], 3, 65521, 250_000_000_000, ("futexwait", "offcpu"), OFFSETS,
                                 202, (0, 9), 4, 777)
    ins = _decode(code)
    assert ins[-1][0] == 0x95 and ins[-2][:1] == (0xB7,)
    # the tgid load, then wedgectl's own tgid (the epoch) and one compare per tgid, before any slot work
    assert ins[3][0] == 0x61 and ins[3][3] == OFFSETS["tgid"]
    assert ins[4][0] == 0x55 and ins[4][4] == 777
    first = next(k for k, i in enumerate(ins) if i[0] == 0x15 and i[4] == 4101)
    assert ins[first - 1][0] == 0x61 and ins[first - 1][3] == OFFSETS["tgid"]  # reloaded after the epoch
    assert (ins[first + 1][0], ins[first + 1][4]) == (0x15, 4102) and ins[first + 2][0] == 0x05
    assert ins[4][3] == first - 5  # wedgectl's other threads jump straight to the compares
    # the clock helper is called once, in the epoch's block; a target thread's switch reads the task instead
    ktime = [k for k, i in enumerate(ins) if i[0] == 0x85 and i[4] == ebpfraw.KTIME_GET_NS]
    assert len(ktime) == 1 and 4 < ktime[0] < first
    assert any(i[0] == 0x79 and i[2] == 7 and i[3] == OFFSETS["arrived"] for i in ins[first:])
    assert any(i[0] == 0x97 and i[4] == 65521 for i in ins)  # slot = tid % modulus
    maps = [i[4] for i in ins if i[0] == 0x18 and i[2] == 1]
    assert maps == [4, 3]  # the epoch, then the slots
    wide = [((ins[k + 1][4] & 0xFFFFFFFF) << 32) | (ins[k][4] & 0xFFFFFFFF)
            for k, i in enumerate(ins) if i[0] == 0x18 and i[2] == 0]
    assert wide.count(250_000_000_000) == 2  # the threshold, for futexwait and offcpu, past 32 bits
    assert any(i[0] == 0x55 and i[4] == 202 for i in ins)  # the futex syscall number
    only_offcpu = _decode(ebpfraw.sched_program([1], 3, 7, 0, ("offcpu",), OFFSETS, 202, (0,), 4, 777))
    assert not any(i[0] == 0x85 and i[4] == ebpfraw.TASK_PT_REGS for i in only_offcpu)
    assert len(only_offcpu) < len(ins)


def test_pick_modulus_gives_each_thread_its_own_slot() -> None:
    tids = [100, 100 + 65536, 200, 200 + 2 * 65536, 4_000_000]
    m = ebpfraw.pick_modulus(tids)
    assert m <= ebpfraw.MAX_SLOTS and len({t % m for t in tids}) == len(tids)
    assert ebpfraw.pick_modulus([]) == ebpfraw.MAX_SLOTS
    # more threads than slots: the fewest shared, never more slots than allowed
    assert ebpfraw.pick_modulus(range(40), most=16, tries=4) <= 16


@pytest.mark.skipif(not BTF.exists(), reason="this kernel has no BTF")
def test_kernel_offsets_from_this_kernels_btf() -> None:
    o = ebpfraw.kernel_offsets()
    assert set(o) == {"pid", "tgid", "ran", "ran_before", "run_delay", "arrived", "orig_ax", "si", "di"}
    assert o["tgid"] == o["pid"] + 4  # pid_t pid; pid_t tgid; side by side in task_struct
    assert o["ran_before"] - o["ran"] == 8  # sum_exec_runtime, then prev_sum_exec_runtime


def test_btf_refuses_what_is_not_btf_or_lacks_a_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too short"):
        ebpfraw.btf_offsets({"task_struct": {"pid"}}, b"\x9f\xeb")
    with pytest.raises(ValueError, match="not BTF"):
        ebpfraw.btf_offsets({"task_struct": {"pid"}}, b"\0" * 64)
    # a header whose type section runs past the data, then a struct with a member the caller lacks
    strings = b"\0s\0a\0b\0"
    types = struct.pack("<III", 1, (4 << 24) | 1, 8) + struct.pack("<III", 3, 0, 32)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    blob = hdr + types + strings
    assert ebpfraw.btf_offsets({"s": {"a"}}, blob) == {"s": {"a": 4}}
    with pytest.raises(ValueError, match="struct s has no b"):
        ebpfraw.btf_offsets({"s": {"a", "b"}}, blob)
    with pytest.raises(ValueError, match="no struct t"):
        ebpfraw.btf_offsets({"t": {"a"}}, blob)
    with pytest.raises(ValueError):
        ebpfraw.btf_offsets({"s": {"a"}}, blob[:30])


def test_unsupported_says_why() -> None:
    assert ebpfraw.unsupported(("futexwait", "offcpu"), "x86_64", "6.18.44") is None
    assert "pylockwait" in ebpfraw.unsupported(("futexwait", "pylockwait"), "x86_64", "6.18.0")
    assert "x86_64 only" in ebpfraw.unsupported(("futexwait",), "aarch64", "6.18.0")
    assert "5.18 or later" in ebpfraw.unsupported(("offcpu",), "x86_64", "5.15.0-91-generic")
    assert ebpfraw.unsupported(("offcpu",), "x86_64", "weird") is None  # unknown: the load will say


def _tree(root: Path, btf: bool = True) -> Host:
    if btf:
        (root / "sys/kernel/btf").mkdir(parents=True)
        (root / "sys/kernel/btf/vmlinux").write_bytes(b"")
    return Host(root=root, which=lambda n: None, euid=lambda: 0, release="6.18.0-test", cap_eff=lambda: None,
                machine="x86_64")


def test_rawtp_check_on_recorded_host_trees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ebpfhost.DISABLE_ENV, raising=False)
    host = _tree(tmp_path / "ok")
    st = ebpfhost.check_rawtp(host, ("futexwait", "offcpu"))
    assert st.available and "no wake tracing" in st.reason
    # no bpftrace, no bcc: rawtp is chosen before the /proc fallback
    assert ebpfhost.choose_backend(ebpfhost.detect_backends(host=host)).name == "rawtp"
    assert not ebpfhost.check_rawtp(_tree(tmp_path / "nobtf", btf=False), ("futexwait",)).available
    arm = Host(root=tmp_path / "ok", euid=lambda: 0, release="6.18.0", machine="aarch64")
    assert "x86_64 only" in ebpfhost.check_rawtp(arm, ("futexwait",)).reason
    user = Host(root=tmp_path / "ok", euid=lambda: 1000, cap_eff=lambda: 0, release="6.18.0", machine="x86_64")
    assert "CAP_BPF" in ebpfhost.check_rawtp(user, ("futexwait",)).reason
    assert "pylockwait" in ebpfhost.check_rawtp(host, ("futexwait", "pylockwait")).reason


def _state(tid: int, futex: int | None) -> ThreadSched:
    t = ThreadSample(tid=tid, comm="python", state="S", syscall_nr=202 if futex else None, futex_addr=futex,
                     futex_op=0x80 if futex else None)
    return ThreadSched(pid=100, thread=t, cpu=0, exec_start_s=None, oncpu_ns=1000, runq_ns=0)


def test_futexwait_reads_rawtp_maps_with_wakes_unknown() -> None:
    """The maps as SchedProbe.read returns them (thread 101's figures as a real run on threads of known
    waits printed them; 102's wait in progress added): waits and totals as counted, the wait in
    progress from fw_at, and no claim about wakes; a thread whose slot another held is not traced."""
    begin = 49004.778316130
    start = {101: _state(101, None), 102: _state(102, 0x7F00)}
    end = {101: _state(101, None), 102: _state(102, 0x7F00)}
    maps = {"fw_at": {101: (0, 140149681819120), 102: (int((begin + 0.5) * 1e9), 0x7F00)},
            "fw_nwaits": {101: 3}, "fw_wait_ns": {101: 150169073}, "fw_carried": {},
            "oc_nblocked": {101: 3}, "oc_blocked_ns": {101: 150150596},
            "t_begin": int(begin * 1e9), "t_end": int((begin + 1.5) * 1e9),
            "untraced": ("fw_wakes", "fw_woken"), "slot_lost": ()}
    w = Window(begin=begin, end=begin + 1.5, start_states=start, end_states=end, end_read_at=begin + 1.6,
               offsets={}, wall_offset=0.0)
    by = {t.tid: t for t in combine("rawtp", ("futexwait", "offcpu"), maps, w)}
    assert by[101].waits == 3 and by[101].total_wait_s == pytest.approx(0.1502, abs=1e-4)
    assert by[101].wakes_on_addr is None and by[101].futex_addr is None
    assert by[102].futex_addr == 0x7F00 and by[102].wait_source == "tracepoint"
    assert by[102].wait_s == pytest.approx(1.0, abs=0.01) and by[102].waits == 1
    assert by[102].wakes_on_addr is None and by[102].backend == "rawtp"
    lost = combine("rawtp", ("futexwait",), {**maps, "slot_lost": (101,)}, w)
    assert {t.tid: t for t in lost}[101].waits is None and {t.tid: t for t in lost}[101].total_wait_s is None
    # the same maps from a back-end that traces wakes: none on the address is a count, 0
    traced = {k: v for k, v in maps.items() if k != "untraced"}
    assert {t.tid: t for t in combine("bpftrace", ("futexwait",), traced, w)}[102].wakes_on_addr == 0


def test_a_wait_woken_and_never_switched_out_again_ends_when_its_thread_got_the_cpu_back() -> None:
    # opened at 1.000 s having run 5 ms; detached at 3.000 s having run 5 ms + 400 ms since: back at 2.6 s
    assert ebpfraw.ended_wait_ns(1_000_000_000, 5_000_000, 3_000_000_000, 405_000_000) == 1_600_000_000
    assert ebpfraw.ended_wait_ns(1_000_000_000, 0, 3_000_000_000, 405_000_000) is None  # CPU at open unknown
    assert ebpfraw.ended_wait_ns(1_000_000_000, 5_000_000, 3_000_000_000, None) is None  # schedstat unreadable
    assert ebpfraw.ended_wait_ns(1_000_000_000, 5_000_000, 3_000_000_000, 4_000_000) is None  # less CPU than at open
    assert ebpfraw.ended_wait_ns(1_000_000_000, 5_000_000, 1_500_000_000, 905_000_000) is None  # ran longer than the span


def test_a_wait_opens_only_on_a_sleep_not_a_preemption_or_a_stop() -> None:
    ins = _decode(ebpfraw.sched_program([1], 3, 7, 0, ("futexwait",), OFFSETS, 202, (0,), 4, 777))
    ctx_reads = [i[3] for i in ins if i[0] == 0x79 and i[2] == 6]  # loads from the tracepoint's arguments
    assert ctx_reads == [0, 24]  # preempt, then prev_state
    at = next(k for k, i in enumerate(ins) if i[0] == 0x79 and i[2] == 6 and i[3] == 24)
    assert ins[at + 1][:1] == (0x57,) and ins[at + 1][4] == 0xF  # the state's low bits: stopped and traced too
    assert [i[4] for i in ins[at + 2:at + 6]] == [0, 1, 2, 3]  # running: out; interruptible, uninterruptible, both
