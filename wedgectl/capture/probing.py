"""The eBPF probes of a diagnose capture: one bounded run, started when the escalation asks, results on the last sample.

From the start with --ebpf on, from the escalation step (policy.next_step) with auto; stopped
whatever ends the capture (capture.window.capture).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from wedgectl.capture.discover import Deployment
from wedgectl.capture.options import SamplerOptions
from wedgectl.model.types import Bundle

if TYPE_CHECKING:
    from wedgectl.collect.ebpf import ProbeRun


class Probes:
    """At most one probe run per capture, started when the escalation asks for it."""

    def __init__(self, dep: Deployment, options: SamplerOptions) -> None:
        self.dep, self.options = dep, options
        self.run: ProbeRun | None = None
        self.started = False

    def start(self, max_s: float) -> None:
        if not self.started:
            self.started = True
            self.run = start_probes(self.dep, self.options, max_s)
            if self.run is not None and self.run.interrupted:
                raise KeyboardInterrupt  # Ctrl-C came mid-attach: the child is gone; the capture ends as Ctrl-C ends it

    def stop(self) -> tuple[tuple, tuple]:
        return self.run.stop() if self.run is not None else ((), ())


def start_probes(dep: Deployment, options: SamplerOptions, max_s: float | None = None) -> ProbeRun | None:
    """options.ebpf "auto"/"on": start the probes on the deployment's pids; None for "off" or no pid."""
    if options.ebpf == "off" or dep.root_pid is None:
        return None
    from wedgectl.collect import ebpf

    run = ebpf.start_probes(dep.pids, options.ebpf, max_s=(options.window_s if max_s is None else max_s) + 10.0)
    if run is not None and options.progress and not run.interrupted:
        options.progress(f"probes: {run.backend.name} ({run.backend.reason})")
    return run


def with_probes(bundle: Bundle, records: tuple, failures: tuple) -> Bundle:
    """The probes' records and failures on the bundle's last sample."""
    if not bundle.samples or not (records or failures):
        return bundle
    last = bundle.samples[-1]
    last = replace(last, probes=tuple(records), failures=last.failures + tuple(failures))
    return replace(bundle, samples=(*bundle.samples[:-1], last))
