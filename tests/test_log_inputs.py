"""Logs as operators get them: piped (`--log -`), rotated (.gz), prefixed by kubectl, docker or journald; and files
that are not vLLM logs at all, which are refused whatever words they hold."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from wedgectl.classify import classify
from wedgectl.model import exitcodes
from wedgectl.model.errors import NoVllmLines, UnreadableInput
from wedgectl.model.types import VerdictKind
from wedgectl.read.logwrap import DOCKER, JOURNAL, detect, unwrap
from wedgectl.store import sources
from wedgectl.store.sources import bundle_from_log, read_log_lines, read_stdin_lines

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
PREFIXED = FIXTURES / "logs" / "prefixed"
PLAIN = {  # tests/fixtures/logs/prefixed/record.py wrote each form of these
    "engine-deadlock": FIXTURES / "bundles" / "engine-deadlock.log",
    "admission-wedge": FIXTURES / "bundles" / "admission-wedge.log",
    "starved": FIXTURES / "logs" / "seed000_starved.log",
    "engine-dead": FIXTURES / "logs" / "engine_dead.log",
}
FORMS = ("docker-json", "journal-json", "journal-short-iso", "kubectl-timestamps")


def wedgectl(*args: str, stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", *args], input=stdin, capture_output=True,
                          timeout=timeout, cwd=ROOT)


# --- the forms operators get -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_each_prefixed_form_reads_as_the_plain_log(name, form):
    plain = classify(bundle_from_log(PLAIN[name]))
    wrapped = classify(bundle_from_log(PREFIXED / f"{name}.{form}.log"))
    assert wrapped.verdict is plain.verdict and wrapped.rule == plain.rule
    assert wrapped.facts == plain.facts  # the same silence, KV growth and counts: timed by vLLM's own stamps
    assert [e.t for e in wrapped.evidence] == [e.t for e in plain.evidence]


def test_the_journald_forms_are_journald_s_own():
    short = (PREFIXED / "starved.journal-short-iso.log").read_text().splitlines()
    assert all(re.match(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}[+-]\d{2}:?\d{2} \S+ vllm-starved-\d+\[\d+\]: ", line)
               for line in short)
    lines = (PREFIXED / "starved.journal-json.log").read_text().splitlines()
    assert detect(lines) == JOURNAL
    assert detect((PREFIXED / "starved.docker-json.log").read_text().splitlines()) == DOCKER
    assert detect(PLAIN["starved"].read_text().splitlines()) is None


def test_journal_json_stamps_are_utc_and_messages_may_be_bytes():
    lines = ['{"__REALTIME_TIMESTAMP": "1796549804974482", "MESSAGE": "INFO 12-06 09:36:44 [x.py:1] a"}',
             '{"__REALTIME_TIMESTAMP": "1796549805000000", "MESSAGE": [73, 78, 70, 79, 32, 255]}'] * 3
    out, kind = unwrap(lines)
    assert kind == JOURNAL
    assert out[0] == "2026-12-06T09:36:44.974482Z INFO 12-06 09:36:44 [x.py:1] a"
    assert out[1] == "2026-12-06T09:36:45.000000Z INFO \ufffd"


def test_docker_parts_of_a_long_line_are_joined():
    long = "INFO 12-06 09:36:44 [x.py:1] " + "x" * 40000
    stamp = "2026-12-06T09:36:44.123456789Z"
    parts = [long[i:i + 16384] for i in range(0, len(long), 16384)]
    lines = [f'{{"log": "{p}{chr(92) + "n" if i == len(parts) - 1 else ""}", "stream": "stderr", "time": "{stamp}"}}'
             for i, p in enumerate(parts)]
    out, kind = unwrap(lines)
    assert kind == DOCKER and out == [f"{stamp} {long}"]


def test_a_file_of_some_json_lines_is_not_unwrapped():
    lines = ['{"log": "x\\n"}', "INFO 12-06 09:36:44 [x.py:1] a", "INFO 12-06 09:36:45 [x.py:1] b"]
    assert unwrap(lines) == (lines, None)


# --- stdin -------------------------------------------------------------------------------------------------


def test_log_dash_reads_a_pipe():
    log = PLAIN["engine-deadlock"].read_bytes()
    done = wedgectl("diagnose", "--log", "-", stdin=log)
    assert done.returncode == exitcodes.for_verdict(VerdictKind.ENGINE_DEADLOCK), done.stderr
    assert b"engine_deadlock" in done.stdout
    also = wedgectl("diagnose", "--log", "/dev/stdin", stdin=log)
    assert also.returncode == done.returncode


def test_log_dash_with_a_live_source_is_a_usage_error():
    done = wedgectl("diagnose", "--log", "-", "--url", "http://127.0.0.1:9", stdin=b"")
    assert done.returncode == exitcodes.USAGE
    assert b"--log -" in done.stderr and b"Traceback" not in done.stderr


def test_a_pipe_that_stays_open_is_read_until_it_goes_quiet():
    r, w = os.pipe()
    data = PLAIN["starved"].read_bytes()
    os.write(w, data[: len(data) // 2])

    def more() -> None:
        time.sleep(0.2)
        os.write(w, data[len(data) // 2:])  # then nothing, and the pipe stays open (a follow)

    threading.Thread(target=more, daemon=True).start()
    try:
        with os.fdopen(r, "rb") as stream:
            lines, notes = read_stdin_lines(stream=stream, idle_s=1.0, wait_s=30)
    finally:
        os.close(w)
    assert "\n".join(lines) == data.decode().rstrip("\n")
    assert any("still open" in n for n in notes)


def test_a_pipe_that_never_writes_is_given_up_on():
    r, w = os.pipe()
    try:
        with os.fdopen(r, "rb") as stream, pytest.raises(UnreadableInput, match="empty"):
            read_stdin_lines(stream=stream, idle_s=0.2, wait_s=0.3)
    finally:
        os.close(w)


def test_stdin_keeps_only_its_tail():
    r, w = os.pipe()
    line = b"INFO 12-06 09:36:44 [x.py:1] " + b"y" * 70 + b"\n"  # 100 bytes
    writer = threading.Thread(target=lambda: (os.write(w, line * 5000), os.close(w)), daemon=True)
    writer.start()
    with os.fdopen(r, "rb") as stream:
        lines, notes = read_stdin_lines(max_bytes=10_000, stream=stream, idle_s=5, wait_s=5)
    writer.join()
    assert len(lines) in (99, 100) and all(x == line.decode().rstrip("\n") for x in lines)  # whole lines only
    assert any("500000 bytes; read its last 10000" in n for n in notes)


def test_a_terminal_on_stdin_is_refused():
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "rb", closefd=False) as stream, pytest.raises(UnreadableInput, match="terminal"):
            read_stdin_lines(stream=stream)
    finally:
        os.close(master)
        os.close(slave)


# --- rotated logs ------------------------------------------------------------------------------------------


def test_a_gzipped_log_reads_as_the_plain_one(tmp_path):
    gz = tmp_path / "vllm.log.1.gz"
    gz.write_bytes(gzip.compress(PLAIN["admission-wedge"].read_bytes()))
    lines, notes = read_log_lines(gz)
    assert lines == tuple(PLAIN["admission-wedge"].read_text().splitlines())
    assert any("gzip" in n for n in notes)
    assert classify(bundle_from_log(gz)).verdict is VerdictKind.ADMISSION_WEDGE


def test_a_gzip_bomb_is_unpacked_only_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_UNPACKED_BYTES", 4 << 20)
    bomb = tmp_path / "bomb.log.gz"
    bomb.write_bytes(gzip.compress(b"INFO 12-06 09:36:44 [x.py:1] z\n" * (1 << 20), compresslevel=9))  # 31 MiB
    lines, notes = read_log_lines(bomb, max_bytes=1 << 20)
    assert any(f"past {4 << 20} bytes" in n for n in notes)
    assert sum(len(x) + 1 for x in lines) <= 1 << 20


def test_a_damaged_gzip_is_one_line_and_exit_21(tmp_path):
    bad = tmp_path / "vllm.log.gz"
    bad.write_bytes(gzip.compress(PLAIN["starved"].read_bytes())[:40])
    done = wedgectl("diagnose", "--log", str(bad))
    assert done.returncode == exitcodes.UNREADABLE_INPUT
    assert done.stderr.decode().count("\n") == 1 and b"gzip" in done.stderr


# --- files vLLM did not write ------------------------------------------------------------------------------

WEB_APP = """2026-12-06 09:00:01,120 INFO app.server: listening on 0.0.0.0:8080
2026-12-06 09:04:12,433 INFO app.server: shutting down on signal 15
"""


@pytest.mark.parametrize("path", [
    ROOT / "README.md",  # prose naming EngineDeadError, stats lines in examples
    ROOT / "docs" / "design.md",  # a markdown page
    FIXTURES / "logs" / "make_seed002.py",  # a script holding stats-line strings
    None,  # another server's log
], ids=["readme", "markdown", "script", "web-app"])
def test_a_file_vllm_did_not_write_is_exit_22(path, tmp_path):
    if path is None:
        path = tmp_path / "app.log"
        path.write_text(WEB_APP)
    with pytest.raises(NoVllmLines, match="not a vLLM log"):
        bundle_from_log(path)
    done = wedgectl("diagnose", "--log", str(path))
    assert done.returncode == exitcodes.NO_VLLM_LINES, done.stdout[-500:]
    assert done.stderr.decode().count("\n") == 1


# --- a silence too short to measure ------------------------------------------------------------------------


def _stats(stamp: str, running: int, gen: float) -> str:
    return (f"(APIServer pid=851) INFO 12-06 {stamp} [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 "
            f"tokens/s, Avg generation throughput: {gen:.1f} tokens/s, Running: {running} reqs, Waiting: 0 reqs, "
            "GPU KV cache usage: 3.1%, Prefix cache hit rate: 0.0%")


def test_a_five_second_stop_is_inconclusive_and_says_how_long(tmp_path):
    log = tmp_path / "short.log"
    log.write_text("\n".join([_stats("09:00:00", 2, 12.0), _stats("09:00:05", 2, 0.0)]) + "\n")
    v = classify(bundle_from_log(log))
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert "5.0 s" in v.summary and "too short" in v.summary
    seen = [e for e in v.evidence if "seen_s" in e.values]
    assert seen and seen[0].values["seen_s"] == 5.0


def test_a_whole_interval_stopped_is_still_a_deadlock(tmp_path):
    log = tmp_path / "long.log"
    log.write_text("\n".join([_stats("09:00:00", 2, 12.0), _stats("09:00:10", 2, 0.0),
                              _stats("09:00:20", 2, 0.0)]) + "\n")
    assert classify(bundle_from_log(log)).verdict is VerdictKind.ENGINE_DEADLOCK


# --- a summary never contradicts its evidence --------------------------------------------------------------

ALL_LOGS = sorted({*FIXTURES.glob("**/*.log")} - {FIXTURES / "logs" / "empty.log", FIXTURES / "logs" / "garbage.log"})


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_log_verdict_s_summary_agrees_with_its_evidence(path):
    try:
        bundle = bundle_from_log(path)
    except NoVllmLines:
        return  # a fixture of something else (a probe's output): nothing to judge
    v = classify(bundle)
    scrapes_after = [e.values.get("scrapes_after") for e in v.evidence if "scrapes_after" in e.values]
    if "kept answering" in v.summary:
        assert scrapes_after and max(scrapes_after) > 0, v.summary
    for e in v.evidence:
        if e.values.get("scrapes_after") == 0:
            assert "GET /metrics were answered" not in e.what, e.what
    m = re.search(r"silent ~(\S+ \S+)", v.summary)
    if m:
        silent = v.facts.get("engine_silent_s")
        assert silent is not None and m.group(1) in " ".join(e.what for e in v.evidence) + v.summary
