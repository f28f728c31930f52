"""wedgectl's side of the patched engine: the `repro --patched` checks and `wedgectl swap`, on fake servers."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from wedgectl.model import exitcodes

from wedgectl.lab import swap
from wedgectl.lab.patched import (
    ADMISSION_BOUND_S,
    Observation,
    evaluate,
    heartbeat_stall,
    states_capacity,
)
from wedgectl.collect.control import free_port, stop_tree
from wedgectl.render.text import render_swap, render_swap_plan

# --- repro --patched: the checks -----------------------------------------------------

ERR_400 = json.dumps({"error": {"message": "max_tokens=110 cannot be greater than max_model_len=96.", "code": 400}})
ERR_503 = json.dumps({"error": {"message": "engine stalled: 2 request(s) ...", "code": 503}})


def by_name(checks):
    return {c.name: c for c in checks}


def test_admission_needs_a_fast_error_that_states_capacity():
    obs = Observation(client=[{"status": 400, "body": ERR_400, "elapsed_s": 0.01}], exit_s=0.4)
    checks = by_name(evaluate("admission_wedge", obs))
    assert all(c.passed for c in checks.values()), checks
    assert "HTTP 400" in checks["clear error"].detail
    slow = Observation(client=[{"status": 400, "body": ERR_400, "elapsed_s": ADMISSION_BOUND_S + 1}], exit_s=0.4)
    assert not by_name(evaluate("admission_wedge", slow))["clear error"].passed
    vague = Observation(client=[{"status": 500, "body": '{"error": {"message": "Internal server error"}}',
                                 "elapsed_s": 0.1}], exit_s=0.4)
    assert not by_name(evaluate("admission_wedge", vague))["clear error"].passed
    hung = Observation(client=[], exit_s=0.4)
    assert not by_name(evaluate("admission_wedge", hung))["clear error"].passed


def test_states_capacity():
    assert states_capacity("the request needs 4 KV-cache blocks for 97 tokens but only 3 blocks")
    assert states_capacity("max_tokens=110 cannot be greater than max_model_len=96")
    assert not states_capacity("Internal server error")
    assert not states_capacity("too many tokens")


def test_deadlock_needs_errors_and_health_503_within_the_watchdog_bound():
    reqs = [{"status": 503, "body": ERR_503, "elapsed_s": 8.4}] * 2
    ok = Observation(client=reqs, health_503_after_s=8.7, exit_s=0.4, watchdog_s=8.0)
    assert all(c.passed for c in evaluate("engine_deadlock", ok))
    late = dataclasses.replace(ok, health_503_after_s=None)
    assert not by_name(evaluate("engine_deadlock", late))["health 503"].passed
    hung = dataclasses.replace(ok, client=[{"error": "ReadTimeout: timed out", "elapsed_s": 120}])
    checks = by_name(evaluate("engine_deadlock", hung))
    assert not checks["watchdog error"].passed and not checks["every client answered"].passed


def test_the_heartbeat_must_freeze_and_age_with_the_clock_before_the_watchdog():
    """Readings every 0.5 s, each answered 0.1 s after it was sent (sent, answered, steps, model steps, step age,
    model step age): three steps, then blocked."""
    steps = [(0.0, 0.1, 5, 3, 0.1, 0.1), (0.5, 0.6, 6, 4, 0.1, 0.1), (1.0, 1.1, 7, 5, 0.2, 0.2)]
    blocked = [(1.0 + 0.5 * k, 1.1 + 0.5 * k, 7, 5, 0.2 + 0.5 * k, 0.2 + 0.5 * k) for k in range(1, 12)]
    hb = heartbeat_stall(steps + blocked)
    # proven frozen from the first frozen reading's answer (1.1) to the last one's send (6.5)
    assert hb is not None and (hb["steps"], hb["model_steps"], hb["frozen_s"]) == (7, 5, 5.4)
    assert hb["step_age_grew_s"] == hb["model_step_age_grew_s"] == 5.5 and hb["model_step_age_s"] == 5.7
    reqs = [{"status": 503, "body": ERR_503, "elapsed_s": 8.4}] * 2
    ok = Observation(client=reqs, health_503_after_s=8.7, exit_s=0.4, watchdog_s=8.0, heartbeat=hb)
    checks = by_name(evaluate("engine_deadlock", ok))
    assert checks["heartbeat ages while blocked"].passed and "frozen at 7 (5 with model work) for 5.4 s" in \
        checks["heartbeat ages while blocked"].detail
    # a loaded host: the last scrape was sent at 5.0 but answered at 10.1, its ages read about 5 s before it
    # came back; the stretch proven is the 3.9 s up to its send, and its ages grew that much
    slow = heartbeat_stall(steps + blocked[:7] + [(5.0, 10.1, 7, 5, 4.3, 4.3)])
    assert slow is not None and slow["frozen_s"] == 3.9 and slow["step_age_grew_s"] == 4.1
    assert by_name(evaluate("engine_deadlock", dataclasses.replace(ok, heartbeat=slow)))[
        "heartbeat ages while blocked"].passed
    # ages that stop growing (an engine still taking empty steps would reset the step age) fail it
    stuck = heartbeat_stall(steps + [(s, c, 7, 5, 0.3, a) for s, c, _, _, _, a in blocked])
    assert not by_name(evaluate("engine_deadlock", dataclasses.replace(ok, heartbeat=stuck)))[
        "heartbeat ages while blocked"].passed
    # seen frozen too briefly before the 503 says nothing
    brief = heartbeat_stall(steps + blocked[:2])
    assert not by_name(evaluate("engine_deadlock", dataclasses.replace(ok, heartbeat=brief)))[
        "heartbeat ages while blocked"].passed
    assert heartbeat_stall([]) is None and "heartbeat ages while blocked" not in by_name(
        evaluate("engine_deadlock", dataclasses.replace(ok, heartbeat=None)))


def test_shutdown_needs_an_error_after_sigterm_and_a_closed_upload():
    client = [{"stalled_upload": True}, {"status": 503, "body": "{}", "elapsed_s": 4.1}]
    ok = Observation(client=client, exit_s=1.4, upload_closed=True, answered_after_sigterm_s=[0.02])
    assert all(c.passed for c in evaluate("shutdown_hang", ok))
    still_open = dataclasses.replace(ok, upload_closed=False)
    assert not by_name(evaluate("shutdown_hang", still_open))["upload connection closed"].passed
    never = dataclasses.replace(ok, exit_s=None)
    assert not by_name(evaluate("shutdown_hang", never))["exit on SIGTERM"].passed
    slow = dataclasses.replace(ok, exit_s=11.0)
    assert not by_name(evaluate("shutdown_hang", slow))["exit on SIGTERM"].passed


def test_completions_count_only_what_came_before_the_sigterm():
    client = [{"status": 200, "elapsed_s": 0.2}] * 3 + [{"status": 503, "body": "{}", "elapsed_s": 0.3}]
    obs = Observation(client=client, exit_s=0.5, answered_before_sigterm=3)
    assert all(c.passed for c in evaluate("progressing", obs))
    failed = Observation(client=[{"status": 500, "body": "{}", "elapsed_s": 0.2}], exit_s=0.5)
    assert not by_name(evaluate("starved", failed))["completions"].passed


def test_leaked_capacity_needs_every_ghost_reaped_and_the_real_request_served():
    ghosts = [{"max_tokens": 16000, "error": "ReadTimeout: timed out", "gave_up": True, "elapsed_s": 1.5}] * 3
    served = ghosts + [{"status": 200, "elapsed_s": 0.8}]
    ok = Observation(client=served, exit_s=0.4, reaped=3, reaped_after_s=2.1, gave_up=3, answered_before_sigterm=4)
    checks = by_name(evaluate("leaked_capacity", ok))
    assert all(c.passed for c in checks.values()), checks
    assert "3 request(s) reaped of 3" in checks["ghosts reaped"].detail
    assert not by_name(evaluate("leaked_capacity", dataclasses.replace(ok, reaped=2)))["ghosts reaped"].passed
    assert not by_name(evaluate("leaked_capacity", dataclasses.replace(ok, reaped=None, reaped_after_s=None)))["ghosts reaped"].passed
    # the clients that left are owed nothing; the one that stayed is
    waiting = dataclasses.replace(ok, client=ghosts + [{"max_tokens": 16, "error": "ReadTimeout"}])
    assert not by_name(evaluate("leaked_capacity", waiting))["every client answered"].passed


def test_a_hang_with_no_fix_checks_only_a_bounded_sigterm_and_answers():
    obs = Observation(client=[{"status": 503, "body": "{}", "elapsed_s": 9.0}], exit_s=0.4)
    names = [c.name for c in evaluate("admission_wedge", obs, no_fix="no deadline for paused sessions")]
    assert names == ["exit on SIGTERM", "every client answered"]
    assert not all(c.passed for c in evaluate("admission_wedge", dataclasses.replace(obs, exit_s=None), no_fix="x"))


def test_idle_checks_only_the_exit():
    assert [c.name for c in evaluate("idle", Observation(exit_s=0.3))] == ["exit on SIGTERM", "every client answered"]


# --- swap: redaction -------------------------------------------------------------------


def test_redact_env_and_argv():
    env = {"HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "sk-1", "DB_PASSWORD": "pw", "PATH": "/bin", "EMPTY_TOKEN": ""}
    assert swap.redact_env(env) == {"HF_TOKEN": swap.REDACTED, "OPENAI_API_KEY": swap.REDACTED,
                                    "DB_PASSWORD": swap.REDACTED, "PATH": "/bin", "EMPTY_TOKEN": ""}
    argv = ["python", "-m", "vllm", "serve", "m", "--api-key", "sk-secret", "--hf-token=hf_x", "--port", "8000"]
    assert swap.redact_argv(argv) == ["python", "-m", "vllm", "serve", "m", "--api-key", swap.REDACTED,
                                      f"--hf-token={swap.REDACTED}", "--port", "8000"]
    text = "failed: sk-secret and hf_x and hf_abc"
    assert swap.redact_text(text, env, argv) == f"failed: {swap.REDACTED} and {swap.REDACTED} and {swap.REDACTED}"


def test_read_proc_from_a_recorded_root(tmp_path):
    p = tmp_path / "123"
    p.mkdir()
    (p / "cmdline").write_bytes(b"/venv/bin/python\0x_serve.py\0serve\0--port\0\x39000\0")
    (p / "environ").write_bytes(b"PATH=/venv/bin:/bin\0HF_TOKEN=abc=def\0")
    os.symlink("/srv/app", p / "cwd")
    argv, env, cwd = swap.read_proc(123, tmp_path)
    assert argv == ["/venv/bin/python", "x_serve.py", "serve", "--port", "9000"]
    assert env == {"PATH": "/venv/bin:/bin", "HF_TOKEN": "abc=def"} and cwd == "/srv/app"
    with pytest.raises(swap.NoSuchProcess):
        swap.read_proc(124, tmp_path)


def test_interpreter_and_address():
    assert swap.resolve_interpreter(["/venv/bin/python", "x"], {}, "/") == "/venv/bin/python"
    assert swap.resolve_interpreter(["bin/python", "x"], {}, "/srv") == "/srv/bin/python"
    assert swap.resolve_interpreter(["sh"], {"PATH": "/bin:/usr/bin"}, "/").endswith("/sh")
    with pytest.raises(swap.SwapError):
        swap.resolve_interpreter(["no-such-python-here"], {"PATH": "/nonexistent"}, "/")
    assert swap.host_and_port(["x", "--host", "0.0.0.0", "--port", "8123"], None) == ("127.0.0.1", 8123)
    assert swap.host_and_port(["x", "--host=10.1.2.3"], "http://10.1.2.3:9000") == ("10.1.2.3", 9000)
    assert swap.host_and_port(["x"], None) == ("127.0.0.1", 8000)


# --- swap: end to end on a fake server ---------------------------------------------------------

FAKE = textwrap.dedent('''
    """A stand-in vLLM API server: /health, and /env for the variables a test asks about."""
    import http.server, json, os, signal, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    if os.environ.get("FAKE_FAIL_WHEN_FIXED") and os.environ.get("WEDGE_ENGINE_FIXES"):
        sys.exit(3)
    if os.environ.get("FAKE_IGNORE_TERM") and not os.environ.get("WEDGE_ENGINE_FIXES"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the shutdown hang: SIGTERM does nothing
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({k: os.environ.get(k) for k in ("WEDGE_ENGINE_FIXES", "HF_TOKEN", "FAKE_IGNORE_TERM")}
                              | {"pid": os.getpid(), "argv": sys.argv[1:]}).encode()
            self.send_response(200 if self.path in ("/health", "/env") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    time.sleep(float(os.environ.get("FAKE_START_S", "0")))
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE)
    started: list[int] = []

    def start(**env):
        port = free_port()
        full = {**os.environ, "HF_TOKEN": "hf_supersecret", **env}
        p = subprocess.Popen([sys.executable, str(script), "serve", "tiny", "--port", str(port), "--api-key",
                              "sk-verysecret"], cwd=tmp_path, env=full, start_new_session=True,
                             stdout=open(tmp_path / "fake.log", "ab"), stderr=subprocess.STDOUT)
        started.append(p.pid)
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return p, url
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("fake server did not start")

    yield start
    for pid in started:
        stop_tree(pid, 1.0)


def _swapped_pids(result) -> list[int]:
    return [result.new_pid] if result.new_pid else []


def test_plan_reads_the_server_and_prints_no_secret(fake_server):
    p, url = fake_server()
    plan = swap.plan_swap(p.pid)
    assert plan.api_pid == p.pid and plan.url == url and plan.cwd
    assert "sk-verysecret" in plan.argv and plan.env["HF_TOKEN"] == "hf_supersecret"
    shown = "\n".join(render_swap_plan(plan)) + json.dumps(plan.to_json())
    assert "sk-verysecret" not in shown and "hf_supersecret" not in shown
    assert "HF_TOKEN" in shown and swap.REDACTED in shown
    assert plan.new_env["WEDGE_ENGINE_FIXES"] == "all" and plan.new_env["HF_TOKEN"] == "hf_supersecret"


def test_dry_run_touches_nothing(fake_server):
    p, url = fake_server()
    result = swap.swap_deployment(p.pid, dry_run=True)
    assert result.ok and result.dry_run and result.new_pid is None
    assert p.poll() is None and httpx.get(f"{url}/env").json()["pid"] == p.pid
    assert "dry run" in "\n".join(render_swap(result))


def test_swap_replaces_a_server_that_ignores_sigterm(fake_server):
    p, url = fake_server(FAKE_IGNORE_TERM="1")
    plan = dataclasses.replace(swap.plan_swap(p.pid), plugin_ok=True)  # the fake needs no plugin
    steps: list[str] = []
    result = swap.swap_deployment(p.pid, plan=plan, stop_grace_s=1.0, progress=steps.append, health_timeout_s=30)
    try:
        assert result.ok, result.message
        assert result.killed and result.stop_s is not None and 1.0 <= result.stop_s < 7
        assert result.new_pid and result.new_pid != p.pid and result.downtime_s is not None
        env = httpx.get(f"{url}/env").json()
        assert env["pid"] == result.new_pid and env["WEDGE_ENGINE_FIXES"] == "all"
        assert env["HF_TOKEN"] == "hf_supersecret" and "sk-verysecret" in env["argv"]  # kept, not shown
        assert not any("sk-verysecret" in s or "hf_supersecret" in s for s in steps + list(render_swap(result)))
        p.wait(timeout=5)
    finally:
        for pid in _swapped_pids(result):
            stop_tree(pid, 2.0)


def test_swap_rolls_back_when_the_patched_server_fails(fake_server):
    p, url = fake_server(FAKE_FAIL_WHEN_FIXED="1")
    plan = dataclasses.replace(swap.plan_swap(p.pid), plugin_ok=True)
    result = swap.swap_deployment(p.pid, plan=plan, stop_grace_s=2.0, health_timeout_s=20)
    try:
        assert not result.ok and result.rolled_back
        assert "original command is running again" in result.message
        env = httpx.get(f"{url}/env").json()
        assert env["pid"] == result.new_pid and env["WEDGE_ENGINE_FIXES"] is None
    finally:
        for pid in _swapped_pids(result):
            stop_tree(pid, 2.0)


def test_stop_tree_terms_then_kills(tmp_path):
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped = stop_tree(polite.pid, 5.0)
    assert not stopped.killed and stopped.seconds < 3 and polite.poll() is not None
    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()
    stopped = stop_tree(stubborn.pid, 0.5)
    assert stopped.killed and 0.5 <= stopped.seconds < 5
    stubborn.wait(timeout=5)  # already reaped by stop_tree (its child): 0 from Popen, pid gone
    with pytest.raises(ProcessLookupError):
        os.kill(stubborn.pid, 0)


# --- the CLI --------------------------------------------------------------------------------


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_swap_refuses_a_process_that_is_not_vllm():
    r = run("swap", "--pid", "1", "--dry-run")
    assert r.returncode == exitcodes.NOT_VLLM, r.stderr
    r = run("swap", "--pid", "999999999", "--dry-run")
    assert r.returncode == exitcodes.NO_SUCH_PROCESS


def test_cli_swap_dry_run_prints_the_plan_without_secrets(fake_server):
    p, url = fake_server()
    r = run("swap", "--pid", str(p.pid), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "swap plan" in r.stdout and url in r.stdout and "dry run: nothing was touched" in r.stdout
    assert "sk-verysecret" not in r.stdout + r.stderr and "hf_supersecret" not in r.stdout + r.stderr
    r = run("swap", "--pid", str(p.pid), "--dry-run", "--json")
    out = json.loads(r.stdout)
    assert out["dry_run"] and out["plan"]["env"]["HF_TOKEN"] == swap.REDACTED
    assert p.poll() is None


def test_cli_repro_patched_cannot_keep():
    r = run("repro", "idle", "--patched", "--keep")
    assert r.returncode == exitcodes.USAGE


def test_the_plan_says_what_swap_sets_apart_from_what_the_server_had(fake_server):
    """A repro's server carries its own WEDGE_ENGINE_FAULT: the plan shows it kept, not as something swap sets."""
    p, _url = fake_server()
    plan = swap.plan_swap(p.pid)
    plan = dataclasses.replace(plan, env={**plan.env, "WEDGE_ENGINE_FAULT": "engine-stall",
                                          "WEDGE_ENGINE_STATUS_FILE": "/run/old-status.json"})
    lines = list(render_swap_plan(plan))
    (env_line,) = [ln for ln in lines if ln.startswith("  environment:")]
    assert "swap sets WEDGE_ENGINE_FIXES=all" in env_line and "WEDGE_ENGINE_FAULT" not in env_line
    assert env_line.endswith("drops WEDGE_ENGINE_STATUS_FILE")
    assert "  kept as the server had them: WEDGE_ENGINE_FAULT=engine-stall" in lines
    assert plan.new_env["WEDGE_ENGINE_FAULT"] == "engine-stall"  # kept indeed
