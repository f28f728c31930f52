"""Reading an engine report: the parser on hostile bytes, and the collector's search, file checks and stale-pid check.

A report is a file the target writes, so every case here is one a target could plant: deep nesting,
10 MB, wrong types, NaN, huge integers, a symlink, a FIFO, another owner's file, a directory others may
write, a report of an earlier process with the same pid. Each must end in a reason, in bounded time,
never a traceback. The reports themselves are built from the schema (tests/engine_reports.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from engine_reports import SCHEMA_EXAMPLE, report_bytes, schema_report
from wedgectl.collect import procfs
from wedgectl.collect.enginereport import FILE_NAME, read_engine_report, read_engine_reports, where_to_look
from wedgectl.model import bounds as B
from wedgectl.model.engine import (GONE, MALFORMED, NOT_FOUND, NOT_OURS, STALE_PROCESS, TOO_BIG, UNREADABLE,
                                   EngineReport)
from wedgectl.read.enginereport import parse_report

ME = os.getpid()
TICKS = procfs.start_ticks(ME)
NOW_NS = 50_000_000_000


def clock() -> int:
    return NOW_NS


# --- the parser ------------------------------------------------------------------------------------

def test_the_schema_example_reads_whole():
    report = parse_report(json.dumps(SCHEMA_EXAMPLE).encode())
    assert isinstance(report, EngineReport)
    assert report.to_dict() == SCHEMA_EXAMPLE  # every key of the contract, and back
    assert report.stage_name == "execute_model_wait" and report.running == 1
    assert report.kv_blocks is not None and report.kv_blocks.total == 4
    assert report.requests[0].never_fits(report.kv_blocks)  # 5 blocks needed, 4 in the pool


@pytest.mark.parametrize("data, reason", [
    (b"", MALFORMED), (b"{", MALFORMED), (b"[1, 2]", MALFORMED), (b"\xff\xfe{}", MALFORMED), (b"null", MALFORMED),
    (b"[" * 200_000, MALFORMED),  # deep nesting, under the size bound: json's recursion limit, no traceback
    (json.dumps({**SCHEMA_EXAMPLE, "x": [[[[[[[[[[1]]]]]]]]]]}).encode(), MALFORMED),  # deeper than the bound
    (b" " * (B.ENGINE_REPORT_MAX_BYTES + 1), TOO_BIG),
    (b"x" * (10 << 20), TOO_BIG),  # 10 MB: refused unparsed
    (json.dumps(schema_report(pid="1234")).encode(), MALFORMED),  # a required key of the wrong type
    (json.dumps(schema_report(proc_start_ticks=None)).encode(), MALFORMED),
    (json.dumps(schema_report(written_mono_ns=True)).encode(), MALFORMED),  # a bool is not an integer
    (json.dumps(schema_report(schema=0)).encode(), MALFORMED),
])
def test_hostile_bytes_give_a_reason(data, reason):
    got = parse_report(data)
    assert isinstance(got, str) and got.startswith(reason), got


def test_wrong_types_are_dropped_not_fatal():
    got = parse_report(report_bytes(
        role=["engine_core"], vllm=7, seq=-1, interval_s="1", stage="execute_model_wait", steps=1.5,
        scheduler={"running": "1", "waiting": 2, "waiting_by_reason": {"capacity": "x", "deferred": 3},
                   "paused": 0, "kv_blocks": [1, 2]},
        requests=[5, {"id": 7}, {"id": "ok", "age_s": "12", "blocks_needed": -1, "client_connected": "yes"}],
        rank="tp0", stacks={"threads": [{"name": 1, "frames": [{"line": "10"}, 3]}, "x"]}))
    assert isinstance(got, EngineReport)
    assert (got.role, got.vllm, got.seq, got.interval_s, got.stage, got.steps) == ("other", "", None, None, None, None)
    assert got.scheduler is not None and got.scheduler.running is None and got.scheduler.waiting == 2
    assert got.scheduler.waiting_by_reason == {"deferred": 3} and got.scheduler.paused is None
    assert got.scheduler.kv_blocks is None and got.rank is None
    assert [r.id for r in got.requests] == ["ok"]
    assert got.requests[0].age_s is None and got.requests[0].blocks_needed is None
    assert got.stacks is not None and len(got.stacks.threads) == 1 and got.stacks.threads[0].frames[0].line is None


HISTORY = [[119, 1000, 990], [120, 1100, 1080], [121, 1150, 1100], [122, 1200, 1150], [123, 1234, 1200]]


def test_the_history_reads_whole_and_back():
    report = parse_report(report_bytes(history=HISTORY))
    assert isinstance(report, EngineReport)
    assert report.history == tuple(tuple(e) for e in HISTORY)
    assert report.step_history == ((119, 1000), (120, 1100), (121, 1150), (122, 1200), (123, 1234))
    assert report.to_dict()["history"] == HISTORY  # the schema's lists, as written


def test_a_report_without_history_reads_as_before():
    report = parse_report(report_bytes())
    assert isinstance(report, EngineReport) and report.history == () and report.step_history == ()
    assert "history" not in report.to_dict()  # the report as it was written: the field is optional
    assert parse_report(report_bytes(history=None)) == report


@pytest.mark.parametrize("history", [
    "x", 7, {"0": [1, 2, 3]}, [None], ["1,2,3"], [[1, 2]], [[1, 2, 3, 4]], [[1, "2", 3]], [[1, 2.5, 3]],
    [[True, 2, 3]], [[-1, 2, 3]], [[1, 2, None]], [[2**63, 2, 3]], [{"written_mono_ns": 1, "steps": 2}],
])
def test_a_history_of_the_wrong_shape_is_dropped(history):
    report = parse_report(report_bytes(history=history))
    assert isinstance(report, EngineReport) and report.history == () and report.step_history == ()
    assert report.steps == 1234  # the rest of the report stands


def test_the_history_keeps_its_newest_entries_and_drops_the_bad_ones():
    long = [[i, 10 * i, i] for i in range(1, 1001)]
    report = parse_report(report_bytes(written_mono_ns=5000, history=long))
    assert isinstance(report, EngineReport)
    assert len(report.history) == B.ENGINE_REPORT_MAX_HISTORY
    assert report.history[0] == (993, 9930, 993) and report.history[-1] == (1000, 10000, 1000)
    mixed = parse_report(report_bytes(history=[[110, 5, 5], "junk", [111, 6], [112, 7, 7]]))
    assert isinstance(mixed, EngineReport) and mixed.history == ((110, 5, 5), (112, 7, 7))


def test_step_history_orders_and_bounds_what_a_bundle_holds():
    # a bundle's report is built without from_dict: step_history checks its entries again
    report = EngineReport(1, 1234, 5, written_mono_ns=100, steps=9,
                          history=((90, 1, 1), (95,), (80, 2, 2), (96, -3, 3), (97, 4, 4), (150, 9, 9)))
    assert report.step_history == ((90, 1), (97, 4))  # one short, one out of order, a negative, one from the future


WORKER_RANK = {"tp": 1, "pp": 0, "dp": 0, "world_size": 2, "steps": 41,
               "collective": {"op": "all_reduce", "group": "tp", "seq": 40, "since_mono_ns": 90, "inside": True}}


def test_a_ranks_steps_and_last_collective_read_whole_and_back():
    d = schema_report(role="worker", rank=WORKER_RANK)
    got = parse_report(json.dumps(d).encode())
    assert isinstance(got, EngineReport) and got.rank is not None and got.rank.collective is not None
    assert (got.rank.tp, got.rank.steps) == (1, 41)
    c = got.rank.collective
    assert (c.op, c.group, c.seq, c.since_mono_ns, c.inside) == ("all_reduce", "tp", 40, 90, True)
    assert got.to_dict()["rank"] == WORKER_RANK


def test_a_rank_without_steps_or_collective_reads_as_before():
    old = {"tp": 0, "pp": 0, "dp": 0, "world_size": 2}
    d = schema_report(role="worker", rank=old)
    got = parse_report(json.dumps(d).encode())
    assert isinstance(got, EngineReport) and got.rank is not None
    assert (got.rank.steps, got.rank.collective) == (None, None)
    assert got.to_dict()["rank"] == old  # no keys the writer did not write


@pytest.mark.parametrize("collective", [
    "all_reduce", 7, [], None, {}, {"op": ""}, {"op": 5, "group": "tp"}, {"group": "tp", "seq": 1},
])
def test_a_collective_without_an_op_is_dropped_and_the_rank_kept(collective):
    got = parse_report(report_bytes(role="worker", rank={**WORKER_RANK, "collective": collective}))
    assert isinstance(got, EngineReport) and got.rank is not None
    assert got.rank.collective is None and got.rank.tp == 1 and got.rank.steps == 41


def test_a_collectives_wrong_types_are_dropped_and_its_names_cut():
    got = parse_report(report_bytes(role="worker", rank={
        "tp": 0, "steps": -3, "collective": {"op": "x" * 5000, "group": ["tp"], "seq": 1.5,
                                             "since_mono_ns": 2 ** 64, "inside": "yes"}}))
    assert isinstance(got, EngineReport) and got.rank is not None and got.rank.collective is not None
    c = got.rank.collective
    assert got.rank.steps is None and c.op == "x" * B.ENGINE_REPORT_MAX_NAME
    assert (c.group, c.seq, c.since_mono_ns, c.inside) == (None, None, None, None)
    got = parse_report(report_bytes(role="worker", rank={"collective": {"op": "barrier", "group": "g" * 500}}))
    assert isinstance(got, EngineReport) and got.rank is not None and got.rank.collective is not None
    assert got.rank.collective.group == "g" * B.ENGINE_REPORT_MAX_NAME


def test_nan_infinity_and_huge_numbers_read_as_null():
    text = report_bytes(interval_s=0.5).replace(b'"interval_s": 0.5', b'"interval_s": NaN')
    text = text.replace(b'"written_unix": 1733500000.123', b'"written_unix": 1e400')
    text = text.replace(b'"steps": 1234', b'"steps": ' + b"9" * 5000)
    text = text.replace(b'"age_s": 12.3', b'"age_s": -Infinity')
    t0 = time.process_time()
    got = parse_report(text)
    assert time.process_time() - t0 < 0.5
    assert isinstance(got, EngineReport)
    assert got.interval_s is None and got.written_unix is None and got.steps is None
    assert got.requests[0].age_s is None
    assert got.period_s == B.ENGINE_REPORT_INTERVAL_S  # the contract's period where the report's own is gone


def test_strings_and_lists_are_cut_to_the_schema_bounds():
    frames = [{"file": "f.py", "line": i, "function": f"fn{i}"} for i in range(50)]  # within 256 KiB in all
    got = parse_report(report_bytes(
        vllm="v" * 1000,
        requests=[{"id": "r" * 500, "state": "waiting"}] * 50,
        stacks={"reason": "s" * 999, "taken_mono_ns": 1,
                "threads": [{"name": "t", "id": 1, "frames": frames}] * 70},
        scheduler={"waiting_by_reason": {f"k{i}": i for i in range(100)}}))
    assert isinstance(got, EngineReport) and got.stacks is not None and got.scheduler is not None
    assert len(got.vllm) == B.ENGINE_REPORT_MAX_STRING
    assert len(got.requests) == B.ENGINE_REPORT_MAX_REQUESTS
    assert len(got.requests[0].id) == B.ENGINE_REPORT_MAX_REQUEST_ID
    assert len(got.stacks.reason) == B.ENGINE_REPORT_MAX_STRING
    assert len(got.stacks.threads) == B.ENGINE_REPORT_MAX_THREADS
    assert len(got.stacks.threads[0].frames) == B.ENGINE_REPORT_MAX_FRAMES
    assert got.stacks.threads[0].frames[0].function == "fn0"  # innermost first: the innermost kept
    assert len(got.scheduler.waiting_by_reason) == B.ENGINE_REPORT_MAX_REASONS


def test_a_largest_hostile_report_parses_in_linear_time():
    """Many short strings and keys up to the size bound: one pass, well under a second."""
    body = json.dumps({**SCHEMA_EXAMPLE, "junk": ["\\u0000\"" * 8] * 6000})
    data = body.encode()[: B.ENGINE_REPORT_MAX_BYTES]
    for blob in (data, body.encode()[: B.ENGINE_REPORT_MAX_BYTES - 2] + b"]}"):
        t0 = time.process_time()
        parse_report(blob)
        assert time.process_time() - t0 < 1.0


# --- the collector: where it looks --------------------------------------------------------------------

def _proc_root(tmp_path: Path, environ: bytes = b"", root: Path | None = None) -> Path:
    """A proc root holding this process's real stat and status, a given environ, and a root of its own."""
    proc = tmp_path / "proc"
    (proc / str(ME)).mkdir(parents=True)
    for name in ("stat", "status"):
        shutil.copy(f"/proc/{ME}/{name}", proc / str(ME) / name)
    (proc / str(ME) / "environ").write_bytes(environ)
    if root is not None:
        os.symlink(root, proc / str(ME) / "root")
    return proc


def test_the_search_order(tmp_path):
    ctr = tmp_path / "ctr"
    ctr.mkdir()
    proc = _proc_root(tmp_path, root=ctr)
    got = where_to_look(ME, 1000, proc, {"WEDGE_ENGINE_REPORT_DIR": "/ours"}, "/tmp", "/theirs")
    root = f"{proc}/{ME}/root"  # read through the process's own root link, as /proc/PID/root is
    assert got == ("/ours", f"{root}/ours", "/theirs", f"{root}/theirs", "/tmp/wedge-engine-reports-1000",
                   f"{root}/tmp/wedge-engine-reports-1000")
    # a relative dir in our own environment is ignored; a root that is ours adds nothing
    plain = _proc_root(tmp_path / "b", root=Path("/"))
    assert where_to_look(ME, 0, plain, {"WEDGE_ENGINE_REPORT_DIR": "rel"}, "/tmp") == ("/tmp/wedge-engine-reports-0",)


def _report_dir(base: Path, mode: int = 0o711) -> Path:
    d = base / f"wedge-engine-reports-{os.geteuid()}"
    d.mkdir(parents=True)
    d.chmod(mode)
    return d


def _write(d: Path, pid: int = ME, **over) -> Path:
    path = d / FILE_NAME.format(pid=pid)
    path.write_bytes(report_bytes(**{"pid": pid, "proc_start_ticks": TICKS, "written_mono_ns": NOW_NS - 400_000_000,
                                      **over}))
    return path


def test_a_fresh_report_in_the_default_dir(tmp_path):
    _write(_report_dir(tmp_path), stage={"name": "execute_model_wait", "since_mono_ns": NOW_NS - 12 * 10**9})
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.error is None and r.report is not None and r.report.pid == ME
    assert r.age_s == pytest.approx(0.4) and r.stage_age_s == pytest.approx(12.0)
    assert r.fresh and not r.stale


def test_the_first_dir_in_order_wins(tmp_path):
    ours, default = tmp_path / "ours", _report_dir(tmp_path)
    ours.mkdir()
    _write(ours, seq=1)
    _write(default, seq=2)
    r = read_engine_report(ME, environ={"WEDGE_ENGINE_REPORT_DIR": str(ours)}, tmp=str(tmp_path), clock=clock)
    assert r.report is not None and r.report.seq == 1 and r.path.startswith(str(ours))


def test_the_process_own_dir_is_read_from_its_environ(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    _write(theirs, seq=3)
    proc = _proc_root(tmp_path, environ=f"A=1\0WEDGE_ENGINE_REPORT_DIR={theirs}\0".encode())
    r = read_engine_report(ME, proc, environ={}, tmp=str(tmp_path / "none"), clock=clock)
    assert r.report is not None and r.report.seq == 3


def test_a_container_report_is_found_under_its_root(tmp_path):
    ctr = tmp_path / "ctr"
    _write(_report_dir(ctr / "tmp"), seq=4)
    proc = _proc_root(tmp_path, root=ctr)
    r = read_engine_report(ME, proc, environ={}, tmp="/tmp", clock=clock)
    assert r.report is not None and r.report.seq == 4 and r.path.startswith(f"{proc}/{ME}/root/tmp/")


def test_not_found_names_where_it_looked(tmp_path):
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.report is None and r.problem == NOT_FOUND and str(tmp_path) in (r.error or "")


def test_a_gone_process(tmp_path):
    r = read_engine_report(999_999_999, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.problem == GONE


# --- the collector: what it refuses ----------------------------------------------------------------------

def test_a_report_of_an_earlier_process_with_that_pid_is_ignored(tmp_path):
    d = _report_dir(tmp_path)
    path = d / FILE_NAME.format(pid=ME)
    path.write_bytes(report_bytes(pid=ME, proc_start_ticks=(TICKS or 0) - 1, written_mono_ns=NOW_NS))
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.report is None and r.problem == STALE_PROCESS and "earlier process" in (r.error or "")


def test_a_report_naming_another_pid_is_refused(tmp_path):
    d = _report_dir(tmp_path)
    (d / FILE_NAME.format(pid=ME)).write_bytes(report_bytes(pid=1, proc_start_ticks=TICKS, written_mono_ns=NOW_NS))
    assert read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock).problem == MALFORMED


def test_a_report_from_the_future_is_refused(tmp_path):
    _write(_report_dir(tmp_path), written_mono_ns=NOW_NS + 60 * 10**9)
    assert read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock).problem == MALFORMED


def test_a_symlink_is_not_followed(tmp_path):
    d = _report_dir(tmp_path)
    real = _write(tmp_path, seq=9)
    os.symlink(real, d / FILE_NAME.format(pid=ME))
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.report is None and r.problem == NOT_OURS and "symbolic link" in (r.error or "")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    d = _report_dir(tmp_path)
    os.mkfifo(d / FILE_NAME.format(pid=ME))
    t0 = time.monotonic()
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert time.monotonic() - t0 < 2.0
    assert r.problem == NOT_OURS and "not a regular file" in (r.error or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_owners_file_is_refused(tmp_path):
    os.chown(_write(_report_dir(tmp_path)), 4321, 4321)
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.problem == NOT_OURS and "uid 4321" in (r.error or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_owners_dir_is_refused(tmp_path):
    d = _report_dir(tmp_path)
    _write(d)
    os.chown(d, 4321, 4321)
    assert read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock).problem == NOT_OURS


def test_a_dir_others_may_write_is_refused(tmp_path):
    _write(_report_dir(tmp_path, mode=0o777))
    r = read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock)
    assert r.problem == NOT_OURS and "writable by others" in (r.error or "")


def test_a_big_file_is_refused_unread(tmp_path):
    path = _write(_report_dir(tmp_path))
    with open(path, "ab") as fh:
        fh.write(b" " * B.ENGINE_REPORT_MAX_BYTES)
    assert read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock).problem == TOO_BIG


def test_a_malformed_file_is_a_reason(tmp_path):
    (_report_dir(tmp_path) / FILE_NAME.format(pid=ME)).write_bytes(b"{" * 5000)
    assert read_engine_report(ME, environ={}, tmp=str(tmp_path), clock=clock).problem == MALFORMED


def test_an_unreadable_file_is_eacces(tmp_path):
    """Read as nobody (a forked child drops root), as a sidecar of another uid would: the file is there, its
    mode refuses."""
    base = Path(tempfile.mkdtemp(prefix="wedgectl-eacces-", dir="/tmp"))
    try:
        base.chmod(0o711)  # traversable by nobody, as /tmp/wedge-engine-reports-UID is
        path = _write(_report_dir(base))
        path.chmod(0o600)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            try:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                r = read_engine_report(ME, environ={}, tmp=str(base), clock=clock)
                os.write(write, json.dumps([r.problem, r.error]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as fh:
            problem, error = json.loads(fh.read() or b"[null, null]")
        os.waitpid(child, 0)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert problem == UNREADABLE and "EACCES" in (error or ""), (problem, error)


def test_a_refusal_does_not_hide_a_good_report_further_on(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir(mode=0o777)
    bad.chmod(0o777)
    _write(bad)
    _write(_report_dir(tmp_path), seq=5)
    r = read_engine_report(ME, environ={"WEDGE_ENGINE_REPORT_DIR": str(bad)}, tmp=str(tmp_path), clock=clock)
    assert r.report is not None and r.report.seq == 5


def test_one_reading_per_pid(tmp_path):
    got = read_engine_reports([ME, 999_999_999], environ={}, tmp=str(tmp_path), clock=clock)
    assert [r.pid for r in got] == [ME, 999_999_999] and all(r.report is None for r in got)


def test_in_a_pid_namespace_the_file_is_named_by_the_process_own_pid(tmp_path):
    """A container's process knows itself as pid 7: its writer names the file and the report so."""
    ctr = tmp_path / "ctr"
    _write(_report_dir(ctr / "tmp"), pid=7, seq=6)
    proc = _proc_root(tmp_path, root=ctr)
    status = proc / str(ME) / "status"
    lines = [line for line in status.read_text().splitlines() if not line.startswith("NSpid:")]
    status.write_text("\n".join([*lines, f"NSpid:\t{ME}\t7"]) + "\n")
    r = read_engine_report(ME, proc, environ={}, tmp="/tmp", clock=clock)
    assert r.report is not None and r.report.pid == 7 and r.report.seq == 6
