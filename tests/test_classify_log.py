"""The log rules of the classifier, on log text from the seeds and real vLLM formats."""

from pathlib import Path

import pytest

from wedgectl.classify import classify
from wedgectl.store.sources import bundle_from_log
from wedgectl.model.types import VerdictKind

LOGS = Path(__file__).parent / "fixtures" / "logs"


def verdict_of(name: str):
    return classify(bundle_from_log(LOGS / name))


def test_seed000_is_starved_with_kv_growth_and_eta():
    v = verdict_of("seed000_starved.log")
    assert v.verdict is VerdictKind.STARVED
    assert v.rule == "log_starved"
    # 76.5 % at 22:54:32 -> 90.3 % at 23:14:12 (1180 s): ~0.70 %/min by least squares.
    assert v.facts["kv_growth_pct_per_min"] == pytest.approx(0.70, abs=0.03)
    assert v.facts["seconds_to_kv_full"] == pytest.approx(9.7 / (0.70 / 60), rel=0.06)
    assert v.facts["waiting"] == 14 and v.facts["running"] == 1
    assert v.facts["tokens_per_s"] == pytest.approx(4.7)
    whats = " ".join(e.what for e in v.evidence)
    assert "14 waiting" in whats and "%/min" in whats


def test_seed002_is_deadlock_with_silence_measured_from_scrapes():
    v = verdict_of("seed002_deadlock.log")
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK
    assert v.rule == "log_engine_deadlock"
    assert v.facts["scrapes_after_last_stats"] == 660
    # 2 scrapes per 10 s stats interval before the stop -> 660 scrapes ~ 55 min.
    assert v.facts["engine_silent_s"] == pytest.approx(3300, rel=0.01)
    assert any(e.t == "04-17 23:38:41" for e in v.evidence)


def test_seed003_shutdown_without_finish_is_shutdown_hang():
    v = verdict_of("seed003_cpp.log")
    assert v.verdict is VerdictKind.SHUTDOWN_HANG
    assert any("signal 15" in e.what for e in v.evidence)


def test_engine_dead_log():
    # Recorded (tests/fixtures/bundles/record_engine_dead.py): the EngineCore SIGKILLed while serving; the
    # API server printed EngineDeadError and answered the requests after it with 500.
    lines = (LOGS / "engine_dead.log").read_text().splitlines()
    v = verdict_of("engine_dead.log")
    assert v.verdict is VerdictKind.ENGINE_DEAD and v.rule == "log_engine_dead"
    assert "EngineDeadError" in v.evidence[0].what
    assert "EngineDeadError" in lines[v.evidence[0].values["line"] - 1]
    # killed, not hung first: no shared-memory warning to cite
    assert not any("shared memory broadcast" in e.what for e in v.evidence)


def test_engine_dead_log_cut_before_the_kill_is_progressing(tmp_path):
    # The same server's log up to its last stats line before the death: it was serving.
    lines = (LOGS / "engine_dead.log").read_text().splitlines()
    dead_at = next(i for i, line in enumerate(lines) if "EngineDeadError" in line)
    last_stats = max(i for i, line in enumerate(lines[:dead_at]) if "loggers.py" in line)
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(lines[:last_stats + 1]) + "\n")
    assert classify(bundle_from_log(cut)).verdict is VerdictKind.PROGRESSING
    # progressing.log is that server's log too, copied a moment before the kill
    served = (LOGS / "progressing.log").read_text().splitlines()
    assert lines[:len(served)] == served and len(served) <= dead_at


def test_engine_dead_log_cites_the_shared_memory_warnings_before_it():
    # The engine-dead rule on a real log where a worker stopped answering first (the collective-hold run
    # left to its RPC timeout; classify names the timeout, a rule earlier in the list).
    from wedgectl.classify import LOG_RULES, Facts

    rule = next(r for r in LOG_RULES if r.name == "log_engine_dead")
    lines = (LOGS / "collective-hang-timeout.log").read_text().splitlines()
    v = rule(Facts(bundle_from_log(LOGS / "collective-hang-timeout.log")))
    assert v is not None and v.verdict is VerdictKind.ENGINE_DEAD
    warned = [i for i, line in enumerate(lines, 1) if "No available shared memory broadcast block" in line]
    assert v.evidence[0].what.startswith(f"{len(warned)} 'No available shared memory broadcast block' warning(s)")
    assert v.evidence[0].values["line"] == warned[0]


def test_queued_requests_being_served_are_progressing():
    # Recorded: six clients on two sequence slots (--max-num-seqs 2), copied with the load still on.
    v = verdict_of("progressing.log")
    assert v.verdict is VerdictKind.PROGRESSING and v.rule == "log_progressing"
    assert v.confidence > 0.5
    last = v.evidence[0].values
    assert last["running"] == 2 and last["waiting"] >= 1 and last["gen_tokens_per_s"] > 0


def test_seed000_truncated_to_one_line_is_not_starved(tmp_path):
    # One stats line cannot show a queue that does not drain.
    one = tmp_path / "one.log"
    one.write_text((LOGS / "seed000_starved.log").read_text().splitlines()[0] + "\n")
    v = classify(bundle_from_log(one))
    assert v.verdict is VerdictKind.PROGRESSING


def test_deadlock_without_the_silence_is_less_certain(tmp_path):
    # The last stats line alone (a 10 s interval at 0 tokens/s with a request running) is the
    # stop; the 660 answered scrapes after it are what make it certain and give its length.
    lines = (LOGS / "seed002_deadlock.log").read_text().splitlines()[:11]
    short = tmp_path / "short.log"
    short.write_text("\n".join(lines) + "\n")
    v = classify(bundle_from_log(short))
    full = verdict_of("seed002_deadlock.log")
    assert v.verdict is VerdictKind.ENGINE_DEADLOCK
    assert v.confidence < full.confidence
    assert "engine_silent_s" not in v.facts


def test_a_stats_line_with_tokens_flowing_is_not_a_deadlock(tmp_path):
    lines = (LOGS / "seed002_deadlock.log").read_text().splitlines()[:8]
    short = tmp_path / "flowing.log"
    short.write_text("\n".join(lines) + "\n")
    assert classify(bundle_from_log(short)).verdict is VerdictKind.PROGRESSING


def test_log_with_only_probe_lines_is_inconclusive(tmp_path):
    # No stats line: vLLM is silent both when idle and when stuck before its first interval.
    p = tmp_path / "probes.log"
    p.write_text('(APIServer pid=7) INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK\n' * 3)
    v = classify(bundle_from_log(p))
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert any("no stats lines" in e.what for e in v.evidence)


def test_real_server_log_that_ends_idle():
    # Recorded from the managed runtime: a burst of requests, then the all-zero line, then quiet.
    v = classify(bundle_from_log(LOGS.parent / "real" / "progressing_server.log"))
    assert v.verdict is VerdictKind.IDLE
    assert v.evidence[0].values["gen_tokens_per_s"] == 0
    # A server that was never asked anything logs no stats line at all: idle, quiet 38 s by its stamps.
    v = classify(bundle_from_log(LOGS.parent / "real" / "idle_server.log"))
    assert v.verdict is VerdictKind.IDLE and v.rule == "log_never_asked"


def test_vllm_lines_with_no_decision_are_inconclusive(tmp_path):
    p = tmp_path / "odd.log"
    p.write_text("(APIServer pid=7) INFO 12-01 10:00:01 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 "
                 "tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, "
                 "CPU KV cache usage: 5.0%, Prefix cache hit rate: 0.0%\n")
    v = classify(bundle_from_log(p))
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert v.advice
