"""What every probe's parser reads: the maps its program printed, and the /proc reads at the window's edges."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

Maps = dict[str, Any]  # map name (no "@") -> {int or tuple-of-int key: value}, or a scalar


def _key(k: str) -> int | tuple[int, ...]:
    parts = k.split(",")
    return int(parts[0], 0) if len(parts) == 1 else tuple(int(p, 0) for p in parts)


def parse_bpftrace_output(lines: Iterable[str]) -> tuple[Maps, list[str], list[str]]:
    """(maps, printf lines, other lines) from `bpftrace -f json` (the bcc runner prints the same shape).

    Map keys become ints, or tuples of ints for multi-key maps ("0x7f..,4101" too).
    """
    maps: Maps = {}
    printed: list[str] = []
    other: list[str] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            other.append(line)
            continue
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "map":
            for name, value in obj.get("data", {}).items():
                name = name.lstrip("@")
                if isinstance(value, dict):
                    try:
                        maps[name] = {_key(k): v for k, v in value.items()}
                    except ValueError:
                        other.append(line)
                else:
                    maps[name] = value
        elif kind == "printf":
            printed.append(str(obj.get("data", "")).rstrip("\n"))
        elif kind != "attached_probes":
            other.append(line)
    return maps, printed, other


class ThreadSched(Protocol):
    """What a parser reads of one thread at one edge of the window (collect's procfs.ThreadSched has it)."""

    @property
    def pid(self) -> int: ...
    @property
    def cpu(self) -> int | None: ...  # the CPU it last ran on
    @property
    def exec_start_s(self) -> float | None: ...  # last ran at, on that CPU's scheduler clock
    @property
    def oncpu_ns(self) -> int | None: ...
    @property
    def runq_ns(self) -> int | None: ...
    @property
    def futex_addr(self) -> int | None: ...
    @property
    def in_futex_wait(self) -> bool: ...


@dataclass(frozen=True)
class Window:
    """The probe's window on CLOCK_MONOTONIC, and the /proc reads at its edges."""

    begin: float
    end: float
    start_states: dict[int, ThreadSched]
    end_states: dict[int, ThreadSched]
    end_read_at: float  # monotonic time of the end read
    offsets: dict[int, float]  # per CPU: monotonic - scheduler clock
    wall_offset: float  # time.time() - time.monotonic()
    min_wait_s: float = 0.01  # the threshold the program ran with: shorter waits were not recorded

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.begin)

    def exec_start_mono(self, st: ThreadSched) -> float | None:
        """When the thread last ran, on CLOCK_MONOTONIC: its exec_start plus its CPU's clock offset."""
        if st.exec_start_s is None or st.exec_start_s <= 0:
            return None
        off = self.offsets.get(st.cpu) if st.cpu is not None else None
        if off is None and self.offsets:
            off = sorted(self.offsets.values())[len(self.offsets) // 2]
        return st.exec_start_s + (off or 0.0)


def table(maps: Maps, name: str) -> dict[Any, Any]:
    """One map as a dict; {} when the program printed none (an empty map prints nothing)."""
    value = maps.get(name)
    return value if isinstance(value, dict) else {}


def pair(value: Any) -> tuple[int, int]:
    """A (start, address) map value as ints; (0, 0) when absent or of another shape (bpftrace prints a tuple as a
    list)."""
    if isinstance(value, (list, tuple)) and len(value) >= 2:
        try:
            return int(value[0]), int(value[1])
        except (TypeError, ValueError):
            pass
    return 0, 0


def rounded(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)
