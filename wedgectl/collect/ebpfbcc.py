"""The bcc runner: a child process that loads the composed BPF C text, and prints its maps as `bpftrace -f json` does.

A child, so that clang and every attachment go with it when it exits (run as
`python -m wedgectl.collect.ebpfbcc SPEC.json`, with bcc on its PYTHONPATH).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

READY_MARK = "wedgectl-probe-ready"


def bcc_child(spec_path: str) -> int:
    """Load the composed C text with bcc, report 'ready', wait for SIGINT or max_s, print the maps as bpftrace does."""
    import ctypes as ct

    from bcc import BPF  # type: ignore[import-not-found]

    spec = json.loads(Path(spec_path).read_text())
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    b = BPF(text=spec["text"])
    for lib in spec.get("libs", ()):
        for sym, enter, ret in spec.get("uprobes", ()):
            b.attach_uprobe(name=lib, sym=sym, fn_name=enter)
            b.attach_uretprobe(name=lib, sym=sym, fn_name=ret)
    begin = time.monotonic_ns()  # CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns
    b["t_begin"][ct.c_int(0)] = ct.c_uint64(begin)
    emit = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    emit({"type": "printf", "data": READY_MARK + "\n"})
    stop.wait(float(spec.get("max_s", 60)))
    end = time.monotonic_ns()
    b["t_begin"][ct.c_int(0)] = ct.c_uint64(0)  # probes go quiet while the maps are read

    def key_text(k: Any) -> str:
        if hasattr(k, "_fields_"):
            return ",".join(str(getattr(k, f)) for f, _ in k._fields_)
        return str(k.value)

    def value(v: Any) -> Any:  # a struct value prints as a list, as bpftrace prints a tuple
        if hasattr(v, "_fields_"):
            return [int(getattr(v, f)) for f, _ in v._fields_]
        return int(v.value)

    for name in spec["maps"]:
        data = {key_text(k): value(v) for k, v in b[name].items()}
        if data:
            emit({"type": "map", "data": {"@" + name: data}})
    emit({"type": "map", "data": {"@t_begin": begin}})
    emit({"type": "map", "data": {"@t_end": end}})
    b.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(bcc_child(sys.argv[1]))
