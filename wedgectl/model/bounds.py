"""The ranges a number given to wedgectl must lie in: every numeric option, and every time in a bundle.

nan compares false with everything and inf passes any lower bound, so a check written `x <= 0`
lets both through: a window of nan or inf never ends, an interval of nan busy-loops, a grace of
nan keeps /livez from ever failing, and a bundle time of 1e18 breaks the date formatting of a
report (issue 33). One function decides, for the command line (wedgectl/cli/checks.py, probes/_tool.py)
and the bundle reader (wedgectl/store/bundle.py) alike; it never raises.
"""

from __future__ import annotations

import math

# pid_t. Linux's own ceiling (PID_MAX_LIMIT) is 4194304; a pid between the host's pid_max and this
# is a well-formed pid that names no process ("no such process"), one past it is a usage error.
MAX_PID = (1 << 31) - 1
DAY_S = 86400.0  # the longest window, interval, timeout or grace an option takes
YEAR_S = 365 * DAY_S  # watch --max-seconds
# diagnose --startup-quiet: seconds without start-up progress after which a start is hung (the classifier's
# default is classify.startup.STARTUP_QUIET_S); a bundle recording a bound outside these is judged by the default
STARTUP_QUIET_MIN_S, STARTUP_QUIET_MAX_S = 5.0, 3600.0
MAX_COUNT = 1_000_000  # counts: bundles kept, refreshes between stacks
MAX_MIB = float(1 << 20)  # sizes in MiB: 1 TiB
PROBE_WINDOW_S = 300.0  # a probe run's longest window (wedgectl.collect.ebpf.MAX_WINDOW_S)
PROBE_MAX_ENTRIES = 1 << 20  # entries per BPF map (the collector clamps to this)

# A process's cumulative bytes read (/proc/PID/io's rchar and read_bytes): the kernel's u64 counters, of which a
# sample keeps what a signed 64-bit integer holds (exabytes: a larger one is not a real count). A bundle holding
# one outside 0 to this is refused.
MAX_IO_BYTES = (1 << 63) - 1
# Times in a bundle. 0 is a time not recorded (the model's default); the ceiling is the year 5138.
MAX_UNIX_TIME = 1e11
# Durations in a bundle (a process's cumulative CPU seconds included): 3,000 years of one CPU.
MAX_DURATION_S = 1e11

# The engine report (the wedge_engine plugin's own word on each vLLM process; docs/bundle.md, "engine"): the
# bounds its writer keeps, which the reader (read/enginereport.py) enforces too and cuts to. A report is a
# target's file: hostile input, so what exceeds a bound is dropped, never trusted.
ENGINE_REPORT_SCHEMA = 1  # the schema this reader knows; a newer one is read for the keys it shares
ENGINE_REPORT_MAX_BYTES = 262144  # REPORT_MAX_BYTES: a bigger file is refused unread
ENGINE_REPORT_INTERVAL_S = 1.0  # REPORT_INTERVAL_S: the writer's period when a report names none
ENGINE_REPORT_MAX_INTERVAL_S = 3600.0  # an interval_s beyond this (or <= 0) is dropped
ENGINE_REPORT_MAX_REQUESTS = 20  # request samples kept: running first, then waiting, oldest first
ENGINE_REPORT_MAX_THREADS = 64  # threads of a stack snapshot
ENGINE_REPORT_MAX_FRAMES = 48  # frames per thread, innermost first (the innermost kept)
ENGINE_REPORT_MAX_STRING = 200  # every string is cut to this
ENGINE_REPORT_MAX_REQUEST_ID = 128  # a request id is cut to this
ENGINE_REPORT_MAX_REASONS = 16  # waiting_by_reason keys kept
ENGINE_REPORT_MAX_NAME = 64  # a Worker's collective: its op and group names are cut to this
ENGINE_REPORT_MAX_HISTORY = 8  # history entries kept, the newest (the writer keeps its last 5 writes)
# Nesting the reader accepts (the schema's deepest is 5: report, stacks, threads, a thread, frames, a frame);
# anything deeper is malformed before json parses it, so a file of brackets costs one linear scan.
ENGINE_REPORT_MAX_DEPTH = 8
ENGINE_REPORT_MAX_INT = (1 << 63) - 1  # counters, ticks and CLOCK_MONOTONIC ns; larger is dropped


def in_range(value: float, lo: float, hi: float, *, above: bool = False) -> bool:
    """value is a finite number with lo <= value <= hi (lo < value with above)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (value > lo if above else value >= lo) and value <= hi


def describe(lo: float, hi: float, *, above: bool = False) -> str:
    """The range in words, as in_range checks it: '> 0 and <= 86400'."""
    return f"{'>' if above else '>='} {_number(lo)} and <= {_number(hi)}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"
