"""Logs as the tools that ship them write them: one JSON object per line, unwrapped to the line inside. No I/O.

* Docker's json-file driver (`/var/lib/docker/containers/ID/ID-json.log`): `{"log": "...\\n", "stream": "stderr",
  "time": "2026-12-06T08:55:03.123456789Z"}`. A line over 16 KiB is split into parts; only the last ends in "\\n".
* `journalctl -o json`: `{"__REALTIME_TIMESTAMP": "1765011303123456", "MESSAGE": "...", ...}`; a MESSAGE that is not
  valid UTF-8 is a list of byte values.

Each line becomes "STAMP MESSAGE", the tool's ISO stamp (UTC, with its year and zone) first, as `kubectl logs
--timestamps` writes it: logstamp.split_header reads that form. The prefixed text forms (kubectl, `docker logs -t`,
`journalctl -o short-iso`) need no unwrapping: split_header reads their prefix. A file is unwrapped only when most
of its first lines are such objects; anything else is returned as it is.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence

MAX_JOINED_CHARS = 1 << 20  # a docker line's parts joined: no vLLM line is near this
_PROBE_LINES = 50  # the first non-empty lines that decide the format
_MIN_SHARE = 0.8  # of them, the share that must be one format's objects

DOCKER = "docker json-file"
JOURNAL = "journalctl -o json"


def _object(line: str) -> dict | None:
    s = line.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return None
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _kind(obj: dict | None) -> str | None:
    if obj is None:
        return None
    if isinstance(obj.get("log"), str):
        return DOCKER
    if "MESSAGE" in obj and "__REALTIME_TIMESTAMP" in obj:
        return JOURNAL
    return None


def detect(lines: Sequence[str]) -> str | None:
    """DOCKER or JOURNAL when most of the first non-empty lines are that tool's objects; else None."""
    probe = [line for line in lines[: _PROBE_LINES * 4] if line.strip()][:_PROBE_LINES]
    if not probe:
        return None
    kinds = [_kind(_object(line)) for line in probe]
    for kind in (DOCKER, JOURNAL):
        if kinds.count(kind) >= _MIN_SHARE * len(probe):
            return kind
    return None


def _journal_text(message: object) -> str | None:
    if isinstance(message, str):
        return message
    if isinstance(message, list) and all(isinstance(b, int) and 0 <= b < 256 for b in message):
        return bytes(message).decode("utf-8", errors="replace")
    return None


def _journal_stamp(usec: object) -> str:
    try:
        t = int(str(usec)) / 1e6
        when = _dt.datetime.fromtimestamp(t, _dt.timezone.utc)
    except (ValueError, OverflowError, OSError):
        return ""
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _docker_stamp(time: object) -> str:
    return time if isinstance(time, str) and len(time) <= 64 and time[:4].isdigit() else ""


def unwrap(lines: Sequence[str]) -> tuple[list[str], str | None]:
    """The lines inside a docker json-file or journald JSON log, each "STAMP TEXT"; and the format found (None:
    the lines as given). A line that is not the format's object is kept as it is."""
    kind = detect(lines)
    if kind is None:
        return list(lines), None
    out: list[str] = []
    pending = ""  # a docker line's parts, until the part that ends it
    pending_stamp = ""
    for line in lines:
        obj = _object(line)
        if _kind(obj) != kind:
            if pending:
                out.append(f"{pending_stamp} {pending}".strip())
                pending = ""
            out.append(line)
            continue
        assert obj is not None
        if kind == DOCKER:
            text, stamp = obj["log"], _docker_stamp(obj.get("time"))
            if not pending:
                pending_stamp = stamp
            pending = (pending + text)[:MAX_JOINED_CHARS]
            if text.endswith("\n"):
                for part in pending.rstrip("\n").split("\n"):
                    out.append(f"{pending_stamp} {part}".strip())
                pending = ""
        else:
            text = _journal_text(obj.get("MESSAGE"))
            if text is None:
                continue
            stamp = _journal_stamp(obj.get("__REALTIME_TIMESTAMP"))
            for part in text.split("\n"):
                out.append(f"{stamp} {part}".strip())
    if pending:
        out.append(f"{pending_stamp} {pending}".strip())
    return out, kind
