"""`wedgectl watch`: classify servers continuously for Prometheus, liveness and readiness probes.

Registered on the app by cli/__init__.py. No `from __future__ import annotations`: typer reads the
parameters at each start (see cli/__init__.py).
"""

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from wedgectl.cli import checks
from wedgectl.cli.output import _progress
from wedgectl.model import bounds, exitcodes
from wedgectl.model.types import ProbeMode
from wedgectl.read.redact import printable


def watch(
    pid: Annotated[Optional[list[int]],
                   typer.Option("--pid", callback=checks.pid,
                                help="A pid of a vLLM deployment to watch (repeatable).")] = None,
    url: Annotated[Optional[list[str]],
                   typer.Option("--url", callback=checks.url,
                                help="A server's base URL to watch, metrics only (repeatable).")] = None,
    listen: Annotated[str,
                      typer.Option("--listen",
                                   help="HOST:PORT serving /metrics and /livez; /v1/targets too on a loopback address "
                                        "or behind --web-config-file.")] = "127.0.0.1:9464",
    web_config_file: Annotated[Optional[Path],
                               typer.Option("--web-config-file",
                                            help="TLS and basic auth for every path, in the Prometheus "
                                                 "exporter-toolkit's format "
                                                 "(node_exporter's --web.config.file).")] = None,
    bundle_dir: Annotated[Optional[Path],
                          typer.Option("--bundle-dir",
                                       help="Save an evidence bundle here at each episode's onset.")] = None,
    bundle_keep: Annotated[int,
                           typer.Option("--bundle-keep", callback=checks.count,
                                        help="Onset bundles kept in --bundle-dir (oldest deleted first).")] = 50,
    bundle_max_mb: Annotated[float,
                             typer.Option("--bundle-max-mb", callback=checks.within(0, bounds.MAX_MIB, above=True),
                                          help="MiB all onset bundles may take together.")] = 512.0,
    grace: Annotated[float,
                     typer.Option("--grace", callback=checks.within(0, bounds.DAY_S),
                                  help="Seconds in a hang class before /livez answers 503.")] = 120.0,
    interval: Annotated[float,
                        typer.Option("--interval", callback=checks.seconds,
                                     help="Seconds between looks at each server.")] = 5.0,
    ebpf: Annotated[ProbeMode,
                    typer.Option("--ebpf", help="Probes in the capture taken at an episode's onset.")] = ProbeMode.AUTO,
    as_json: Annotated[bool, typer.Option("--json", help="Episodes as JSON lines.")] = False,
    max_seconds: Annotated[Optional[float],
                           typer.Option("--max-seconds", callback=checks.within(0, bounds.YEAR_S, above=True),
                                        help="Stop after this long (tests, benchmarks).")] = None,
    users: Annotated[Optional[str], typer.Option("--users", help="Host mode: adopt only servers run by these users "
                                                 "(names or uids, comma-separated; default: root and the user watch "
                                                 "runs as).")] = None,
    max_targets: Annotated[int,
                           typer.Option("--max-targets", callback=checks.count,
                                        help="Host mode: adopt at most this many servers.")] = 64,
    target_budget_mb: Annotated[float,
                                typer.Option("--target-budget-mb", callback=checks.within(0.0625, bounds.MAX_MIB),
                                             help="MiB each server's kept samples may take.")] = 8.0,
    total_budget_mb: Annotated[float,
                               typer.Option("--total-budget-mb", callback=checks.within(0.0625, bounds.MAX_MIB),
                                            help="MiB all servers' kept samples may take.")] = 256.0,
    remediate: Annotated[Optional[str],
                         typer.Option("--remediate", metavar="CLASSES",
                                      help="Act on hangs of these classes (comma-separated verdicts, e.g. "
                                           "admission_wedge,orphaned_engine) once they have lasted --grace, as "
                                           "`wedgectl remedy --yes --restart` does; the restart classes are "
                                           "restarted. Off by default.")] = None,
    remediate_budget: Annotated[int,
                                typer.Option("--remediate-budget", callback=checks.count,
                                             help="At most this many acts per server per hour. The same hang back "
                                                  "within the hour after an act ended it stops all acts on that "
                                                  "server (a storm).")] = 1,
) -> None:
    """Classify every vLLM server continuously; serve the verdicts to Prometheus and liveness probes.

    With no --pid or --url: every vLLM deployment on this host (or in this pod), rediscovered as servers come and go;
    only those run by --users (default: root and the user watch runs as), at most --max-targets of them; each
    one skipped is said once on stderr. Each server's kept samples take at most --target-budget-mb (8), all
    together --total-budget-mb (256): older pages are trimmed past it (wedgectl_budget_exceeded_total).

    One line per episode on stdout (--json: JSON lines). SIGTERM or Ctrl-C stops it.
    """
    import threading

    from wedgectl.collect.control import Signal, handle_signals
    from wedgectl.watch import Rotation, Spec, WatchOptions, run_watch

    import math

    from wedgectl.watch.targets import parse_users

    budgets = (target_budget_mb, total_budget_mb)
    if max_targets < 1 or not all(math.isfinite(b) and 0.0625 <= b <= 1 << 20 for b in budgets):
        raise typer.BadParameter("--max-targets must be >= 1, --target-budget-mb and --total-budget-mb 0.0625..1048576")
    from wedgectl.watch.remediation import Policy, parse_classes

    try:
        uids = parse_users(users) if users is not None else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        policy = Policy(parse_classes(remediate), remediate_budget) if remediate is not None else None
    except ValueError as exc:
        raise checks.Refused(f"--remediate {printable(remediate or '')[:80]}: {exc}") from None
    from wedgectl.watch.exposition import WebConfigError, load_web_config

    try:
        web = load_web_config(web_config_file) if web_config_file is not None else None
    except WebConfigError as exc:
        typer.echo(f"wedgectl: --web-config-file: {exc}", err=True)
        raise typer.Exit(exitcodes.USAGE) from None
    specs = tuple(Spec(pid=p) for p in pid or ()) + tuple(Spec(url=u) for u in url or ())
    options = WatchOptions(specs=specs, listen=listen, web_config=web, bundle_dir=bundle_dir, grace_s=grace,
                           interval_s=interval,
                           rotation=Rotation(bundle_keep, int(bundle_max_mb * (1 << 20))), ebpf=ebpf.value,
                           as_json=as_json, users=uids, max_targets=max_targets,
                           target_budget_bytes=int(target_budget_mb * (1 << 20)),
                           total_budget_bytes=int(total_budget_mb * (1 << 20)), remediate=policy)
    try:
        os.nice(10)  # a watcher yields the CPU to the servers it watches
    except OSError:
        pass
    stop = threading.Event()
    handle_signals((Signal.TERM, Signal.INT), lambda _sig: stop.set())
    try:
        rc = run_watch(options, stop, emit=lambda line: print(line, flush=True), say=_progress, max_s=max_seconds)
    except (OSError, ValueError) as exc:
        typer.echo(f"wedgectl: --listen {listen}: {exc}", err=True)
        raise typer.Exit(exitcodes.USAGE) from None
    raise typer.Exit(rc)
