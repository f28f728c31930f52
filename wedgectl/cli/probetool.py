"""Running one probe tool (`python -m wedgectl.probes.NAME`): the collectors run it, the renderer prints it.

The probe modules hold their programs, their parsers and their command line, and import only the
model; what runs them (collect/ebpf.py) and what prints their records (render/, store/) sit above
them, so a probe's `main` hands its parsed arguments here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from wedgectl.probes import EXIT_FAILED, EXIT_GONE, EXIT_NO_BACKEND, EXIT_OK, EXIT_PERMISSION

PLACEHOLDER_LIB = "/path/to/libpython3.X.so"  # --ebpf without a python target still shows the uprobe


def run(args: argparse.Namespace, probes: Sequence[str]) -> int:
    """Print the program (--ebpf) or run the probes and print their results; the tool's exit status."""
    pids: list[int] = args.pid
    from wedgectl.collect import ebpf, ebpfhost  # here, not at import: the collector loads the probes' text

    if args.ebpf:  # no root needed: text only, nothing attached
        print(program_text(probes, pids, args), end="")
        return EXIT_OK
    if not args.no_children:
        pids = ebpf.expand_tree(pids)
    if not ebpf.pids_exist(pids):
        print(f"no such process: {pids}", file=sys.stderr)
        return EXIT_GONE
    if args.backend in ebpfhost.EBPF_BACKENDS:
        status = ebpfhost.forced_backend_status(args.backend, probes)
        if not status.available:
            print(f"{args.backend} cannot run here: {status.reason}", file=sys.stderr)
            return EXIT_PERMISSION if "root" in status.reason else EXIT_NO_BACKEND
    records, failures = ebpf.run_probes(pids, args.duration, probes=probes, backend=args.backend,
                                        max_entries=args.max_entries, min_wait_s=args.min_wait_ms / 1000)
    print_records(records, as_json=args.json)
    for f in failures:
        print(f"{f.kind.value}: {f.message}", file=sys.stderr)
    header = records[0] if records else None
    if header is None or (args.backend in ebpfhost.EBPF_BACKENDS and header.backend != args.backend):
        return EXIT_FAILED
    return EXIT_OK


def program_text(probes: Sequence[str], pids: Sequence[int], args: argparse.Namespace) -> str:
    """What --ebpf prints: the C text for --backend bcc, else the bpftrace program."""
    from wedgectl.collect import ebpf

    min_wait_s = args.min_wait_ms / 1000
    if args.backend == "rawtp":
        return ("# rawtp has no program text: wedgectl/collect/ebpfraw.py assembles its sched_switch program "
                "and loads it through bpf(2)\n")
    if args.backend == "bcc":
        return ebpf.bcc_program(probes, pids, args.max_entries, min_wait_s=min_wait_s) + "\n"
    libs: list[str] = []
    if "pylockwait" in probes:
        libs = ebpf.python_libraries(pids) or [PLACEHOLDER_LIB]
    return ebpf.bpftrace_program(probes, pids, args.duration, libs, min_wait_s=min_wait_s)


def print_records(records: Sequence[object], as_json: bool) -> None:
    from wedgectl.render.text import render_threads
    from wedgectl.store.bundle import to_jsonable

    if as_json:
        for r in records:
            print(json.dumps(to_jsonable(r)))
        return
    for line in render_threads(records):  # type: ignore[arg-type]
        print(line)
