"""Unit tests for the collectors on recorded /proc text and fake runners (scrapes: tests/test_scrape.py)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from wedgectl.collect import procfs, pyspy, scrape
from wedgectl.collect.processes import classify_role, is_mp_helper
from wedgectl.collect import sockets
from wedgectl.collect.sockets import TcpTables, format_address, sockets_from_tables
from wedgectl.model.types import FailureKind, FutexWaiters, Role, StackDump, ThreadSample

# --- recorded /proc text (x86_64, kernel 6.18) --------------------------------

SYSCALL_LOCK = "202 0x5652e4bab440 0x189 0x0 0x0 0x0 0xffffffff 0x7f6ad0ff8d60 0x7f6ad1a6b117\n"
SYSCALL_TIMED = "202 0x7f3c8c000b60 0x89 0x0 0x7f3c97ffe9f0 0x0 0xffffffff 0x7f3c97ffe980 0x7f3c9a4c1117\n"
SYSCALL_RESTART = "219 0x7f3c8c000b60 0x89 0x0 0x7f3c97ffe9f0 0x0 0xffffffff 0x7f3c97ffe980 0x7f3c9a4c1117\n"
SYSCALL_WAIT4 = "61 0xffffffff 0x7ffd5f1c3a6c 0x0 0x0 0x0 0x0 0x7ffd5f1c3a48 0x7f0e1c2ea5ba\n"
SYSCALL_RUNNING = "running\n"
SYSCALL_OUTSIDE = "-1 0x7ffd5f1c3a48 0x55d0c8e0d3a1\n"

STAT_PLAIN = (
    "4138 (python) S 4100 4138 4100 34816 4138 4194560 1893 0 0 0 250 37 0 0 20 0 3 0 "
    "123456 30601216 3471 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 1 0 0 0 0 0\n"
)
# comm with spaces and parentheses (a setproctitle'd title is cut at 15 chars)
STAT_WEIRD = (
    "4142 (a) b (c) d) R 4100 4138 4100 34816 4138 4194368 10 0 0 0 1234 5 0 0 20 0 60 0 "
    "123460 30601216 3471 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 0 0 0 0 0 0\n"
)
STATUS = (
    "Name:\tpython\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4138\nPid:\t4142\n"
    "voluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3456\n"
)


def test_parse_syscall_futex_lock_wait() -> None:
    nr, args = procfs.parse_syscall(SYSCALL_LOCK)
    assert nr == 202
    assert args == (0x5652E4BAB440, 0x189, 0, 0, 0, 0xFFFFFFFF)
    assert procfs.futex_from_syscall(nr, args, "futex_do_wait", "x86_64") == (0x5652E4BAB440, 0x189, False)


def test_parse_syscall_timed_futex() -> None:
    nr, args = procfs.parse_syscall(SYSCALL_TIMED)
    assert procfs.futex_from_syscall(nr, args, "", "x86_64") == (0x7F3C8C000B60, 0x89, True)


def test_restart_syscall_counts_as_futex_with_previous_args() -> None:
    nr, args = procfs.parse_syscall(SYSCALL_RESTART)
    assert nr == 219
    assert procfs.futex_from_syscall(nr, args, "futex_do_wait", "x86_64") == (0x7F3C8C000B60, 0x89, True)
    assert procfs.futex_from_syscall(nr, args, "", "x86_64")[0] == 0x7F3C8C000B60
    # restart_syscall resuming a sleep is not a futex wait
    assert procfs.futex_from_syscall(nr, args, "hrtimer_nanosleep", "x86_64") == (None, None, None)


def test_parse_syscall_running_and_outside() -> None:
    assert procfs.parse_syscall(SYSCALL_RUNNING) == (None, ())
    assert procfs.parse_syscall("") == (None, ())
    assert procfs.parse_syscall(SYSCALL_OUTSIDE) == (-1, ())
    assert procfs.futex_from_syscall(-1, (), "", "x86_64") == (None, None, None)
    assert procfs.futex_from_syscall(None, (), "", "x86_64") == (None, None, None)


def test_futex_numbers_follow_architecture() -> None:
    nr, args = procfs.parse_syscall("98 0xffff8000a000 0x80 0x2 0x0 0x0 0x0 0xffffc0de 0xffff0000")
    assert procfs.futex_from_syscall(nr, args, "", "aarch64") == (0xFFFF8000A000, 0x80, False)
    assert procfs.futex_from_syscall(nr, args, "", "x86_64") == (None, None, None)  # 98 is getrusage there
    assert procfs.futex_from_syscall(*procfs.parse_syscall(SYSCALL_WAIT4), "do_wait", "x86_64") == (None, None, None)
    assert procfs.futex_syscall_numbers("riscv64") is None


def test_parse_stat_plain() -> None:
    st = procfs.parse_stat(STAT_PLAIN)
    assert (st.pid, st.comm, st.state, st.ppid) == (4138, "python", "S", 4100)
    assert (st.utime_ticks, st.stime_ticks, st.num_threads, st.starttime_ticks) == (250, 37, 3, 123456)
    assert st.flags == 4194560 and not st.flags & procfs.PF_EXITING


def test_a_process_in_its_exit_reads_as_exiting(tmp_path: Path) -> None:
    """PF_EXITING (0x4) in the flags field: killed, being torn down, still in state R."""
    from wedgectl.collect.processes import sample_process

    (tmp_path / "4138").mkdir()
    (tmp_path / "4138" / "stat").write_text(STAT_PLAIN.replace(" S 4100 ", " R 4100 ").replace(" 4194560 ", " 4194564 "))
    st, failures = procfs.read_process_stat(4138, tmp_path)
    assert failures == () and st is not None
    assert (st.state, st.flags & procfs.PF_EXITING, st.exiting) == ("R", 4, True)
    sample, _ = sample_process(4138, Role.ENGINE_CORE, proc_root=tmp_path, with_threads=False)
    assert (sample.state, sample.exiting, sample.ppid) == ("R", True, 4100)
    (tmp_path / "4138" / "stat").write_text(STAT_PLAIN.replace(" S 4100 ", " Z 4100 ").replace(" 4194560 ", " 4194564 "))
    assert not procfs.read_process_stat(4138, tmp_path)[0].exiting  # a zombie has exited
    (tmp_path / "4138" / "stat").write_text(STAT_PLAIN)
    assert not procfs.read_process_stat(4138, tmp_path)[0].exiting


def test_a_process_killed_but_not_yet_run_reads_as_exiting(tmp_path: Path) -> None:
    """SIGKILL pending (bit 9 of SigPnd or ShdPnd) and no PF_EXITING yet: a thread that has not had a CPU
    since the kill. Seen on a loaded host: a killed deployment's EngineCore in state R, read as an orphan."""
    from wedgectl.collect.processes import sample_process

    status = Path("/proc/self/status").read_text()  # this kernel's format, the masks set below
    assert "SigPnd:\t0000000000000000" in status and "ShdPnd:\t0000000000000000" in status
    (tmp_path / "4138").mkdir()
    (tmp_path / "4138" / "stat").write_text(STAT_PLAIN.replace(" S 4100 ", " R 4100 "))
    for field in ("SigPnd", "ShdPnd"):
        (tmp_path / "4138" / "status").write_text(status.replace(f"{field}:\t0000000000000000", f"{field}:\t0000000000000100"))
        assert procfs.kill_pending(4138, tmp_path)
        sample, _ = sample_process(4138, Role.ENGINE_CORE, proc_root=tmp_path, with_threads=False)
        assert (sample.state, sample.exiting) == ("R", True)
        # the API server is not read for it: only an engine process's exit decides a verdict
        sample, _ = sample_process(4138, Role.API_SERVER, proc_root=tmp_path, with_threads=False)
        assert not sample.exiting
    # another signal pending (SIGTERM, bit 15) is not a kill
    (tmp_path / "4138" / "status").write_text(status.replace("SigPnd:\t0000000000000000", "SigPnd:\t0000000000004000"))
    assert not procfs.kill_pending(4138, tmp_path)
    sample, _ = sample_process(4138, Role.ENGINE_CORE, proc_root=tmp_path, with_threads=False)
    assert not sample.exiting
    (tmp_path / "4138" / "status").write_text("SigPnd:\tnot hex\n")
    assert not procfs.kill_pending(4138, tmp_path) and not procfs.kill_pending(999999, tmp_path)


def test_parse_stat_comm_with_spaces_and_parentheses() -> None:
    st = procfs.parse_stat(STAT_WEIRD)
    assert st.comm == "a) b (c) d"
    assert (st.pid, st.state, st.ppid, st.utime_ticks, st.stime_ticks, st.num_threads) == (4142, "R", 4100, 1234, 5, 60)


def test_a_pid_sampled_without_psutil_reads_as_psutil_does() -> None:
    """sample_process given a pid reads RSS from statm and the start time from the stat line it
    already read: the figures psutil gives for the same process (a live child, read twice)."""
    import psutil

    from wedgectl.collect.processes import sample_process, sample_roles

    import time

    child = subprocess.Popen(["sleep", "30"])
    try:
        ps = psutil.Process(child.pid)
        deadline = time.monotonic() + 10
        while ps.status() != psutil.STATUS_SLEEPING and time.monotonic() < deadline:
            time.sleep(0.01)  # asleep: its memory no longer moves (the loader is done)
        sample, failures = sample_process(child.pid, Role.OTHER)
        assert failures == ()
        assert sample.started == ps.create_time()
        assert sample.rss_bytes == ps.memory_info().rss == procfs.read_rss(child.pid)
        assert sample.ppid == ps.ppid() and sample.state == "S"
        child.kill()
        child.wait()
        # gone before its stat was read: left out of the sample, without a failure
        got, failures = sample_roles({child.pid: Role.OTHER})
        assert got == () and failures == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_boot_time_and_rss_from_a_recorded_tree(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  1 2 3 4 5 6 7 8 0 0\nintr 12\nbtime 1796327203\nprocesses 9\n")
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "statm").write_text("1000 250 100 10 0 300 0\n")
    assert procfs.boot_time(tmp_path) == 1796327203.0
    assert procfs.read_rss(7, tmp_path) == 250 * procfs.PAGE_SIZE
    (tmp_path / "7" / "statm").write_text("garbled")
    assert procfs.read_rss(7, tmp_path) is None and procfs.read_rss(8, tmp_path) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "stat").write_text("cpu  1 2 3\n")  # no btime line
    assert procfs.boot_time(other) is None


def test_parse_wchan_and_status() -> None:
    assert procfs.parse_wchan("0") == ""
    assert procfs.parse_wchan("futex_do_wait") == "futex_do_wait"
    assert procfs.parse_ctxt_switches(STATUS) == (12, 3456)
    assert procfs.parse_ctxt_switches("Name:\tx\n") == (None, None)


def test_thread_from_texts_converts_ticks() -> None:
    t = procfs.thread_from_texts(4142, STAT_WEIRD, "0", SYSCALL_RUNNING, STATUS, "x86_64", clk_tck=100)
    assert t == ThreadSample(
        tid=4142,
        comm="a) b (c) d",
        state="R",
        wchan="",
        utime_s=12.34,
        stime_s=0.05,
        voluntary_switches=12,
        nonvoluntary_switches=3456,
    )
    assert not t.in_futex_wait
    unreadable = procfs.thread_from_texts(4142, STAT_PLAIN, None, None, None, "x86_64")
    assert unreadable.syscall_nr is None and unreadable.voluntary_switches is None


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (0x189, "FUTEX_WAIT_BITSET_PRIVATE|FUTEX_CLOCK_REALTIME"),
        (0x80, "FUTEX_WAIT_PRIVATE"),
        (0x89, "FUTEX_WAIT_BITSET_PRIVATE"),
        (0x81, "FUTEX_WAKE_PRIVATE"),
        (0x0, "FUTEX_WAIT"),
        (0x86, "FUTEX_LOCK_PI_PRIVATE"),
        (0x1F, "FUTEX_OP_0x1f"),
    ],
)
def test_decode_futex_op(op: int, name: str) -> None:
    assert procfs.decode_futex_op(op) == name


def test_futex_waiters_group_by_address() -> None:
    # The one grouping (classifier, top, collectors) counts every thread /proc shows in futex(2),
    # whatever the op: a thread caught inside FUTEX_WAKE (0x81) is grouped too, as the
    # classifier always did. Most waiters first; tids in the order the threads were read.
    def t(tid: int, addr: int | None, op: int | None = 0x189) -> ThreadSample:
        return ThreadSample(tid=tid, comm="x", state="S", futex_addr=addr, futex_op=op)

    threads = [t(2, 0xB0), t(3, 0xA0), t(1, 0xA0), t(4, None), t(5, 0xC0, op=0x81)]
    waiters = FutexWaiters.of(threads)
    assert [(g.addr, g.tids) for g in waiters.groups] == [(0xA0, (3, 1)), (0xB0, (2,)), (0xC0, (5,))]
    assert waiters.n_waiting == 4 and waiters.n_threads == 5
    assert waiters.sharing(0xA0) == 2 and waiters.sharing(None) == 0 and waiters.sharing(0xD0) == 0
    assert FutexWaiters.of([]).by_addr == {}


# --- read_threads on a recorded tree -----------------------------------------


def _fake_proc(root: Path, pid: int, threads: dict[int, dict[str, str]]) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "stat").write_text(next(iter(threads.values()))["stat"])
    for tid, files in threads.items():
        d = root / str(pid) / "task" / str(tid)
        d.mkdir(parents=True)
        for name, text in files.items():
            (d / name).write_text(text)


def test_read_threads_from_recorded_tree(tmp_path: Path) -> None:
    lock = {"stat": STAT_PLAIN, "wchan": "futex_do_wait", "syscall": SYSCALL_LOCK, "status": STATUS}
    spin = {"stat": STAT_WEIRD, "wchan": "0", "syscall": SYSCALL_RUNNING, "status": STATUS}
    _fake_proc(tmp_path, 4138, {4138: lock, 4142: spin})
    threads, failures = procfs.read_threads(4138, tmp_path, machine="x86_64")
    assert failures == ()
    assert [x.tid for x in threads] == [4138, 4142]
    assert threads[0].futex_addr == 0x5652E4BAB440 and threads[0].wchan == "futex_do_wait"
    assert threads[1].state == "R" and threads[1].syscall_nr is None
    stat, failures = procfs.read_process_stat(4138, tmp_path)
    assert failures == () and stat is not None and stat.num_threads == 3 and stat.ppid == 4100


def test_read_threads_thread_vanishes_mid_read(tmp_path: Path) -> None:
    full = {"stat": STAT_PLAIN, "wchan": "0", "syscall": SYSCALL_RUNNING, "status": STATUS}
    _fake_proc(tmp_path, 4138, {4138: full, 4142: {"stat": STAT_WEIRD}})  # 4142 lost its other files
    threads, failures = procfs.read_threads(4138, tmp_path)
    assert [x.tid for x in threads] == [4138]
    assert [f.kind for f in failures] == [FailureKind.GONE]
    assert "4142" in failures[0].message


def test_read_threads_missing_process_is_gone(tmp_path: Path) -> None:
    threads, failures = procfs.read_threads(99999, tmp_path)
    assert threads == () and [f.kind for f in failures] == [FailureKind.GONE]
    stat, failures = procfs.read_process_stat(99999, tmp_path)
    assert stat is None and failures[0].kind is FailureKind.GONE


def test_read_threads_permission_on_syscall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = {"stat": STAT_PLAIN, "wchan": "0", "syscall": SYSCALL_LOCK, "status": STATUS}
    _fake_proc(tmp_path, 4138, {4138: full, 4139: full})
    real = procfs.threads.read_text

    def deny_syscall(path: Path | str) -> str:
        if Path(path).name == "syscall":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(procfs.threads, "read_text", deny_syscall)
    threads, failures = procfs.read_threads(4138, tmp_path)
    assert len(threads) == 2 and all(t.syscall_nr is None for t in threads)
    assert [f.kind for f in failures] == [FailureKind.PERMISSION]  # one per process, not per thread
    assert "CAP_SYS_PTRACE" in failures[0].message or "ptrace" in failures[0].message


def test_read_threads_bad_data(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 7, {7: {"stat": "garbage", "wchan": "0", "syscall": "running", "status": ""}})
    threads, failures = procfs.read_threads(7, tmp_path)
    assert threads == () and failures[0].kind is FailureKind.BAD_DATA


# --- roles ------------------------------------------------------------------

PY = "/opt/venv/bin/python3.12"


@pytest.mark.parametrize(
    ("name", "cmdline", "role"),
    [
        ("VLLM::EngineCor", ["VLLM::EngineCore"], Role.ENGINE_CORE),
        ("VLLM::EngineCor", ["VLLM::EngineCore_DP0"], Role.ENGINE_CORE),
        ("VLLM::EngineCor", [], Role.ENGINE_CORE),  # cmdline unreadable: the cut comm still tells
        ("VLLM::Worker_TP", ["VLLM::Worker_TP0"], Role.WORKER),
        ("VLLM::Worker", ["VLLM::Worker"], Role.WORKER),
        ("VLLM::Worker_PP", ["VLLM::Worker_PP0_TP1"], Role.WORKER),
        ("VLLM::APIServer", ["VLLM::APIServer_0"], Role.API_SERVER),
        ("VLLM::APIServer", ["VLLM::APIServer      "], Role.API_SERVER),
        ("PD-L1_binder::E", ["PD-L1_binder::EngineCore_DP0"], Role.ENGINE_CORE),
        ("VLLM::DPCoordin", ["VLLM::DPCoordinator"], Role.OTHER),
        ("vllm", [PY, "/opt/venv/bin/vllm", "serve", "Qwen/Qwen3-0.6B", "--port", "8000"], Role.API_SERVER),
        ("vllm", ["/opt/venv/bin/vllm", "serve", "facebook/opt-125m"], Role.API_SERVER),
        ("python3.12", [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], Role.API_SERVER),
        ("python3", [PY, "-u", "/opt/venv/lib/python3.12/site-packages/vllm/entrypoints/openai/api_server.py"], Role.API_SERVER),
        ("python3", [PY, "/opt/venv/lib/python3.12/site-packages/vllm/entrypoints/cli/main.py", "serve", "m"], Role.API_SERVER),
        ("python3", [PY, "-m", "vllm.entrypoints.cli.main", "serve", "m"], Role.API_SERVER),
        ("python3", [PY, "/srv/wedge_serve.py", "serve", "/models/tiny", "--port", "8123"], Role.API_SERVER),
        ("python3", [PY, "/srv/wedge_serve.py", "--help"], Role.OTHER),
        ("vllm", ["vllm serve Qwen/Qwen3-0.6B --port 8000"], Role.API_SERVER),  # title without NULs
        ("python3", [PY, "-c", "from multiprocessing.resource_tracker import main;main(7)"], Role.OTHER),
        ("python3", [PY, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=8, pipe_handle=10)", "--multiprocessing-fork"], Role.OTHER),
        ("bash", ["bash", "-c", "vllm serve m --port 8000"], Role.OTHER),
        ("python3", [PY, "-m", "pytest", "tests/test_vllm_serve.py"], Role.OTHER),
        ("sleep", ["sleep", "30"], Role.OTHER),
        ("", [], Role.OTHER),
    ],
)
def test_classify_role(name: str, cmdline: list[str], role: Role) -> None:
    assert classify_role(name, cmdline) is role


@pytest.mark.parametrize(
    "cmdline, helper",
    [
        ([PY, "-B", "-c", "from multiprocessing.resource_tracker import main;main(31)"], True),  # vLLM's, as read from /proc
        ([PY, "-c", "from multiprocessing.forkserver import main; main(5, 6, ['__main__'], **{})"], True),
        (["python3 -c from multiprocessing.resource_tracker import main;main(7)"], True),  # a title without NULs
        ([PY, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=8, pipe_handle=10)", "--multiprocessing-fork"], False),
        (["VLLM::EngineCore", "", ""], False),
        ([PY, "/srv/resource_tracker.py"], False),  # a script of that name is not multiprocessing's
        ([PY, "-c"], False),
        ([], False),
    ],
)
def test_is_mp_helper(cmdline: list[str], helper: bool) -> None:
    """multiprocessing's helpers, never stack-dumped; its spawned children (the engine) are not helpers."""
    assert is_mp_helper(cmdline) is helper


# --- sockets ------------------------------------------------------------------

NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 45657 1 0000000012f1e76a 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D4C2 01 00000000:00000000 00:00000000 00000000     0        0 45681 1 00000000d45b15df 20 4 30 10 -1
"""
NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5001 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:1F42 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5002 1 0000000000000000 100 0 0 10 0
"""


def test_tcp_tables_decode_v4_and_v6(tmp_path: Path) -> None:
    (tmp_path / "7" / "net").mkdir(parents=True)
    (tmp_path / "7" / "net" / "tcp").write_text(NET_TCP)
    (tmp_path / "7" / "net" / "tcp6").write_text(NET_TCP6)
    (tmp_path / "7" / "fd").mkdir()
    for fd, inode in enumerate((45657, 45681, 5001, 5002)):
        (tmp_path / "7" / "fd" / str(fd)).symlink_to(f"socket:[{inode}]")
    rows = TcpTables(tmp_path).of(7)
    assert sorted(local for _state, local, _remote in rows) == [
        "0.0.0.0:8000", "127.0.0.1:8000", "127.0.0.1:8002", "[::1]:8001"]  # v4-mapped v6 reads as v4
    assert TcpTables(tmp_path).listening_on(7, 8001) == ("[::1]:8001",)
    assert format_address("::", 80) == "[::]:80"


SOCK_DIAG_REPLY = Path(__file__).parent / "fixtures" / "real" / "sock-diag-reply.bin"


def test_a_recorded_sock_diag_reply_parses_to_the_sockets_it_lists() -> None:
    """Recorded from this kernel: a test's listener on [::1]:51353, one on 127.0.0.1:33951, and a
    connection to it (both ends), then NLMSG_DONE."""
    data = SOCK_DIAG_REPLY.read_bytes()
    rows: dict = {}
    assert sockets.parse_diag_dump(data, rows) is True
    decoded = {inode: (state, sockets.endpoint(local), sockets.endpoint(remote))
               for inode, (state, local, remote) in rows.items()}
    assert decoded == {
        476769: (0x0A, ("::1", 51353), ("::", 0)),
        476770: (0x0A, ("127.0.0.1", 33951), ("0.0.0.0", 0)),
        476771: (0x01, ("127.0.0.1", 45928), ("127.0.0.1", 33951)),
        476772: (0x01, ("127.0.0.1", 33951), ("127.0.0.1", 45928)),
    }
    # the dump's last message (NLMSG_DONE, 20 bytes) cut off: not done yet, the records kept
    partial: dict = {}
    assert sockets.parse_diag_dump(data[:-20], partial) is False and partial == rows


def test_a_sock_diag_error_or_a_malformed_reply_is_an_oserror_not_a_loop() -> None:
    error = sockets._NLMSG.pack(36, sockets.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -13) + bytes(16)
    with pytest.raises(OSError) as exc:
        sockets.parse_diag_dump(error, {})
    assert exc.value.errno == 13
    with pytest.raises(OSError):
        sockets.parse_diag_dump(sockets._NLMSG.pack(0, sockets.SOCK_DIAG_BY_FAMILY, 0, 1, 0), {})
    assert sockets.parse_diag_dump(b"\x01\x02", {}) is False  # shorter than a header: nothing in it


def test_sock_diag_and_proc_read_the_same_sockets_of_a_real_process() -> None:
    """wedgectl's own namespace is asked over sock_diag; /proc/PID/net/tcp[6] must say the same."""
    import socket as so

    v6 = so.socket(so.AF_INET6)
    v6.bind(("::1", 0))
    v6.listen()
    v4 = so.socket()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    client = so.create_connection(v4.getsockname())
    served, _ = v4.accept()
    try:
        diag = sockets.TcpTables()
        by_diag = sorted(diag.of(os.getpid()))
        assert diag.diag_failed is None
        by_proc = sorted(sockets.TcpTables(diag=False).of(os.getpid()))
        assert by_diag == by_proc
        port6, port4 = v6.getsockname()[1], v4.getsockname()[1]
        assert (0x0A, f"[::1]:{port6}", ("::", 0)) in by_diag
        assert (0x01, f"127.0.0.1:{client.getsockname()[1]}", ("127.0.0.1", port4)) in by_diag
        assert diag.listening_on(os.getpid(), port4) == (f"127.0.0.1:{port4}",)
    finally:
        for s in (v6, v4, client, served):
            s.close()


def _net_tree(root: Path, pid: int, fds: dict[str, str]) -> None:
    (root / str(pid) / "net").mkdir(parents=True)
    (root / str(pid) / "net" / "tcp").write_text(NET_TCP)
    (root / str(pid) / "cmdline").write_bytes(b"python\0-m\0vllm.entrypoints.openai.api_server\0--port\08000\0")
    (root / str(pid) / "fd").mkdir()
    for fd, target in fds.items():
        (root / str(pid) / "fd" / fd).symlink_to(target)


def test_tcp_tables_read_a_recorded_tree(tmp_path: Path) -> None:
    _net_tree(tmp_path, 4101, {"3": "socket:[45657]", "4": "socket:[45681]", "5": "/dev/null"})
    tables = TcpTables(tmp_path)
    rows = tables.of(4101)
    assert sorted(rows) == [(0x01, "127.0.0.1:8000", ("127.0.0.1", 0xD4C2)), (0x0A, "0.0.0.0:8000", ("0.0.0.0", 0))]
    assert sockets_from_tables(4101, tables, frozenset()) == (("0.0.0.0:8000",), 1)
    # the established one is ours (wedgectl's scrape): not a client
    assert sockets_from_tables(4101, tables, frozenset({("127.0.0.1", 0xD4C2)})) == (("0.0.0.0:8000",), 0)


def test_listening_of_falls_back_to_the_port_in_the_cmdline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_SYS_PTRACE the fds are unreadable: the LISTEN rows on the port the cmdline names."""
    _net_tree(tmp_path, 4101, {})

    def refused(pid: int, proc_root: Path = procfs.PROC) -> list[str]:
        raise PermissionError(13, "Permission denied")  # as reading /proc/PID/fd without CAP_SYS_PTRACE

    monkeypatch.setattr(procfs, "fd_links", refused)
    assert sockets.listening_of(4101, tmp_path) == ("0.0.0.0:8000",)


# --- py-spy with a fake runner -----------------------------------------------

PYSPY_JSON = json.dumps(
    [
        {
            "pid": 4138,
            "thread_id": 139862306956992,
            "thread_name": "spinner",
            "os_thread_id": 4142,
            "active": True,
            "owns_gil": True,
            "process_info": None,
            "frames": [
                {"name": "spin", "filename": "/t/spinner.py", "module": None, "short_filename": "spinner.py",
                 "line": 21, "locals": None, "is_entry": True, "is_shim_entry": False},
                {"name": "run", "filename": "/usr/lib/python3.11/threading.py", "module": None,
                 "short_filename": "threading.py", "line": 982, "locals": None, "is_entry": False, "is_shim_entry": False},
            ],
        }
    ]
)


def _runner(stdout: str = "", stderr: str = "", rc: int = 0, raises: BaseException | None = None):
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        assert kwargs["timeout"] > 0
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(cmd, rc, stdout, stderr)

    run.calls = calls  # type: ignore[attr-defined]
    return run


@pytest.fixture
def pyspy_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyspy, "find_pyspy", lambda: "/usr/bin/py-spy")


def test_dump_stacks_parses_json(pyspy_found: None) -> None:
    run = _runner(PYSPY_JSON)
    dump = pyspy.dump_stacks(4138, runner=run)
    assert run.calls == [["/usr/bin/py-spy", "dump", "--pid", "4138", "--json", "--nonblocking"]]
    assert dump.error is None and len(dump.threads) == 1
    assert pyspy.frame_names(dump.threads[0]) == ["spin (spinner.py:21)", "run (threading.py:982)"]
    assert pyspy.thread_for_tid(dump, 4142)["thread_name"] == "spinner"
    assert pyspy.thread_for_tid(dump, 1) is None
    assert pyspy.stack_failure(dump) is None


def test_native_drops_nonblocking(pyspy_found: None) -> None:
    run = _runner(PYSPY_JSON)
    dump = pyspy.dump_stacks(4138, native=True, runner=run)
    assert run.calls[0][-1] == "--native" and "--nonblocking" not in run.calls[0]
    assert dump.native


def test_dump_stacks_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyspy, "find_pyspy", lambda: None)
    dump = pyspy.dump_stacks(1, runner=_runner(PYSPY_JSON))
    assert pyspy.stack_failure(dump).kind is FailureKind.MISSING_TOOL


def test_dump_stacks_timeout(pyspy_found: None) -> None:
    dump = pyspy.dump_stacks(1, timeout=0.5, runner=_runner(raises=subprocess.TimeoutExpired(["py-spy"], 0.5)))
    assert dump.threads == () and pyspy.stack_failure(dump).kind is FailureKind.TIMEOUT


def test_dump_stacks_permission(pyspy_found: None) -> None:
    stderr = (
        "Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n"
        "    0: Permission denied (os error 13)\n    1: Permission denied (os error 13)\n"
    )
    dump = pyspy.dump_stacks(1, runner=_runner(stderr=stderr, rc=1))  # pid 1 exists
    failure = pyspy.stack_failure(dump)
    assert failure.kind is FailureKind.PERMISSION
    assert "CAP_SYS_PTRACE" in failure.message or "ptrace" in failure.message


def test_dump_stacks_not_python_and_bad_json(pyspy_found: None) -> None:
    dump = pyspy.dump_stacks(1, runner=_runner(stderr="Error: Failed to find python version from target process\n", rc=1))
    assert "not a Python process" in dump.error
    dump = pyspy.dump_stacks(1, runner=_runner(stdout='{"not": "a list"}'))
    assert pyspy.stack_failure(dump).kind is FailureKind.BAD_DATA
    dump = pyspy.dump_stacks(1, runner=_runner(raises=FileNotFoundError("py-spy")))
    assert pyspy.stack_failure(dump).kind is FailureKind.MISSING_TOOL


def test_stack_failure_without_prefix() -> None:
    f = pyspy.stack_failure(StackDump(pid=5, t=0.0, error="something odd"))
    assert f.kind is FailureKind.ERROR and f.message == "something odd" and f.target == "5"


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/metrics"),
        ("127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
        ("http://host:8000/v1", "http://host:8000/metrics"),
        ("http://host:8000/metrics", "http://host:8000/metrics"),
        ("0.0.0.0:8000", "http://127.0.0.1:8000/metrics"),
        ("[::]:8000", "http://[::1]:8000/metrics"),
        ("https://vllm.example.com", "https://vllm.example.com/metrics"),
    ],
)
def test_metrics_url_for(base: str, url: str) -> None:
    assert scrape.metrics_url_for(base) == url


def test_boot_time_follows_a_stepped_wall_clock(tmp_path, monkeypatch):
    """btime is the wall clock less the time since boot, so it moves when the clock is stepped;
    psutil reads it at every call, and a value kept for good put start times seconds off theirs
    (seen: 12 s after a VM clock sync). It is read again once BOOT_TTL_S has passed."""
    from wedgectl.collect import procfs

    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1000\nprocesses 5\n")
    assert procfs.boot_time(tmp_path) == 1000.0
    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1012\nprocesses 5\n")
    assert procfs.boot_time(tmp_path) == 1000.0  # within the TTL: the kept value
    monkeypatch.setattr(procfs.stat, "BOOT_TTL_S", 0.0)
    assert procfs.boot_time(tmp_path) == 1012.0
