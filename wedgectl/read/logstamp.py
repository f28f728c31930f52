"""The prefix vLLM and uvicorn write before a log message (a stamp, the process tag, the level, the
source: split_header), and their stamps as monotonic seconds since 2000-01-01 (Clock, parse_stamp,
format_stamp). A year-less stamp that falls more than ROLLOVER_S behind the one before it is read in
the next year. No I/O."""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass

EPOCH = _dt.datetime(2000, 1, 1)
ROLLOVER_S = 180 * 86400.0  # a jump back this far is a new year, not clock skew


# --- the log header ---------------------------------------------------------

_STAMP_BODY = (
    r"(?:(?P<Y>\d{4})-)?(?P<mo>\d{2})-(?P<d>\d{2})[ T]"
    r"(?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})(?P<frac>[.,]\d{1,9})?"
)
_STAMP = re.compile(_STAMP_BODY)
# `kubectl logs --timestamps`, `docker logs -t` and `journalctl -o short-iso` put an ISO stamp first (with a
# year, and a zone, which vLLM's own stamp lacks); journald then names the host and "ident[pid]:".
_LEAD_ISO = re.compile(
    r"\[?(?P<Y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})[ T](?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})"
    r"(?P<frac>[.,]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})?\]?\s+"
    r"(?:\S{1,255}\s+[^\s\[\]:]{1,255}\[\d{1,10}\]:\s+)?"
)
# "(APIServer pid=851)", "(EngineCore_DP0 pid=9)", "(VllmWorker rank=0 pid=12)"
_PROC = re.compile(r"\((?P<proc>[A-Za-z][\w.\-]*)\s+(?:[^()]*?\s)?pid=(?P<pid>\d{1,10})[^()]*\)\s*")
_LEVEL = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?P<colon>:?)(?:\s+|$)"
)
_LEVEL_STAMP = re.compile(_STAMP_BODY + r"\s*")
_SRC = re.compile(r"\[(?P<src>[^\]\s]{1,200}:\d{1,7})\]\s*")


@dataclass
class Header:
    """What precedes a line's message: the pid of "(APIServer pid=N)", the stamp and its parts, and
    whether the prefix is vLLM's (a process tag, or a level with a stamp, a source or a colon)."""

    pid: int | None = None
    stamp: str | None = None
    stamp_parts: dict | None = None
    msg: str = ""
    vllm_like: bool = False
    # vLLM's own logger wrote it: "(APIServer pid=N)", or "LEVEL [MM-DD HH:MM:SS] [file.py:N]" (seed 003's
    # build logs no stamp)
    vllm_own: bool = False


def split_header(line: str) -> Header:
    """A line's prefix taken apart: a leading ISO stamp (kubectl, docker, journald), the process tag, the level,
    the level's own stamp and the [file:line] source, in that order; the rest is the message. A line is timed by
    its own stamp (the clock that wrote the rest of the log), in the year its leading stamp names."""
    h = Header()
    s = line.lstrip()
    lead = False
    m = _LEAD_ISO.match(s)
    if m:
        h.stamp, h.stamp_parts, lead = m.group(0).strip(" []"), m.groupdict(), True
        s = s[m.end():]
    proc = _PROC.match(s)
    if proc:
        h.pid = int(proc.group("pid"))
        s = s[proc.end():]
    level = _LEVEL.match(s)
    own_stamp = src = False
    if level:
        s = s[level.end():]
        if not level.group("colon"):
            m = _LEVEL_STAMP.match(s)
            if m:
                own_stamp = True
                parts = m.groupdict()
                if lead and not parts.get("Y") and h.stamp_parts:
                    parts["Y"] = h.stamp_parts["Y"]  # the leading stamp has the year vLLM's own lacks
                h.stamp, h.stamp_parts = m.group(0).strip(), parts
                s = s[m.end():]
        m = _SRC.match(s)
        if m:
            src = True
            s = s[m.end():]
    h.msg = s
    h.vllm_own = proc is not None or (level is not None and src)
    h.vllm_like = proc is not None or (
        level is not None and (own_stamp or src or lead or bool(level.group("colon")))
    )
    return h


# --- time -------------------------------------------------------------------


def _seconds(year: int, mo: int, d: int, hh: int, mm: int, ss: int) -> float | None:
    try:
        when = _dt.datetime(year, mo, d, hh, mm, ss)
    except ValueError:
        if not (mo == 2 and d == 29 and 1 <= year <= 9999 and 0 <= hh < 24 and 0 <= mm < 60 and 0 <= ss < 62):
            return None  # year 0 or 10000 (a rollover past 9999) has no 03-01 either
        # A year-less 02-29 read in a non-leap year: take it as the day after 02-28.
        when = _dt.datetime(year, 3, 1, hh, mm, min(ss, 59))
    return (when - EPOCH).total_seconds()


class Clock:
    """Turns stamps into monotonic seconds, adding a year at each rollover."""

    def __init__(self) -> None:
        self.year = 2000
        self.last: float | None = None

    def read(self, parts: dict) -> float | None:
        mo, d = int(parts["mo"]), int(parts["d"])
        hh, mm, ss = int(parts["H"]), int(parts["M"]), int(parts["S"])
        frac = float("0." + parts["frac"][1:]) if parts.get("frac") else 0.0
        if parts.get("Y"):
            year = int(parts["Y"])
            t = _seconds(year, mo, d, hh, mm, ss)
            if t is None:
                return None
            self.year = year
        else:
            t = _seconds(self.year, mo, d, hh, mm, ss)
            if t is None:
                return None
            if self.last is not None and t < self.last - ROLLOVER_S:
                self.year += 1
                t = _seconds(self.year, mo, d, hh, mm, ss)
                if t is None:
                    return None
        t += frac
        self.last = t
        return t


def parse_stamp(text: str) -> float | None:
    """Seconds since 2000-01-01 for one "MM-DD HH:MM:SS" (year 2000) or ISO stamp."""
    m = _STAMP.fullmatch(text.strip())
    return Clock().read(m.groupdict()) if m else None


def format_stamp(t: float) -> str:
    """The inverse of the stamp reading: seconds since 2000-01-01 -> "MM-DD HH:MM:SS"."""
    if not math.isfinite(t):
        raise ValueError(f"not a time: {t!r}")
    return (EPOCH + _dt.timedelta(seconds=math.floor(t))).strftime("%m-%d %H:%M:%S")
