"""`wedgectl top` without a terminal: the same collection (and, with --app, the same app) for benchmarks.

    python -m wedgectl.tui.headless --pid PID --duration 20            # the collector loop alone
    python -m wedgectl.tui.headless --pid PID --duration 20 --app      # the whole app, headless

It prints one JSON object: ticks, the last verdict, and the CPU seconds this
process and its children (py-spy) used, so a benchmark can charge them to top.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable

from wedgectl.tui.model import Frame
from wedgectl.tui.source import STACKS_EVERY, Collector, LiveSource

DEFAULT_REFRESH_S = 2.0
# The screen the app is laid out for (top.tcss). At Textual's headless default, 80x24, the stack
# and evidence views are off screen: a frame drew less than on a terminal, and each of their
# updates made Textual map the whole screen again.
APP_SIZE = (120, 40)


def run_headless(source: LiveSource, duration_s: float, refresh_s: float = DEFAULT_REFRESH_S,
                 stacks_every: int = STACKS_EVERY, on_frame: Callable[[Frame], None] | None = None) -> list[Frame]:
    """Tick the collector every refresh_s for duration_s, as the app's timer does; the frames it built."""
    collector = Collector(source, stacks_every=stacks_every)
    frames = []
    start = time.monotonic()
    due = start
    while time.monotonic() - start < duration_s:
        frame = collector.tick()
        if frame is not None:
            frames.append(frame)
            if on_frame is not None:
                on_frame(frame)
        # Like the app's timer: a tick that is late (a slow target) is skipped, not made up.
        due = max(due + refresh_s, time.monotonic())
        time.sleep(max(0.0, due - time.monotonic()))
    return frames


def run_app_headless(source: LiveSource, duration_s: float, refresh_s: float = DEFAULT_REFRESH_S,
                     stacks_every: int = STACKS_EVERY) -> tuple[int, str | None]:
    """Run the Textual app with no terminal for duration_s; (frames shown, last verdict)."""
    from wedgectl.tui.app import make_app

    app = make_app(source, refresh_s=refresh_s, stacks_every=stacks_every, quit_after_s=duration_s)
    app.run(headless=True, size=APP_SIZE)
    frame = app.frame
    return (app.collector.ticks if app.collector else 0), (frame.verdict.verdict.value if frame else None)


def cpu_seconds() -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"self_s": own.ru_utime + own.ru_stime, "children_s": kids.ru_utime + kids.ru_stime}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wedgectl.tui.headless", description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int)
    ap.add_argument("--url")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--refresh", type=float, default=DEFAULT_REFRESH_S)
    ap.add_argument("--stacks-every", type=int, default=STACKS_EVERY)
    ap.add_argument("--app", action="store_true", help="run the whole Textual app headless, not just the collector")
    ap.add_argument("--same-priority", action="store_true",
                    help="stay at the caller's priority (`wedgectl top` runs at nice +5 and idle I/O priority unless "
                         "asked)")
    args = ap.parse_args(argv)
    if not args.same_priority:  # as `wedgectl top` does by default: what a benchmark charges top is what users run
        from wedgectl.collect.priority import lower_priority

        lower_priority()
    if args.app:
        import wedgectl.tui.app  # noqa: F401 - imported before the CPU clock starts: a one-off cost
    before = cpu_seconds()
    t0 = time.monotonic()
    source = LiveSource.connect(pid=args.pid, url=args.url)
    if args.app:
        ticks, verdict = run_app_headless(source, args.duration, args.refresh, args.stacks_every)
    else:
        frames = run_headless(source, args.duration, args.refresh, args.stacks_every)
        ticks, verdict = len(frames), (frames[-1].verdict.verdict.value if frames else None)
    after = cpu_seconds()
    out = {
        "mode": "app" if args.app else "collector",
        "wall_s": round(time.monotonic() - t0, 2),
        "ticks": ticks,
        "verdict": verdict,
        "cpu_self_s": round(after["self_s"] - before["self_s"], 3),
        "cpu_children_s": round(after["children_s"] - before["children_s"], 3),
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
