"""Running wedgectl as nobody: uid and gid 65534, no groups, no capabilities (setpriv), as a sidecar of another
user in a hardened pod runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
