"""tracefs is mounted only when permitted (root or CAP_SYS_ADMIN, not disabled), and never without a line on stderr."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from wedgectl.collect import ebpfhost
from wedgectl.collect.ebpfhost import Host


def _host(root: Path, euid: int, caps: int | None, said: list[str]) -> Host:
    return Host(root=root, which=lambda _n: None, euid=lambda: euid, release="6.8.0", cap_eff=lambda: caps,
                say=said.append)


@pytest.fixture
def no_mount_runs(monkeypatch):
    runs = []
    monkeypatch.setattr(ebpfhost.subprocess, "run", lambda *a, **k: runs.append(a) or pytest.fail("mount ran"))
    return runs


def test_an_unprivileged_user_never_tries(tmp_path, monkeypatch, no_mount_runs):
    monkeypatch.delenv(ebpfhost.NO_MOUNT_ENV, raising=False)
    said: list[str] = []
    caps = 1 << ebpfhost.CAP_BPF | 1 << ebpfhost.CAP_PERFMON  # enough for the probes, not for mount(2)
    found, why = ebpfhost.ensure_tracefs(_host(tmp_path, 1000, caps, said))
    assert found is None and "needs root or CAP_SYS_ADMIN" in why and not said


def test_the_operator_can_forbid_it(tmp_path, monkeypatch, no_mount_runs):
    monkeypatch.setenv(ebpfhost.NO_MOUNT_ENV, "1")
    said: list[str] = []
    found, why = ebpfhost.ensure_tracefs(_host(tmp_path, 0, ~0, said))
    assert found is None and ebpfhost.NO_MOUNT_ENV in why and not said


def test_a_mount_always_says_so(monkeypatch):
    monkeypatch.delenv(ebpfhost.NO_MOUNT_ENV, raising=False)
    monkeypatch.setattr(ebpfhost, "find_tracefs", lambda host=None: None)  # as on a host without it mounted
    runs = []

    def run(cmd, **kw):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 32, "", "mount: permission denied")

    monkeypatch.setattr(ebpfhost.subprocess, "run", run)
    said: list[str] = []
    found, why = ebpfhost.ensure_tracefs(_host(Path("/"), 0, 1 << ebpfhost.CAP_SYS_ADMIN, said))
    assert runs and runs[0][:3] == ["mount", "-t", "tracefs"]
    assert len(said) == 1 and said[0].startswith("wedgectl: mounting tracefs at ") and ebpfhost.NO_MOUNT_ENV in said[0]
    assert found is None and "permission denied" in why
