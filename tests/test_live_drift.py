"""Issue 34: diagnose, top and watch say the same about one deployment.

The three held a deployment under watch each in their own code (the sampler's window, tui.source's
LiveSource and Collector, watch.targets' Watched); they now hold one live session (capture.session). They had drifted: top named a server started with
--served-model-name "?" (or by its full model path) where watch used the served name, and watch's
manifests kept the URL's user:password where diagnose's and top's redacted it. Here one deployment
(tests/targets/fake_vllm_serve.py: an API server, its EngineCore and Worker, its log a file over
4 MiB) and one URL with a password in it go through each command's own code; what each writes must be
the same. diagnose names no model (a bundle has no model field), so the model name is top's and watch's.

Also: watch does not import the TUI (it found the host's servers through wedgectl.tui.source), nor the
TUI watch; checked in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from page_server import page_server

from wedgectl.capture.discover import BUNDLE_LOG_BYTES, deployment_manifest, discover, served_model
from wedgectl.read.redact import redact_argv
from wedgectl.capture.options import SamplerOptions
from wedgectl.capture.session import model_from_metrics
from wedgectl.capture.window import capture
from wedgectl.tui.source import Collector, LiveSource, find_servers
from wedgectl.model.types import MetricsScrape, Sample
from wedgectl.watch.targets import Spec, Watched, host_deployments

ROOT = Path(__file__).resolve().parents[1]
TARGETS = Path(__file__).parent / "targets"
REAL = Path(__file__).parent / "fixtures" / "real"
PASSWORD = "s3cr3t-pw-1234"
API_KEY = "sk-live-0123456789abcdefghijklmnop"
NODE = "node-a"


@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    """A server on 127.0.0.1 answering /metrics with a recorded idle vLLM page, /health with 200."""
    page = (REAL / "metrics_idle.txt").read_bytes()

    with page_server(lambda path: page if path.startswith("/metrics") else b"") as url:
        yield url.replace("http://", f"http://probe:{PASSWORD}@")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """The stand-in deployment, started as `... serve /models/Meta-Llama-3-8B/ --served-model-name prod-llama
    prod-llama-alias --api-key SECRET`, writing to a log of recorded vLLM lines over BUNDLE_LOG_BYTES:
    (its API server's pid, the log)."""
    log = tmp_path_factory.mktemp("drift") / "server.log"
    recorded = (REAL / "progressing_server.log").read_bytes()
    with open(log, "wb") as f:
        for i in range(BUNDLE_LOG_BYTES // len(recorded) + 2):
            f.write(f"copy {i} of the recorded log\n".encode() + recorded)
    argv = [sys.executable, str(TARGETS / "fake_vllm_serve.py"), "serve", "/models/Meta-Llama-3-8B/",
            "--served-model-name", "prod-llama", "prod-llama-alias", "--api-key", API_KEY]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=TARGETS, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(TARGETS)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        ready = None
        while ready is None:
            assert proc.poll() is None and time.monotonic() < deadline, f"no ready line (exit {proc.poll()})"
            with open(log, "rb") as f:
                f.seek(-4096, os.SEEK_END)
                ready = next((ln for ln in f.read().splitlines() if ln.startswith(b"ready {")), None)
            time.sleep(0.1)
        yield json.loads(ready.split(b" ", 1)[1])["api"], log
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine and worker too (and PR_SET_PDEATHSIG)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


# ------------------------------------------------------------------ the manifest and the log tail


def test_diagnose_top_and_watch_write_one_manifest_target_and_log_tail(deployment, metrics_url):
    api, log = deployment
    port = metrics_url.rsplit(":", 1)[1]

    diagnose = capture(pid=api, url=metrics_url, options=SamplerOptions(window_s=1.0, interval_s=0.5, stacks=False))

    top = LiveSource.connect(pid=api, url=metrics_url)
    try:
        collector = Collector(top)
        assert collector.tick() is not None
        top_bundle = collector.bundle()  # what top's "save" writes
    finally:
        top.close()

    watched = Watched.connect(Spec(pid=api, url=metrics_url), NODE)
    try:
        watched.sample(full=False, stacks=False, options=SamplerOptions())
        # What the daemon keeps at an episode's onset, and what each evaluation classifies.
        watch_bundle = watched.bundle("onset", log_bytes=BUNDLE_LOG_BYTES, fresh_log=True)
        watch_manifest = watched.manifest("captured by wedgectl watch")
    finally:
        watched.close()

    manifests = {"diagnose": diagnose.manifest, "top": top.manifest(), "top save": top_bundle.manifest,
                 "watch onset": watch_bundle.manifest, "watch": watch_manifest}
    for name, m in manifests.items():
        assert m.target.url == f"http://<redacted>@127.0.0.1:{port}", (name, m.target.url)
        assert PASSWORD not in repr(m), name
        assert m.target.pid == api and m.source == "live", (name, m.target, m.source)
    assert len({m.target for m in manifests.values()}) == 1, {n: m.target for n, m in manifests.items()}
    assert diagnose.manifest.target.log_path == str(log) and set(diagnose.manifest.target.pids) >= {api}

    # The tail a bundle keeps: the same BUNDLE_LOG_BYTES from all three, cut from a longer log.
    tails = {"diagnose": diagnose.log_lines, "top save": top_bundle.log_lines, "watch onset": watch_bundle.log_lines}
    assert len(set(tails.values())) == 1, {n: (len(t), t[:1]) for n, t in tails.items()}
    kept = diagnose.log_lines
    assert kept and kept[-1].startswith("ready {")
    assert "copy 0 of the recorded log" not in kept  # the head is cut off: the log is over BUNDLE_LOG_BYTES
    assert BUNDLE_LOG_BYTES - 64 * 1024 < sum(len(ln) + 1 for ln in kept) <= BUNDLE_LOG_BYTES


def test_top_redacts_the_url_of_a_listener_found_late(deployment, metrics_url):
    """top and watch look again for a server that was not listening yet when found: the manifest
    then names the URL found, redacted as the first one was."""
    api, _ = deployment
    dep = discover(pid=api, url=metrics_url)
    top = LiveSource(replace(dep, metrics_url=None), api, metrics_url)  # as found before it listened
    try:
        top.take(with_stacks=False)
    finally:
        top.close()
    assert top.deployment.metrics_url is not None  # it looked again
    assert top.manifest().target == deployment_manifest(dep, api).target
    assert PASSWORD not in repr(top.manifest()) and "<redacted>@" in (top.manifest().target.url or "")


def test_watch_finds_a_late_listener_as_top_does(deployment, metrics_url):
    """The same live session (capture.session) looks again for watch: the sample is scraped, and
    its manifest names the URL found, redacted."""
    api, _ = deployment
    dep = discover(pid=api, url=metrics_url)
    watched = Watched(Spec(pid=api, url=metrics_url), replace(dep, metrics_url=None), NODE)
    try:
        s = watched.sample(full=False, stacks=False, options=SamplerOptions())
    finally:
        watched.close()
    assert watched.deployment.metrics_url is not None and s.metrics is not None and s.metrics.ok
    m = watched.manifest("captured by wedgectl watch")
    assert m.target == deployment_manifest(dep, api).target and PASSWORD not in repr(m)


# ------------------------------------------------------------------ the model name


def test_top_and_watch_name_the_served_model_alike(deployment):
    api, _ = deployment
    (picked,) = [s for s in find_servers() if s.pid == api]  # top's picker
    assert picked.model == "prod-llama"  # the first --served-model-name: the label vLLM puts on its series
    assert API_KEY not in repr(picked) and "<redacted>" in picked.cmdline

    assert api in host_deployments()  # watch with no target: the same scan
    watched = Watched.connect(Spec(pid=api), NODE)
    try:
        assert watched.model == picked.model
        assert watched.name.endswith("/prod-llama"), watched.name
    finally:
        watched.close()


@pytest.mark.parametrize(("argv", "model"), [
    (["vllm", "serve", "/m/Llama-3-8B/", "--served-model-name", "a", "b"], "a"),
    (["python", "_serve.py", "serve", "/m/tiny", "--served-model-name=prod"], "prod"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "org/m"], "m"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model=org/m2"], "m2"),
    (["vllm", "serve", "/models/Qwen3-0.6B", "--port", "8001"], "Qwen3-0.6B"),
    (["vllm", "serve", "/a/b", "--model", "c"], "b"),  # the positional wins, as in vLLM
    (["vllm", "serve", "--model", "/x/y"], "y"),
    (["vllm", "serve", "/a", "--served-model-name", "x", "--served-model-name", "y"], "y"),  # argparse: the last
    (["vllm", "serve", "/a", "--served-model-name", "--port", "1"], "a"),  # no name given: the path
    (["python", "-m", "vllm.entrypoints.openai.api_server"], None),
    (["vllm", "serve", "/a", "--served-model-name", "hf_abcdefghijklmnopqrstuvwxyz0123456789"], "<redacted>"),
    (["vllm", "serve", "/a", "--served-model-name=sk-abcdefghijklmnopqrstuvwxyz012345"], "<redacted>"),
    (["vllm", "serve", f"http://u:{PASSWORD}@hub/org/model", "--api-key", "prod"], "model"),
])
def test_served_model_names_raw_and_redacted_argvs_alike(argv, model):
    """top's picker reads an argv already redacted (processes.api_servers), watch the raw one."""
    assert served_model(argv) == model
    assert served_model(redact_argv(argv)) == model


@pytest.mark.parametrize("name", ["prod-llama", "hf_abcdefghijklmnopqrstuvwxyz0123456789"])
def test_watch_names_a_model_from_its_metrics_as_from_its_argv(name):
    """A server whose argv names no model is named from its series' model_name label: redacted alike."""
    page = (REAL / "metrics_idle.txt").read_text().replace('model_name="tiny"', f'model_name="{name}"')
    assert name in page
    sample = Sample(t=0.0, metrics=MetricsScrape(t=0.0, url="http://127.0.0.1:8000/metrics", status=200,
                                                 elapsed_s=0.01, text=page))
    assert model_from_metrics(sample) == served_model(["vllm", "serve", "/m", "--served-model-name", name])


# ------------------------------------------------------------------ watch and top stay apart


@pytest.mark.parametrize(("imports", "other"), [
    ("wedgectl.watch, wedgectl.watch.daemon, wedgectl.watch.targets, wedgectl.watch.recorder", "wedgectl.tui"),
    ("wedgectl.tui, wedgectl.tui.source, wedgectl.tui.app", "wedgectl.watch"),
])
def test_watch_and_the_tui_import_nothing_of_each_other(imports, other):
    code = (f"import sys, json, {imports}\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m == {other!r} or m.startswith({other!r} + '.'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
