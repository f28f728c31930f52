"""What drawing a frame costs `wedgectl top`, apart from collecting it: live frames recorded, then replayed.

    python bench/top_draw.py --pid PID [--frames 40] [--replays 3] [--pause-ms 20]

top_breakdown.py measures the drawing beside the collection, against a serving server
whose load moves from second to second; a change to the widgets saves a millisecond a
frame that the server's swings hide. This records FRAMES real frames of the server at
--pid (the collector's own ticks, one a second), then, with the server left alone,
replays them through the whole Textual app headless at 120x40, REPLAYS times: each frame
posted as the collector posts it, then the app left PAUSE_MS to draw it. It prints the
process's CPU per frame, beside the same loop with no frame posted (the replay's own
cost: Textual's test pilot and its timers), side by side in one run, and their difference,
the drawing. Run it on two trees (PYTHONPATH) to compare them; on a quiet host (the server
and its processes stopped with SIGSTOP once the frames are recorded: --stop-server) the figures hold to a
few percent.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import statistics
import sys
import time

import psutil


def record(pid: int, n: int) -> tuple[list, object]:
    """n frames of the server, a second apart, and the collector's window as a bundle."""
    from wedgectl.tui.source import Collector, LiveSource

    collector = Collector(LiveSource.connect(pid=pid))
    frames = []
    due = time.monotonic()
    while len(frames) < n:
        frame = collector.tick()
        if frame is not None:
            frames.append(frame)
            print(f"\rrecorded {len(frames)}/{n} frames", end="", file=sys.stderr, flush=True)
        due = max(due + 1.0, time.monotonic())
        time.sleep(max(0.0, due - time.monotonic()))
    print(file=sys.stderr)
    return frames, collector.bundle()


async def replay(frames: list, bundle: object, replays: int, pause_s: float) -> tuple[list[float], float]:
    """(ms of CPU per frame for each replay, ms per pause with no frame)."""
    from wedgectl.tui.app import FrameReady, make_app
    from wedgectl.tui.headless import APP_SIZE
    from wedgectl.tui.source import BundleSource

    app = make_app(BundleSource(bundle))
    async with app.run_test(size=APP_SIZE) as pilot:
        await pilot.pause(0.5)
        for frame in frames[:3]:  # the first frames lay the screen out and freeze start-up's objects
            app.post_message(FrameReady(frame))
            await pilot.pause(0.05)
        gc.collect()
        drawn = []
        for _ in range(replays):
            t0 = time.process_time()
            for frame in frames[3:]:
                app.post_message(FrameReady(frame))
                await pilot.pause(pause_s)
            drawn.append(1000 * (time.process_time() - t0) / (len(frames) - 3))
        t0 = time.process_time()
        for _ in frames[3:]:
            await pilot.pause(pause_s)
        idle = 1000 * (time.process_time() - t0) / (len(frames) - 3)
    return drawn, idle


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int, required=True, help="a running vLLM API server to record frames of")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--pause-ms", type=float, default=20.0)
    ap.add_argument("--stop-server", action="store_true",
                    help="SIGSTOP the server's session while replaying (SIGCONT after): a quiet host")
    args = ap.parse_args()
    if args.frames < 8:
        ap.error("--frames: at least 8 (the first 3 lay the screen out)")
    frames, bundle = record(args.pid, args.frames)
    tree = []
    if args.stop_server:
        root = psutil.Process(args.pid)
        tree = [root, *root.children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGSTOP)
    try:
        drawn, idle = asyncio.run(replay(frames, bundle, args.replays, args.pause_ms / 1000))
    finally:
        for p in tree:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
    med = statistics.median(drawn)
    print(f"{len(frames) - 3} live frames of pid {args.pid} replayed {args.replays} times at 120x40, "
          f"{args.pause_ms:g} ms for each to draw")
    print(f"{'':28} {'ms of CPU a frame':>18}")
    print(f"{'frames posted':28} {med:18.2f}   (replays: {' '.join(f'{d:.2f}' for d in drawn)})")
    print(f"{'no frame (the loop alone)':28} {idle:18.2f}")
    print(f"{'drawing a frame':28} {med - idle:18.2f}   (ratio frames/loop {med / idle:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
