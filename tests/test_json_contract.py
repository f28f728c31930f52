"""--json as a program reads it: every object says the command's exit status and the schema version, and an
error is one JSON object on stdout (`error`, `exit_code`, `schema_version`) beside its one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import gone_pid, one_line, run_cli
from wedgectl.model import exitcodes
from wedgectl.render.text import SCHEMA_VERSION, error_json, with_status

LOGS = Path(__file__).parent / "fixtures" / "logs"
BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


@pytest.mark.parametrize("args", [
    ("diagnose", "--log", str(LOGS / "seed002_deadlock.log")),
    ("diagnose", "--log", str(LOGS / "progressing.log")),
    ("diagnose", "--bundle", str(BUNDLES / "admission-wedge.tar.gz")),
    ("runtime", "list"),
    ("probes",),
])
def test_every_json_result_carries_its_exit_status_and_the_schema_version(args: tuple[str, ...]) -> None:
    r = run_cli(*args, "--json")
    out = json.loads(r.stdout)
    assert out["exit_code"] == r.returncode and out["schema_version"] == SCHEMA_VERSION == 1, r.stdout[-500:]
    assert "error" not in out or r.returncode != 0


@pytest.mark.parametrize(("args", "code", "says"), [
    (("diagnose", "--pid", "GONE"), exitcodes.NO_SUCH_PROCESS, "no such process"),
    (("diagnose", "--log", "/nonexistent/vllm.log"), exitcodes.NO_SUCH_FILE, "/nonexistent/vllm.log"),
    (("diagnose", "--log", str(Path(__file__))), exitcodes.NO_VLLM_LINES, "not a vLLM log"),
    (("diagnose", "--window", "-1"), exitcodes.USAGE, "--window"),
    (("probes", "--pid", "GONE", "--seconds", "1"), exitcodes.PROBES_GONE, "no such process"),
])
def test_an_error_under_json_is_one_object_on_stdout_and_one_line_on_stderr(args: tuple[str, ...], code: int,
                                                                             says: str) -> None:
    gone = str(gone_pid())
    r = run_cli(*(gone if a == "GONE" else a for a in args), "--json")
    assert r.returncode == code, r
    line = one_line(r.stderr)
    err = json.loads(r.stdout)
    assert set(err) == {"error", "exit_code", "schema_version"}
    assert err["exit_code"] == code and err["schema_version"] == SCHEMA_VERSION and says in err["error"]
    assert line == f"wedgectl: {err['error']}"


def test_without_json_an_error_prints_nothing_on_stdout() -> None:
    r = run_cli("diagnose", "--log", "/nonexistent/vllm.log")
    assert r.returncode == exitcodes.NO_SUCH_FILE and r.stdout == ""
    one_line(r.stderr)


def test_a_json_after_double_dash_is_not_the_option() -> None:
    """`--` ends the options: a `--json` after it is an argument (here an unexpected one), not a request for JSON."""
    r = run_cli("diagnose", "--", "--json")
    assert r.returncode == exitcodes.USAGE and r.stdout == ""


def test_with_status_keeps_the_object_and_adds_the_two_keys() -> None:
    assert json.loads(with_status('{"verdict": "idle"}', 0)) == {"verdict": "idle", "exit_code": 0,
                                                                 "schema_version": SCHEMA_VERSION}
    assert json.loads(error_json('a "quoted"\nline', 21)) == {"error": 'a "quoted"\nline', "exit_code": 21,
                                                              "schema_version": SCHEMA_VERSION}
