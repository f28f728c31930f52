"""The rules of docs/design.md that the import contracts cannot state, read from each module's syntax tree.

pyproject.toml's [tool.importlinter] contracts check which layer imports which (`lint-imports`), and
that no layer but collect/ imports subprocess, psutil or signal. These check, with ast rather than a
grep of the text (which code can route around): that nothing re-exports those modules' names, that
nothing imports the project's own modules through importlib, and that only collect/control.py sends
a signal and only collect/ names /proc.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEDGECTL = ROOT / "wedgectl"
PROBES = ROOT / "probes"
# Run by the server's own python, never imported by wedgectl: the rules of its layers are not theirs.
IN_SERVER = ("lab/runtime/_serve.py", "lab/runtime/_make_model.py")
PROCESS_MODULES = ("subprocess", "psutil", "signal")
IMPORT_CALLS = ("import_module", "find_spec", "spec_from_file_location", "reload", "__import__", "run_module")
OWN_PACKAGES = ("wedgectl", "probes")
KILL_CALLS = ("kill", "killpg", "send_signal", "terminate", "pidfd_send_signal")


def _modules() -> Iterator[tuple[str, ast.Module]]:
    """(path as "collect/control.py" or "probes/_tool.py", its tree) of every module wedgectl imports."""
    for path in sorted(WEDGECTL.rglob("*.py")):
        rel = path.relative_to(WEDGECTL).as_posix()
        if rel not in IN_SERVER:
            yield rel, ast.parse(path.read_text(), filename=str(path))
    for path in sorted(PROBES.glob("*.py")):
        yield f"probes/{path.name}", ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.Module) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names): `import a.b` gives ("a.b", ()), `from a import b, c` gives ("a", ("b", "c"))."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            yield node.lineno, node.module, tuple(alias.name for alias in node.names)


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _in_collect(rel: str) -> bool:
    return rel.startswith("collect/")


def test_only_collect_imports_subprocess_psutil_or_signal() -> None:
    offenders = [f"{rel}:{line}: {module}" for rel, tree in _modules() if not _in_collect(rel)
                 for line, module, _ in _imports(tree) if _top(module) in PROCESS_MODULES]
    assert offenders == []


def test_collect_reexports_no_name_of_subprocess_psutil_or_signal() -> None:
    """collect/ imports them as modules only, and binds none of their names at module level, so no
    `from wedgectl.collect.x import TimeoutExpired` can hand them on: the layers above use collect's own."""
    offenders = []
    for rel, tree in _modules():
        if not _in_collect(rel):
            continue
        offenders += [f"{rel}:{line}: from {module} import {', '.join(names)}"
                      for line, module, names in _imports(tree) if names and _top(module) in PROCESS_MODULES]
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                root = node.value
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in PROCESS_MODULES:
                    offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_no_module_imports_the_projects_own_through_importlib() -> None:
    """A module of the project is imported by an import statement, which the contracts see. importlib
    (and __import__) may only look up a third-party module named by a literal: bcc, say."""
    offenders = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name not in IMPORT_CALLS:
                continue
            first = node.args[0] if node.args else None
            literal = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            if literal is None or _top(literal) in OWN_PACKAGES:
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_only_control_sends_signals() -> None:
    """Every signal goes through control.send_signal: nothing else calls a kill primitive."""
    calls = [(rel, node) for rel, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KILL_CALLS]
    assert [f"{rel}:{node.lineno}: {ast.unparse(node)}" for rel, node in calls if rel != "collect/control.py"] == []
    # control.send_signal itself: the pidfd, the pid without one, and the process group
    senders = sorted(ast.unparse(node.func) for rel, node in calls if rel == "collect/control.py")
    assert senders == ["os.kill", "os.killpg", "signal.pidfd_send_signal"]


def test_only_collect_names_proc() -> None:
    """/proc paths are read by collect/ alone (the others ask it)."""
    offenders = []
    for rel, tree in _modules():
        if _in_collect(rel):
            continue
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        offenders += [f"{rel}:{node.lineno}: {node.value[:40]!r}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)
                      and node.value.startswith("/proc") and id(node) not in docstrings]
    assert offenders == []
