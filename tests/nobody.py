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


def check_as_nobody(pid: int, root: dict, *said: str, flags: tuple[str, ...] = ()) -> dict:
    """Diagnose a kept repro as nobody (with the diagnose `flags` root's ran with) and hold it to the issue's bar:
    the verdict root had (with its exit code), at least as confident, with the engine report's stage and what
    else `said` names in the evidence, py-spy refused (the report stood in for the stacks)."""
    rc, out = diagnose_as_nobody(pid, *flags)
    engine = " | ".join(engine_lines(out))
    everything = " | ".join(e["what"] for e in out["evidence"])
    ranks = [{k: r.get(k) for k in ("label", "pid", "state", "cpu_cores", "where")} for r in out.get("ranks") or ()]
    assert (out["verdict"], rc) == (root["verdict"], VERDICT_CODES[VerdictKind(root["verdict"])]), (
        f"{out['summary']} || {everything} || ranks {ranks}")
    assert out["confidence"] >= root["confidence"], (out["confidence"], root["confidence"], out["rule"])
    assert "stage " in engine, everything
    for text in said:
        assert text in engine, (text, engine)
    refused = [e["what"] for e in out["evidence"] if e["source"] == "wedgectl"]
    assert any("no Python stacks" in w or "refused" in w for w in refused), refused
    return out
