"""Reading an engine report's bytes into the model: bounded, tolerant, never raising. No I/O.

A report is a file a target writes, so its bytes are hostile input: more than
ENGINE_REPORT_MAX_BYTES is refused unparsed, nesting past ENGINE_REPORT_MAX_DEPTH is
malformed, NaN and Infinity read as null, an integer of more than 19 digits as null
(Python parses a long digit string in quadratic time), and every value of the wrong
type or beyond its bound is dropped by `EngineReport.from_dict`. json's C scanner and
the walk below are each linear in the input.
"""

from __future__ import annotations

import json
import math
from typing import Any

from wedgectl.model import bounds as B
from wedgectl.model.engine import MALFORMED, TOO_BIG, EngineReport

_MAX_INT_DIGITS = 19  # 2**63 - 1 has 19 digits: ENGINE_REPORT_MAX_INT


def _float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None  # 1e400 reads as inf: dropped


def _int(text: str) -> int | None:
    return int(text) if len(text.lstrip("-")) <= _MAX_INT_DIGITS else None


def _depth_within(obj: Any, limit: int) -> bool:
    """obj nests no deeper than limit (arrays and objects counted), walked without recursion."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def parse_report(data: bytes) -> EngineReport | str:
    """The report in data, or the reason it is not one (a string starting TOO_BIG or MALFORMED)."""
    if len(data) > B.ENGINE_REPORT_MAX_BYTES:
        return f"{TOO_BIG}: more than {B.ENGINE_REPORT_MAX_BYTES} bytes"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return f"{MALFORMED}: not UTF-8 text"
    try:
        obj = json.loads(text, parse_float=_float, parse_int=_int, parse_constant=lambda _: None)
    except RecursionError:
        return f"{MALFORMED}: nested deeper than {B.ENGINE_REPORT_MAX_DEPTH}"
    except ValueError as exc:  # JSONDecodeError: an empty, truncated or non-JSON file
        return f"{MALFORMED}: not JSON ({str(exc)[:80]})"
    if not isinstance(obj, dict):
        return f"{MALFORMED}: not a JSON object"
    if not _depth_within(obj, B.ENGINE_REPORT_MAX_DEPTH):
        return f"{MALFORMED}: nested deeper than {B.ENGINE_REPORT_MAX_DEPTH}"
    report = EngineReport.from_dict(obj)
    if report is None:
        return f"{MALFORMED}: schema, pid, proc_start_ticks or written_mono_ns missing or not an integer"
    return report
