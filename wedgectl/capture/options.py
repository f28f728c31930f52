"""What a capture is asked for: its window, cadence, stacks and probes (SamplerOptions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ESCALATE_BURST = 3  # dumps of the EngineCore and each Worker once the cheap evidence leaves a hang open


@dataclass(frozen=True)
class SamplerOptions:
    window_s: float = 6.0  # the longest a capture runs when no verdict becomes certain
    interval_s: float = 1.0
    min_window_s: float = 0.0  # stop no sooner (the classifier's thresholds decide when evidence is enough)
    stacks: bool = True
    native: bool = False
    ebpf: str = "off"
    # A saturated API server answers /metrics in seconds: a scrape has this long, and the
    # sampling clock does not wait for it (the next sample starts on time; see capture.window).
    scrape_timeout_s: float = 4.0
    stack_burst: int = ESCALATE_BURST  # dumps of each engine process once a hang is open
    progress: Callable[[str], None] | None = None
    # Ctrl-C ends the capture with what it has (diagnose: a partial verdict); else it goes on up (repro, watch)
    partial_on_interrupt: bool = False
    # The start-up quiet bound the verdicts are judged with (diagnose --startup-quiet; the manifest records
    # it); None: the classifier's default
    startup_quiet_s: float | None = None


# The note a capture that Ctrl-C ended leaves in its bundle (SamplerOptions.partial_on_interrupt).
INTERRUPTED_NOTE = "interrupted (Ctrl-C): the verdict is partial, drawn from what was sampled"
