"""Start-up judged by progress: the bytes each process read (/proc/PID/io) collected, kept in the bundle, and
read by the startup-hang rule; and a start-up diagnosed without ptrace from the engine's own report.

The captures are the recorded start-up hangs (tests/fixtures/bundles/startup-hang.tar.gz and the v0.* ones:
`wedgectl repro startup-hang`, a Worker's warm-up that never returns). Recorded before wedgectl read
/proc/PID/io, they hold none; each variant below sets it (unchanged, or rising), moves the stall into weight
loading (the startup-stall fault's WEDGE_ENGINE_FAULT_PHASE=load names its frame load_model), or shows the
capture as a user without CAP_SYS_PTRACE sees it, to show what each piece of evidence decides.
io/startup-hang.tar.gz is the same repro recorded since (vLLM 0.32, judged with its 20 s bound): its
processes' io as read, unchanged over its window, and the engine plugin's own reports (the EngineCore and
Worker in stage starting, graph capture / warm-up; the API server "serving", as it says from the start).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from engine_reports import reading, with_readings
from wedgectl.classify import classify, confidence as C
from wedgectl.classify.facts import Facts
from wedgectl.classify.ioprogress import engine_reads
from wedgectl.classify.startup import (NO_READS_MIN_S, STARTUP_DEADLINE_S, STARTUP_QUIET_S, WARM_UP,
                                       WEIGHT_LOADING, idle_reads, reported_starting)
from wedgectl.collect import procfs
from wedgectl.collect.procsample import sample_process
from wedgectl.model import bounds
from wedgectl.model.errors import BadBundle
from wedgectl.model.types import Bundle, CollectorFailure, FailureKind, Role, VerdictKind
from wedgectl.store.bundle import read_bundle, write_bundle

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
VERSIONS = sorted(p.parent.name for p in BUNDLES.glob("v0.*/startup-hang.tar.gz"))
ENGINE = (Role.ENGINE_CORE, Role.WORKER)
# /proc/PID/io of a real process, as the kernel prints it
IO_TEXT = ("rchar: 2381741\nwchar: 120963\nsyscr: 2412\nsyscw: 731\nread_bytes: 1310720\nwrite_bytes: 12288\n"
           "cancelled_write_bytes: 0\n")


def load(name: str = "startup-hang") -> Bundle:
    return replace(read_bundle(BUNDLES / f"{name}.tar.gz"), verdict=None)


def pid_of(b: Bundle, role: Role) -> int:
    return next(p.pid for p in b.samples[-1].processes if p.role is role)


def pids_of(b: Bundle, role: Role) -> list[int]:
    return [p.pid for p in b.samples[-1].processes if p.role is role]


def text(v) -> str:
    return " | ".join(e.what for e in v.evidence)


def shifted(b: Bundle, seconds: float) -> Bundle:
    """As if captured `seconds` earlier (the log unchanged): a younger stall."""
    return replace(b, samples=tuple(replace(s, t=s.t - seconds) for s in b.samples))


def longer(b: Bundle, seconds: int) -> Bundle:
    """The window run on `seconds` more, a sample a second, the engine as it was at the last (no stack burst)."""
    last = b.samples[-1]
    return replace(b, samples=(*b.samples, *(replace(last, t=last.t + k, stacks=()) for k in range(1, seconds + 1))))


def with_io(b: Bundle, rchar_step: int = 0, read_step: int = 0) -> Bundle:
    """Each process's io at every sample: unchanged, or rising by the steps each sample in the engine's."""
    def io(i, p):
        rising = p.role in ENGINE
        return replace(p, io_rchar=5_000_000 + p.pid + (i * rchar_step if rising else 0),
                       io_read_bytes=1_000_000 + (i * read_step if rising else 0))
    return replace(b, samples=tuple(replace(s, processes=tuple(io(i, p) for p in s.processes))
                                    for i, s in enumerate(b.samples)))


def loading(b: Bundle) -> Bundle:
    """The same hang with the Worker stalled in load_model: its frame renamed, the log cut where the load began."""
    def frame(fr):
        name = fr.get("name") or ""
        return {**fr, "name": name.replace("compile_or_warm_up_model", "load_model")}

    def dump(d):
        return replace(d, threads=tuple({**t, "frames": [frame(fr) for fr in t.get("frames") or ()]}
                                        for t in d.threads))
    cut = next(i for i, line in enumerate(b.log_lines) if "Loading weights took" in line)
    return replace(b, log_lines=b.log_lines[:cut],
                   samples=tuple(replace(s, stacks=tuple(dump(d) for d in s.stacks)) for s in b.samples))


def busy(b: Bundle) -> Bundle:
    """The engine burning two cores a second: loading, compiling or capturing."""
    n = {id(s): i for i, s in enumerate(b.samples)}
    return replace(b, samples=tuple(replace(s, processes=tuple(
        replace(p, cpu_user_s=p.cpu_user_s + n[id(s)] * 2.0) if p.role in ENGINE else p
        for p in s.processes)) for s in b.samples))


def unprivileged(b: Bundle) -> Bundle:
    """The capture as a user without CAP_SYS_PTRACE over the server sees it: every process's fds (sockets) and
    io unreadable, py-spy refused. /proc/PID/stat (the CPU) stays readable by all."""
    def fails(s):
        return s.failures + tuple(CollectorFailure(c, FailureKind.PERMISSION, "denied", str(p.pid))
                                  for p in s.processes for c in ("psutil", "pyspy"))
    return replace(b, samples=tuple(replace(
        s, stacks=(), failures=fails(s),
        processes=tuple(replace(p, connections=None, listening=(), io_rchar=None, io_read_bytes=None)
                        for p in s.processes)) for s in b.samples))


def reporting(b: Bundle, phase: str | None = "graph capture / warm-up", stage: str = "starting",
              age_s: float = 0.4, stage_s: float = 90.0) -> Bundle:
    """The plugin's reports at each sample: the EngineCore and its Workers (none before 0.23: the model ran in
    the EngineCore) in `stage` (with `phase`), the API server "serving" (its stage from the start: it says
    nothing of the engine)."""
    core, api = pid_of(b, Role.ENGINE_CORE), pid_of(b, Role.API_SERVER)
    st = {"name": stage, "since_mono_ns": 1, "phase": phase}
    quiet = {"scheduler": None, "requests": [], "steps": None, "model_steps": None}
    return with_readings(b, lambda i, s: (
        reading(core, s.t, age_s, stage_s, role="engine_core", stage=st, **quiet),
        *(reading(w, s.t, age_s, stage_s, role="worker", stage=st, **quiet) for w in pids_of(b, Role.WORKER)),
        reading(api, s.t, 0.3, 150.0, role="api_server", stage={"name": "serving", "since_mono_ns": 1, "phase": None},
                **quiet)))


# ------------------------------------------------------------------ the collector


def test_io_is_parsed_from_the_kernels_text():
    assert procfs.parse_io(IO_TEXT) == (2381741, 1310720)
    assert procfs.parse_io(IO_TEXT.replace("rchar: 2381741\n", "")) is None  # one missing: none
    assert procfs.parse_io(IO_TEXT.replace("2381741", "-5")) is None
    assert procfs.parse_io(IO_TEXT.replace("2381741", "\u00b2")) is None  # a digit to isdigit, not to int
    assert procfs.parse_io(IO_TEXT.replace("2381741", str(bounds.MAX_IO_BYTES + 1))) is None
    assert procfs.parse_io(IO_TEXT.replace("2381741", "9" * 400)) is None
    assert procfs.parse_io("") is None


def test_io_is_read_from_the_proc_root_and_never_raises(tmp_path):
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "io").write_text(IO_TEXT)
    assert procfs.read_io(41, tmp_path) == (2381741, 1310720)
    assert procfs.read_io(42, tmp_path) is None  # gone
    (tmp_path / "43" / "io").mkdir(parents=True)  # not a file: an OSError on read
    assert procfs.read_io(43, tmp_path) is None
    own = procfs.read_io(os.getpid())
    assert own is not None and own[0] > 0  # our own process: readable


def test_a_sample_carries_the_bytes_read():
    sample, _ = sample_process(os.getpid(), Role.OTHER, with_threads=False)
    assert sample.io_rchar is not None and sample.io_read_bytes is not None
    before = sample.io_rchar
    Path(__file__).read_bytes()  # a read(2) of this file: rchar grows by its size
    again, _ = sample_process(os.getpid(), Role.OTHER, with_threads=False)
    assert again.io_rchar is not None and again.io_rchar >= before + Path(__file__).stat().st_size


# ------------------------------------------------------------------ the recording with its reads


def test_the_recording_with_its_reads_cites_no_bytes_read():
    b = load("io/startup-hang")
    core, worker = pid_of(b, Role.ENGINE_CORE), pid_of(b, Role.WORKER)
    assert all(p.io_rchar is not None and p.io_read_bytes is not None for s in b.samples for p in s.processes)
    reads = engine_reads(b.samples)
    assert reads.none_read and reads.pids == (core, worker) and 1.0 < reads.span_s < NO_READS_MIN_S
    v = classify(b)
    assert (v.verdict, v.rule, v.confidence) == (VerdictKind.STARTUP_HANG, "live_startup_hang",
                                                 C.STARTUP_PARKED_CORROBORATED)
    assert v.facts["phase"] == WARM_UP and v.facts["deadline_s"] == 20.0  # the repro's bound, from the manifest
    assert (f"no bytes read and no CPU (0.03 cores) for 1.2 s: rchar and read_bytes (/proc/PID/io) unchanged in "
            f"EngineCore pid {core}, Worker pid {worker}") in text(v)


def test_the_recording_stalled_in_weight_loading_is_judged_by_its_reads():
    b = loading(load("io/startup-hang"))
    short = classify(b)  # its own 1.2 s: too short for the reads to decide a slow phase
    assert short.verdict is VerdictKind.INCONCLUSIVE and "no bytes read, but over only 1.2 s" in short.summary
    v = classify(longer(b, 3))
    assert (v.verdict, v.facts["phase"], v.facts["deadline_s"]) == (VerdictKind.STARTUP_HANG, WEIGHT_LOADING, 20.0)
    assert "no bytes read and no CPU (0.01 cores) for 4.2 s" in text(v), text(v)  # the same CPU over 3 s more
    unread = replace(b, samples=tuple(replace(s, processes=tuple(replace(p, io_rchar=None, io_read_bytes=None)
                                                                 for p in s.processes)) for s in b.samples))
    assert classify(longer(unread, 3)).verdict is VerdictKind.INCONCLUSIVE


def test_the_recording_as_nobody_is_decided_by_its_own_reports():
    b = unprivileged(load("io/startup-hang"))
    assert not any(p.io_rchar for s in b.samples for p in s.processes)
    v = classify(b)
    assert (v.verdict, v.rule, v.facts["phase"]) == (VerdictKind.STARTUP_HANG, "live_startup_hang", WARM_UP)
    assert "its sockets unreadable (no CAP_SYS_PTRACE); the engine's report says it is starting" in v.evidence[0].what
    core = pid_of(b, Role.ENGINE_CORE)
    assert any(e.source == "engine" and e.what.startswith("stage starting (graph capture / warm-up) for 24 s")
               and f"EngineCore pid {core}" in e.what for e in v.evidence), text(v)
    # its reports gone stale (no Python ran in the engine for three periods): no verdict on them
    stale = replace(b, samples=tuple(replace(s, engine=tuple(replace(r, age_s=30.0) for r in s.engine))
                                     for s in b.samples))
    assert classify(stale).verdict is not VerdictKind.STARTUP_HANG


# ------------------------------------------------------------------ the bundle


def test_io_survives_a_bundle_and_older_bundles_read_none(tmp_path):
    assert all(p.io_rchar is None and p.io_read_bytes is None for s in load().samples for p in s.processes)
    b = with_io(load(), 4096, 4096)
    back = read_bundle(write_bundle(b, tmp_path / "b.tar.gz"))
    assert [(p.io_rchar, p.io_read_bytes) for s in back.samples for p in s.processes] == \
        [(p.io_rchar, p.io_read_bytes) for s in b.samples for p in s.processes]


@pytest.mark.parametrize("value, problem", [
    (-1, "out of range for a count of bytes"), (bounds.MAX_IO_BYTES + 1, "out of range for a count of bytes"),
    (1 << 70, "number out of range"), (1.5, "expected an integer"), ("12", "expected an integer"),
    (True, "expected an integer"),
])
def test_a_hostile_io_count_is_refused_naming_the_field(tmp_path, value, problem):
    path = write_bundle(with_io(load()), tmp_path / "b")
    lines = (path / "samples.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["processes"][0]["io_read_bytes"] = value
    (path / "samples.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(BadBundle, match=rf"samples.jsonl line 1: processes\[0\].io_read_bytes: .*{problem}"):
        read_bundle(path)


def test_a_null_io_count_reads_as_unread(tmp_path):
    path = write_bundle(with_io(load()), tmp_path / "b")
    lines = (path / "samples.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["processes"][0]["io_rchar"] = None
    (path / "samples.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert read_bundle(path).samples[0].processes[0].io_rchar is None


# ------------------------------------------------------------------ a slow phase judged by its reads


def test_weight_loading_parked_and_reading_nothing_is_hung_at_the_quiet_bound():
    b = with_io(longer(loading(load()), 3))
    f = Facts(b)
    assert f.engine_parked and idle_reads(f) is not None and engine_reads(b.samples).span_s >= NO_READS_MIN_S
    v = classify(b)
    assert (v.verdict, v.rule) == (VerdictKind.STARTUP_HANG, "live_startup_hang"), v.summary
    assert v.facts["phase"] == WEIGHT_LOADING and v.facts["deadline_s"] == STARTUP_QUIET_S
    assert STARTUP_QUIET_S <= v.facts["quiet_s"] < STARTUP_DEADLINE_S
    assert v.summary.startswith(f"Start-up stuck in {WEIGHT_LOADING} for ")
    assert v.confidence == C.STARTUP_PARKED_CORROBORATED  # the Worker's stack and the log both name the phase
    line = next(e for e in v.evidence if e.what.startswith("no bytes read"))
    core, worker = pid_of(b, Role.ENGINE_CORE), pid_of(b, Role.WORKER)
    assert line.what == (f"no bytes read and no CPU (0.00 cores) for 4.3 s: rchar and read_bytes (/proc/PID/io) "
                         f"unchanged in EngineCore pid {core}, Worker pid {worker}")
    assert line.values["rchar"] == line.values["read_bytes"] == 0
    # without the stacks the log alone names the phase: the reads' own confidence
    bare = classify(replace(b, samples=tuple(replace(s, stacks=()) for s in b.samples)))
    assert (bare.verdict, bare.confidence, bare.facts["phase"]) == (VerdictKind.STARTUP_HANG, C.STARTUP_NO_READS,
                                                                    WEIGHT_LOADING)


def test_weight_loading_still_reading_keeps_the_slow_deadline_and_says_so():
    b = with_io(longer(loading(load()), 3), rchar_step=8_000_000, read_step=8_000_000)
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE, v.summary
    assert v.summary.startswith(f"Starting: in {WEIGHT_LOADING} for ")
    # 8 MB a second in each of the EngineCore and the Worker, over the 4.3 s the window now spans
    assert "short of the 10 min after which this phase counts as hung; the engine still reads (64.0 MB over 4.3 s)" \
        in v.summary, v.summary
    assert any(e.what.startswith("the engine read 64.0 MB (rchar) and had 64.0 MB fetched from storage "
                                 "(read_bytes) over 4.3 s: still reading") for e in v.evidence)
    assert any("grep -E '^(rchar|read_bytes)' /proc/" in a for a in v.advice)
    # a read from the page cache (rchar alone) is progress too, and so is a load through mmap (read_bytes alone)
    assert classify(with_io(longer(loading(load()), 3), rchar_step=4096)).verdict is VerdictKind.INCONCLUSIVE
    v = classify(with_io(longer(loading(load()), 3), read_step=1_000_000))
    assert v.verdict is VerdictKind.INCONCLUSIVE and "the engine still reads (8.0 MB over 4.3 s)" in v.summary
    # and past the slow deadline it is hung all the same
    late = shifted(b, -(STARTUP_DEADLINE_S - 60))
    v = classify(late)
    assert v.verdict is VerdictKind.STARTUP_HANG and v.facts["deadline_s"] == STARTUP_DEADLINE_S


def test_weight_loading_with_io_unknown_keeps_the_slow_deadline_and_says_what_to_check():
    b = longer(loading(load()), 3)  # recorded before /proc/PID/io was read
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert "; bytes read unknown: /proc/PID/io not recorded; not a verdict yet." in v.summary, v.summary
    assert any(e.what.startswith("bytes read unknown: /proc/PID/io not recorded for EngineCore pid") for e in v.evidence)
    assert any("grep -E '^(rchar|read_bytes)'" in a and "as the server's user or root" in a for a in v.advice)
    # as another user (the report standing for the sockets): unreadable without ptrace, and said so
    v = classify(reporting(unprivileged(b), phase="weight loading"))
    assert "; bytes read unknown: /proc/PID/io unreadable without ptrace; not a verdict yet." in v.summary, v.summary
    assert any(e.source == "wedgectl" and e.what.startswith("bytes read unknown") for e in v.evidence)
    # past the slow deadline: hung, as before
    assert classify(shifted(b, -STARTUP_DEADLINE_S)).verdict is VerdictKind.STARTUP_HANG


def test_weight_loading_read_nothing_over_too_short_a_window_is_not_decided():
    b = with_io(loading(load()))  # the recorded window: 1.3 s
    assert engine_reads(b.samples).none_read and engine_reads(b.samples).span_s < NO_READS_MIN_S
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert "; no bytes read, but over only 1.3 s (it takes 3 s)" in v.summary, v.summary
    assert any("--window 10" in a for a in v.advice)


def test_a_busy_engine_in_weight_loading_is_not_hung_whatever_it_reads():
    b = busy(with_io(longer(loading(load()), 3)))
    assert not Facts(b).engine_parked and idle_reads(Facts(b)) is None
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE and "bytes read" not in v.summary


def test_one_engine_process_unread_leaves_the_reads_unknown():
    b = with_io(longer(loading(load()), 3))
    worker = pid_of(b, Role.WORKER)
    b = replace(b, samples=tuple(replace(s, processes=tuple(replace(p, io_rchar=None, io_read_bytes=None)
                                                            if p.pid == worker else p for p in s.processes))
                                 for s in b.samples))
    assert not engine_reads(b.samples).known
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE and "bytes read unknown: /proc/PID/io not recorded" in v.summary
    assert f"not recorded for Worker pid {worker} (" in text(v)


def test_warm_up_is_still_judged_by_its_cpu_and_now_cites_the_reads():
    """The recorded hang's own phase burns CPU when it works: parked decides it, as before; the reads are cited."""
    b = with_io(load())
    v = classify(b)
    assert (v.verdict, v.confidence, v.facts["phase"]) == (VerdictKind.STARTUP_HANG, C.STARTUP_PARKED_CORROBORATED,
                                                           WARM_UP)
    assert "no bytes read and no CPU (0.00 cores) for 1.3 s: rchar and read_bytes" in text(v)
    assert "bytes read" not in text(classify(load()))  # a capture without them: as it read before


@pytest.mark.parametrize("version", VERSIONS)
def test_every_release_reads_the_same_with_the_reads_added(version):
    b = load(f"{version}/startup-hang")
    plain, flat = classify(b), classify(with_io(longer(b, 3)))
    assert plain.verdict is flat.verdict is VerdictKind.STARTUP_HANG
    assert flat.facts["phase"] == plain.facts["phase"] and "no bytes read and no CPU" in text(flat)


# ------------------------------------------------------------------ as a user without ptrace, with the report


def test_without_ptrace_the_engines_report_stands_for_the_unreadable_sockets():
    b = reporting(unprivileged(load()))
    f = Facts(b)
    assert f.api_server is not None and f.api_server.connections is None and not f.stacks
    told = reported_starting(f)
    assert told is not None and told.pid == pid_of(b, Role.ENGINE_CORE)
    v = classify(b)
    assert (v.verdict, v.rule, v.facts["phase"]) == (VerdictKind.STARTUP_HANG, "live_startup_hang", WARM_UP)
    assert v.facts["deadline_s"] == STARTUP_QUIET_S  # warm-up, parked: its CPU, from /proc/PID/stat, decides
    api, core = pid_of(b, Role.API_SERVER), pid_of(b, Role.ENGINE_CORE)
    first = v.evidence[0].what
    assert first.startswith(f"API server pid {api} alive, /metrics never answered, its sockets unreadable (no "
                            "CAP_SYS_PTRACE); the engine's report says it is starting, and vLLM's API server listens "
                            "only once the engine reports ready"), first
    assert any(e.source == "engine" and e.what.startswith("stage starting (graph capture / warm-up) for ")
               and f"EngineCore pid {core}, report 0.4 s old" in e.what for e in v.evidence)
    assert "engine used 0.00 cores over the window (parked" in text(v)
    assert v.confidence == C.STARTUP_PARKED  # the log names the phase; no stack does


def test_without_ptrace_a_young_start_says_where_it_is_and_what_it_could_not_read():
    b = reporting(unprivileged(loading(load())), phase="weight loading")
    v = classify(b)  # as recorded: about a minute quiet, short of 10 min
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert v.summary.startswith(f"Starting: in {WEIGHT_LOADING} for ")
    assert "short of the 10 min" in v.summary and "bytes read unknown: /proc/PID/io unreadable without ptrace" \
        in v.summary, v.summary
    assert any("its sockets unreadable" in e.what for e in v.evidence)


def test_without_ptrace_or_the_log_the_reports_time_in_its_stage_is_how_long():
    """Another user's log is unreadable too: how long the engine has been in its phase is the report's time in
    its stage, not the API server's age (seen live as nobody: up 84 s, in warm-up for 43 s)."""
    b = replace(reporting(unprivileged(load()), stage_s=43.0), log_lines=())
    assert Facts(b).api_server is not None
    v = classify(b)
    assert v.verdict is VerdictKind.INCONCLUSIVE
    assert v.summary.startswith(f"Starting: in {WARM_UP} for 43 s, short of the 60 s after which"), v.summary
    v = classify(replace(reporting(unprivileged(load()), stage_s=75.0), log_lines=()))
    assert (v.verdict, v.facts["stuck_s"], v.facts["quiet_s"]) == (VerdictKind.STARTUP_HANG, 75.0, None)
    assert v.facts["stuck_s"] < v.facts["age_s"]


@pytest.mark.parametrize("change", ["stale", "idle", "none", "listening"])
def test_without_ptrace_no_fresh_starting_report_decides_nothing(change):
    b = unprivileged(load())
    if change == "stale":
        b = reporting(b, age_s=30.0)
    elif change == "idle":
        b = reporting(b, phase=None, stage="idle")
    elif change == "listening":  # the listener seen after all (a netns LISTEN row): it listened
        b = reporting(b)
        b = replace(b, samples=tuple(replace(s, processes=tuple(
            replace(p, listening=("127.0.0.1:8000",)) if p.role is Role.API_SERVER else p for p in s.processes))
            for s in b.samples))
    assert reported_starting(Facts(b)) is None or change == "listening"
    assert classify(b).verdict is not VerdictKind.STARTUP_HANG


@pytest.mark.parametrize("version", VERSIONS)
def test_every_release_without_ptrace_but_with_the_report_is_a_startup_hang(version):
    v = classify(reporting(unprivileged(load(f"{version}/startup-hang"))))
    assert (v.verdict, v.facts["phase"]) == (VerdictKind.STARTUP_HANG, WARM_UP), v.summary
    assert "its sockets unreadable" in v.evidence[0].what
