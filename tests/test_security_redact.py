"""Issue 33, findings 2 and 12: redaction takes time linear in what a target sends, and PWD is not a secret.

Linearity is measured, not argued: the CPU time (time.process_time, which another process's load does
not inflate) of redact_text on 4n characters of a repeated adversarial unit must stay within 8 times
that on n characters (linear: 4; quadratic: 16). The units are built from the regexes' own tokens.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wedgectl.read.redact import REDACTED, is_secret_name, redact_argv, redact_env, redact_text

# Prefixes each pattern in wedgectl.read.redact starts a scan at, and what those scans run over.
TOKENS = (
    "a: [", "api_key: [", "a:[[", "a: [x]", "]", "[", "a=", "a: ", "password=", "key: '", '"key": "', "'k': '",
    '"', "'", "Bearer ", "basic ", "token ", "a://user:", "://", "@", "-----BEGIN ", "-----BEGIN PRIVATE KEY-----",
    "-----END ", "PRIVATE KEY", "eyJ", "eyJ-", ".eyJ", "eyJhbGciOi.eyJ", ".", "sk-", "hf_", "ghp_", "github_pat_",
    "xoxb-", "AKIA", "=", "= ", "=\"", "--api-key ", "--a ", "-", "_", ":", ",", "{", "}", "None", " ", "\n",
    "0123456789abcdef", "Zm9vYmFyQmF6", "A1b", "x" * 30,
)
FILLERS = ("", "x" * 30, "A1b" * 10, "0123456789abcdef" * 2, " ")


def _cpu(text: str) -> float:
    """The least CPU time of three redactions (the least is the one nothing else interrupted)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        redact_text(text)
        best = min(best, time.process_time() - t0)
    return best


def _assert_linear(unit: str, base: int = 30_000) -> None:
    small = unit * (base // len(unit) + 1)
    large = unit * (4 * (base // len(unit) + 1))
    t1, t4 = _cpu(small), _cpu(large)
    # 4x the input may cost 8x the time, plus 20 ms for the timer and the allocator
    assert t4 <= 8 * t1 + 0.02, f"{unit!r}: {len(small)} chars {t1:.3f} s, {len(large)} chars {t4:.3f} s"


@pytest.mark.parametrize("token", TOKENS)
@pytest.mark.parametrize("filler", ["", "x" * 30])
def test_each_token_repeated_redacts_in_linear_time(token, filler):
    _assert_linear(token + filler)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=4), st.sampled_from(FILLERS))
def test_any_mix_of_tokens_repeated_redacts_in_linear_time(tokens, filler):
    _assert_linear("".join(tokens) + filler)


def test_the_issue_line_of_400_kb_redacts_in_well_under_a_second():
    line = ("a: [" + "x" * 30) * (400_000 // 34)
    t0 = time.process_time()
    out = redact_text(line)
    assert time.process_time() - t0 < 1.0
    assert out == line  # nothing in it is a secret, and nothing is lost


def test_diagnose_of_a_log_with_that_line_saves_its_bundle_quickly(tmp_path):
    """The whole path the issue timed (57 s): diagnose --log F --save-bundle B, in a child process."""
    fixture = Path(__file__).parent / "fixtures" / "logs" / "progressing.log"
    log = tmp_path / "server.log"
    log.write_text(fixture.read_text() + "INFO 01-01 00:00:00 x.py:1] " + ("a: [" + "x" * 30) * 12_000 + "\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--log", str(log), "--save-bundle",
                        str(tmp_path / "b.tar.gz")], capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0 and r.stdout.startswith("VERDICT  progressing"), r.stderr
    assert (tmp_path / "b.tar.gz").is_file()
    assert cpu < 5.0, f"diagnose took {cpu:.1f} s of CPU"


# --- what the linear forms still redact (the same as before) ---------------------------------------


@pytest.mark.parametrize("text, gone, kept", [
    # a list closed on its line; one left open later on the same line does not stop it
    ("args: {'api_key': ['k1secret', 'k2secret']} a: [open", ("k1secret", "k2secret"), "a: [open"),
    # an open list is no list: what follows on the line is still read
    ("api_key: [open password=hunter2pw", ("hunter2pw",), "api_key: [open"),
    # an open '[' before a closed list on the same line: the first ']' closes it, as it always did
    ("api_key: [k1secret x: [y]", ("k1secret",), "]"),
    # a list across lines is not one, on either line
    ("api_key: [k1\npassword=hunter2pw ]", ("hunter2pw",), "api_key: [k1\n"),
    # a JWT after a '-' is still one; a run of 'eyJ-' is not
    ("id-eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", ("eyJhbGciOiJIUzI1NiJ9",), "id-"),
    ("eyJ-eyJ-eyJ-eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", ("eyJzdWIiOiIxIn0",), ""),
])
def test_the_linear_forms_redact_what_they_did(text, gone, kept):
    out = redact_text(text)
    assert all(g not in out for g in gone) and REDACTED in out and kept in out, out


def test_a_text_holding_private_use_characters_comes_back_whole():
    """The stand-in for an open '[' is a character the text does not hold, whatever it holds."""
    pua = "".join(chr(c) for c in range(0xE000, 0xE000 + 300))
    text = f"{pua} api_key: [open {pua} password=hunter2pw [x\n\ue000[ b: [c]"
    out = redact_text(text)
    assert out == text.replace("hunter2pw", REDACTED)


# --- finding 12: plain path variables are not secrets ----------------------------------------------


@pytest.mark.parametrize("name", [
    "PWD", "OLDPWD", "HOME", "PATH", "TMPDIR", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "XDG_DATA_DIRS",
    "XDG_CACHE_HOME", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH", "CONDA_PREFIX",
])
def test_plain_path_variables_are_not_secrets(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize("name", [
    "PASSWD", "DB_PASSWORD", "MYSQL_PWD", "DB_PWD", "pwd", "--pwd", "Pwd", "XDG_SESSION_ID", "PGPASSWORD",
])
def test_passwords_stay_secrets(name):
    assert is_secret_name(name)


def test_the_rollback_hint_keeps_its_path():
    """swap's messages hide every secret value of the server's environment: PWD's was one, so the path
    under it read `sh <redacted>/.cache/...`."""
    from wedgectl.lab import swap

    env = {"PWD": "/home/alice", "OLDPWD": "/home/alice/src", "HOME": "/home/alice", "DB_PASSWORD": "hunter2pw"}
    hint = "to start the original again: sh /home/alice/.cache/wedgectl/swap/restore-8000.sh (pw hunter2pw)"
    out = swap.redact_text(hint, env, ["vllm", "serve", "/m"])
    assert "sh /home/alice/.cache/wedgectl/swap/restore-8000.sh" in out and "hunter2pw" not in out
    assert redact_env(env) == {**env, "DB_PASSWORD": REDACTED}
    assert redact_argv(["env", "PWD=/home/alice", "PASSWD=x1"]) == ["env", "PWD=/home/alice", f"PASSWD={REDACTED}"]
