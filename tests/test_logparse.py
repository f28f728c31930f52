"""Unit tests for wedgectl.read.logparse: the seed logs, and lines written from vLLM's formats."""

from __future__ import annotations

import datetime as dt
import importlib.util
import pathlib
import random

import pytest

from wedgectl.read.logparse import (
    MAX_TEXT_CHARS,
    AccessLine,
    StatsLine,
    format_stamp,
    parse_log,
    parse_stamp,
)

LOGS = pathlib.Path(__file__).parent / "fixtures" / "logs"
EPOCH = dt.datetime(2000, 1, 1)


def secs(month: int, day: int, hh: int, mm: int, ss: int, year: int = 2000) -> float:
    """Seconds since 2000-01-01, computed independently of the parser."""
    return (dt.datetime(year, month, day, hh, mm, ss) - EPOCH).total_seconds()


def read(name: str):
    with open(LOGS / name, encoding="utf-8") as f:
        return parse_log(f)


# --- seed 000: a runaway request, counters still moving ---------------------


def test_seed000_stats_lines():
    log = read("seed000_starved.log")
    assert len(log.stats) == 14
    first = log.stats[0]
    assert first == StatsLine(
        lineno=1,
        t=secs(4, 28, 22, 54, 32),
        stamp="04-28 22:54:32",
        pid=851,
        engine=0,
        prompt_tps=0.0,
        gen_tps=5.4,
        running=1,
        waiting=14,
        kv_kind="GPU",
        kv_usage_pct=76.5,
        prefix_hit_pct=92.0,
        deferred=None,
        preemptions=None,
    )
    assert [s.kv_usage_pct for s in log.stats] == [
        76.5, 76.7, 76.8, 77.0, 89.2, 89.4, 89.5, 89.5, 89.7, 89.8, 90.0, 90.0, 90.1, 90.3,
    ]
    assert {(s.running, s.waiting) for s in log.stats} == {(1, 14)}
    assert log.last_stats.kv_usage_pct == 90.3
    assert log.last_stats.stamp == "04-28 23:14:12"
    assert log.last_stats.gen_tps == 4.7
    assert log.stats[11].gen_tps == 4.6
    # The blank line hides 17 min 40 s between the fourth and fifth stats lines.
    assert log.stats[4].t - log.stats[3].t == 1060.0


def test_seed000_scrapes_and_counts():
    log = read("seed000_starved.log")
    assert log.n_lines == 39
    assert log.n_recognised == 38  # all but the blank line
    assert len(log.access) == 24
    assert len(log.metrics_scrapes) == 24
    assert log.first_t == secs(4, 28, 22, 54, 32)
    assert log.last_t == secs(4, 28, 23, 14, 12)
    clients = [a.client for a in log.access]
    assert clients.count("10.109.20.86:59146") == 6
    assert clients.count("10.109.20.86:56202") == 18
    a = log.access[0]
    assert a == AccessLine(
        lineno=2, t=secs(4, 28, 22, 54, 32), pid=851,
        client="10.109.20.86:59146", method="GET", path="/metrics", status=200,
    )
    # Each access line inherits the stamp of the stats line just before it.
    for acc in log.access:
        before = [s for s in log.stats if s.lineno < acc.lineno][-1]
        assert acc.t == before.t
    assert log.access_after(log.last_stats.lineno) == ()
    assert (log.shutdown, log.failures, log.startup) == ((), (), ())


# --- seed 002: engine deadlock, stats stop while scrapes go on --------------


def test_seed002_stats_and_padding():
    log = read("seed002_deadlock.log")
    assert [s.lineno for s in log.stats] == [1, 5, 8, 11]
    assert [s.running for s in log.stats] == [493, 177, 1, 1]
    assert [s.gen_tps for s in log.stats] == [12921.2, 11353.3, 1639.9, 0.0]
    assert [s.kv_usage_pct for s in log.stats] == [65.1, 23.4, 0.1, 0.1]
    padded = log.stats[2]  # "Running:   1 reqs ... GPU KV cache usage:  0.1%"
    assert (padded.running, padded.waiting, padded.kv_usage_pct) == (1, 0, 0.1)
    assert padded.t == secs(4, 17, 23, 38, 31)
    assert all(s.prefix_hit_pct is None for s in log.stats)
    assert all(s.pid == 851 and s.engine == 0 for s in log.stats)


def test_seed002_scrapes_after_last_stats():
    log = read("seed002_deadlock.log")
    assert log.n_lines == 671
    assert log.n_recognised == 671  # the SpecDecoding line counts as a vLLM line
    assert len(log.metrics_scrapes) == 666
    after = log.access_after(log.last_stats.lineno)
    assert len(after) == 660
    assert {a.t for a in after} == {secs(4, 17, 23, 38, 41)}
    assert {(a.client, a.status, a.pid) for a in after} == {("127.0.0.1:40312", 200, 851)}
    assert log.first_t == secs(4, 17, 23, 38, 11)
    assert log.last_t == secs(4, 17, 23, 38, 41)


def test_seed002_generator_reproduces_fixture():
    spec = importlib.util.spec_from_file_location("make_seed002", LOGS / "make_seed002.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.make_lines() == (LOGS / "seed002_deadlock.log").read_text().splitlines()


# --- seed 003: the C++ port and the pinned oracle ---------------------------


def test_seed003_startup_and_shutdown():
    log = read("seed003_cpp.log")
    assert log.n_lines == 9
    assert log.n_recognised == 7  # the two bare "INFO core-step" heartbeats are not vLLM's format
    assert log.stats == () and log.access == () and log.failures == ()
    facts = [(f.lineno, f.key, f.value, f.extra) for f in log.startup]
    assert facts == [
        (1, "max_model_len_autofit", 64, {"from": 2048, "to": 64, "blocks": 4, "block_size": 16}),
        (1, "num_blocks", 4, {}),
        (1, "block_size", 16, {}),
        (5, "num_gpu_blocks_override", 4, {"from": 44182}),
        (6, "max_model_len_autofit", 64, {"from": 2048, "to": 64, "available_gib": 0.0}),
        (7, "kv_cache_tokens", 64, {"kind": "GPU"}),
    ]
    assert log.facts["num_gpu_blocks_override"] == 4
    assert [(s.lineno, s.kind) for s in log.shutdown] == [
        (4, "signal"), (8, "vllm_shutdown"), (9, "vllm_shutdown"),
    ]
    assert log.shutdown[0].text == "server: shutting down on signal 15"
    assert all(s.t is None and s.pid is None for s in log.shutdown)
    assert log.first_t is None


# --- lines written from vLLM's and uvicorn's format strings -----------------

HDR = "(APIServer pid=851) INFO 11-30 10:00:00 [x.py:1] "


@pytest.mark.parametrize(
    ("line", "kind", "pid"),
    [
        (HDR + "[shutdown] API server: shutdown triggered", "vllm_shutdown", 851),
        ("(EngineCore pid=900) INFO 11-30 10:00:00 [core.py:1636] "
         "[shutdown] EngineCore: start mode=abort timeout=0s", "vllm_shutdown", 900),
        (HDR + "[shutdown] EngineCore: trigger received signal=15", "vllm_shutdown", 851),
        ("server: shutting down on signal 15", "signal", None),
        (HDR + "Received signal 15, shutting down", "signal", 851),
        (HDR + "Got SIGTERM, exiting", "signal", 851),
        ("(APIServer pid=851) INFO:     Shutting down", "uvicorn_shutting_down", 851),
        ("(APIServer pid=851) INFO:     Waiting for connections to close. (CTRL+C to force quit)",
         "waiting_connections", 851),
        ("INFO:     Waiting for background tasks to complete. (CTRL+C to force quit)",
         "waiting_background", None),
        ("INFO:     Waiting for application shutdown.", "application_shutdown", None),
        ("INFO:     Application shutdown complete.", "application_shutdown", None),
        ("(APIServer pid=851) INFO:     Finished server process [851]", "finished", 851),
    ],
)
def test_shutdown_kinds(line, kind, pid):
    log = parse_log([line])
    assert [(s.kind, s.pid, s.text) for s in log.shutdown] == [(kind, pid, line)]
    assert log.n_recognised == 1


def test_shutting_down_something_else_is_not_uvicorn():
    log = parse_log([HDR + "Shutting down the tokenizer pool"])
    assert log.shutdown == ()
    assert log.n_recognised == 1  # still a vLLM line


@pytest.mark.parametrize(
    ("line", "kind", "pid"),
    [
        ("(APIServer pid=851) ERROR 11-30 10:00:00 [async_llm.py:1] "
         "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
         "engine_dead", 851),
        ("(EngineCore_DP0 pid=1234) INFO 11-30 10:00:00 [shm_broadcast.py:109] No available "
         "shared memory broadcast block found in 60 seconds. This typically happens when some "
         "processes are hanging.", "shm_broadcast_timeout", 1234),
        ("(APIServer pid=851) ERROR 11-30 10:00:00 [core_client.py:1] Engine core proc "
         "EngineCore_DP0 died unexpectedly, shutting down client.", "engine_core_failed", 851),
        ("(EngineCore_DP0 pid=1234) ERROR 11-30 10:00:00 [core.py:1510] "
         "EngineCore failed to start.",
         "engine_core_failed", 1234),
        ("RuntimeError: Engine core initialization failed. See root cause above. "
         "Failed core proc(s): {}", "engine_core_failed", None),
        ("Traceback (most recent call last):", "traceback", None),
        ("(VllmWorker rank=0 pid=77) Traceback (most recent call last):", "traceback", 77),
    ],
)
def test_failure_kinds(line, kind, pid):
    log = parse_log([line])
    assert [(f.kind, f.pid) for f in log.failures] == [(kind, pid)]


def test_failures_inherit_the_last_stamp():
    log = parse_log([
        "(APIServer pid=851) ERROR 04-17 23:40:00 [x.py:1] AsyncLLM output_handler failed.",
        "Traceback (most recent call last):",
        '  File "vllm/v1/engine/async_llm.py", line 1, in output_handler',
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    ])
    assert [(f.lineno, f.kind, f.t) for f in log.failures] == [
        (2, "traceback", secs(4, 17, 23, 40, 0)),
        (4, "engine_dead", secs(4, 17, 23, 40, 0)),
    ]
    assert log.n_recognised == 3  # the File line is neither a record nor a vLLM header


def test_startup_facts_from_vllm_032_lines():
    lines = [
        "(APIServer pid=851) INFO 11-30 10:00:00 [api_utils.py:286] non-default args: "
        "{'model_tag': 'tiny', 'model': '/tmp/tiny', 'block_size': 32, "
        "'num_gpu_blocks_override': 4, 'max_model_len': -1}",
        "(APIServer pid=851) INFO 11-30 10:00:00 [api_utils.py:327] "
        "vLLM server version 0.32.0, serving model /tmp/tiny",
        "(EngineCore pid=900) INFO 11-30 10:00:01 [core.py:134] Initializing a V1 LLM engine "
        "(v0.32.0) with config: model='/tmp/tiny', speculative_config=None, "
        "tokenizer='/tmp/tiny', dtype=torch.bfloat16, max_seq_len=2048, served_model_name=tiny",
        "(EngineCore pid=900) INFO 11-30 10:00:02 [kv_cache_utils.py:2620] "
        "Overriding num_gpu_blocks=1,234 with num_gpu_blocks_override=4",
        "(EngineCore pid=900) INFO 11-30 10:00:02 [kv_cache_utils.py:2478] Auto-fit max_model_len: "
        "reduced from 2048 to 96 to fit in available KV cache memory (0.01 GiB CPU)",
        "(EngineCore pid=900) INFO 11-30 10:00:02 [kv_cache_utils.py:2327] CPU KV cache size: "
        "1,234 tokens, Maximum concurrency for 2,048 tokens per request: 3.20x",
        "(APIServer pid=851) INFO 11-30 10:00:03 [entry.py:140] "
        "Starting vLLM server on http://127.0.0.1:8000",
        "(APIServer pid=851) INFO:     Uvicorn running on http://127.0.0.1:8000 "
        "(Press CTRL+C to quit)",
        "INFO 11-30 10:00:04 [api_server.py:1] vLLM API server version 0.31.1",
    ]
    log = parse_log(lines)
    got = [(f.lineno, f.key, f.value, f.extra) for f in log.startup]
    assert got == [
        (1, "num_gpu_blocks_override", 4, {"source": "args"}),
        (1, "block_size", 32, {"source": "args"}),
        (1, "max_model_len", -1, {"source": "args"}),
        (1, "model", "/tmp/tiny", {}),
        (2, "vllm_version", "0.32.0", {}),
        (2, "model", "/tmp/tiny", {}),
        (3, "max_model_len", 2048, {"source": "engine_config"}),
        (3, "vllm_version", "0.32.0", {}),
        (3, "model", "/tmp/tiny", {}),
        (4, "num_gpu_blocks_override", 4, {"from": 1234}),
        (5, "max_model_len_autofit", 96, {"from": 2048, "to": 96, "available_gib": 0.01}),
        (6, "kv_cache_tokens", 1234, {"kind": "CPU"}),
        (6, "max_concurrency", 3.2, {"tokens_per_request": 2048}),
        (7, "listening", "http://127.0.0.1:8000", {}),
        (8, "listening", "http://127.0.0.1:8000", {}),
        (9, "vllm_version", "0.31.1", {}),
    ]
    assert log.facts["vllm_version"] == "0.31.1"  # the later line wins
    assert log.startup[-1].t == secs(11, 30, 10, 0, 4)
    assert log.startup[-2].t == secs(11, 30, 10, 0, 3)  # uvicorn's line inherits


# --- stats line variants ----------------------------------------------------


def test_stats_line_with_every_optional_part():
    line = (
        "(APIServer pid=12) WARNING 01-02 03:04:05 [loggers.py:257] Engine 001: "
        "Avg prompt throughput: 1,234.5 tokens/s, Avg generation throughput:    0.0 tokens/s, "
        "Running:   1,024 reqs, Waiting: 2,000 reqs, Deferred: 3 reqs, Preemptions: 7, "
        "CPU KV cache usage:  0.1%, Prefix cache hit rate: 12.5%, "
        "External prefix cache hit rate: 1.0%"
    )
    (s,) = parse_log([line]).stats
    assert (s.pid, s.engine, s.stamp, s.t) == (12, 1, "01-02 03:04:05", secs(1, 2, 3, 4, 5))
    assert (s.prompt_tps, s.gen_tps, s.running, s.waiting) == (1234.5, 0.0, 1024, 2000)
    assert (s.deferred, s.preemptions) == (3, 7)
    assert (s.kv_kind, s.kv_usage_pct, s.prefix_hit_pct) == ("CPU", 0.1, 12.5)


def test_stats_line_without_prefix_or_engine():
    line = (
        "INFO 04-28 22:54:32 [loggers.py:257] 2 Engines Aggregated: Avg prompt throughput: "
        "0.0 tokens/s, Avg generation throughput: 5.4 tokens/s, Running: 1 reqs, "
        "Waiting: 14 reqs, XPU KV cache usage: 76.5%, External prefix cache hit rate: 3.0%"
    )
    (s,) = parse_log([line]).stats
    assert (s.pid, s.engine, s.kv_kind, s.prefix_hit_pct) == (None, None, "XPU", None)


def test_iteration_detail_line_is_not_a_stats_line():
    line = HDR + (
        "Engine 000: Iteration(5): 1 context requests, 6 context tokens, 0 generation requests, "
        "0 generation tokens, iteration elapsed time: 1.00 ms, CPU KV cache usage: 3.0%"
    )
    log = parse_log([line])
    assert log.stats == ()
    assert log.n_recognised == 1


def test_huge_number_is_not_parsed_and_does_not_raise():
    line = HDR + (
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        f"Running: {'9' * 5000} reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%"
    )
    assert parse_log([line]).stats == ()


# --- time -------------------------------------------------------------------


def test_year_rollover_keeps_t_monotonic():
    log = parse_log([
        HDR.replace("11-30 10:00:00", "12-31 23:59:50") + "a",
        HDR.replace("11-30 10:00:00", "01-01 00:00:10") + "b",
        HDR.replace("11-30 10:00:00", "01-01 00:00:05") + "c",  # small skew: no new year
        HDR.replace("11-30 10:00:00", "02-29 12:00:00") + "d",  # 2001 has no 02-29
    ])
    assert log.first_t == secs(12, 31, 23, 59, 50)
    assert log.last_t == secs(3, 1, 12, 0, 0, year=2001)
    stamped = parse_log([
        "INFO 12-31 23:59:50 [a.py:1] a",
        "INFO 01-01 00:00:10 [a.py:1] b",
        "INFO 01-01 00:00:05 [a.py:1] c",
    ])
    assert stamped.last_t - stamped.first_t == 15.0


def test_stats_t_across_rollover():
    base = (
        "INFO {} [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: 0.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, "
        "GPU KV cache usage: 0.1%"
    )
    log = parse_log([base.format("12-31 23:59:55"), base.format("01-01 00:00:05")])
    assert [s.t for s in log.stats] == [secs(12, 31, 23, 59, 55), secs(1, 1, 0, 0, 5, year=2001)]
    assert log.stats[1].t - log.stats[0].t == 10.0
    assert [s.stamp for s in log.stats] == ["12-31 23:59:55", "01-01 00:00:05"]


def test_iso_stamps_share_the_epoch_and_set_the_year():
    log = parse_log([
        "2026-08-23 09:29:02 INFO starting",
        "INFO 08-23 09:29:05 [x.py:1] three seconds later",
        "2026-08-23T09:29:10.500000Z (APIServer pid=3) INFO 08-23 09:29:10 [x.py:1] later",
    ])
    assert log.first_t == secs(8, 23, 9, 29, 2, year=2026)
    assert log.last_t == secs(8, 23, 9, 29, 10, year=2026)
    assert log.n_recognised == 3


def test_a_leading_stamp_gives_the_year_vllm_s_own_lacks():
    # `kubectl logs --timestamps` of a log begun in 2031: vLLM's stamps alone would be read in 2000
    log = parse_log([
        "2031-12-31T23:59:58.000000001Z INFO 12-31 23:59:58 [x.py:1] one",
        "2032-01-01T00:00:03.5Z (APIServer pid=3) INFO 01-01 00:00:03 [x.py:1] five seconds later, a new year",
    ])
    assert log.first_t == secs(12, 31, 23, 59, 58, year=2031)
    assert log.last_t == secs(1, 1, 0, 0, 3, year=2032)
    assert log.n_vllm == 2


def test_parse_stamp_and_format_stamp_are_inverse():
    assert parse_stamp("02-29 12:00:00") == secs(2, 29, 12, 0, 0)
    assert parse_stamp("2026-01-02 03:04:05") == secs(1, 2, 3, 4, 5, year=2026)
    assert parse_stamp("13-45 99:99:99") is None
    assert parse_stamp("not a stamp") is None
    for text in ("01-01 00:00:00", "02-29 12:00:00", "04-28 22:54:32", "12-31 23:59:59"):
        assert format_stamp(parse_stamp(text)) == text
    assert format_stamp(secs(1, 1, 0, 0, 5, year=2001) + 0.9) == "01-01 00:00:05"
    with pytest.raises(ValueError):
        format_stamp(float("nan"))


def test_invalid_stamp_gives_no_time_but_keeps_the_line():
    log = parse_log([
        "INFO 13-45 99:99:99 [loggers.py:257] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
        "Avg generation throughput: 0.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, "
        "GPU KV cache usage: 0.1%",
    ])
    (s,) = log.stats
    assert (s.t, s.stamp, s.running) == (None, None, 2)
    assert log.first_t is None


def test_access_line_before_any_stamp_has_no_time():
    log = parse_log(['INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK'])
    (a,) = log.access
    assert (a.t, a.pid, a.path, a.status) == (None, None, "/health", 200)
    assert log.metrics_scrapes == ()


# --- hostile input ----------------------------------------------------------


def test_garbage_gives_nothing():
    log = read("garbage.log")
    assert log.n_lines == 11
    assert log.n_recognised == 0
    # nginx and proxy lines carry "GET /metrics" too; they are not uvicorn's access log.
    assert (log.stats, log.access, log.shutdown, log.failures, log.startup) == ((), (), (), (), ())
    assert (log.first_t, log.last_t) == (None, None)


def test_binary_gives_nothing():
    data = (LOGS / "binary.bin").read_bytes()
    assert b"\x00" in data
    as_bytes = parse_log(data.splitlines(keepends=True))
    assert as_bytes.n_lines == len(data.splitlines())
    assert as_bytes.n_recognised == 0
    with open(LOGS / "binary.bin", encoding="utf-8", errors="replace", newline="") as f:
        as_text = parse_log(f)
    assert as_text.n_lines >= 2
    assert as_text.stats == () and as_text.access == ()


def test_empty_file():
    log = read("empty.log")
    assert (log.n_lines, log.n_recognised, log.first_t, log.stats) == (0, 0, None, ())


def test_crlf_and_ansi():
    seed = (LOGS / "seed000_starved.log").read_text().splitlines()
    coloured = [
        "\x1b[1;36m(APIServer pid=851)\x1b[0;0m " + seed[0].split(") ", 1)[1] + "\r\n",
        seed[1].replace("200 OK", "\x1b[32m200 OK\x1b[0m") + "\r\n",
    ]
    log = parse_log(coloured)
    (s,) = log.stats
    got = (s.pid, s.running, s.waiting, s.kv_usage_pct, s.prefix_hit_pct)
    assert got == (851, 1, 14, 76.5, 92.0)
    (a,) = log.access
    assert (a.pid, a.status, a.path, a.t) == (851, 200, "/metrics", s.t)
    crlf = parse_log(line + "\r\n" for line in seed)
    assert (len(crlf.stats), len(crlf.access), crlf.n_recognised) == (14, 24, 38)
    assert crlf.stats[-1].kv_usage_pct == 90.3


def test_very_long_lines():
    seed = (LOGS / "seed000_starved.log").read_text().splitlines()
    long_line = HDR + "x(" * 500_000
    long_failure = HDR + "EngineDeadError " + "y" * 1_000_000
    log = parse_log([long_line, "\x00" * 200_000, long_failure, seed[0]])
    assert log.n_lines == 4
    assert len(log.stats) == 1 and log.stats[0].lineno == 4
    assert [(f.lineno, f.kind, len(f.text)) for f in log.failures] == [
        (3, "engine_dead", MAX_TEXT_CHARS)
    ]
    assert log.n_recognised == 3


def test_mutated_lines_never_raise():
    rng = random.Random(20261130)
    pool = []
    for name in ("seed000_starved.log", "seed002_deadlock.log", "seed003_cpp.log"):
        pool.extend((LOGS / name).read_text().splitlines()[:40])
    alphabet = "0123456789,.:%()[]-= \t\x1b\x00\r\nAaZzé█"
    lines = []
    for _ in range(3000):
        chars = list(rng.choice(pool))
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(i, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(i, rng.choice(alphabet))
            else:
                chars[i:i] = list(rng.choice(pool)[: rng.randint(0, 60)])
        lines.append("".join(chars))
    log = parse_log(lines)
    assert log.n_lines == 3000
    assert 0 < log.n_recognised <= 3000
    assert log.stats  # most mutations leave the stats line readable
    for s in log.stats:
        assert isinstance(s.running, int) and isinstance(s.waiting, int)
        assert isinstance(s.kv_usage_pct, float) and isinstance(s.gen_tps, float)
    ts = [s.t for s in log.stats if s.t is not None]
    assert all(isinstance(t, float) for t in ts)


def test_repeated_markers_stay_linear():
    # A lazy ".*?" after a marker made these take seconds each; now milliseconds.
    import time

    lines = [
        HDR + "non-default args: " * 3600,
        HDR + "with config: " * 5000,
        HDR + "Avg prompt throughput: 1 tokens/s, " * 1800 + "KV cache usage",
    ] * 3
    # CPU time of this thread, not wall time: a loaded host holds a thread off a CPU for seconds.
    start = time.thread_time()
    log = parse_log(lines)
    assert time.thread_time() - start < 1.0
    assert (log.n_recognised, log.stats, log.startup) == (9, (), ())
