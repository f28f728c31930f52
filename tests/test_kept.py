"""Kept repros (wedgectl/lab/kept.py, `repro --stop`): recorded when kept, stopped later by the pid and start time
they had then, never a process that took the pid since. Real processes stand in for the server and its clients."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from cli_run import one_line, run_cli
from wedgectl.collect.procfs.stat import start_ticks
from wedgectl.lab import kept
from wedgectl.model import exitcodes
from wedgectl.model.errors import WedgectlError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WEDGECTL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def stand_ins():
    """A 'server' and its 'clients': sleeps in sessions of their own, as repro starts them."""
    procs = [subprocess.Popen(["sleep", "300"], start_new_session=True) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _gone(p: subprocess.Popen, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return True
        time.sleep(0.05)
    return False


def test_a_recorded_repro_is_listed_and_stopped_with_its_clients(cache: Path, stand_ins) -> None:
    server, clients = stand_ins
    path = kept.record(kept.new_record("admission-wedge", server.pid, "http://127.0.0.1:1", clients.pid,
                                       cache / "out", 3600))
    assert oct(os.stat(path.parent).st_mode & 0o777) == "0o700" and oct(os.stat(path).st_mode & 0o777) == "0o600"
    ((listed_path, k),) = kept.list_kept()
    assert listed_path == path and (k.name, k.pid, k.holder_pid) == ("admission-wedge", server.pid, clients.pid)
    assert k.pid_ticks == start_ticks(server.pid) and k.running()
    stopped = kept.stop(path, k)
    assert stopped is not None and not stopped.killed  # sleep ends on SIGTERM
    assert _gone(server) and _gone(clients) and not path.exists()


def test_a_pid_taken_by_another_process_since_is_never_signalled(cache: Path, stand_ins) -> None:
    server, clients = stand_ins
    k = kept.new_record("engine-deadlock", server.pid, "http://127.0.0.1:1", clients.pid, cache / "out", 3600)
    reused = kept.KeptRepro(**{**k.__dict__, "pid_ticks": k.pid_ticks - 1, "holder_ticks": k.holder_ticks - 1})
    path = kept.record(reused)
    assert not reused.running()
    assert kept.stop(path, reused) is None  # "already gone": the record goes, the processes stay
    assert server.poll() is None and clients.poll() is None and not path.exists()


def test_records_that_do_not_read_are_skipped(cache: Path, stand_ins) -> None:
    server, _ = stand_ins
    kept.record(kept.new_record("idle", server.pid, "http://127.0.0.1:1", None, cache / "out", 60))
    d = kept.kept_dir()
    (d / "garbage.json").write_text("{not json")
    (d / "wrong.json").write_text(json.dumps({"name": "x", "pid": "1; rm -rf /"}))
    (d / "huge.json").write_bytes(b" " * (kept.RECORD_MAX_BYTES + 10))
    os.symlink("/etc/passwd", d / "link.json")
    assert [k.name for _p, k in kept.list_kept()] == ["idle"]


def test_a_records_directory_open_to_others_is_refused(cache: Path) -> None:
    d = kept.kept_dir(create=True)
    os.chmod(d, 0o777)
    with pytest.raises(WedgectlError) as info:
        kept.list_kept()
    assert info.value.exit_code == exitcodes.UNWRITABLE_OUTPUT and "not a private directory" in str(info.value)


def test_stop_from_the_command_line(cache: Path, stand_ins) -> None:
    server, clients = stand_ins
    env = {**os.environ, "WEDGECTL_CACHE": str(cache)}
    r = run_cli("repro", "--stop", "no-such", env=env)
    assert r.returncode == exitcodes.USAGE and one_line(r.stderr) == \
        "wedgectl: no kept repro named 'no-such' (kept: none)"
    kept.record(kept.new_record("shutdown-hang", server.pid, "http://127.0.0.1:1", clients.pid, cache / "o", 60))
    r = run_cli("repro", "--stop", str(server.pid), "--json", env=env)  # by its server's pid
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["exit_code"] == 0, r
    assert [(s["name"], s["pid"], s["was_running"]) for s in out["stopped"]] == [("shutdown-hang", server.pid, True)]
    assert _gone(server) and _gone(clients)
    r = run_cli("repro", "--stop-all", env=env)
    assert r.returncode == 0 and r.stdout.strip() == "no kept repros", r
    r = run_cli("repro", "shutdown-hang", "--stop", "--stop-all", env=env)
    assert r.returncode == exitcodes.USAGE


def test_a_kept_repro_lasts_as_long_as_its_output_says() -> None:
    """vLLM 0.32 ends a step that never returns after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s): a kept engine
    deadlock would die at five minutes while its clients hold on for KEEP_S. Kept, the timeout is KEEP_S."""
    from wedgectl.lab.repro import KEEP_S, find_config, repro_env

    cfg = find_config("engine-deadlock")
    assert repro_env(cfg, keep=True)["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == str(KEEP_S) == "3600"
    assert "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in repro_env(cfg)  # not kept: vLLM's own default
    assert repro_env(cfg, keep=True)["WEDGE_ENGINE_FAULT"] == cfg.env["WEDGE_ENGINE_FAULT"]
