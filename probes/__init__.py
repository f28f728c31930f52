"""eBPF probes, one tool per module in the bcc tools' manner (installed as `wedgectl.probes`).

Each module owns its program text (bpftrace, and C for bcc), its map names and
the parser of its maps, and runs on its own: `python -m wedgectl.probes.futexwait -p PID`.
wedgectl/collect/ebpf.py composes them into one program and runs it.
"""

from __future__ import annotations

from types import ModuleType

DEFAULT_PROBES = ("futexwait", "offcpu")
ALL_PROBES = ("futexwait", "offcpu", "pylockwait")  # pylockwait is opt-in: its uprobe costs every Python process

# Waits (futex, off-CPU blocks, Python lock acquires) shorter than this leave nothing in the
# maps: what a hang diagnosis needs is waits of seconds, and the short ones are most of the
# events on a busy server. `--min-wait-ms` changes it.
DEFAULT_MIN_WAIT_MS = 10.0

# the tools' exit status, shared by `wedgectl probes`
EXIT_OK, EXIT_USAGE, EXIT_NO_BACKEND, EXIT_PERMISSION, EXIT_GONE, EXIT_FAILED = 0, 2, 3, 4, 5, 6


def load_probe(name: str) -> ModuleType:
    """The probe module NAME (one of ALL_PROBES)."""
    # Imported when asked for, each by name: a probe's module is loaded only by a run that uses it.
    if name == "futexwait":
        from wedgectl.probes import futexwait as probe
    elif name == "offcpu":
        from wedgectl.probes import offcpu as probe
    elif name == "pylockwait":
        from wedgectl.probes import pylockwait as probe
    else:
        raise ValueError(f"no probe {name!r}; there are {', '.join(ALL_PROBES)}")
    return probe


__all__ = ["ALL_PROBES", "DEFAULT_MIN_WAIT_MS", "DEFAULT_PROBES", "EXIT_FAILED", "EXIT_GONE", "EXIT_NO_BACKEND",
           "EXIT_OK",
           "EXIT_PERMISSION", "EXIT_USAGE", "load_probe"]
