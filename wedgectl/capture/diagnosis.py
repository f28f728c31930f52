"""One diagnosis: from the source `diagnose` names (a pid, a URL, a log, a bundle) to the evidence and its verdict.

The command parses options and prints; this module decides which source is read, captures a live one at the
priority asked for, saves the evidence where asked, and classifies it. Each source imports only what it reads:
a log or a saved bundle never loads the sampler, its collectors or their threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from wedgectl.classify import classify
from wedgectl.model.types import Bundle, Verdict
from wedgectl.store.bundle import read_bundle, write_bundle

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LiveOptions:
    """How a live server is sampled: diagnose's --window, --interval, stacks, --ebpf and priority options."""

    window_s: float = 6.0
    interval_s: float = 1.0
    stacks: bool = True
    native: bool = False
    ebpf: str = "auto"
    low_priority: bool = True  # nice +5 and idle I/O, below the server
    urgent: bool = False  # above the server, in a session of its own where autogroup applies
    startup_quiet_s: float | None = None  # --startup-quiet: the start-up bound; None: the classifier's default


@dataclass(frozen=True)
class Diagnosis:
    """A verdict and the evidence it rests on.

    `bundle.verdict` is the verdict the evidence was saved with: for a re-classified bundle (`reclassified`),
    the one it recorded, which the report shows beside the new one; for a fresh diagnosis, `verdict` itself.
    """

    verdict: Verdict
    bundle: Bundle
    saved: Path | None = None  # where --save-bundle wrote the evidence
    reclassified: bool = False

    @property
    def partial(self) -> bool:
        """Ctrl-C ended the capture: the verdict rests on what was sampled by then."""
        from wedgectl.capture.options import INTERRUPTED_NOTE

        return not self.reclassified and any(n.startswith(INTERRUPTED_NOTE) for n in self.bundle.manifest.notes)


def source_problem(pid: int | None, url: str | None, log: Path | None, bundle: Path | None) -> str | None:
    """Why these sources make no diagnosis (a usage error), or None: one source, or a live one plus its log."""
    if pid is None and url is None and log is None and bundle is None:
        return "give one of --pid, --url, --log or --bundle"
    if bundle is not None and (pid is not None or url is not None or log is not None):
        return "--bundle re-classifies saved evidence; it takes no other source"
    from wedgectl.store.sources import is_stdin

    if log is not None and is_stdin(log) and (pid is not None or url is not None):
        return "--log - reads a log piped in, alone; with --pid or --url give the log's path (it is read again)"
    return None


def diagnose(*, pid: int | None = None, url: str | None = None, log: Path | None = None, bundle: Path | None = None,
             save_to: Path | None = None, options: LiveOptions = LiveOptions(),
             progress: Progress | None = None) -> Diagnosis:
    """Read or capture the evidence the sources name, save it to `save_to` (not for --bundle), and classify it.

    Raises the capture's WedgectlError when a live target gave nothing to classify (saving what it gave first).
    """
    if bundle is not None:
        return reclassify(bundle, options.startup_quiet_s)
    if pid is None and url is None:
        from wedgectl.store.sources import bundle_from_log

        assert log is not None  # a source was given (source_problem), and it is not --bundle
        evidence = with_startup_quiet(bundle_from_log(log), options.startup_quiet_s)
    else:
        evidence = capture_live(pid, url, log, options, progress, save_to)
    return classify_and_save(evidence, save_to)


def reclassify(path: Path, startup_quiet_s: float | None = None) -> Diagnosis:
    """A saved bundle, classified again by today's rules (with `startup_quiet_s`, that start-up bound rather
    than the one it recorded); it keeps the verdict it recorded."""
    saved = with_startup_quiet(read_bundle(path), startup_quiet_s)
    return Diagnosis(classify(saved), saved, reclassified=True)


def with_startup_quiet(evidence: Bundle, startup_quiet_s: float | None) -> Bundle:
    """The evidence to be judged with this start-up bound (None: as it is)."""
    if startup_quiet_s is None:
        return evidence
    return replace(evidence, manifest=replace(evidence.manifest, startup_quiet_s=startup_quiet_s))


def capture_live(pid: int | None, url: str | None, log: Path | None, options: LiveOptions,
                 progress: Progress | None, save_to: Path | None = None) -> Bundle:
    """Sample a live deployment for up to the window, at the priority `options` asks for.

    Raises the sampler's fatal problem (the target exited, was never vLLM, never answered) after saving the
    evidence to `save_to`, so that the bundle shows why.
    """
    from wedgectl.capture.options import SamplerOptions
    from wedgectl.capture.window import capture, fatal_problem
    from wedgectl.collect import priority

    urgent_note = None
    if options.urgent:
        urgent_note = priority.raise_priority()  # before any thread starts: it may go on in a child
        if progress:
            progress(urgent_note)
    elif options.low_priority:
        priority.lower_priority()  # best effort: a refused nice or ioprio changes nothing but the priority
    opts = SamplerOptions(window_s=options.window_s, interval_s=options.interval_s, stacks=options.stacks,
                          native=options.native, ebpf=options.ebpf, progress=progress, partial_on_interrupt=True,
                          startup_quiet_s=options.startup_quiet_s)
    evidence = capture(pid=pid, url=url, log_path=log, options=opts)
    if urgent_note:
        evidence = replace(evidence, manifest=replace(evidence.manifest, notes=(*evidence.manifest.notes, urgent_note)))
    # The target is sampled: what is left (classify, print, exit) is wedgectl's alone and takes
    # milliseconds of CPU, which a niced process next to a busy server can wait seconds for.
    priority.restore_priority()
    problem = fatal_problem(evidence)
    if problem is not None:
        if save_to is not None:
            write_bundle(evidence, save_to)
        raise problem
    return evidence


def classify_and_save(evidence: Bundle, save_to: Path | None = None) -> Diagnosis:
    """Classify fresh evidence and, where asked, save it with its verdict."""
    # Lean copies (wedgectl/classify/judged.py): the same verdict, from the parses the capture already made.
    from wedgectl.classify.judged import judged_bundle

    verdict = classify(judged_bundle(evidence))
    evidence = replace(evidence, verdict=verdict)
    saved = write_bundle(evidence, save_to) if save_to is not None else None
    return Diagnosis(verdict, evidence, saved=saved)


__all__ = ["Diagnosis", "LiveOptions", "capture_live", "classify_and_save", "diagnose", "reclassify",
           "source_problem"]
