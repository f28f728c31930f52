"""What each fix and fault wraps in vLLM, checked against the vLLM it runs in, not against a version string.

Every fix and fault module names what it relies on as ``REQUIRES`` (all must
hold, or it stays off) and ``OPTIONAL`` (parts left out where absent): each a
``Needs`` (module, dotted name in it, and the leading parameter names its
wrapper passes through). Before a module is activated, ``check`` imports the
vLLM module and looks the name up (classes' methods through their bases, as
Python does) and compares the signature; the plugin then logs one line per
process naming what is on and what is off, and why.

The same declarations are checked without importing anything by
``static_problem``, which reads a release's source (a wheel unpacked under
``root``): that is how ``docs/vllm-versions.md`` is generated for releases that
do not run here (see ``docs/gen_vllm_versions.py``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE_MAX = 2 << 20  # bytes of one module read by the static check


@dataclass(frozen=True)
class Needs:
    """One vLLM name a fix or fault relies on."""

    module: str  # "vllm.v1.core.sched.scheduler"
    name: str  # "Scheduler.schedule", a function, a class, or a constant
    params: tuple[str, ...] | None = None  # leading parameter names the wrapper passes on; None: not checked
    why: str = ""  # what it is used for, for the support table

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class AnyOf:
    """Names of which one is enough: where vLLM moved or renamed what a fix uses, the code takes whichever
    the release has (first first)."""

    options: tuple[Needs, ...]
    why: str = ""

    def __str__(self) -> str:
        return " or ".join(map(str, self.options))


Need = Needs | AnyOf


def _either(problems_of: list[str | None]) -> str | None:
    return None if any(p is None for p in problems_of) else " and ".join(p for p in problems_of if p)


# ------------------------------------------------------------------ in the running process


def check(needs: Need) -> str | None:
    """None when `needs` holds in this process's vLLM; else one line saying what is wrong."""
    if isinstance(needs, AnyOf):
        return _either([check(option) for option in needs.options])
    try:
        obj: Any = importlib.import_module(needs.module)
    except Exception as exc:  # ImportError, or a module that fails to import here
        return f"{needs.module} does not import ({type(exc).__name__})"
    for part in needs.name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return f"{needs} is missing"
    if needs.params is None:
        return None
    try:
        parameters = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None  # a builtin without a signature: present is all that can be said
    got = tuple(parameters)
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values())
    named = [n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    if varargs and len(named) < len(needs.params):
        return None  # (self, *args): anything passes through, as static_problem says too
    return _params_problem(needs, got)


def _params_problem(needs: Needs, got: Sequence[str]) -> str | None:
    want = needs.params or ()
    if tuple(got[: len(want)]) != want:
        return f"{needs} takes ({', '.join(got)}), not ({', '.join(want)}, ...)"
    return None


def holds(needs: Needs) -> bool:
    """Whether `needs` holds here: for the code that takes whichever option of an AnyOf the release has."""
    return check(needs) is None


def problems(needs: Iterable[Need]) -> list[str]:
    """What does not hold of `needs` here, one line each."""
    return [p for p in (check(n) for n in needs) if p is not None]


# ------------------------------------------------------------------ in a release's source, nothing imported


def static_problem(needs: Need, root: Path) -> str | None:
    """None when `needs` holds in the vLLM source under `root` (the folder that holds vllm/); else why not."""
    return _Source(root).problem(needs)


class _Source:
    """A release's source tree, parsed on demand (each module once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}
        self._packages: set[str] = set()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            self._trees[module] = None
            base = self.root.joinpath(*module.split("."))
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                try:
                    with open(path, "rb") as handle:
                        self._trees[module] = ast.parse(handle.read(SOURCE_MAX))
                    if path.name == "__init__.py":
                        self._packages.add(module)
                    break
                except (OSError, SyntaxError, ValueError):
                    continue
        return self._trees[module]

    def problem(self, needs: Need) -> str | None:
        if isinstance(needs, AnyOf):
            return _either([self.problem(option) for option in needs.options])
        if self.tree(needs.module) is None:
            return f"{needs.module} does not exist"
        found = self.lookup(needs.module, needs.name.split("."), depth=0)
        if found is None:
            return f"{needs} is missing"
        if needs.params is not None and isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = found.args
            got = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            if args.vararg is not None and len(got) < len(needs.params):
                return None  # (self, *args): anything passes through
            return _params_problem(needs, got)
        return None

    def lookup(self, module: str, parts: list[str], depth: int) -> ast.AST | None:
        """The definition of parts[0] in `module` (following `from x import y`), then of the rest in it."""
        if depth > 8:
            return None
        tree = self.tree(module)
        if tree is None:
            return None
        node = _defined(tree.body, parts[0])
        if node is None:
            source = _imported(tree.body, parts[0], module if module in self._packages else module + ".")
            if source is None:
                return None
            return self.lookup(source[0], [source[1], *parts[1:]], depth + 1)
        for part in parts[1:]:
            if not isinstance(node, ast.ClassDef):
                return node  # an attribute of a function or constant: present is all that can be said
            member = _defined(node.body, part)
            if member is None:
                member = self._inherited(module, node, part, depth)
                if member is None:
                    return None
            node = member
        return node

    def _inherited(self, module: str, cls: ast.ClassDef, name: str, depth: int) -> ast.AST | None:
        for base in cls.bases:
            dotted = _dotted(base)
            if dotted is None:
                continue
            found = self.lookup(module, [*dotted.split("."), name], depth + 1)
            if found is not None:
                return found
        return None


def _defined(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The last top-level definition of `name` in `body` (a def, a class, or an assignment)."""
    found: ast.AST | None = None
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            found = stmt
        elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            found = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            found = stmt
        elif isinstance(stmt, ast.If):  # `if TYPE_CHECKING: ... else: ...`, version switches
            inner = _defined(stmt.body, name) or _defined(stmt.orelse, name)
            found = inner or found
        elif isinstance(stmt, ast.Try):
            found = _defined(stmt.body, name) or found
    return found


def _imported(body: list[ast.stmt], name: str, module: str) -> tuple[str, str] | None:
    """(module, name) that `from module import name [as name]` in `body` binds `name` to. `module` is the
    importing module's package with a trailing "." for a plain module ("a.b." for a/b.py, "a.b" for
    a/b/__init__.py), so that relative imports resolve as Python resolves them."""
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return _absolute(stmt, module), alias.name
        elif isinstance(stmt, (ast.If, ast.Try)):
            inner = _imported(stmt.body, name, module)
            if inner is not None:
                return inner
    return None


def _absolute(stmt: ast.ImportFrom, module: str) -> str:
    if not stmt.level:
        return stmt.module or ""
    package = module.rstrip(".").split(".") if not module.endswith(".") else module[:-1].split(".")[:-1]
    package = package[: len(package) - (stmt.level - 1)]
    return ".".join([*package, *([stmt.module] if stmt.module else [])])


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    if isinstance(node, ast.Subscript):  # Generic[T]
        return _dotted(node.value)
    return None
