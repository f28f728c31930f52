"""The command line every probe tool shares: its arguments and --ebpf; wedgectl/cli/probetool.py runs them."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import NoReturn

from wedgectl.model import bounds
from wedgectl.probes import DEFAULT_MIN_WAIT_MS, EXIT_USAGE

MAX_WINDOW_S = bounds.PROBE_WINDOW_S


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line and EXIT_USAGE, as wedgectl's own commands give it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see -h)\n")


def _number(kind: Callable[[str], float], lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in the range (wedgectl.model.bounds, which wedgectl's options use too)."""
    def parse(text: str) -> float:
        value = kind(text)  # a ValueError: argparse says "invalid float value"
        if not bounds.in_range(value, lo, hi, above=above):
            raise argparse.ArgumentTypeError(f"must be {bounds.describe(lo, hi, above=above)}, not {value!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _pids(text: str) -> list[int]:
    """-p: comma-separated pids, each 1..pid_t's largest."""
    try:
        pids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad pid list: {text[:200]!r}") from None
    if not pids:
        raise argparse.ArgumentTypeError("no pid given")
    for pid in pids:
        if not bounds.in_range(pid, 1, bounds.MAX_PID):
            raise argparse.ArgumentTypeError(f"each pid must be {bounds.describe(1, bounds.MAX_PID)}, not {pid}")
    return pids


def parser(prog: str, summary: str, epilog: str) -> argparse.ArgumentParser:
    """-p/--pid, -d/--duration, --min-wait-ms, --backend, --max-entries, --no-children, --json, and the hidden
    --ebpf."""
    p = _Parser(prog=prog, description=summary, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--pid", required=True, type=_pids,
                   help="pid(s) to trace, comma-separated; each one's descendants are traced too")
    p.add_argument("-d", "--duration", type=_number(float, 0, MAX_WINDOW_S, above=True), default=5.0,
                   help="seconds to trace (default 5, at most 300)")
    p.add_argument("--min-wait-ms", type=_number(float, 0, MAX_WINDOW_S * 1000),
                   default=DEFAULT_MIN_WAIT_MS,
                   help=f"record only waits that outlast this, in ms (default {DEFAULT_MIN_WAIT_MS:g}); "
                        "shorter ones cost one map write and read and leave nothing")
    p.add_argument("--backend", choices=("auto", "bcc", "bpftrace", "rawtp", "procfs"), default="auto",
                   help="force a back-end (default: the best this host supports)")
    p.add_argument("--max-entries", type=_number(int, 1, bounds.PROBE_MAX_ENTRIES), default=4096,
                   help="entries per BPF map (default 4096)")
    p.add_argument("--no-children", action="store_true", help="trace the given pids only, not their descendants")
    p.add_argument("--json", action="store_true", help="print JSON lines: a header, then one object per thread")
    p.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None, probes: Sequence[str], *, prog: str, summary: str, epilog: str) -> int:
    """Parse the arguments, then print the program (--ebpf) or run the probes and print their results."""
    args = parser(prog, summary, epilog).parse_args(argv)  # every number range-checked as it is parsed
    # The one import above the model: running a probe takes the collectors and the renderer, which
    # import the probes; only the tool's entry point goes up to them (see pyproject.toml's contracts).
    from wedgectl.cli.probetool import run

    return run(args, probes)
