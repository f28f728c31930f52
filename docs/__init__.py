"""The docs, carried inside wedgectl's wheel as `wedgectl._docs`.

This file only makes the folder importable as data for wedgectl: `watch` serves the runbooks here
(the hang-*.md pages and runbook-watch.md) at /runbooks/, where the alert rules' links point.
"""
