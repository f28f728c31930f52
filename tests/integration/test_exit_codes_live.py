"""The documented exit codes that need eBPF or a real vLLM, produced by the real CLI (issue 34).

- 6: `probes --pid --backend bpftrace` whose bpftrace dies in the window: the probe reported nothing,
  and the results printed are /proc's (a run left alone, the control, exits 0 with bpftrace's);
- 42: `repro` of a config whose server cannot start (vLLM rejects a flag and exits);
- 41: `repro` of a config that expects another verdict than the one its idle server gets (in test_wheel.py,
  whose repro from the wheel it is).

The others are in tests/test_exit_codes.py. Each run is bounded; what it started (the CLI, bpftrace,
a vLLM server) is killed if it outlives its bound, and checked gone when it ends by itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from cli_run import REPO, kill_tree, run_cli
from wedgectl.model import exitcodes
from wedgectl.collect import ebpfhost

pytestmark = pytest.mark.integration

REPRO_TIMEOUT_S = 480  # a vLLM start (40 s here, minutes on a loaded 2-core host), the window, the teardown


# ------------------------------------------------------------------ 6: the probe reported nothing


def _bpftrace_ready() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    st = ebpfhost.forced_backend_status("bpftrace")
    return None if st.available else st.reason


NO_BPFTRACE = _bpftrace_ready()


@pytest.mark.skipif(NO_BPFTRACE is not None, reason=f"eBPF: {NO_BPFTRACE}")
def test_6_probes_whose_bpftrace_reports_nothing() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL)
    try:
        # the control: left alone, bpftrace reports and the exit is 0
        ok = run_cli("probes", "--pid", str(sleeper.pid), "--seconds", "1", "--backend", "bpftrace", "-q",
                     timeout=120)
        assert ok.returncode == exitcodes.OK, ok
        assert ok.stdout.startswith("back-end bpftrace:") and "Traceback" not in ok.stderr, ok

        # bpftrace killed once attached: it leaves no maps, the run falls back to /proc, the exit is 6
        cli = subprocess.Popen([sys.executable, "-m", "wedgectl", "probes", "--pid", str(sleeper.pid),
                                "--seconds", "120", "--backend", "bpftrace"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert cli.stdout is not None and cli.stderr is not None
            said: list[str] = []  # stderr, line by line as it comes; stdout read whole at the end
            printed: list[str] = []
            stdout, stderr = cli.stdout, cli.stderr
            readers = [threading.Thread(target=lambda: said.extend(stderr), daemon=True),
                       threading.Thread(target=lambda: printed.append(stdout.read()), daemon=True)]
            for reader in readers:
                reader.start()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and cli.poll() is None and not any("tracing" in s for s in said):
                time.sleep(0.05)
            assert any("tracing 1 processes with bpftrace" in s for s in said), said
            tracers = [p for p in psutil.Process(cli.pid).children() if p.name() == "bpftrace"]
            assert len(tracers) == 1, tracers
            tracers[0].kill()
            cli.wait(timeout=60)  # the window was 120 s: it ends because bpftrace did
            for reader in readers:
                reader.join(timeout=10)
            out = "".join(printed)
        finally:
            if cli.poll() is None:
                kill_tree(cli)
        assert cli.returncode == exitcodes.PROBES_FAILED == 6, (out, said)
        assert "Traceback" not in "".join(said), said
        lines = [s.rstrip("\n") for s in said]
        assert lines[-1] == "wedgectl: bpftrace reported nothing; the results above are /proc's", lines
        assert lines[-2] == "could not: error: bpftrace reported no results: exit -9", lines
        assert out.startswith("back-end procfs: ") and "fell back: bpftrace reported no results" in out, out
        assert f"pids [{sleeper.pid}]" in out
        assert psutil.wait_procs(tracers, timeout=10)[1] == []
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


# ------------------------------------------------------------------ 42 and 41: repro on a real vLLM

BAD_FLAG = "--no-such-flag-for-wedgectl-7f3a"


def test_42_a_server_that_cannot_start(vllm_python: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "bad-flag.toml"
    cfg.write_text(f'name = "bad-flag"\nexpected = "idle"\ndescription = "vLLM rejects a flag"\n\n'
                   f'[server]\nflags = ["{BAD_FLAG}"]\n')
    r = run_cli("repro", str(cfg), "--python", str(vllm_python), "--out", str(tmp_path / "out"), "-q",
                cwd=tmp_path, timeout=REPRO_TIMEOUT_S)
    assert r.returncode == exitcodes.SERVER_FAILED == 42, r
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    log = tmp_path / "out" / "server.log"
    # the first line of the error, then the log's last line: the cause
    assert r.stderr.startswith(f"wedgectl: vLLM exited with code 2 before /health answered (log {log}): ... "), r
    assert r.stderr.rstrip("\n").endswith(f"error: unrecognized arguments: {BAD_FLAG}"), r
    assert r.stdout == ""
    left = [p for p in psutil.process_iter(["cmdline"]) if BAD_FLAG in (p.info["cmdline"] or [])]
    assert left == [], left


# 41 from a real repro (an idle server whose config expects an admission wedge) is produced by
# test_wheel.py's repro, run from the installed wheel: one server start for both.
