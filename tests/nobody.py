"""Running wedgectl as nobody: uid and gid 65534, no groups, no capabilities (setpriv), as a sidecar of another
user in a hardened pod runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wedgectl.model.exitcodes import VERDICT_CODES
from wedgectl.model.types import VerdictKind

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", *argv]


def nobody_wedgectl() -> tuple[str, dict[str, str]]:
    """An interpreter nobody may run that imports this checkout's wedgectl, and the environment it needs:
    this venv's (whose base may sit in root's 0700 home), else the system python with the checkout on
    PYTHONPATH. PATH names this venv's bin first, so that nobody's wedgectl finds py-spy (and is refused
    by the kernel, as in a pod without CAP_SYS_PTRACE), not "not installed"."""
    site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"), None)
    path = f"{Path(sys.prefix) / 'bin'}:/usr/bin:/bin"
    tries = [(sys.executable, {}), ("/usr/bin/python3", {"PYTHONPATH": f"{REPO}:{site}" if site else str(REPO)})]
    for python, extra in tries:
        env = {"PATH": path, "LANG": "C.UTF-8", **extra}
        try:
            ok = subprocess.run(as_nobody(python, "-c", "import wedgectl.cli"), env=env, cwd="/",
                                capture_output=True, timeout=60).returncode == 0
        except OSError:
            ok = False
        if ok:
            return python, env
    pytest.fail("no Python interpreter nobody may run imports this checkout's wedgectl")


def diagnose_as_nobody(pid: int, *extra: str) -> tuple[int, dict]:
    """`wedgectl diagnose --pid PID --json` as nobody: its exit code and JSON (never a traceback)."""
    python, env = nobody_wedgectl()
    r = subprocess.run(as_nobody(python, "-m", "wedgectl", "diagnose", "--pid", str(pid), "--json", "--window", "4",
                                 *extra), env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def engine_lines(out: dict) -> list[str]:
    """The verdict's evidence from the engine's own report."""
    return [e["what"] for e in out["evidence"] if e["source"] == "engine"]


def tree_now(pid: int) -> list[dict]:
    """For a failure's message, read as root right after: each process of the tree, its threads' states and
    wait channels (counted), and how long ago its engine report file was replaced."""
    import collections
    import os
    import time

    import psutil

    seen = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error as exc:
        return [{"error": repr(exc)}]
    for proc in procs:
        threads: collections.Counter[str] = collections.Counter()
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
                wchan = (task / "wchan").read_text()
            except OSError:
                continue
            threads[f"{stat[stat.rfind(')') + 2]} {wchan or '-'}"] += 1
        report = Path(f"/tmp/wedge-engine-reports-{os.geteuid()}/wedge-engine-{proc.pid}.report.json")
        try:
            age = round(time.time() - report.stat().st_mtime, 1)
        except OSError as exc:
            age = exc.strerror
        try:
            seen.append({"pid": proc.pid, "name": proc.name(), "cpu_s": round(sum(proc.cpu_times()[:2]), 1),
                         "threads": dict(threads), "report_age_s": age})
        except psutil.Error as exc:
            seen.append({"pid": proc.pid, "error": repr(exc)})
    return seen


def check_as_nobody(pid: int, root: dict, *said: str, flags: tuple[str, ...] = ()) -> dict:
    """Diagnose a kept repro as nobody (with the diagnose `flags` root's ran with) and hold it to the issue's bar:
    the verdict root had (with its exit code), at least as confident, with the engine report's stage and what
    else `said` names in the evidence, py-spy refused (the report stood in for the stacks)."""
    rc, out = diagnose_as_nobody(pid, *flags)
    engine = " | ".join(engine_lines(out))
    everything = " | ".join(e["what"] for e in out["evidence"])
    ranks = [{k: r.get(k) for k in ("label", "pid", "state", "cpu_cores", "where")} for r in out.get("ranks") or ()]
    why = f"{out['summary']} || {everything} || ranks {ranks} || as root now: {tree_now(pid)}"
    assert (out["verdict"], rc) == (root["verdict"], VERDICT_CODES[VerdictKind(root["verdict"])]), why
    assert out["confidence"] >= root["confidence"], (out["confidence"], root["confidence"], out["rule"], why)
    assert "stage " in engine, everything
    for text in said:
        assert text in engine, (text, engine)
    refused = [e["what"] for e in out["evidence"] if e["source"] == "wedgectl"]
    assert any("no Python stacks" in w or "refused" in w for w in refused), refused
    return out
