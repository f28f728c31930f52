"""`wedgectl watch` on recorded data: episodes, escalation, naming, rotation, the exposition and the endpoints."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.cli import main
from wedgectl.model.types import Bundle, Role, Verdict, VerdictKind
from wedgectl.watch import HANG_CLASSES, Episode, Snapshot, Tracker, is_hang, make_registry, target_name
from wedgectl.watch.daemon import episode_lines
from wedgectl.watch.exposition import Endpoint, parse_listen
from wedgectl.watch.recorder import Rotation, bundle_name, recorded, rotate, save_onset
from wedgectl.watch.state import (CALM_TICKS, Escalation, TargetLabels, frozen_with_work, hang_onset, not_listening,
                                  queue_of, trouble, wall_time)
from wedgectl.capture.discover import served_model
from wedgectl.watch.targets import node_name, target_labels

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
DOCS = Path(__file__).parents[1] / "docs"
V = VerdictKind


def verdict(kind: VerdictKind, confidence: float = 0.9) -> Verdict:
    return Verdict(kind, confidence, f"{kind.value} summary", f"rule_{kind.value}")


# ------------------------------------------------------------------ episodes


def test_hang_classes_are_every_verdict_but_the_serving_and_undecided_ones():
    assert set(HANG_CLASSES) == {
        V.ADMISSION_WEDGE, V.ENGINE_DEADLOCK, V.SHUTDOWN_HANG, V.ENGINE_DEAD,
        V.STARTUP_HANG, V.ORPHANED_ENGINE, V.LEAKED_CAPACITY, V.COLLECTIVE_HANG,
    }
    assert not any(is_hang(k) for k in (V.IDLE, V.PROGRESSING, V.STARVED, V.INCONCLUSIVE))


def test_a_stall_that_recovers_is_one_episode_with_its_peak_queue():
    tr = Tracker("node:8000/tiny")
    assert tr.observe(verdict(V.PROGRESSING), 100.0, 2) is None
    started = tr.observe(verdict(V.ADMISSION_WEDGE), 105.0, 1)
    assert started is not None and started.open and started.start == 105.0 and started.verdict is V.ADMISSION_WEDGE
    assert tr.observe(verdict(V.INCONCLUSIVE), 110.0, 3) is None  # undecided: the hang goes on
    assert tr.observe(verdict(V.ENGINE_DEADLOCK), 115.0, 4) is None
    ended = tr.observe(verdict(V.IDLE), 120.0, 0)
    assert ended is not None and not ended.open
    assert (ended.start, ended.end, ended.peak_queue) == (105.0, 120.0, 4)
    assert ended.verdicts == (V.ADMISSION_WEDGE, V.ENGINE_DEADLOCK)
    assert tr.totals == {V.ADMISSION_WEDGE: 1}
    assert tr.observe(verdict(V.STARVED), 125.0, 9) is None  # starved is not a hang
    assert len(tr.episodes) == 1


def test_liveness_fails_only_after_the_grace_and_never_for_starved():
    tr = Tracker("t")
    tr.observe(verdict(V.STARVED), 0.0)
    assert not tr.view(None, None, False).failing_liveness(10_000.0, 120.0)
    tr.observe(verdict(V.ENGINE_DEADLOCK), 100.0)
    view = tr.view(None, None, True)
    assert not view.failing_liveness(219.0, 120.0)
    assert view.failing_liveness(221.0, 120.0)
    tr.observe(verdict(V.PROGRESSING), 222.0)
    assert not tr.view(None, None, False).failing_liveness(500.0, 120.0)


def test_state_seconds_counts_from_the_verdict_change():
    tr = Tracker("t")
    tr.observe(verdict(V.IDLE), 10.0)
    tr.observe(verdict(V.IDLE), 20.0)
    assert tr.view(None, None, False).state_seconds(25.0) == 15.0
    tr.observe(verdict(V.PROGRESSING), 30.0)
    assert tr.view(None, None, False).state_seconds(31.0) == 1.0


def test_episode_lines_text_and_json():
    ep = Episode("n:8000/tiny", V.ADMISSION_WEDGE, 1_700_000_000.0, 1_700_000_060.0, 1.0, "/b/x.tar.gz", (V.ADMISSION_WEDGE,))
    (text,) = episode_lines("end", ep, False, 1_700_000_100.0)
    assert "admission_wedge ended after 60s" in text and "/b/x.tar.gz" in text and len(text) < 200
    (line,) = episode_lines("start", ep, True, 1_700_000_100.0)
    obj = json.loads(line)
    assert obj["event"] == "episode_start" and obj["verdict"] == "admission_wedge" and obj["peak_queue"] == 1.0
    assert obj["start"] == "2023-11-14T22:13:20Z" and obj["end"] == "2023-11-14T22:14:20Z" and obj["bundle"] == "/b/x.tar.gz"


# ------------------------------------------------------------------ escalation on recorded bundles


@pytest.mark.parametrize("name, signs", [
    ("admission-wedge", {"frozen_with_work", "waiting_not_draining"}),
    ("engine-deadlock", {"frozen_with_work"}),
    ("starved", {"waiting_not_draining"}),
    ("shutdown-hang", {"not_listening"}),
    ("healthy", set()),
    ("idle", set()),
])
def test_cheap_signs_of_trouble_in_recorded_bundles(name, signs):
    samples = read_bundle(BUNDLES / f"{name}.tar.gz").samples
    assert set(trouble(samples)) == signs


def test_escalation_holds_while_unhealthy_and_drops_back_after_calm_ticks():
    wedge = read_bundle(BUNDLES / "admission-wedge.tar.gz").samples
    idle = read_bundle(BUNDLES / "idle.tar.gz").samples
    esc = Escalation()
    assert esc.update(idle, V.IDLE) is False
    assert esc.update(wedge, V.ADMISSION_WEDGE) is True
    assert "frozen_with_work" in esc.reasons and esc.stacks_due
    assert esc.update(wedge, V.ADMISSION_WEDGE) is True and not esc.stacks_due
    assert esc.update(wedge, V.ADMISSION_WEDGE) is True and not esc.stacks_due
    assert esc.update(wedge, V.ADMISSION_WEDGE) is True and esc.stacks_due
    assert esc.update(idle, V.STARVED) is True  # a verdict that is not healthy keeps the full samples
    for _ in range(CALM_TICKS - 1):
        assert esc.update(idle, V.IDLE) is True
    assert esc.update(idle, V.IDLE) is False


def test_replaying_a_recorded_wedge_opens_an_admission_wedge_episode():
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    tr = Tracker("replay")
    began = []
    for i in range(1, len(b.samples) + 1):
        window = Bundle(b.manifest, b.samples[:i], b.log_lines)
        ep = tr.observe(classify(window), b.samples[i - 1].t, queue_of(b.samples[:i]))
        if ep is not None:
            began.append(ep)
    assert [e.verdict for e in began] == [V.ADMISSION_WEDGE] and began[0].open and began[0].peak_queue == 1.0


# ------------------------------------------------------------------ naming


def test_target_names_are_node_port_model(monkeypatch):
    assert target_name("node-a", "http://127.0.0.1:8000", "tiny") == "node-a:8000/tiny"
    assert target_name("node-a", "http://gpu-7.example:9000", None) == "gpu-7.example:9000/unknown"
    assert target_name("node-a", None, "m", pid=42) == "node-a:pid42/m"
    monkeypatch.setenv("POD_NAME", "vllm-0")
    assert node_name() == "vllm-0"
    monkeypatch.delenv("POD_NAME")
    monkeypatch.setenv("HOSTNAME", "vllm-1")
    assert node_name() == "vllm-1"


def test_served_model_prefers_the_served_name():
    assert served_model(["python", "_serve.py", "serve", "/m/tiny-llama/", "--served-model-name", "tiny"]) == "tiny"
    assert served_model(["vllm", "serve", "/models/Llama-3-8B", "--port", "8001"]) == "Llama-3-8B"
    assert served_model(["python", "-m", "vllm.entrypoints.openai.api_server", "--model=x"]) == "x"
    assert served_model(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/m"]) == "m"


# ------------------------------------------------------------------ rotation


def test_rotation_is_bounded_by_count_and_size_and_spares_other_files(tmp_path):
    foreign = tmp_path / "notes.txt"
    foreign.write_text("x" * 10_000)
    paths = []
    for i in range(5):
        p = tmp_path / bundle_name("n:8000/tiny", "admission_wedge", 1_700_000_000 + i)
        p.write_bytes(b"z" * 1000)
        os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
        paths.append(p)
    assert rotate(tmp_path, Rotation(keep=3, max_bytes=10**9)) == paths[:2]
    assert recorded(tmp_path) == paths[2:]
    assert rotate(tmp_path, Rotation(keep=10, max_bytes=1500), keep_path=paths[4]) == paths[2:4]
    assert recorded(tmp_path) == [paths[4]] and foreign.exists()
    assert rotate(tmp_path, Rotation(keep=1, max_bytes=10), keep_path=paths[4]) == []  # the newest stays


def test_save_onset_writes_a_readable_bundle(tmp_path):
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    p = save_onset(b, tmp_path, "n:8000/tiny", "admission_wedge", Rotation())
    assert p.name.startswith("wedgectl-watch-n_8000_tiny-admission_wedge-") and p.name.endswith(".tar.gz")
    assert classify(read_bundle(p)).verdict is V.ADMISSION_WEDGE
    p2 = save_onset(b, tmp_path, "n:8000/tiny", "admission_wedge", Rotation())
    assert p2 != p and len(recorded(tmp_path)) == 2


# ------------------------------------------------------------------ exposition and endpoints


def _snapshot(now: float = 1000.0, grace: float = 60.0) -> Snapshot:
    wedged = Tracker("n:8001/wedged", TargetLabels("n", "8001", "wedged"))
    healthy = Tracker("n:8000/tiny", TargetLabels("n", "8000", "tiny"))
    wedged.observe(verdict(V.PROGRESSING), now - 300)
    wedged.observe(verdict(V.ADMISSION_WEDGE, 0.95), now - 100, 1)
    healthy.observe(verdict(V.IDLE, 0.8), now - 50)
    views = (wedged.view("http://127.0.0.1:8001", 11, True, up=False),
             healthy.view("http://127.0.0.1:8000", 12, False, up=True))
    return Snapshot(now, grace, views, {("pyspy", "permission"): 3})


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_are_a_state_set_per_target_with_counters_and_build_info():
    fam = _families(generate_latest(make_registry(_snapshot)).decode())
    states = {(s.labels["target"], s.labels["verdict"]): s.value for s in fam["wedgectl_verdict"]}
    assert len(states) == 2 * len(VerdictKind)
    assert states[("n:8001/wedged", "admission_wedge")] == 1.0
    assert sum(v for (t, _), v in states.items() if t == "n:8001/wedged") == 1.0
    assert states[("n:8000/tiny", "idle")] == 1.0
    conf = {s.labels["target"]: s.value for s in fam["wedgectl_verdict_confidence"]}
    assert conf == {"n:8001/wedged": 0.95, "n:8000/tiny": 0.8}
    held = {s.labels["target"]: s.value for s in fam["wedgectl_state_seconds"]}
    assert held == {"n:8001/wedged": 100.0, "n:8000/tiny": 50.0}
    episodes = {(s.labels["target"], s.labels["verdict"]): s.value for s in fam["wedgectl_episodes"] if s.name.endswith("_total")}
    assert episodes[("n:8001/wedged", "admission_wedge")] == 1.0 and episodes[("n:8000/tiny", "engine_deadlock")] == 0.0
    last = {s.labels["target"]: s.value for s in fam["wedgectl_last_evaluation_timestamp_seconds"]}
    assert last == {"n:8001/wedged": 900.0, "n:8000/tiny": 950.0}
    (fail,) = [s for s in fam["wedgectl_collector_failures"] if s.name.endswith("_total")]
    assert fail.labels == {"collector": "pyspy", "kind": "permission"} and fail.value == 3.0
    up = {s.labels["target"]: s.value for s in fam["wedgectl_target_up"]}
    assert up == {"n:8001/wedged": 0.0, "n:8000/tiny": 1.0}
    # the target's parts, each a label of its own: joins with vLLM's series on model_name
    (wedge,) = [s for s in fam["wedgectl_verdict"] if s.labels["verdict"] == "admission_wedge" and s.value == 1.0]
    assert wedge.labels == {"target": "n:8001/wedged", "node": "n", "port": "8001", "model_name": "wedged", "pid": "",
                            "verdict": "admission_wedge"}
    (build,) = fam["wedgectl_build_info"]
    assert build.name == "wedgectl_build_info" and build.labels["version"]


@contextlib.contextmanager
def _serving(state: dict) -> Iterator[tuple[str, httpx.Client]]:
    """An Endpoint answering from state["snap"] (swap it to change what it says): its base URL and a client."""
    ep = Endpoint("127.0.0.1:0", lambda: state["snap"]).start()
    try:
        with httpx.Client(timeout=5, trust_env=False) as c:
            yield f"http://{ep.address}", c
    finally:
        ep.close()
    assert not ep.thread.is_alive()


def test_endpoints_answer_livez_targets_and_metrics():
    state = {"snap": _snapshot(grace=200.0)}
    with _serving(state) as (base, c):
        assert c.get(f"{base}/livez").status_code == 200  # 100 s in the wedge, grace 200 s
        state["snap"] = _snapshot(grace=60.0)
        r = c.get(f"{base}/livez")
        assert r.status_code == 503 and "n:8001/wedged: admission_wedge for 100s" in r.text
        targets = c.get(f"{base}/v1/targets").json()["targets"]
        by = {t["target"]: t for t in targets}
        assert by["n:8001/wedged"]["verdict"] == "admission_wedge" and by["n:8001/wedged"]["live"] is False
        assert by["n:8001/wedged"]["episodes"][0]["end"] is None
        assert by["n:8000/tiny"]["verdict"] == "idle" and by["n:8000/tiny"]["live"] is True
        m = c.get(f"{base}/metrics")
        assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
        assert ('wedgectl_verdict{model_name="wedged",node="n",pid="",port="8001",target="n:8001/wedged",'
                'verdict="admission_wedge"} 1.0') in m.text
        assert c.get(f"{base}/nope").status_code == 404
        # the runbooks the alert rules link to, from the installed wedgectl; nothing else by that path
        page = c.get(f"{base}/runbooks/hang-admission-wedge.md")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/markdown")
        assert page.content == (DOCS / "hang-admission-wedge.md").read_bytes()
        for other in ("design.md", "..%2Fpyproject.toml", "../README.md", "hang-none.md", "runbook-watch.md.bak"):
            assert c.get(f"{base}/runbooks/{other}").status_code == 404, other


def test_readyz_takes_a_hung_target_out_of_rotation_at_once_and_livez_after_the_grace():
    state = {"snap": _snapshot(grace=200.0)}
    with _serving(state) as (base, c):
        # 100 s in the wedge, grace 200 s: alive, but not ready
        assert c.get(f"{base}/livez").status_code == 200
        r = c.get(f"{base}/readyz")
        assert r.status_code == 503 and r.text == "n:8001/wedged: admission_wedge for 100s\n"
        # one target's answer, by its `target` label
        wedged = c.get(f"{base}/readyz", params={"target": "n:8001/wedged"})
        healthy = c.get(f"{base}/readyz", params={"target": "n:8000/tiny"})
        assert (wedged.status_code, healthy.status_code, healthy.text) == (503, 200, "ok\n")
        assert c.get(f"{base}/livez", params={"target": "n:8001/wedged"}).status_code == 200
        state["snap"] = _snapshot(grace=60.0)
        assert c.get(f"{base}/livez", params={"target": "n:8001/wedged"}).status_code == 503
        assert c.get(f"{base}/livez", params={"target": "n:8000/tiny"}).status_code == 200
        # an unknown target is not "ready"; a query other than ?target=NAME is refused, hostile text escaped
        gone = c.get(f"{base}/readyz", params={"target": "n:9/\x1b[2Jx"})
        assert gone.status_code == 404 and "\x1b" not in gone.text and gone.text.startswith("no such target")
        for query in ("?verdict=x", "?target=a&target=b", "?" + "&".join(f"f{i}=1" for i in range(50)), "?=&"):
            assert c.get(f"{base}/readyz{query}").status_code == 400, query
        assert "/readyz" in c.get(f"{base}/").text


def test_readyz_is_ready_with_no_target_in_a_hang_class():
    healthy = Tracker("n:8000/tiny", TargetLabels("n", "8000", "tiny"))
    healthy.observe(verdict(V.STARVED, 0.8), 900.0)  # starved is no hang: it stays in rotation
    snap = Snapshot(1000.0, 60.0, (healthy.view("http://127.0.0.1:8000", 12, False, up=True),))
    assert snap.unready == () and snap.only("n:8000/tiny") is not None and snap.only("other") is None


@pytest.mark.parametrize("listen, want", [("127.0.0.1:9464", ("127.0.0.1", 9464)), (":9", ("0.0.0.0", 9)),
                                          ("[::1]:80", ("::1", 80))])
def test_parse_listen(listen, want):
    assert parse_listen(listen) == want


@pytest.mark.parametrize("bad", ["9464", "host:", "host:99999", "host:x"])
def test_parse_listen_refuses(bad):
    with pytest.raises(ValueError):
        parse_listen(bad)


def test_cli_refuses_bad_options_and_targets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["watch", "--interval", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["watch", "--pid", "999999999", "--listen", "127.0.0.1:0"])
    assert e.value.code == 30 and "no such process" in capsys.readouterr().err


def test_watch_of_an_unreachable_url_is_not_a_hang_and_stops_on_time():
    """A URL nobody answers is inconclusive, not an episode; the loop ends at --max-seconds."""
    from wedgectl.watch import Spec, WatchOptions, Watcher, run_watch

    stop = threading.Event()
    lines: list[str] = []
    t0 = time.monotonic()
    rc = run_watch(WatchOptions(specs=(Spec(url="http://127.0.0.1:1"),), listen="127.0.0.1:0", interval_s=0.2),
                   stop, lines.append, lambda _m: None, max_s=1.0)
    assert rc == 0 and time.monotonic() - t0 < 15 and lines == []
    w = Watcher(WatchOptions(specs=(Spec(url="http://127.0.0.1:1"),), interval_s=0.2), lines.append, lambda _m: None)
    w.connect_explicit()
    for _ in range(3):
        w.tick()
        w.close(wait_s=10)
    (view,) = w.snapshot().targets
    assert view.name.endswith(":1/unknown") and view.verdict.verdict is V.INCONCLUSIVE and not view.episodes
    assert w.snapshot().failures.get(("metrics", "unreachable"), 0) >= 1


def test_a_cheap_sample_reads_process_cpu_and_one_scrape_without_threads():
    """On real processes (this one and a child that exits): CPU and state, no threads, a gone pid left out."""
    import subprocess
    import sys

    from wedgectl.capture.discover import Deployment
    from wedgectl.capture.options import SamplerOptions
    from wedgectl.model.types import Role
    from wedgectl.watch.targets import Spec, Watched

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    state = {"snap": _snapshot()}
    ep = Endpoint("127.0.0.1:0", lambda: state["snap"]).start()
    try:
        me = os.getpid()
        dep = Deployment(me, None, {me: Role.API_SERVER, child.pid: Role.ENGINE_CORE}, f"http://{ep.address}",
                         f"http://{ep.address}/metrics")
        w = Watched(Spec(pid=me), dep, "node")
        first = w.sample(full=False, stacks=False, options=SamplerOptions())
        assert {p.pid for p in first.processes} == {me, child.pid}
        assert all(p.threads == () and p.num_threads >= 1 for p in first.processes)
        assert next(p for p in first.processes if p.pid == me).cpu_s > 0
        assert first.metrics is not None and first.metrics.ok and "wedgectl_verdict" in first.metrics.text
        assert first.health_status is None and first.stacks == ()  # cheap: no /health, no py-spy
        child.kill()
        child.wait(timeout=10)
        second = w.sample(full=False, stacks=False, options=SamplerOptions())
        assert [p.pid for p in second.processes] == [me] and second.metrics.ok  # the kept transport still works
        assert "process_gone" in trouble(w.window())
        w.close()
    finally:
        child.kill()
        child.wait(timeout=10)
        ep.close()


# ------------------------------------------------------------------ onset: state_seconds from the hang's start


def _local(*when: int) -> float:
    return datetime.datetime(*when).timestamp()


def test_a_wedge_found_already_under_way_counts_from_vllms_first_frozen_stats_line():
    """A real wedge's log (recorded): its 08:37:49 stats line still counted tokens; at 08:37:59 vLLM logged
    0 tokens/s over the ten seconds since, with a request waiting (the rest it logs at DEBUG). No token came after
    08:37:49: a watcher that first looks at 08:40:29 dates the hang from there, 160 s back."""
    lines = (BUNDLES / "admission-wedge.log").read_text().splitlines()
    now = _local(2026, 12, 1, 8, 40, 29)
    onset = hang_onset(V.ADMISSION_WEDGE, verdict(V.ADMISSION_WEDGE), (), lines, now)
    assert onset == _local(2026, 12, 1, 8, 37, 49) == now - 160
    tr = Tracker("n:8000/tiny")
    ep = tr.observe(verdict(V.ADMISSION_WEDGE), now, 1, onset)
    assert ep is not None and ep.start == now - 160
    assert tr.view(None, None, True).state_seconds(now + 10) == 170.0
    # the lines before the hang alone (tokens flowing at their end) date nothing
    flowing = [ln for ln in lines if "08:37:59" not in ln]
    assert hang_onset(V.ADMISSION_WEDGE, verdict(V.ADMISSION_WEDGE), (), flowing, now) is None
    # a class whose evidence is not frozen counters is not dated by them
    assert hang_onset(V.ORPHANED_ENGINE, verdict(V.ORPHANED_ENGINE), (), lines, now) is None


def test_a_log_from_before_the_server_started_dates_nothing():
    """A log appended to across restarts: the frozen run belongs to the server before this one."""
    lines = (BUNDLES / "admission-wedge.log").read_text().splitlines()
    b = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    now = _local(2026, 12, 1, 8, 40, 29)
    last = b.samples[-1]
    restarted = replace(last, processes=tuple(replace(p, started=now - 30) if p.role is Role.API_SERVER else p
                                              for p in last.processes))
    assert any(p.role is Role.API_SERVER for p in restarted.processes)
    assert hang_onset(V.ADMISSION_WEDGE, verdict(V.ADMISSION_WEDGE), (restarted,), lines, now) is None


def test_recorded_samples_date_the_frozen_run_and_the_closed_listener():
    wedge = read_bundle(BUNDLES / "admission-wedge.tar.gz")
    now = wedge.samples[-1].t
    onset = hang_onset(V.ADMISSION_WEDGE, classify(wedge), wedge.samples, (), now)
    # every sample from the onset on shows the same token count with the request in flight
    assert onset is not None and onset < now
    frozen = [s for s in wedge.samples if s.t >= onset]
    assert len(frozen) >= 2 and all(frozen_with_work(frozen[i - 1:i + 1]) for i in range(1, len(frozen)))
    shutdown = read_bundle(BUNDLES / "shutdown-hang.tar.gz")
    v = classify(shutdown)
    assert v.verdict is V.SHUTDOWN_HANG
    onset = hang_onset(V.SHUTDOWN_HANG, v, shutdown.samples, (), shutdown.samples[-1].t)
    closed = [s for s in shutdown.samples if not_listening([s])]
    assert onset == closed[0].t and len(closed) >= 2


def test_a_startup_hang_counts_from_the_phase_the_classifier_timed():
    b = read_bundle(BUNDLES / "startup-hang.tar.gz")
    v = classify(b)
    assert v.verdict is V.STARTUP_HANG and v.facts["stuck_s"] > 60
    now = b.samples[-1].t
    assert hang_onset(V.STARTUP_HANG, v, b.samples, (), now) == pytest.approx(now - v.facts["stuck_s"])


def test_wall_time_reads_a_year_less_stamp_in_this_year_or_the_last():
    assert wall_time("12-01 08:37:59", _local(2026, 12, 1, 9, 0, 0)) == _local(2026, 12, 1, 8, 37, 59)
    assert wall_time("12-31 23:59:00", _local(2027, 1, 1, 0, 1, 0)) == _local(2026, 12, 31, 23, 59, 0)
    assert wall_time("2025-06-01 10:00:00", _local(2026, 1, 1, 0, 0, 0)) == _local(2025, 6, 1, 10, 0, 0)
    assert wall_time("13-45 99:00:00", _local(2026, 1, 1, 0, 0, 0)) is None
    assert wall_time("not a stamp", 0.0) is None


def test_target_labels_are_the_names_parts_and_pid_only_without_a_port():
    assert target_labels("node-a", "http://127.0.0.1:8000", "tiny", 42) == TargetLabels("node-a", "8000", "tiny", "")
    assert target_labels("node-a", "http://gpu-7.example:9000", None) == TargetLabels("gpu-7.example", "9000",
                                                                                       "unknown", "")
    assert target_labels("node-a", None, "m", pid=42) == TargetLabels("node-a", "", "m", "42")
