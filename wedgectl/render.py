"""Renderers: a verdict as text lines that fit 80 columns, or as one JSON object."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from typing import Any

from wedgectl.bundle import to_jsonable
from wedgectl.types import Verdict

WIDTH = 80


def verdict_to_json(verdict: Verdict, **extra: Any) -> dict[str, Any]:
    """The --json object: verdict, confidence, summary, evidence, advice, and extras."""
    out = to_jsonable(verdict)
    out.update({k: to_jsonable(v) for k, v in extra.items()})
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_value(x) for x in v[:4]) + (", ..." if len(v) > 4 else "") + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt_value(x)}" for k, x in list(v.items())[:3]) + "}"
    return str(v)


def render_verdict(verdict: Verdict, width: int = WIDTH, expected: str | None = None) -> Iterator[str]:
    """Yield the text report, verdict first."""
    head = f"VERDICT  {verdict.verdict.value}  (confidence {verdict.confidence:.2f})"
    if expected is not None:
        mark = "matches" if expected == verdict.verdict.value else "MISMATCH"
        head += f"  expected {expected}: {mark}"
    yield head
    yield from textwrap.wrap(verdict.summary, width)
    if verdict.evidence:
        yield ""
        yield "Evidence"
        for e in verdict.evidence:
            tag = f"[{e.source}{' ' + e.t if e.t else ''}] "
            yield from textwrap.wrap(e.what, width, initial_indent="  " + tag, subsequent_indent="      ")
            skip = {"frames"}
            vals = ", ".join(f"{k}={_fmt_value(v)}" for k, v in e.values.items() if v is not None and k not in skip)
            if vals:
                yield from textwrap.wrap(vals, width, initial_indent="      ", subsequent_indent="      ")
            for fr in (e.values.get("frames") or [])[:5]:
                fr = str(fr)
                yield "        " + (fr if len(fr) <= width - 8 else fr[: width - 11] + "...")
    if verdict.advice:
        yield ""
        yield "Next"
        for a in verdict.advice:
            yield from textwrap.wrap(a, width, initial_indent="  - ", subsequent_indent="    ")
    yield ""
    yield f"rule: {verdict.rule}"
