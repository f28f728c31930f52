"""`wedgectl watch`: every vLLM server on a host classified continuously, served to Prometheus and liveness probes.

`targets` finds and samples the deployments (cheap ticks: one /metrics scrape and each
process's CPU; full ticks: the sampler's /health, threads, sockets and stacks), `state` folds each target's verdicts
into episodes
and decides when to look closer (pure), `recorder` saves an evidence bundle at each
episode's onset and rotates them, `exposition` serves /metrics (a prometheus_client
Collector), /livez and /v1/targets, and `daemon` runs the loop.
"""

from wedgectl.watch.daemon import WatchOptions, Watcher, run_watch
from wedgectl.watch.exposition import DEFAULT_LISTEN, Snapshot, WatchCollector, make_registry
from wedgectl.watch.recorder import Rotation
from wedgectl.watch.state import HANG_CLASSES, Episode, Tracker, is_hang
from wedgectl.watch.targets import Spec, target_name

__all__ = [
    "DEFAULT_LISTEN", "HANG_CLASSES", "Episode", "Rotation", "Snapshot", "Spec", "Tracker", "WatchCollector",
    "WatchOptions", "Watcher", "is_hang", "make_registry", "run_watch", "target_name",
]
