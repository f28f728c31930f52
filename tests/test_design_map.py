"""docs/design.md against the tree: every module is on the map, and every name the map gives exists.

The map names a module by its path (`wedgectl/capture/policy.py`, `capture/policy.py`), by its file
name inside its layer's section (`policy.py` under "## `capture/`"), or dotted (`collect.heldlog`).
A dotted reference that starts with a wedgectl module (`policy.next_step`, `model.types.Bundle`,
`procfs.main_thread_sched`) must name something that module defines; a path must be a file or folder
of the repository. Prose is not read: only paths and what sits between backticks.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "build", "dist"}

# A temporary re-export shim for callers not yet moved; the map must not send anyone to it.
NOT_ON_THE_MAP = {"wedgectl/capture/sampler.py"}
# Where the wheel puts a top-level folder (pyproject.toml): the map may name either.
INSTALLED_AS = {"wedgectl/probes/": "probes/", "wedgectl/_engine/": "engine/wedge_engine/", "wedgectl/_docs/": "docs/"}
# Words the map writes in place of a name (`python -m wedgectl.probes.NAME`, /proc/PID/stat).
PLACEHOLDERS = {"NAME", "PID", "N"}


def _repo_paths() -> set[str]:
    """Every file and folder of the repository, relative, folders with a trailing slash."""
    found: set[str] = set()
    stack = [ROOT]
    while stack:
        here = stack.pop()
        for entry in here.iterdir():
            if entry.name in SKIP_DIRS or entry.name.startswith(".") or entry.name.endswith(".egg-info"):
                continue
            rel = entry.relative_to(ROOT).as_posix()
            if entry.is_dir():
                found.add(rel + "/")
                stack.append(entry)
            else:
                found.add(rel)
    return found


REPO = _repo_paths()
# probes/ is installed as wedgectl.probes, and the map names it either way.
MODULES = {p for p in REPO if p.endswith(".py") and p.split("/")[0] in ("wedgectl", "probes")} - NOT_ON_THE_MAP


def _dotted(path: str) -> str:
    """wedgectl/collect/procfs/__init__.py -> wedgectl.collect.procfs; probes/x.py -> wedgectl.probes.x."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] == "probes":
        parts.insert(0, "wedgectl")
    return ".".join(parts)


DOTTED = {_dotted(p): p for p in MODULES}
TEXT = DESIGN.read_text(encoding="utf-8")
SPANS = re.findall(r"`([^`\n]+)`", TEXT)
# A path: at least one slash, not the start of an absolute path (/proc/PID/stat, /metrics).
PATH = re.compile(r"(?<![\w/.\-])((?:[\w.*\-]+/)+[\w.*\-]*)")
DOTTED_NAME = re.compile(r"(?<![\w./\-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/])")
FILE_SUFFIX = re.compile(r"\.(py|md|toml|txt|log|gz|yaml|yml|json|sh|cfg)$")


def _resolve_path(token: str) -> list[str]:
    """The repository paths `token` names: the path itself, or one that ends with it."""
    token = token.rstrip(".,;:")
    for installed, source in INSTALLED_AS.items():
        if token.startswith(installed):
            token = source + token.removeprefix(installed)
    if token.endswith("/"):
        pool = [p for p in REPO if p.endswith("/")]
    else:
        pool = [p for p in REPO if not p.endswith("/")]
    return [p for p in pool if fnmatch.fnmatchcase(p, token) or fnmatch.fnmatchcase(p, "*/" + token)]


def _path_tokens() -> list[str]:
    """Paths the map gives whose first part is a folder of the repository (so not "and/or")."""
    roots = {seg for p in REPO if p.endswith("/") for seg in p.rstrip("/").split("/")}
    return [t for t in PATH.findall(TEXT) if t.split("/")[0] in roots]


def _sections() -> dict[str, str]:
    """Each layer's folder ("capture", "tui", ...) to the text of the "## `layer/`" section naming it."""
    by_layer: dict[str, str] = {}
    for chunk in re.split(r"^(?=## )", TEXT, flags=re.M):
        heading = chunk.split("\n", 1)[0]
        for layer in re.findall(r"`([\w]+)/`", heading):
            by_layer[layer] = chunk
    return by_layer


@cache
def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"))


@cache
def _bindings(path: str) -> frozenset[str]:
    """Names a module defines at its top level; a package's __init__ also what it imports."""
    tree = _tree(path)
    names: set[str] = set()
    nodes: list[ast.stmt] = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.If, ast.Try)):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                nodes.extend(handler.body)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and path.endswith("__init__.py"):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


@cache
def _class_members(path: str, name: str) -> frozenset[str] | None:
    """What class `name` of module `path` defines (methods, properties, fields); None if not a class."""
    tree = _tree(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            return frozenset(members)
    return None


def _modules_ending(parts: list[str]) -> list[str]:
    """Module files whose dotted name ends with these parts (`model` is the layer or tui/model.py)."""
    tail = ".".join(parts)
    return [path for dotted, path in DOTTED.items() if dotted == tail or dotted.endswith("." + tail)]


def _dotted_refs() -> list[str]:
    refs: list[str] = []
    for span in SPANS:
        for token in DOTTED_NAME.findall(span):
            if not FILE_SUFFIX.search(token):
                refs.append(token)
    return refs


def _check_dotted(ref: str) -> str | None:
    """None if `ref` holds, or was never a wedgectl name; else why it does not hold."""
    parts = ref.split(".")
    if PLACEHOLDERS & set(parts):
        return None
    if ref in {k.rstrip("/").replace("/", ".") for k in INSTALLED_AS}:
        return None  # wedgectl._engine: engine/wedge_engine/ as the wheel installs it
    if not _modules_ending(parts[:1]) and parts[0] != "wedgectl":
        # Facts.engine_queued: a class of ours, which must define it; vllm.general_plugins: not ours.
        owners = [m for m in sorted(MODULES) if _class_members(m, parts[0]) is not None]
        if not owners or any(parts[1] in (_class_members(m, parts[0]) or ()) for m in owners):
            return None
        return f"`{ref}`: class {parts[0]} ({', '.join(owners)}) defines no {parts[1]!r}"
    for cut in range(len(parts), 0, -1):
        modules = _modules_ending(parts[:cut])
        if not modules:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        for module in modules:
            if rest[0] not in _bindings(module):
                continue
            if len(rest) == 1:
                return None
            members = _class_members(module, rest[0])
            if members is None or rest[1] in members:
                return None  # an attribute of a value, or of a class that defines it
        where = ", ".join(sorted(modules))
        return f"`{ref}`: {where} defines no {rest[0]!r}" + (f" with {rest[1]!r}" if len(rest) > 1 else "")
    return f"`{ref}`: no module named {parts[0]!r} under wedgectl/ or probes/"


def test_the_map_names_every_module() -> None:
    sections = _sections()
    named_paths = {p for token in _path_tokens() for p in _resolve_path(token)}
    dotted_named = {d for span in SPANS for d in DOTTED_NAME.findall(span)}
    missing = []
    for module in sorted(MODULES):
        parts = module.split("/")
        folder = module.rsplit("/", 1)[0] + "/"
        if module in named_paths or _dotted(module) in dotted_named:
            continue
        if parts[-1] == "__init__.py" and folder in named_paths:
            continue
        layer = parts[1] if parts[0] == "wedgectl" else "probes"
        section = sections.get(layer, "")
        bare = parts[-1] if parts[-1] != "__init__.py" else parts[-2] + "/"
        if re.search(rf"(?<![\w/.]){re.escape(bare)}(?![\w])", section):
            continue
        missing.append(module)
    why = "modules docs/design.md does not name (by path, or by file name in its layer's section):"
    assert not missing, why + "\n" + "\n".join(missing)


def test_every_path_on_the_map_exists() -> None:
    stale = sorted({t for t in _path_tokens() if not _resolve_path(t)})
    assert not stale, "paths in docs/design.md that are not in the tree:\n" + "\n".join(stale)


def test_every_dotted_name_on_the_map_exists() -> None:
    stale = sorted({why for ref in _dotted_refs() if (why := _check_dotted(ref))})
    assert not stale, "names in docs/design.md that the tree does not define:\n" + "\n".join(stale)


@pytest.mark.parametrize("gone", sorted(NOT_ON_THE_MAP))
def test_the_map_does_not_send_anyone_to_a_shim(gone: str) -> None:
    stem = Path(gone).stem
    assert not re.search(rf"\b{stem}(\.py\b|\.[a-z_])", TEXT), f"docs/design.md names {gone}, a re-export shim"
