"""Lean copies of live samples for the classifier: the metrics text without comments and histogram buckets.

A live capture and `top` classify after every sample, re-reading every scrape of
the window; prometheus_client's parse of vLLM's exposition is most of that cost,
and histogram buckets are most of the text. MetricsSnapshot reads series by
sample name and no rule reads a bucket, so a lean copy gives the same verdict at
about a quarter of the parse. Saved bundles keep the text as scraped. No I/O.
"""

from __future__ import annotations

from dataclasses import replace

from wedgectl.model.types import Bundle, Sample


def lean_metrics_text(text: str) -> str:
    """The exposition text without comments and `_bucket` series."""
    keep = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if line[:end].endswith("_bucket"):
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def judged_sample(sample: Sample) -> Sample:
    """The sample with a lean copy of its metrics text (unchanged when the scrape failed)."""
    if sample.metrics is None or not sample.metrics.ok:
        return sample
    return replace(sample, metrics=replace(sample.metrics, text=lean_metrics_text(sample.metrics.text or "")))


def judged_bundle(bundle: Bundle) -> Bundle:
    """The bundle as the classifier needs it: every sample lean."""
    return replace(bundle, samples=tuple(judged_sample(s) for s in bundle.samples))


__all__ = ["judged_bundle", "judged_sample", "lean_metrics_text"]
