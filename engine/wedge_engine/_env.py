"""Reading the plugin's settings from the environment: one parser for every duration."""

from __future__ import annotations

import math
from collections.abc import Mapping


def positive_seconds(environ: Mapping[str, str], name: str, default: float, error: type[Exception]) -> float:
    """Seconds from environ[name] (default when unset or blank); `error` unless a finite number > 0."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise error(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise error(f"{name}={raw!r} must be a finite number of seconds > 0")
    return value


def int_at_least(environ: Mapping[str, str], name: str, default: int, minimum: int, error: type[Exception]) -> int:
    """An integer from environ[name] (default when unset or blank); `error` unless it is >= minimum."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise error(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise error(f"{name}={raw!r} must be >= {minimum}")
    return value
