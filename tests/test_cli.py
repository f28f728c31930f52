"""The CLI end to end in a subprocess: outputs, JSON shape, and an exit code for every bad input."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wedgectl.model import exitcodes

LOGS = Path(__file__).parent / "fixtures" / "logs"


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", *args], capture_output=True, text=True, timeout=timeout)


def test_log_json_has_the_contract_keys():
    r = run("diagnose", "--log", str(LOGS / "seed000_starved.log"), "--json")
    assert r.returncode == exitcodes.VERDICT_CODES[__import__("wedgectl.model.types").model.types.VerdictKind.STARVED] == 10
    out = json.loads(r.stdout)
    assert out["verdict"] == "starved"
    assert {"verdict", "confidence", "summary", "evidence", "advice"} <= set(out)
    assert isinstance(out["evidence"], list) and all("what" in e and "source" in e for e in out["evidence"])


def test_text_leads_with_the_verdict_and_fits_80_columns():
    r = run("diagnose", "--log", str(LOGS / "seed002_deadlock.log"))
    assert r.returncode == 12
    lines = r.stdout.splitlines()
    assert lines[0].startswith("VERDICT  engine_deadlock")
    assert max(len(line) for line in lines) <= 80


def test_bundle_round_trip_through_the_cli(tmp_path):
    # A log diagnosis saved as a bundle re-classifies to the same verdict.
    r = run("diagnose", "--log", str(LOGS / "seed002_deadlock.log"), "--save-bundle", str(tmp_path / "b.tar.gz"), "--json")
    assert r.returncode == 12, r.stderr
    r2 = run("diagnose", "--bundle", str(tmp_path / "b.tar.gz"), "--json")
    assert r2.returncode == 12
    assert json.loads(r2.stdout)["verdict"] == "engine_deadlock"
    assert json.loads(r2.stdout)["recorded_verdict"] == "engine_deadlock"


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--log", "/nonexistent/vllm.log"], exitcodes.NO_SUCH_FILE, "no such file"),
        (["--log", str(LOGS / "empty.log")], exitcodes.UNREADABLE_INPUT, "empty"),
        (["--log", str(LOGS / "binary.bin")], exitcodes.UNREADABLE_INPUT, "binary"),
        (["--log", str(LOGS)], exitcodes.UNREADABLE_INPUT, "directory"),
        (["--log", str(LOGS / "garbage.log")], exitcodes.NO_VLLM_LINES, "not a vLLM log"),
        (["--bundle", str(LOGS / "seed000_starved.log")], exitcodes.BAD_BUNDLE, "bundle"),
        (["--bundle", "/nonexistent/b.tar.gz"], exitcodes.NO_SUCH_FILE, "no such file"),
        (["--pid", "999999999"], exitcodes.NO_SUCH_PROCESS, "no such process"),
        (["--pid", "1"], exitcodes.NOT_VLLM, "not part of a vLLM deployment"),
        (["--url", "http://127.0.0.1:9", "--window", "1"], exitcodes.UNREACHABLE, "unreachable"),
        ([], exitcodes.USAGE, "give one of"),
        (["--log", "x", "--bundle", "y"], exitcodes.USAGE, "no other source"),
    ],
)
def test_bad_input_is_one_line_and_its_own_code(args, code, needle):
    r = run("diagnose", *args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_a_truncated_bundle_archive(tmp_path):
    r = run("diagnose", "--log", str(LOGS / "seed000_starved.log"), "--save-bundle", str(tmp_path / "b.tar.gz"))
    data = (tmp_path / "b.tar.gz").read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(data[:40])
    r = run("diagnose", "--bundle", str(tmp_path / "cut.tar.gz"))
    assert r.returncode == exitcodes.BAD_BUNDLE
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_diagnose_imports_only_what_it_uses():
    # A watcher runs diagnose all day on a loaded host: its start-up is part of its cost. The TUI,
    # the exposition, the probes' bcc and a validation library stay out of a diagnose.
    code = ("import runpy, sys\n"
            "sys.argv = ['wedgectl', 'diagnose', '--pid', '999999999', '-q']\n"
            "try:\n    runpy.run_module('wedgectl', run_name='__main__')\n"
            "except SystemExit as e:\n    code = e.code\n"
            "heavy = ('pydantic', 'textual', 'prometheus_client', 'bcc', 'typer._adapters')\n"
            "print(code, sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split(None, 1) == [str(exitcodes.NO_SUCH_PROCESS), "[]\n"], out.stdout + out.stderr


def test_a_live_capture_imports_no_general_purpose_client():
    # A capture that scrapes (refused here: the sampler, the scraper and the classifier all load)
    # speaks HTTP/1.1 over a socket: no HTTP client library, no email package, no TLS for a
    # plain-http target, no tarfile when no bundle is written, no statistics module.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import runpy, sys\n"
            f"sys.argv = ['wedgectl', 'diagnose', '--url', 'http://127.0.0.1:{port}', '-q', '--window', '1']\n"
            "try:\n    runpy.run_module('wedgectl', run_name='__main__')\n"
            "except SystemExit as e:\n    code = e.code\n"
            "heavy = ('httpx', 'http', 'email', 'ssl', 'tarfile', 'statistics', 'textual', 'prometheus_client')\n"
            "loaded = all(m in sys.modules for m in ('wedgectl.capture.window', 'wedgectl.collect.scrape', 'wedgectl.classify'))\n"
            "print(code, loaded, sorted(m for m in sys.modules if m.split('.')[0] in heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split(None, 2) == [str(exitcodes.UNREACHABLE), "True", "[]\n"], out.stdout + out.stderr


# --- what a command imports: a cold start pays only for its own layer (issue 34) -----------------------

# Installed here (a test below checks), and each used by one command only: the TUI (top), the exposition,
# its web config and its basic auth (watch), and the rich help typer draws for --help.
UI_AND_EXPOSITION = ("textual", "prometheus_client", "rich", "yaml", "bcrypt")

_IN_PROCESS = """\
import json, runpy, sys
sys.argv = ['wedgectl', *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module('wedgectl', run_name='__main__')
except SystemExit as e:
    code = e.code
sys.stderr.write('\\nIMPORTED ' + json.dumps([code, sorted(sys.modules)]) + '\\n')
"""


def run_counting_imports(*args: str) -> tuple[subprocess.CompletedProcess, int, list[str]]:
    """`wedgectl ARGS` in a fresh interpreter: its output, its exit code, and every module it imported."""
    r = subprocess.run([sys.executable, "-c", _IN_PROCESS, json.dumps(args)], capture_output=True, text=True,
                       timeout=120)
    report = [line for line in r.stderr.splitlines() if line.startswith("IMPORTED ")]
    assert report, r.stdout + r.stderr
    code, modules = json.loads(report[-1].removeprefix("IMPORTED "))
    return r, code, modules


def heavy_in(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in UI_AND_EXPOSITION)


def test_the_heavy_libraries_are_installed_so_their_absence_means_something():
    r = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                        "print([m for m in sys.argv[1:] if u.find_spec(m) is None])", *UI_AND_EXPOSITION],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_json_diagnose_of_a_log_imports_no_ui_or_exposition_library():
    r, code, modules = run_counting_imports("diagnose", "--log", str(LOGS / "progressing.log"), "--json")
    assert code == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "progressing"
    assert "wedgectl.classify" in modules and "wedgectl.render.text" in modules  # the whole diagnose ran here
    assert heavy_in(modules) == []
    live = ("wedgectl.tui", "wedgectl.watch", "wedgectl.capture.window")
    assert not any(m.startswith(live) for m in modules), modules


def test_a_json_diagnose_of_a_url_imports_no_ui_or_exposition_library():
    # A real HTTP server on loopback answering with a /metrics page recorded from vLLM 0.32 (idle).
    from hostile_metrics import HostileMetrics

    with HostileMetrics("good") as server:
        r, code, modules = run_counting_imports("diagnose", "--url", server.url, "--json", "--window", "1")
        scraped = server.requests
    assert code == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["verdict"], out["source"]) == ("idle", "url")
    assert scraped >= 2  # /metrics at least twice over the window (and /health)
    assert {"wedgectl.capture.window", "wedgectl.collect.scrape", "wedgectl.classify"} <= set(modules)
    assert heavy_in(modules) == []
    assert not any(m.startswith(("wedgectl.tui", "wedgectl.watch")) for m in modules), modules


@pytest.mark.parametrize("command, options", [("top", ("--pid", "--url", "--bundle", "--refresh")),
                                              ("watch", ("--listen", "--web-config-file", "--users"))])
def test_top_and_watch_still_answer_help(command, options):
    # Their own modules (the TUI, the watcher) load only when the command runs, not for its --help.
    r, code, modules = run_counting_imports(command, "--help")
    assert code == 0, r.stderr
    assert f"wedgectl {command} [OPTIONS]" in r.stdout
    assert all(o in r.stdout for o in options), r.stdout
    assert not any(m.startswith(("wedgectl.tui", "wedgectl.watch", "textual", "prometheus_client")) for m in modules)


BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


def test_a_json_diagnose_of_a_bundle_imports_nothing_that_reads_a_live_server():
    # Re-classifying saved evidence reads a file: no sampler, no collector, no HTTP (client, server or TLS),
    # nothing of top, watch or the lab, and none of the UI and exposition libraries.
    r, code, modules = run_counting_imports("diagnose", "--bundle", str(BUNDLES / "healthy-tp2.tar.gz"), "--json")
    assert code == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] in ("idle", "progressing")
    assert {"wedgectl.classify", "wedgectl.store.bundle", "wedgectl.render.text"} <= set(modules)
    assert heavy_in(modules) == []
    assert [m for m in modules if m.split(".")[0] in ("httpx", "http", "email", "ssl")] == []
    live = ("wedgectl.collect", "wedgectl.capture.window", "wedgectl.lab", "wedgectl.tui",
            "wedgectl.watch")
    assert not any(m.startswith(live) for m in modules), modules


# --- diagnose is a thin command: the library below it does the work, and prints what it printed -------------


def _as_before_the_move(verdict, bundle, *, reclassified: bool, saved=None):
    """The object `diagnose --json` printed when the command built it itself (before issue 34)."""
    from wedgectl.classify.collective import rank_summaries
    from wedgectl.render.text import failure_summary, render_report

    if reclassified:
        return render_report(verdict, True, source=bundle.manifest.source,
                             recorded_verdict=bundle.verdict.verdict.value if bundle.verdict else None,
                             ranks=rank_summaries(bundle) or None)
    extra = {"source": bundle.manifest.source, "bundle": saved, "collector_failures": failure_summary(bundle)}
    if bundle.manifest.target.pid is not None:
        extra["pid"] = bundle.manifest.target.pid
    if bundle.manifest.target.url is not None:
        extra["url"] = bundle.manifest.target.url
    probe_records = next((s.probes for s in reversed(bundle.samples) if s.probes), ())
    if probe_records:
        extra["probes"] = list(probe_records)
    if rank_summaries(bundle):
        extra["ranks"] = rank_summaries(bundle)
    return render_report(verdict, True, **extra)


@pytest.mark.parametrize("name", ["healthy-tp2", "collective-hang", "engine-deadlock-escalated", "starved"])
def test_the_json_of_a_diagnosis_is_what_the_command_printed(name, tmp_path):
    from wedgectl.capture.diagnosis import classify_and_save, reclassify
    from wedgectl.render.text import render_diagnosis
    from wedgectl.store.bundle import read_bundle

    again = reclassify(BUNDLES / f"{name}.tar.gz")
    assert list(render_diagnosis(again, True)) == list(_as_before_the_move(again.verdict, again.bundle,
                                                                           reclassified=True))
    out = json.loads("".join(render_diagnosis(again, True)))
    assert list(out)[-3:] == ["source", "recorded_verdict", "ranks"]
    # The same evidence as if just captured: classified as the sampler's bundle is, then saved.
    fresh = classify_and_save(read_bundle(BUNDLES / f"{name}.tar.gz"), tmp_path / "b.tar.gz")
    assert fresh.saved == tmp_path / "b.tar.gz" and read_bundle(fresh.saved).verdict == fresh.verdict
    assert list(render_diagnosis(fresh, True)) == list(_as_before_the_move(fresh.verdict, fresh.bundle,
                                                                           reclassified=False,
                                                                           saved=str(tmp_path / "b.tar.gz")))
    assert [k for k in json.loads("".join(render_diagnosis(fresh, True))) if k not in out][:2] == \
        ["bundle", "collector_failures"]


@pytest.mark.parametrize("sources, problem", [
    ({}, "give one of --pid, --url, --log or --bundle"),
    ({"bundle": Path("b"), "log": Path("l")}, "--bundle re-classifies saved evidence; it takes no other source"),
    ({"bundle": Path("b"), "pid": 7}, "--bundle re-classifies saved evidence; it takes no other source"),
    ({"pid": 7, "log": Path("l")}, None),
    ({"url": "http://127.0.0.1:8000"}, None),
])
def test_which_sources_make_a_diagnosis(sources, problem):
    from wedgectl.capture.diagnosis import source_problem

    args = {"pid": None, "url": None, "log": None, "bundle": None, **sources}
    assert source_problem(**args) == problem


def test_diagnose_is_a_thin_command():
    # Its options are declarations; what it does (source, capture, save, classify) is capture/diagnosis.py's.
    import inspect

    from wedgectl.cli import diagnose

    source = inspect.getsource(diagnose)
    body = source[source.index(") -> None:\n") + len(") -> None:\n"):]
    assert len(body.strip().splitlines()) <= 30, body


SCRIPT = Path(sys.executable).with_name("wedgectl")  # the console script completion is installed for


@pytest.mark.parametrize(("shell", "env", "want"), [
    ("bash", {"COMP_WORDS": "wedgectl diagnose --js", "COMP_CWORD": "2"}, "--json"),
    ("bash", {"COMP_WORDS": "wedgectl dia", "COMP_CWORD": "1"}, "diagnose"),
    ("zsh", {"_TYPER_COMPLETE_ARGS": "wedgectl rep"}, '"repro":"Reproduce a hang class'),
    ("fish", {"_TYPER_COMPLETE_ARGS": "wedgectl wat", "_TYPER_COMPLETE_FISH_ACTION": "get-args"}, "watch\t"),
])
def test_shell_completion_completes_commands_and_options(shell: str, env: dict[str, str], want: str) -> None:
    """What the script `wedgectl --install-completion` installs asks the command itself, through these variables."""
    r = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "_WEDGECTL_COMPLETE": f"complete_{shell}", **env})
    assert r.returncode == 0 and want in r.stdout, (r.stdout, r.stderr)


def test_show_completion_prints_the_script_for_the_shell_it_runs_in() -> None:
    r = subprocess.run(["bash", "-c", f"{SCRIPT} --show-completion"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "_WEDGECTL_COMPLETE=complete_bash" in r.stdout, r.stdout + r.stderr
