"""The deploy/ files: the alert rules under promtool, the Kubernetes manifests against the Kubernetes schemas, and what each must say."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from wedgectl.cli import app
from wedgectl.model.types import VerdictKind
from wedgectl.watch import HANG_CLASSES
from wedgectl.watch.exposition import runbook

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "wedgectl-rules.yaml"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# Kinds of the Prometheus Operator: no schema in Kubernetes' own; checked by hand below.
CRD_KINDS = {"ServiceMonitor"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("no promtool on PATH (tests/setup.sh installs Debian's prometheus)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


def _rules() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def test_promtool_checks_the_rules():
    r = _promtool("check", "rules", RULES.name)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_promtool_unit_tests_pass():
    r = _promtool("test", "rules", "wedgectl-rules.test.yaml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_promtool_unit_tests_can_fail(tmp_path):
    """The rule tests are not vacuous: with VllmAdmissionWedge's for: doubled they fail."""
    if shutil.which("promtool") is None:
        pytest.skip("no promtool on PATH")
    rules = RULES.read_text().replace("for: 2m", "for: 4m", 1)
    (tmp_path / RULES.name).write_text(rules)
    shutil.copy(RULES.parent / "wedgectl-rules.test.yaml", tmp_path)
    r = subprocess.run(["promtool", "test", "rules", "wedgectl-rules.test.yaml"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and "VllmAdmissionWedge" in r.stdout + r.stderr


def test_every_hang_class_alerts_critically_and_starved_warns():
    rules = _rules()
    for kind in HANG_CLASSES:
        (alert,) = [r for r in rules.values() if f'verdict="{kind.value}"' in r["expr"]]
        assert alert["labels"]["severity"] == "critical"
    (starved,) = [r for r in rules.values() if 'verdict="starved"' in r["expr"]]
    assert starved["labels"]["severity"] == "warning"
    # the catch-all for hang classes added later leaves out exactly the classes that have their own alert
    catch_all = rules["VllmHang"]["expr"]
    named = set(re.search(r'verdict!~"([^"]+)"', catch_all).group(1).split("|"))
    assert named == {k.value for k in VerdictKind}
    assert {"WedgectlWatcherDown", "WedgectlStaleEvaluations"} <= set(rules)


RUNBOOK_BASE = ("{{ with $externalLabels.wedgectl_runbooks }}{{ . }}{{ else }}http://{{ $labels.instance }}/runbooks"
                "{{ end }}")


def test_every_alert_has_a_summary_and_a_runbook_that_exists():
    for name, rule in _rules().items():
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        # absolute: under the external label wedgectl_runbooks when set, else the watcher's own /runbooks/
        page = re.fullmatch(re.escape(RUNBOOK_BASE) + r"/([a-z0-9-]+\.md)", ann["runbook_url"])
        assert page is not None, f"{name}: runbook_url {ann['runbook_url']!r}"
        assert (ROOT / "docs" / page.group(1)).is_file(), f"{name}: runbook {page.group(1)} is not in docs/"
        assert runbook(page.group(1)) == (ROOT / "docs" / page.group(1)).read_bytes(), f"{name}: not served"
        assert re.fullmatch(r"\d+m", rule["for"]), f"{name}: for {rule['for']} (production durations, in minutes)"


# ------------------------------------------------------------------ Kubernetes


def _validate(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path):
    docs = _docs(path)
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        _validate(doc)


def test_the_schema_check_catches_a_mistake():
    import kubernetes_validate

    (ds,) = [d for d in _docs(DEPLOY / "kubernetes" / "daemonset.yaml") if d["kind"] == "DaemonSet"]
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)


def _pod(path: Path, kind: str) -> dict:
    (doc,) = [d for d in _docs(path) if d["kind"] == kind]
    return doc["spec"]["template"]["spec"]


def test_daemonset_sees_every_process_with_only_the_capabilities_it_needs():
    pod = _pod(DEPLOY / "kubernetes" / "daemonset.yaml", "DaemonSet")
    assert pod["hostPID"] is True
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "BPF", "PERFMON"]}
    assert "privileged" not in sc
    assert c["args"][0] == "watch" and "--listen=0.0.0.0:9464" in c["args"]
    (sm,) = [d for d in _docs(DEPLOY / "kubernetes" / "daemonset.yaml") if d["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"


def test_sidecar_points_liveness_at_livez_and_readiness_at_readyz():
    pod = _pod(DEPLOY / "kubernetes" / "sidecar-example.yaml", "Deployment")
    assert pod["shareProcessNamespace"] is True
    by = {c["name"]: c for c in pod["containers"]}
    probe = by["vllm"]["livenessProbe"]["httpGet"]
    assert probe == {"path": "/livez", "port": 9464}
    # out of rotation first: the sidecar's readiness is the server's, and fails on the first verdict
    ready = by["wedgectl"]["readinessProbe"]
    assert ready["httpGet"] == {"path": "/readyz", "port": "metrics"} and ready["failureThreshold"] == 1
    assert by["vllm"]["readinessProbe"]["httpGet"]["path"] == "/health"  # start-up stays vLLM's to say
    assert "--listen=0.0.0.0:9464" in by["wedgectl"]["args"]
    assert by["wedgectl"]["securityContext"]["readOnlyRootFilesystem"] is True


def test_sidecar_runs_without_ptrace_and_reads_the_engine_report_from_a_shared_volume():
    """The sidecar with the least privilege that still decides a deadlock or an admission wedge: no
    capability (the engine's report instead of py-spy), another user than the server's, the report's
    directory given to both containers (the sidecar cannot read the server's environ), on a volume both
    mount, as a directory of the server's own inside it (an emptyDir is 0777: the writer and the reader
    refuse a directory others may write)."""
    pod = _pod(DEPLOY / "kubernetes" / "sidecar-example.yaml", "Deployment")
    assert pod["shareProcessNamespace"] is True and "hostPID" not in pod
    by = {c["name"]: c for c in pod["containers"]}
    server, sidecar = by["vllm"], by["wedgectl"]
    sc = sidecar["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}  # no SYS_PTRACE, nothing added
    assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["readOnlyRootFilesystem"] is True
    assert "SYS_PTRACE" not in yaml.safe_dump(pod)

    def env(c: dict) -> dict[str, str]:
        return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}

    assert env(server)["WEDGE_ENGINE_REPORT"] == "1" or "WEDGE_ENGINE_FIXES" in env(server)
    report_dir = env(server)["WEDGE_ENGINE_REPORT_DIR"]
    assert env(sidecar)["WEDGE_ENGINE_REPORT_DIR"] == report_dir and report_dir.startswith("/")

    def volume_of(c: dict) -> tuple[str, dict]:
        (m,) = [m for m in c["volumeMounts"] if report_dir.startswith(m["mountPath"].rstrip("/") + "/")]
        return m["name"], m

    (name, server_mount), (same, sidecar_mount) = volume_of(server), volume_of(sidecar)
    assert name == same and server_mount["mountPath"] == sidecar_mount["mountPath"]
    assert report_dir != server_mount["mountPath"].rstrip("/")  # a directory inside the volume, not the volume
    assert sidecar_mount.get("readOnly") is True and not server_mount.get("readOnly")
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    assert "emptyDir" in volume
    # the onset bundles likewise go into a directory watch makes itself inside its volume
    (bundles,) = [a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--bundle-dir=")]
    assert any(bundles.startswith(m["mountPath"].rstrip("/") + "/") for m in sidecar["volumeMounts"])


def _watch_options() -> set[str]:
    import typer.main

    cmd = typer.main.get_command(app).commands["watch"]
    return {o for p in cmd.params for o in p.opts}


def test_every_watch_invocation_in_deploy_uses_real_options():
    options = _watch_options()
    invocations = [c["args"] for path in MANIFESTS for d in _docs(path) if d["kind"] in ("DaemonSet", "Deployment")
                   for c in d["spec"]["template"]["spec"]["containers"] if c.get("args", [""])[0] == "watch"]
    unit = (DEPLOY / "systemd" / "wedgectl-watch.service").read_text()
    (exec_start,) = re.findall(r"(?m)^ExecStart=\S+ (.*)$", unit)
    invocations.append(exec_start.split())
    cf = (DEPLOY / "Containerfile").read_text()
    invocations.append(json.loads(re.search(r"(?m)^CMD (.*)$", cf).group(1)))
    assert len(invocations) == 4
    for args in invocations:
        assert args[0] == "watch"
        used = {a.split("=", 1)[0] for a in args[1:] if a.startswith("--")}
        assert used <= options, used - options


def test_grafana_dashboard_queries_exported_series():
    dash = json.loads((DEPLOY / "grafana" / "wedgectl.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exported = {"wedgectl_verdict", "wedgectl_verdict_confidence", "wedgectl_state_seconds", "wedgectl_episodes_total",
                "wedgectl_last_evaluation_timestamp_seconds", "wedgectl_collector_failures_total", "wedgectl_targets"}
    used = {m for e in exprs for m in re.findall(r"\bwedgectl_[a-z_]+", e)}
    assert used and used <= exported, used - exported


def test_the_dashboards_hang_count_counts_every_hang_class_and_nothing_else():
    """The stat an operator reads first counts exactly the classes the critical alerts fire for: a hang class
    added to VerdictKind and missing here would show 0 while its alert fires."""
    dash = json.loads((DEPLOY / "grafana" / "wedgectl.json").read_text())
    (panel,) = [p for p in dash["panels"] if p["title"] == "Servers in a hang class"]
    (target,) = panel["targets"]
    counted = set(re.search(r'verdict=~"([^"]+)"', target["expr"]).group(1).split("|"))
    assert counted == {k.value for k in HANG_CLASSES}
    critical = {m for r in _rules().values() if r["labels"].get("severity") == "critical"
                for m in re.findall(r'verdict="([a-z_]+)"', r["expr"])}
    assert counted == critical
    # and the README's selector for a metric-driven picker leaves out the same classes
    readme = (DEPLOY.parent / "README.md").read_text()
    (picker,) = re.findall(r'`wedgectl_verdict\{verdict=~"([^"]+)"\} == 1`', readme)
    assert set(picker.split("|")) == counted


def test_containerfile_installs_the_wheel_and_runs_watch():
    cf = (DEPLOY / "Containerfile").read_text()
    assert re.search(r"(?m)^COPY dist/wedgectl-\*\.whl", cf) and "pip install" in cf
    assert re.search(r'(?m)^ENTRYPOINT \["wedgectl"\]', cf)
