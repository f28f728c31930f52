"""Turning what the operator holds (a log file, a bundle) into a Bundle, with clear errors."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from wedgectl import __version__
from wedgectl.errors import InputNotFound, NoVllmLines, UnreadableInput
from wedgectl.logparse import parse_log
from wedgectl.types import Bundle, Manifest, Target

MAX_LOG_BYTES = 64 << 20  # the tail is what matters for a hang; a bigger log is read from its end


def read_log_lines(path: str | Path, max_bytes: int = MAX_LOG_BYTES) -> tuple[tuple[str, ...], list[str]]:
    """The log's lines (its last max_bytes), and notes about what was done to read it."""
    p = Path(path)
    notes: list[str] = []
    if not p.exists():
        raise InputNotFound(f"{p}: no such file")
    if p.is_dir():
        raise UnreadableInput(f"{p}: is a directory, not a log file (use --bundle for a bundle directory)")
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            if size > max_bytes:
                fh.seek(size - max_bytes)
                fh.readline()  # drop the partial first line
                notes.append(f"log is {size} bytes; read its last {max_bytes}")
            data = fh.read()
    except PermissionError:
        raise UnreadableInput(f"{p}: permission denied") from None
    except OSError as exc:
        raise UnreadableInput(f"{p}: {exc.strerror or exc}") from None
    if not data.strip():
        raise UnreadableInput(f"{p}: the file is empty")
    head = data[:8192]
    if b"\x00" in head or _mostly_binary(head):
        raise UnreadableInput(f"{p}: looks binary, not a text log")
    text = data.decode("utf-8", errors="replace")
    return tuple(text.splitlines()), notes


def _mostly_binary(chunk: bytes) -> bool:
    text_bytes = bytes(range(32, 127)) + b"\n\r\t\b\f\x1b"
    odd = sum(1 for b in chunk if b not in text_bytes and b < 128)
    return len(chunk) > 0 and odd / len(chunk) > 0.1


def host_facts() -> dict[str, str]:
    return {"hostname": socket.gethostname(), "kernel": os.uname().release, "tz": time.strftime("%z")}


def bundle_from_log(path: str | Path) -> Bundle:
    """A log-only bundle; NoVllmLines when nothing in it is a vLLM line."""
    lines, notes = read_log_lines(path)
    parsed = parse_log(lines)
    if parsed.n_recognised == 0:
        raise NoVllmLines(f"{path}: no vLLM log lines found ({parsed.n_lines} lines read)")
    manifest = Manifest(
        created=time.time(),
        wedgectl_version=__version__,
        source="log",
        target=Target(log_path=str(path)),
        host=host_facts(),
        notes=tuple(notes),
    )
    return Bundle(manifest=manifest, log_lines=lines)
