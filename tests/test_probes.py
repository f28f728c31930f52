"""The probes without attaching anything: generated programs (--ebpf), each probe's parser fed recorded maps,
the /proc side, the back-end choice on recorded host trees, combining, the bundle codec and the classifier evidence."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from wedgectl.classify import probefacts

from wedgectl import probes
from wedgectl.store.bundle import from_jsonable, to_jsonable
from wedgectl.collect import ebpf, ebpfhost, procfs
from wedgectl.collect.ebpf import Window
from wedgectl.collect.ebpfhost import Host
from wedgectl.probes import futexwait
from wedgectl.model.types import (
    BackendStatus, Bundle, Manifest, ProbeResult, ProcessSample, Role, Sample, ThreadProbe, ThreadSample, WakeCall,
)

REPO = Path(__file__).resolve().parents[1]
PROBES = REPO / "probes"
TOOLS = probes.ALL_PROBES


# --- the programs -------------------------------------------------------------


def test_bpftrace_program_is_one_bounded_filtered_program() -> None:
    text = ebpf.bpftrace_program(probes.DEFAULT_PROBES, [4101, 4102], 7.5, min_wait_s=0.025)
    assert text.count("\nBEGIN\n") == 1 and text.count("\nEND\n") == 1
    assert "interval:ms:7500" in text and "exit();" in text
    # the timer ends the window, at its first firing (a later one, before bpftrace acts on exit(), keeps it)
    assert "interval:ms:7500\n{\n  if (@t_end == 0) {\n    @t_end = nsecs;\n  }\n  exit();" in text
    # every probe's predicate is the tgid filter and nothing else: another process pays one compare
    attach = re.findall(r"^(tracepoint:\S+) (/.*/)$", text, re.M)
    assert [a for a, _ in attach] == ["tracepoint:syscalls:sys_enter_futex", "tracepoint:syscalls:sys_exit_futex",
                                      "tracepoint:sched:sched_switch"]
    assert {pred for _, pred in attach} == {"/pid == 4101 || pid == 4102/"}
    assert "next_pid" not in text  # nothing runs on a switch in, where the tgid is not known
    # aggregated in the kernel: no per-event output, and only waits over the threshold are recorded
    assert text.count("printf(") == 1 and ">= 25000000" in text and "$used + 25000000" in text
    assert "waits under 25 ms not recorded" in text.splitlines()[0]
    assert "__" not in text  # every placeholder filled
    assert "uprobe" not in text  # pylockwait is opt-in


def test_bpftrace_program_caps_window_and_has_a_default_threshold() -> None:
    text = ebpf.bpftrace_program(("offcpu",), [1], 10_000)
    assert f"interval:ms:{int(ebpf.MAX_WINDOW_S * 1000)}" in text
    assert ebpf.MIN_WAIT_S == probes.DEFAULT_MIN_WAIT_MS / 1000 == 0.01
    assert f"$used + {int(ebpf.MIN_WAIT_S * 1e9)}" in text


def test_pylockwait_repeats_per_library_and_is_skipped_without_one() -> None:
    libs = ["/usr/lib/libpython3.11.so.1.0", "/opt/py/bin/python3.12"]
    text = ebpf.bpftrace_program(("pylockwait",), [7], 5, libs=libs)
    for lib in libs:
        assert f"uprobe:{lib}:PyThread_acquire_lock_timed /pid == 7/" in text
        assert f"uretprobe:{lib}:PyThread_acquire_lock_timed /pid == 7/" in text
    assert "uprobe" not in ebpf.bpftrace_program(("pylockwait",), [7], 5, libs=[])


def test_bcc_text_has_bounded_maps_and_the_filter() -> None:
    text = ebpf.bcc_program(probes.ALL_PROBES, [4101], max_entries=1024, min_wait_s=0.002)
    assert "TRACEPOINT_PROBE(syscalls, sys_enter_futex)" in text
    assert "TRACEPOINT_PROBE(sched, sched_switch)" in text
    assert "BPF_HASH(fw_wakes, struct fw_key3_t, u64, 1024);" in text
    assert "__" not in text
    # each program's first test is the tgid filter
    assert text.count("if (!(pid == 4101)") == 5
    assert text.count(">= 2000000") == 3 and "used + 2000000" in text
    for name in TOOLS:  # every map a probe names is declared in its C text
        for m in probes.load_probe(name).MAPS:
            assert f"BPF_HASH({m}," in text


def test_pid_predicate_rejects_empty() -> None:
    assert ebpf.pid_predicate([3, 1, 3]) == "pid == 1 || pid == 3"
    with pytest.raises(ValueError):
        ebpf.pid_predicate([])


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_ebpf_flag_prints_program_without_running(tool: str) -> None:
    r = subprocess.run([sys.executable, "-m", f"wedgectl.probes.{tool}", "-p", "4242", "--ebpf"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "pid == 4242" in r.stdout and "BEGIN" in r.stdout
    assert "waits under 10 ms not recorded" in r.stdout
    r = subprocess.run([sys.executable, "-m", f"wedgectl.probes.{tool}", "-p", "4242", "--ebpf", "--backend", "bcc",
                        "--min-wait-ms", "50"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "BPF_HASH" in r.stdout and "50000000" in r.stdout


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_header_epilog_overhead_and_example(tool: str) -> None:
    mod = probes.load_probe(tool)
    assert mod.__doc__.splitlines()[0].startswith(f"{tool}: ")
    assert "Overhead" in mod.__doc__ or "overhead" in mod.__doc__
    assert "ratio" in mod.OVERHEAD
    assert "--ebpf" in mod.EPILOG and "examples:" in mod.EPILOG
    assert "Exit status" in mod.__doc__
    assert (PROBES / f"{tool}_example.txt").read_text().strip()
    r = subprocess.run([sys.executable, "-m", f"wedgectl.probes.{tool}", "-h"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0 and "examples:" in r.stdout and "--ebpf" not in r.stdout.split("examples:")[0]


def test_tool_usage_errors_exit_2() -> None:
    r = subprocess.run([sys.executable, "-m", "wedgectl.probes.futexwait", "-p", "x1"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == probes.EXIT_USAGE
    r = subprocess.run([sys.executable, str(PROBES / "futexwait.py")], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2  # argparse
    r = subprocess.run([sys.executable, "-m", "wedgectl.probes.futexwait", "-p", "1", "--min-wait-ms", "-1"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == probes.EXIT_USAGE and "--min-wait-ms" in r.stderr


def test_generated_program_compiles_with_bpftrace(tmp_path: Path) -> None:
    """bpftrace (tests/setup.sh installs it; the suite runs as root) compiles the generated program
    against this kernel's tracepoints; tracefs is mounted first where it is not, as diagnose does."""
    tracefs, why = ebpfhost.ensure_tracefs()
    assert tracefs is not None, why
    text = ebpf.bpftrace_program(probes.ALL_PROBES, [1, 2], 5, [sys.executable])
    src = tmp_path / "p.bt"
    src.write_text(text)
    r = subprocess.run(["bpftrace", "--emit-elf", str(tmp_path / "p.o"), str(src)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.o").stat().st_size > 0


# --- parsing bpftrace -f json ---------------------------------------------------

RECORDED = """\
{"type": "attached_probes", "data": {"probes": 5}}
{"type": "printf", "data": "wedgectl-probe-ready\\n"}


{"type": "map", "data": {"@fw_at": {"2473": [2127220708608,139687234636704]}}}
{"type": "map", "data": {"@fw_wakes": {"0x7f0b7ff4e6f0,2474": 1, "2470,139687234636704,2474": 2}}}
{"type": "map", "data": {"@t_begin": 2125275819821}}
garbage line
"""


def test_parse_bpftrace_output_keys_and_scalars() -> None:
    maps, printed, other = ebpf.parse_bpftrace_output(RECORDED.splitlines())
    assert printed == [ebpf.READY_MARK]
    assert maps["fw_at"] == {2473: [2127220708608, 139687234636704]}  # a tuple value reads as a list
    assert maps["fw_wakes"] == {(0x7F0B7FF4E6F0, 2474): 1, (2470, 139687234636704, 2474): 2}
    assert maps["t_begin"] == 2125275819821
    assert other == ["garbage line"]


# --- the /proc side -------------------------------------------------------------

STAT = ("4143 (worker-a) S 4138 4138 1 0 -1 4194368 21 0 0 0 3 1 0 0 20 0 3 0 123456 0 0 "
        "18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0")
SYSCALL = "202 0x5652e4bab440 0x189 0x0 0x0 0x0 0xffffffff 0x7ffd 0x7f00"
SCHED = """worker-a (4143, #threads: 3)
-------------------------------------------------------------------
se.exec_start                                :       2022667.010839
se.vruntime                                  :           115.061254
"""


def _sched(stat: str, syscall: str | None, wchan: str | None, sched: str | None,
           schedstat: str | None) -> procfs.ThreadSched:
    thread = procfs.thread_from_texts(4143, stat, wchan, syscall, None, machine="x86_64")
    return procfs.sched_from_texts(4138, thread, stat, sched, schedstat)


def test_thread_sched_from_recorded_texts() -> None:
    st = _sched(STAT, SYSCALL, "futex_do_wait", SCHED, "63698 460563 5")
    assert (st.pid, st.tid, st.comm, st.thread.state, st.cpu) == (4138, 4143, "worker-a", "S", 1)
    assert st.futex_addr == 0x5652E4BAB440 and st.in_futex_wait
    assert st.exec_start_s == pytest.approx(2022.667010839)
    assert (st.oncpu_ns, st.runq_ns) == (63698, 460563)


def test_parsers_tolerate_missing_fields() -> None:
    assert procfs.parse_exec_start("nothing here") is None
    assert procfs.parse_schedstat("") is None
    st = _sched(STAT, "running", None, None, None)
    assert st.futex_addr is None and st.exec_start_s is None and st.oncpu_ns is None
    assert procfs.parse_stat(STAT.rsplit(" ", 10)[0]).processor is None  # a short stat line (old kernels)


def test_read_thread_scheds_on_a_recorded_tree(tmp_path: Path) -> None:
    d = tmp_path / "4138" / "task" / "4143"
    d.mkdir(parents=True)
    for name, text in (("stat", STAT), ("syscall", SYSCALL), ("wchan", "futex_do_wait"), ("sched", SCHED),
                       ("schedstat", "63698 460563 5"), ("status", "voluntary_ctxt_switches:\t7\n")):
        (d / name).write_text(text)
    (tmp_path / "4138" / "task" / "4199").mkdir()  # exited mid-read: no stat
    states, failures = procfs.read_thread_scheds([4138, 999], tmp_path)
    assert list(states) == [4143] and states[4143].in_futex_wait and states[4143].pid == 4138
    assert states[4143].exec_start_s == pytest.approx(2022.667010839) and states[4143].cpu == 1
    assert {f.kind.value for f in failures} == {"gone"} and {f.target for f in failures} == {"4138", "999"}


def test_thread_schedstats_of_a_recorded_tree_and_of_this_process(tmp_path: Path) -> None:
    d = tmp_path / "4138" / "task"
    (d / "4143").mkdir(parents=True)
    (d / "4143" / "schedstat").write_text("63698 460563 5")
    (d / "4199").mkdir()  # exited mid-read: no schedstat
    assert procfs.thread_schedstats(4138, tmp_path) == {4143: (63698, 460563, 5)}
    assert procfs.thread_schedstats(999, tmp_path) == {}
    spin = sum(range(200_000))  # this thread has run: its on-CPU ns and timeslices are counted
    mine = procfs.thread_schedstats(os.getpid())
    assert spin and mine[threading.get_native_id()][0] > 0 and mine[threading.get_native_id()][2] > 0


def _skip_without_sched() -> None:
    """Skip where this kernel has no /proc/PID/sched with se.exec_start (no CONFIG_SCHED_DEBUG)."""
    sched = Path("/proc/self/sched")
    if procfs.parse_exec_start(sched.read_text() if sched.exists() else "") is None:
        pytest.skip("no /proc/PID/sched on this kernel")


def test_sched_clock_offsets_are_small_and_positive() -> None:
    _skip_without_sched()
    offsets = procfs.sched_clock_offsets(sorted(os.sched_getaffinity(0)))
    assert offsets and all(-0.01 < v < 3600 for v in offsets.values())


def test_the_clock_offset_comes_from_the_read_no_wait_for_a_cpu_stretched() -> None:
    # Task clock 50 s behind: a read's exec_start is stamped between the wake (before + the
    # 0.5 ms sleep) and the read's end. The first read waited 0.2 s for a CPU after its wake
    # and was stamped again on resuming; a single timing at the wake read 0.2 s off there.
    true = 50.0
    stretched = (1000.0, 1000.2 - true, 1000.201)  # resumed at 1000.2, read by 1000.201
    tight = (1001.0, 1001.0006 - true, 1001.0008)
    got = procfs.offset_from_reads([stretched, tight])
    assert got is not None and abs(got - true) < 0.0002
    # One read alone: the middle of its bracket, so within half its width
    alone = procfs.offset_from_reads([stretched])
    assert alone is not None and abs(alone - true) <= 0.101
    assert procfs.offset_from_reads([(1.0, None, 1.1)]) is None and procfs.offset_from_reads([]) is None
    assert procfs.offset_from_reads([(1.0, None, 1.1), tight]) == got

PROC_STAT = """cpu  7967132 30496 438794 4524932 3609 0 21694 204255 0 0
cpu0 3692531 14037 200722 2570039 2362 0 12371 107225 0 0
cpu1 4274600 16458 238072 1954893 1247 0 9323 97029 0 0
intr 123 0 9
"""  # recorded on this VM: steal is the eighth number of a cpuN line


def test_cpu_steal_read_from_a_recorded_stat(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(PROC_STAT)
    assert procfs.cpu_steal_s(tmp_path) == {0: 107225 / procfs.CLK_TCK, 1: 97029 / procfs.CLK_TCK}
    (tmp_path / "stat").write_text("cpu0 1 2 3\ncpu1 1 2 3 4 5 6 7 x\ncpu2 1 2 3 4 5 6 7 250\n")
    assert procfs.cpu_steal_s(tmp_path) == {2: 250 / procfs.CLK_TCK}  # short and garbled lines are skipped
    assert procfs.cpu_steal_s(tmp_path / "gone") == {}


def test_a_kept_clock_offset_moves_on_by_the_steal_since(tmp_path: Path, monkeypatch) -> None:
    """The task clock stops while the hypervisor steals the CPU: an offset measured a while ago is
    carried forward by the steal /proc/stat counted since, not reused as it was, and measured
    afresh after REFRESH_S."""
    cpu = min(os.sched_getaffinity(0))
    (tmp_path / "thread-self").mkdir()
    (tmp_path / "thread-self" / "sched").write_text(SCHED.replace("2022667.010839", "990000.000000"))
    stat = tmp_path / "stat"
    stat.write_text(f"cpu{cpu} 1 2 3 4 5 6 7 1000 0 0\n")
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    clock = procfs.SchedClock(tmp_path)
    assert clock.offset(cpu) == pytest.approx(10.0)  # measured: now minus its own exec_start (990 s)
    stat.write_text(f"cpu{cpu} 1 2 3 4 5 6 7 {1000 + 2.5 * procfs.CLK_TCK:.0f} 0 0\n")
    now[0] = 1030.0
    assert clock.offset(cpu) == pytest.approx(12.5)  # 2.5 s stolen since: not measured again
    stat.write_text("garbage\n")
    assert clock.offset(cpu) == pytest.approx(10.0)  # no steal to read: the offset as measured
    now[0] = 1061.0
    assert clock.offset(cpu) == pytest.approx(71.0)  # past REFRESH_S: measured afresh (the recorded exec_start)


class _FixedClock(procfs.SchedClock):
    """A scheduler clock whose per-CPU offset is given: the offsets of the recorded host."""

    def __init__(self, offsets: dict[int, float]) -> None:
        super().__init__()
        self.offsets = offsets

    def offset(self, cpu: int) -> float | None:
        return self.offsets.get(cpu)


def test_main_thread_quiet_on_a_recorded_tree(tmp_path: Path, monkeypatch) -> None:
    d = tmp_path / "4138"
    d.mkdir()
    (d / "stat").write_text(STAT)  # state S, last ran on CPU 1
    (d / "sched").write_text(SCHED)  # exec_start 2022.667 s on CPU 1's clock
    monkeypatch.setattr(time, "monotonic", lambda: 2040.0)
    assert procfs.main_thread_quiet_s(4138, tmp_path, _FixedClock({1: 5.0})) == pytest.approx(2040.0 - 2027.667010839)
    assert procfs.main_thread_quiet_s(4138, tmp_path, _FixedClock({0: 5.0})) is None  # CPU 1 out of reach
    (d / "stat").write_text(STAT.replace(") S ", ") R ", 1))
    assert procfs.main_thread_quiet_s(4138, tmp_path, _FixedClock({1: 5.0})) == 0.0  # running or runnable
    (d / "stat").write_text(STAT)
    (d / "sched").write_text(SCHED.replace("2022667.010839", "0.000000"))  # zeroed by a migration
    assert procfs.main_thread_quiet_s(4138, tmp_path, _FixedClock({1: 5.0})) is None
    assert procfs.main_thread_quiet_s(999, tmp_path, _FixedClock({1: 5.0})) is None  # gone


def test_a_thread_that_ran_between_the_reads_has_been_quiet_no_longer_than_they_took(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """exec_start changed between the two reads of sched: the thread ran while it was read, so its quiet is at most
    the read's length (it read as unknown before)."""
    from wedgectl.collect.procfs import sched

    d = tmp_path / "4138"
    d.mkdir()
    (d / "stat").write_text(STAT)
    (d / "sched").write_text(SCHED)
    reads = iter([SCHED, SCHED.replace("2022667.010839", "2022667.110839")])
    real = sched.read_or_none
    monkeypatch.setattr(sched, "read_or_none", lambda p: next(reads) if Path(p).name == "sched" else real(p))
    began = time.monotonic()
    quiet = procfs.main_thread_quiet_s(4138, tmp_path, _FixedClock({1: 5.0}))
    assert quiet is not None and 0.0 <= quiet <= time.monotonic() - began


def test_a_thread_that_sleeps_a_millisecond_a_loop_is_never_read_as_unknown() -> None:
    """A busy loop that naps 1 ms per turn (vLLM's EngineCore between empty steps) runs during one read in nine
    here; each of those reads says it ran, not "unknown"."""
    _skip_without_sched()
    napper = subprocess.Popen([sys.executable, "-c", "import time\nprint('ready', flush=True)\n"
                               "while True: time.sleep(0.001)"], stdout=subprocess.PIPE, text=True)
    try:
        assert napper.stdout is not None and napper.stdout.readline().strip() == "ready"
        quiets = []
        for _ in range(300):
            quiets.append(procfs.main_thread_quiet_s(napper.pid))
            time.sleep(0.002)
        assert None not in quiets, quiets.count(None)
        # on a loaded host its nap can stretch to a wait for a CPU: runnable, which reads 0
        assert sorted(quiets)[len(quiets) // 2] < 0.05, sorted(quiets)[-10:]
    finally:
        napper.kill()
        napper.wait()


def test_main_thread_quiet_of_real_processes() -> None:
    """A child asleep for a second and a half has had no CPU that long; a spinning one has had it throughout."""
    _skip_without_sched()
    import time

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    spinner = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                               stdout=subprocess.PIPE, text=True)
    try:
        # "ready" bounds its last run from below; its state S (asleep: nothing follows the print but the sleep)
        # bounds it from above. A loaded host can preempt it between the two for a tenth of a second and more.
        assert sleeper.stdout.readline().strip() == "ready"
        ready_at, steal_then = time.monotonic(), procfs.cpu_steal_s()
        deadline = ready_at + 30
        while time.monotonic() < deadline:
            if procfs.parse_stat(Path(f"/proc/{sleeper.pid}/stat").read_text()).state == "S":
                break
            time.sleep(0.005)
        asleep_by = time.monotonic()
        assert spinner.stdout.readline().strip() == "ready"
        time.sleep(max(0.0, asleep_by + 1.5 - time.monotonic()))
        read_at = time.monotonic()
        quiet = procfs.main_thread_quiet_s(sleeper.pid)
        # the task clock stops while the hypervisor steals the CPU: quiet reads short by the steal since
        # the sleeper last ran (a lower bound, as the probes' parked waits; 10 ms ticks)
        steal_now = procfs.cpu_steal_s()
        stolen = max((steal_now[c] - steal_then.get(c, steal_now[c]) for c in steal_now), default=0.0) + 0.01
        low, high = read_at - asleep_by - 0.1 - stolen, time.monotonic() - ready_at + 0.5
        assert quiet is not None and low <= quiet <= high, (quiet, stolen, low, high)
        busy = procfs.main_thread_quiet_s(spinner.pid)
        assert busy is not None and busy < 1.0, busy  # runs or waits for a CPU; never off one as long as the sleeper
    finally:
        for p in (sleeper, spinner):
            p.kill()
            p.wait()


# --- combining maps and /proc ------------------------------------------------------


def _st(tid: int, pid: int = 100, addr: int | None = None, exec_start: float | None = 50.0, cpu: int = 0,
        on: int = 0, rq: int = 0, comm: str = "python") -> procfs.ThreadSched:
    thread = ThreadSample(tid=tid, comm=comm, state="S" if addr else "R", futex_addr=addr,
                          futex_op=0x80 if addr else None)
    return procfs.ThreadSched(pid=pid, thread=thread, cpu=cpu, exec_start_s=exec_start, oncpu_ns=on, runq_ns=rq)


def _window(start: dict, end: dict, begin: float = 100.0, stop: float = 105.0) -> Window:
    return Window(begin=begin, end=stop, start_states=start, end_states=end, end_read_at=stop + 0.01,
                  offsets={0: 0.5}, wall_offset=1_000_000.0)


def test_combine_parked_before_attach_uses_exec_start() -> None:
    # parked at 50.0 on the sched clock (+0.5 s offset = 50.5 monotonic), never ran in the window
    start = {101: _st(101, addr=0xAA), 102: _st(102)}
    end = {101: _st(101, addr=0xAA), 102: _st(102, exec_start=104.0, on=4_000_000_000)}
    maps = {"fw_wakes": {(100, 0xBB, 102): 3}, "t_begin": 100_000_000_000}
    by = {t.tid: t for t in ebpf.combine("bpftrace", probes.DEFAULT_PROBES, maps, _window(start, end))}
    t = by[101]
    assert t.futex_addr == 0xAA and t.wait_source == "sched" and t.parked_throughout
    assert t.wait_s == pytest.approx(105.01 - 50.5, abs=1e-3)
    assert t.wait_started == pytest.approx(1_000_050.5, abs=1e-3)
    assert t.wakes_on_addr == 0 and t.wakers == () and t.waits == 0
    assert t.total_wait_s == pytest.approx(5.0, abs=0.02)
    assert (t.oncpu_s, t.offcpu_s) == (0.0, 5.0)  # no switch in the window: schedstat decides
    spinner = by[102]
    assert spinner.futex_addr is None and spinner.oncpu_s == pytest.approx(4.0) and spinner.offcpu_s == pytest.approx(1.0)


def test_combine_wait_begun_in_window_uses_the_tracepoint_and_counts_wakes() -> None:
    start = {101: _st(101), 102: _st(102), 103: _st(103), 104: _st(104)}
    end = {101: _st(101, addr=0xAA, exec_start=103.0, on=500_000_000), 102: _st(102, on=4_900_000_000, rq=100_000_000),
           103: _st(103), 104: _st(104, addr=0xCC, exec_start=104.5)}
    maps = {
        # 101 waits on 0xAA since 103; 103's last wait is over (/proc shows it running); 104's entry is
        # an older wait on another address (a new one began after the program detached)
        "fw_at": {101: [103_000_000_000, 0xAA], 103: [101_000_000_000, 0xBB], 104: [101_000_000_000, 0xBB]},
        "fw_nwaits": {101: 4}, "fw_wait_ns": {101: 1_000_000_000},
        "fw_wakes": {(100, 0xAA, 102): 2, (100, 0xAA, 103): 1, (999, 0xAA, 104): 7},  # another process's 0xAA
        "fw_woken": {(100, 0xAA): 2},
        "oc_blocked_ns": {101: 2_000_000_000}, "oc_nblocked": {101: 1},
    }
    by = {t.tid: t for t in ebpf.combine("bpftrace", probes.DEFAULT_PROBES, maps, _window(start, end))}
    t = by[101]
    assert t.wait_source == "tracepoint" and not t.parked_throughout
    assert t.futex_addr == 0xAA and t.wait_s == pytest.approx(2.0)
    assert t.waits == 5  # 4 ended over the threshold, and the one in progress has lasted 2 s
    assert t.total_wait_s == pytest.approx(3.0)
    assert t.wakes_on_addr == 3 and t.wakers == (102, 103)
    assert t.oncpu_s == pytest.approx(0.5) and t.offcpu_s == pytest.approx(4.5) and t.runq_s == 0.0
    assert by[102].oncpu_s == pytest.approx(4.9) and by[102].runq_s == pytest.approx(0.1)
    assert by[102].offcpu_s == pytest.approx(0.0)
    assert by[103].futex_addr is None and by[103].wait_s is None and by[103].waits == 0
    assert by[104].futex_addr == 0xCC and by[104].wait_source == "sched" and not by[104].parked_throughout
    table = futexwait.wake_table(maps)
    assert table[0] == WakeCall(pid=999, addr=0xAA, waker=104, calls=7, woken=0)
    assert WakeCall(pid=100, addr=0xAA, waker=102, calls=2, woken=2) in table


def test_combine_counts_only_waits_over_the_threshold() -> None:
    start = {101: _st(101)}
    end = {101: _st(101, addr=0xAA, exec_start=104.995)}
    maps = {"fw_at": {101: [104_995_000_000, 0xAA]}}  # in a wait for 5 ms at the end of the window
    w = _window(start, end)
    (t,) = ebpf.combine("bpftrace", ("futexwait",), maps, w)
    assert t.wait_source == "tracepoint" and t.wait_s == pytest.approx(0.005) and t.waits == 0
    (t,) = ebpf.combine("bpftrace", ("futexwait",), maps, dataclasses.replace(w, min_wait_s=0.001))
    assert t.waits == 1


def test_combine_offcpu_long_blocks_without_schedstat() -> None:
    start = {101: procfs.ThreadSched(pid=100, thread=ThreadSample(tid=101, comm="x", state="S"), cpu=0,
                                     exec_start_s=None, oncpu_ns=None, runq_ns=None)}
    maps = {"oc_blocked_ns": {101: 3_000_000_000}, "oc_nblocked": {101: 2}}
    (t,) = ebpf.combine("bpftrace", ("offcpu",), maps, _window(start, dict(start)))
    assert (t.oncpu_s, t.offcpu_s, t.runq_s) == (None, 3.0, None)  # a lower bound: the long blocks


def test_combine_offcpu_times_are_schedstat_at_the_window_edges() -> None:
    start = {102: _st(102, on=1_000_000_000, rq=0)}
    end = {102: _st(102, on=4_000_000_000, rq=500_000_000)}
    maps = {"oc_blocked_ns": {102: 100_000_000}}  # shorter than what schedstat leaves: schedstat wins
    (t,) = ebpf.combine("bpftrace", probes.DEFAULT_PROBES, maps, _window(start, end))
    assert (t.oncpu_s, t.runq_s, t.offcpu_s) == (3.0, 0.5, 1.5)


def test_combine_procfs_knows_durations_not_wakes() -> None:
    start = {101: _st(101, addr=0xAA)}
    end = {101: _st(101, addr=0xAA)}
    (t,) = ebpf.combine("procfs", (), {}, _window(start, end))
    assert t.backend == "procfs" and t.futex_addr == 0xAA and t.wait_source == "sched"
    assert t.wakes_on_addr is None and t.waits is None and t.total_wait_s is None
    assert t.parked_throughout and t.offcpu_s == 5.0


def test_combine_without_exec_start_gives_the_window_as_lower_bound() -> None:
    start = {101: _st(101, addr=0xAA, exec_start=None)}
    end = {101: _st(101, addr=0xAA, exec_start=None)}
    (t,) = ebpf.combine("procfs", (), {}, _window(start, end))
    assert t.wait_source == "window" and t.wait_s == pytest.approx(5.01)


def test_combine_a_thread_that_ran_is_not_parked_throughout() -> None:
    start = {101: _st(101, addr=0xAA, exec_start=50.0)}
    end = {101: _st(101, addr=0xAA, exec_start=102.0)}  # ran at 102, parked again on the same address
    (t,) = ebpf.combine("procfs", (), {}, _window(start, end))
    assert not t.parked_throughout and t.wait_s == pytest.approx(105.01 - 102.5)


def test_each_probe_parses_only_its_own_maps() -> None:
    start = {101: _st(101, addr=0xAA)}
    w = _window(start, dict(start))
    maps = {"pl_at": {101: [103_000_000_000, 0xAA]}, "pl_n": {101: 1}, "pl_ns": {101: 500_000_000}}
    assert probes.load_probe("pylockwait").thread_fields(maps, w, traced=False) == {}
    (pl,) = probes.load_probe("pylockwait").thread_fields(maps, w, traced=True).values()
    assert pl == {"pylock_addr": 0xAA, "pylock_waits": 2, "pylock_wait_s": 2.5}  # one returned, one in progress
    (fw,) = futexwait.thread_fields(maps, w, traced=True).values()
    assert fw["futex_addr"] == 0xAA and fw["waits"] == 0 and "oncpu_s" not in fw
    for name in TOOLS:  # every map a parser reads is one its program declares
        mod = probes.load_probe(name)
        read = set(re.findall(r'table\(maps, "(\w+)"\)', Path(mod.__file__).read_text()))
        assert read and read <= set(mod.MAPS), (name, read - set(mod.MAPS))


LEGACY_HEADER_KEYS = ["kind", "backend", "reason", "skipped", "probes", "pids", "window_s", "started", "ended",
                      "wakes", "maps_full", "clock_offsets_s", "overhead"]
LEGACY_THREAD_KEYS = ["kind", "tid", "pid", "comm", "backend", "futex_addr", "wait_s", "wait_started",
                      "wait_source", "parked_throughout", "waits", "total_wait_s", "wakes_on_addr", "wakers",
                      "oncpu_s", "offcpu_s", "runq_s", "window_s", "pylock_addr", "pylock_waits", "pylock_wait_s"]


def test_probe_records_keep_their_bundle_json_and_round_trip() -> None:
    start = {101: _st(101, addr=0xAA)}
    (t,) = ebpf.combine("procfs", (), {}, _window(start, dict(start)))
    header = ProbeResult(backend="bpftrace", reason="r", pids=(100,), window_s=5.0,
                         wakes=(WakeCall(pid=100, addr=0xAA, waker=102, calls=2, woken=1),),
                         clock_offsets_s={"0": 0.5}, overhead={"futexwait": "x"})
    records = json.loads(json.dumps(to_jsonable((header, t))))
    assert list(records[0]) == LEGACY_HEADER_KEYS and list(records[1]) == LEGACY_THREAD_KEYS
    assert records[0]["wakes"] == [{"pid": 100, "addr": 0xAA, "waker": 102, "calls": 2, "woken": 1}]
    assert records[1]["kind"] == "thread" and records[1]["wakers"] == []
    sample = from_jsonable(Sample, {"t": 1.0, "probes": records + [{"kind": "newer"}]}, "test")
    assert sample.probes == (header, t)  # a record kind a newer writer added is left out


# --- choosing the back-end ------------------------------------------------------------


def _host_tree(root: Path, *, headers: bool, bcc: bool, tracefs: bool = True, release: str = "6.18.0-test") -> None:
    if tracefs:
        for tp in ("syscalls/sys_enter_futex", "syscalls/sys_exit_futex", "sched/sched_switch"):
            (root / "sys/kernel/tracing/events" / tp).mkdir(parents=True)
    (root / "sys/kernel/btf").mkdir(parents=True)
    (root / "sys/kernel/btf/vmlinux").write_bytes(b"")
    if headers:
        (root / f"lib/modules/{release}/build/include").mkdir(parents=True)
    if bcc:
        (root / "usr/lib/python3/dist-packages/bcc").mkdir(parents=True)
        (root / "usr/lib/python3/dist-packages/bcc/__init__.py").write_text("")


def _host(root: Path, bpftrace: bool = True, euid: int = 0, caps: int | None = None) -> Host:
    return Host(root=root, which=lambda n: "/usr/bin/bpftrace" if bpftrace and n == "bpftrace" else None,
                euid=lambda: euid, release="6.18.0-test", cap_eff=lambda: caps, machine="x86_64")


def _names(statuses: tuple[BackendStatus, ...]) -> dict[str, BackendStatus]:
    return {s.name: s for s in statuses}


def test_fallback_order_forcing_each_backend_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ebpfhost.DISABLE_ENV, raising=False)
    _host_tree(tmp_path, headers=True, bcc=True)
    host = _host(tmp_path)
    assert ebpfhost.choose_backend(ebpfhost.detect_backends(host=host)).name == "rawtp"
    statuses = ebpfhost.detect_backends(host=host, disable={"rawtp"})
    assert ebpfhost.choose_backend(statuses).name == "bcc"
    statuses = ebpfhost.detect_backends(host=host, disable={"rawtp", "bcc"})
    assert ebpfhost.choose_backend(statuses).name == "bpftrace"
    assert "disabled" in _names(statuses)["bcc"].reason and "disabled" in _names(statuses)["rawtp"].reason
    monkeypatch.setenv(ebpfhost.DISABLE_ENV, "rawtp,bcc,bpftrace")
    statuses = ebpfhost.detect_backends(host=host)
    assert ebpfhost.choose_backend(statuses).name == "procfs"
    # pylockwait is a uprobe: rawtp cannot run it, and says so; bcc takes the set
    monkeypatch.delenv(ebpfhost.DISABLE_ENV)
    statuses = ebpfhost.detect_backends(probes.ALL_PROBES, host=host)
    assert "pylockwait" in _names(statuses)["rawtp"].reason and ebpfhost.choose_backend(statuses).name == "bcc"
    monkeypatch.setenv(ebpfhost.DISABLE_ENV, "rawtp,bcc,bpftrace")
    statuses = ebpfhost.detect_backends(host=host, disable={"procfs"})
    assert ebpfhost.choose_backend(statuses) is None


def test_bcc_without_headers_falls_to_bpftrace_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ebpfhost.DISABLE_ENV, raising=False)
    _host_tree(tmp_path, headers=False, bcc=True)
    by = _names(ebpfhost.detect_backends(host=_host(tmp_path)))
    assert not by["bcc"].available and "no kernel headers for 6.18.0-test" in by["bcc"].reason
    assert by["bpftrace"].available and "BTF" in by["bpftrace"].reason


def test_missing_tools_tracefs_and_privilege_are_reasons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ebpfhost.DISABLE_ENV, raising=False)
    _host_tree(tmp_path, headers=True, bcc=False, tracefs=False)
    by = _names(ebpfhost.detect_backends(host=_host(tmp_path, bpftrace=False)))
    assert "python3-bpfcc" in by["bcc"].reason
    assert "apt-get install bpftrace" in by["bpftrace"].reason
    by = _names(ebpfhost.detect_backends(host=_host(tmp_path)))
    assert "tracefs is not mounted" in by["bpftrace"].reason
    _host_tree(tmp_path / "b", headers=False, bcc=False)
    by = _names(ebpfhost.detect_backends(host=_host(tmp_path / "b", euid=1000, caps=0)))
    assert "CAP_BPF + CAP_PERFMON" in by["bpftrace"].reason
    caps = 1 << ebpfhost.CAP_BPF | 1 << ebpfhost.CAP_PERFMON
    assert _names(ebpfhost.detect_backends(host=_host(tmp_path / "b", euid=1000, caps=caps)))["bpftrace"].available


def test_missing_tracepoint_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ebpfhost.DISABLE_ENV, raising=False)
    _host_tree(tmp_path, headers=False, bcc=False)
    (tmp_path / "sys/kernel/tracing/events/sched/sched_switch").rmdir()
    by = _names(ebpfhost.detect_backends(host=_host(tmp_path)))
    assert not by["bpftrace"].available and "sched:sched_switch" in by["bpftrace"].reason
    assert _names(ebpfhost.detect_backends(("futexwait",), host=_host(tmp_path)))["bpftrace"].available


def test_procfs_reason_depends_on_sched_file(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    assert "no wait durations" in ebpfhost.check_procfs(Host(), tmp_path).reason
    (tmp_path / "self" / "sched").write_text(SCHED)
    assert "se.exec_start" in ebpfhost.check_procfs(Host(), tmp_path).reason


# --- the classifier's evidence -----------------------------------------------------------


def _sample_with(threads: list[ThreadProbe], header: ProbeResult | None = None) -> Sample:
    procs = (ProcessSample(pid=200, ppid=1, role=Role.ENGINE_CORE, name="VLLM::EngineCor"),
             ProcessSample(pid=300, ppid=200, role=Role.WORKER, name="VLLM::Worker"))
    header = header or ProbeResult(backend="bpftrace", reason="test", window_s=5.0, pids=(200, 300))
    return Sample(t=0.0, processes=procs, probes=(header, *threads))


def _tp(tid: int, pid: int, **kw) -> ThreadProbe:
    base = dict(comm="python", backend="bpftrace", futex_addr=None, wait_s=None, wait_started=None, wait_source="",
                parked_throughout=False, waits=0, total_wait_s=0.0, wakes_on_addr=None, wakers=(), oncpu_s=0.0,
                offcpu_s=5.0, runq_s=0.0, window_s=5.0)
    base.update(kw)
    return ThreadProbe(tid=tid, pid=pid, **base)


def test_probe_evidence_names_the_parked_engine_main_thread() -> None:
    threads = [
        _tp(200, 200, futex_addr=0x7F00AA, wait_s=312.4, wait_started=1.7e9, wait_source="sched",
            parked_throughout=True, wakes_on_addr=0),
        _tp(201, 200, futex_addr=0x7F00BB, wait_s=900.0, wakes_on_addr=0),  # idle helper: not a main thread
        _tp(300, 300, futex_addr=0x7F00CC, wait_s=2.0, wakes_on_addr=0),  # short wait: not the window
        _tp(301, 300, oncpu_s=5.0, offcpu_s=0.0),
    ]
    ev = probefacts.probe_evidence([Sample(t=0.0), _sample_with(threads)])
    assert ev[0].source == "probe"
    assert ev[0].what == ("EngineCore main thread (tid 200) parked 312 s on one futex (0x7f00aa), "
                          "no wake on that address in the 5.0 s window")
    assert ev[0].values["wait_s"] == 312.4 and ev[0].values["role"] == "engine_core"
    assert len([e for e in ev if "parked" in e.what]) == 1
    assert ev[-1].what.startswith("probes: bpftrace over 5.0 s")


def test_probe_evidence_spinning_main_thread_and_woken_waits() -> None:
    threads = [_tp(200, 200, oncpu_s=4.8, offcpu_s=0.0, waits=0),
               _tp(300, 300, futex_addr=0x10, wait_s=30.0, wakes_on_addr=4, wakers=(301,))]
    ev = probefacts.probe_evidence([_sample_with(threads)])
    assert any("EngineCore main thread (tid 200) on the CPU 96%" in e.what for e in ev)
    assert not any("on one futex" in e.what for e in ev)  # the Worker's address was woken: not parked evidence


@pytest.mark.parametrize("source,says", [
    ("sched", "not woken for 60 s (wake calls not traced: procfs)"),  # it has not run since the wait began
    ("window", "wakes not traced (procfs)"),  # on that address at both edges: it may have been woken between
])
def test_probe_evidence_procfs_says_wakes_not_traced(source: str, says: str) -> None:
    threads = [_tp(300, 300, backend="procfs", futex_addr=0x10, wait_s=60.0, waits=None, wakes_on_addr=None,
                   wait_source=source)]
    ev = probefacts.probe_evidence([_sample_with(threads, ProbeResult(backend="procfs", reason="r", window_s=5.0,
                                                                        pids=(300,)))])
    assert "Worker main thread (tid 300) parked 60 s" in ev[0].what
    assert ev[0].what.endswith(says)


def test_probe_evidence_empty_without_probes() -> None:
    assert probefacts.probe_evidence([Sample(t=0.0)]) == []


# --- wiring: sampler and CLI --------------------------------------------------------------


def test_sampler_puts_probe_results_on_the_last_sample() -> None:
    from wedgectl.capture import probing

    b = Bundle(Manifest(), (Sample(t=1.0), Sample(t=2.0)))
    header = ProbeResult(backend="procfs", reason="r")
    out = probing.with_probes(b, (header,), ())
    assert out.samples[0].probes == () and out.samples[-1].probes == (header,)
    assert probing.with_probes(b, (), ()) is b


def test_sampler_off_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from wedgectl.capture import options, probing
    from wedgectl.capture.discover import Deployment

    monkeypatch.setattr(ebpf, "start_probes", lambda *a, **k: pytest.fail("started"))
    dep = Deployment(root_pid=1, api_pid=1, roles={1: Role.API_SERVER}, base_url=None, metrics_url=None)
    assert probing.start_probes(dep, options.SamplerOptions(ebpf="off")) is None
    url_only = Deployment(root_pid=None, api_pid=None, roles={}, base_url="http://x", metrics_url=None)
    assert probing.start_probes(url_only, options.SamplerOptions(ebpf="auto")) is None


def test_cli_probes_reports_each_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from wedgectl.cli import app

    monkeypatch.setenv(ebpfhost.DISABLE_ENV, "rawtp,bcc,bpftrace")
    r = CliRunner().invoke(app, ["probes"], env={"COLUMNS": "80"})
    assert r.exit_code == probes.EXIT_NO_BACKEND, r.output
    assert "bcc" in r.output and "bpftrace" in r.output and "rawtp" in r.output and "procfs    yes <- used" in r.output
    assert "disabled" in r.output and "futexwait" in r.output and "overhead" in r.output
    r = CliRunner().invoke(app, ["probes", "--json"])
    data = json.loads(r.output)
    assert data["chosen"] == "procfs" and [b["name"] for b in data["backends"]] == list(ebpfhost.BACKENDS)


# --- the bcc runner's protocol, against a stand-in bcc module -----------------------

FAKE_BCC = '''
import ctypes as ct

class _Key(ct.Structure):
    _fields_ = [("pid", ct.c_uint64), ("addr", ct.c_uint64), ("tid", ct.c_uint64)]

class _Map(dict):
    def __setitem__(self, k, v):
        super().__setitem__(getattr(k, "value", k), getattr(v, "value", v))
    def items(self):
        out = []
        for k, v in super().items():
            key = _Key(*k) if isinstance(k, tuple) else ct.c_uint64(k)
            out.append((key, ct.c_uint64(v)))
        return out

class BPF:
    def __init__(self, text):
        assert "TRACEPOINT_PROBE(syscalls, sys_enter_futex)" in text
        self.maps = {"t_begin": _Map(), "fw_nwaits": _Map({TID: 2}),
                     "fw_wakes": _Map({(PID, 0xAB, TID): 5})}
    def __getitem__(self, name):
        return self.maps.setdefault(name, _Map())
    def attach_uprobe(self, **kw): pass
    def attach_uretprobe(self, **kw): pass
    def cleanup(self): pass
'''


def test_bcc_runner_protocol_with_a_stand_in_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = subprocess.Popen(["sleep", "30"])
    try:
        fake = tmp_path / "fakebcc" / "bcc"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text(FAKE_BCC.replace("PID", str(target.pid)).replace("TID", str(target.pid)))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake.parent), str(REPO)]))
        run = ebpf.ProbeRun([target.pid], probes.DEFAULT_PROBES, backend=BackendStatus("bcc", True, "stand-in"),
                            max_s=20).start()
        assert run.backend.name == "bcc", run.failures
        assert "BPF_HASH(fw_at" in run.program
        records, failures = run.stop()
    finally:
        target.kill()
        target.wait()
    assert not failures, failures
    header, thread = records[0], records[1]
    assert header.backend == "bcc" and header.wakes == (
        WakeCall(pid=target.pid, addr=0xAB, waker=target.pid, calls=5, woken=0),)
    assert thread.tid == target.pid and thread.waits == 2 and thread.backend == "bcc"
    assert run._proc.poll() is not None  # the runner exited on SIGINT


# --- detach paths, against a stand-in bpftrace ---------------------------------------------

FAKE_BPFTRACE = """#!/bin/sh
# stand-in bpftrace: MODE on SIGINT (set before it says ready), then says ready
MODE
echo '{"type": "printf", "data": "wedgectl-probe-ready\\\\n"}'
while :; do sleep 0.05; done
"""


@pytest.mark.parametrize("mode,want", [
    ("trap 'exit 0' INT", "reported no results"),  # exits, prints no maps
    ("trap '' INT", "did not exit within"),  # ignores SIGINT: killed
])
def test_stand_in_bpftrace_without_results_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      mode: str, want: str) -> None:
    fake = tmp_path / "bpftrace"
    fake.write_text(FAKE_BPFTRACE.replace("MODE", mode))
    fake.chmod(0o755)
    monkeypatch.setattr(ebpf.shutil, "which", lambda name: str(fake) if name == "bpftrace" else None)
    monkeypatch.setattr(ebpf, "STOP_TIMEOUT_S", 1.0)
    target = subprocess.Popen(["sleep", "30"])
    try:
        run = ebpf.ProbeRun([target.pid], probes.DEFAULT_PROBES, backend=BackendStatus("bpftrace", True, "stand-in"),
                            max_s=20).start()
        assert run.backend.name == "bpftrace" and run._proc.poll() is None
        records, failures = run.stop()
    finally:
        target.kill()
        target.wait()
    assert run._proc.poll() is not None  # gone, one way or the other
    header = records[0]
    assert header.backend == "procfs" and any(want in f.message for f in failures), failures
    assert any(s.backend == "bpftrace" and "reported no results" in s.reason for s in header.skipped)
    assert records[1].wakes_on_addr is None  # no maps: no claim about wakes
    assert run._tmp is None  # the program file is removed
