"""The wheel's explicit package list matches the source tree, so an install leaves no subpackage out."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
MAPPED = {"wedgectl.probes": "probes", "wedgectl._engine": "engine", "wedgectl._docs": "docs"}


def test_the_package_list_is_the_tree_plus_the_mapped_folders() -> None:
    tree = {"wedgectl", *(f"wedgectl.{name}" for name in find_packages(ROOT / "wedgectl"))}
    assert sorted(SETUPTOOLS["packages"]) == sorted(tree | set(MAPPED))


def test_probes_the_engine_source_and_the_docs_are_mapped_from_their_top_level_folders() -> None:
    assert SETUPTOOLS["package-dir"] == MAPPED
    for folder in MAPPED.values():
        assert (ROOT / folder / "__init__.py").is_file()
    # The plugin's own distribution must travel whole: its build file and every module.
    engine_data = SETUPTOOLS["package-data"]["wedgectl._engine"]
    assert {"pyproject.toml", "README.md", "wedge_engine/**/*.py"} <= set(engine_data)
    # The runbooks `watch` serves (the alert rules link to them) travel in the wheel.
    assert SETUPTOOLS["package-data"]["wedgectl._docs"] == ["*.md"]
