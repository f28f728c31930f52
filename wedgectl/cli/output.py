"""What every command prints through: its result lines (redacted, the last guard), its exit, its progress."""

import sys
from collections.abc import Iterable
from typing import NoReturn

import typer

from wedgectl.read.redact import printable, redact_text


def _echo(lines: Iterable[str]) -> None:
    for line in lines:
        typer.echo(redact_text(line))  # the renderers redact before wrapping; this is the last guard


def _finish(lines: Iterable[str], as_json: bool, code: int) -> NoReturn:
    """Print a command's result and exit with `code`; with --json, the object says that code and the schema
    version too (render.text.with_status)."""
    from wedgectl.render.text import with_status

    _echo([with_status("\n".join(lines), code)] if as_json else lines)
    raise typer.Exit(code)


def _progress(msg: str) -> None:
    print(printable(redact_text(f"wedgectl: {msg}")), file=sys.stderr, flush=True)
