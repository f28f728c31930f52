"""The live session (capture.session): one deployment under watch, held alike by diagnose, top and watch.

Before it, each command kept its own copy, and they drifted: top named a server started with
--served-model-name "?" where watch named it by that name, and watch's manifest kept the URL's
user:password where diagnose's and top's redacted it. Here top's LiveSource and watch's Watched are
built on one deployment (a real process with a served name in its argv, a URL with a password), and
must say the same; the session's window and log tail are checked on their own.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wedgectl.capture.discover import Deployment, served_model
from wedgectl.capture.session import LiveSession
from wedgectl.model.types import MetricsScrape, Role, Sample
from wedgectl.tui.source import LiveSource
from wedgectl.watch.targets import Spec, Watched

PASSWORD = "s3cr3t-pw-1234"
URL = f"http://probe:{PASSWORD}@127.0.0.1:9"  # port 9 (discard): nothing is scraped here


@pytest.fixture
def server() -> Iterator[int]:
    """A process whose argv reads as `vllm serve` with a served name: (its pid)."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "serve", "/models/Meta-Llama-3-8B/",
            "--served-model-name", "prod-llama", "prod-llama-alias"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30  # between fork and exec its argv is still ours: wait for the exec
    while b"prod-llama" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)


def deployment_of(pid: int) -> Deployment:
    return Deployment(pid, pid, {pid: Role.API_SERVER}, URL, f"{URL}/metrics")


def test_top_and_watch_name_the_served_model_alike(server):
    """top said "?" for a server started with --served-model-name: its session now names it as watch's does."""
    dep = deployment_of(server)
    top, watched = LiveSource(dep, server, None), Watched(Spec(pid=server), dep, "node-a")
    try:
        assert top.session.model == watched.model == "prod-llama"
        assert top.model == "prod-llama" and watched.name.endswith("/prod-llama")
        assert top.model == served_model(["vllm", "serve", "/m", "--served-model-name", "prod-llama"])
    finally:
        top.close()
        watched.close()


def test_top_and_watch_write_the_url_redacted_alike(server):
    """watch's manifest kept the URL's user:password: every manifest of the session redacts it."""
    dep = deployment_of(server)
    top, watched, session = LiveSource(dep, server, None), Watched(Spec(pid=server), dep, "node-a"), LiveSession(dep)
    try:
        manifests = {"top": top.manifest(), "watch": watched.manifest("captured by wedgectl watch"),
                     "session": session.manifest(), "session now": session.manifest(("note",))}
        for name, m in manifests.items():
            assert m.target.url == "http://<redacted>@127.0.0.1:9", (name, m.target.url)
            assert PASSWORD not in repr(m), name
        assert watched.manifest("n").target.pid == server and top.manifest().target.pid == server
    finally:
        top.close()
        watched.close()
        session.close()


def test_a_session_without_a_model_in_its_argv_names_it_from_its_series():
    dep = Deployment(None, None, {}, "http://127.0.0.1:9", "http://127.0.0.1:9/metrics")
    session = LiveSession(dep, url=dep.base_url)
    assert session.model is None
    page = 'vllm:num_requests_running{model_name="tiny"} 0.0\n'
    sample = Sample(t=0.0, metrics=MetricsScrape(t=0.0, url=dep.metrics_url, status=200, elapsed_s=0.01, text=page))
    assert session.name_model(sample) == "tiny" == session.model
    session.close()


def test_the_window_keeps_the_last_samples_by_count_and_by_age():
    by_count = LiveSession(Deployment(None, None, {}, None, None), keep=3)
    assert [by_count.record(Sample(t=float(t))) for t in range(5)][-1] == [Sample(t=1.0)]
    assert [s.t for s in by_count.samples] == [2.0, 3.0, 4.0]
    by_age = LiveSession(Deployment(None, None, {}, None, None), keep_s=10.0)
    for t in (0.0, 5.0, 10.0):
        assert by_age.record(Sample(t=t)) == []
    assert [s.t for s in by_age.record(Sample(t=15.5))] == [0.0, 5.0]
    assert [s.t for s in by_age.samples] == [10.0, 15.5]


def test_the_log_tail_is_read_again_only_once_it_is_old(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("one\n")
    session = LiveSession(Deployment(None, None, {}, None, None), log_path=log)
    assert session.log_tail(max_age_s=60.0) == ("one",)
    log.write_text("one\ntwo\n")
    assert session.log_tail(max_age_s=60.0) == ("one",)  # kept: read less than 60 s ago
    assert session.log_tail(max_bytes=1 << 20) == ("one", "two")  # a bundle's tail is always read
    assert session.log_tail() == ("one", "two")  # fresh
    time.sleep(0.02)
    log.write_text("one\ntwo\nthree\n")
    assert session.log_tail(max_age_s=0.01) == ("one", "two", "three")
    assert session.manifest().target.log_path == str(log)


def test_a_log_that_cannot_be_read_is_a_note_not_an_error(tmp_path):
    session = LiveSession(Deployment(None, None, {}, None, None), log_path=tmp_path / "missing.log")
    lines, notes = session.read_log(1 << 20)
    assert lines == () and len(notes) == 1 and notes[0].startswith("log not read:")


def test_a_late_listener_is_looked_for_only_for_a_pid():
    """A URL target, or one already listening, is not rediscovered (rediscovery needs a pid)."""
    no_pid = LiveSession(Deployment(None, None, {}, None, None))
    assert no_pid.find_late_listener() is False
    listening = LiveSession(Deployment(1, 1, {1: Role.API_SERVER}, "http://127.0.0.1:9", "http://127.0.0.1:9/metrics"),
                            pid=1)
    assert listening.find_late_listener() is True and listening.deployment.base_url == "http://127.0.0.1:9"


# ------------------------------------------------------------------ the runner the looks run on


def test_background_jobs_give_their_results_and_a_bug_gives_none():
    from wedgectl.capture.runner import run_in_background

    def broken() -> object:
        raise RuntimeError("a collector bug")

    done = run_in_background({"metrics": lambda: "page", "health": broken})
    assert done.result(timeout=10) == {"metrics": "page", "health": None}
    assert run_in_background({}).result(timeout=0) == {}


def test_a_job_past_its_wait_is_abandoned_and_its_late_result_dropped():
    import threading

    from wedgectl.capture.runner import run_in_background

    release = threading.Event()
    done = run_in_background({"fast": lambda: 1, "stuck": lambda: release.wait(10) and 2})
    deadline = time.monotonic() + 10
    while "fast" not in done.got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done.abandon() == {"fast": 1}
    release.set()
    time.sleep(0.1)
    assert done.got == {"fast": 1}


def test_a_bounded_map_returns_by_its_bound_with_what_is_done():
    import threading

    from wedgectl.capture.runner import map_bounded

    release = threading.Event()

    def work(item: int) -> int:
        if item == 2:
            release.wait(10)  # stuck past the bound: abandoned, its thread a daemon
        if item == 3:
            raise ValueError("a collector bug")
        return item * 10

    start = time.monotonic()
    got = map_bounded(work, [0, 1, 2, 3, 4], workers=2, bound_s=1.0)
    took = time.monotonic() - start
    release.set()
    assert got == {0: 0, 1: 10, 4: 40} and took < 5.0
