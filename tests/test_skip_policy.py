"""The skip policy of a strict run (tests/conftest.py, tests/skips.toml): with WEDGECTL_STRICT_SKIPS=1 a skip the
allow-list does not name fails the run and is listed last; an allowed one does not; without it nothing fails.

The runs are real pytest runs, in a subprocess, on a small generated test folder whose conftest.py loads this
suite's own (so the hook and the allow-list under test are the ones CI uses)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wedgectl import probes
from wedgectl.collect import ebpfhost

TESTS = Path(__file__).resolve().parent


def _load_conftest():
    spec = importlib.util.spec_from_file_location("wedgectl_tests_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


policy = _load_conftest()

CONFTEST = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("wedgectl_tests_conftest", {str(TESTS / "conftest.py")!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
pytest_configure = module.pytest_configure
pytest_collection_modifyitems = module.pytest_collection_modifyitems
"""

TESTS_PY = """
import pytest

def test_passes():
    assert sum([1, 2]) == 3

def test_allowed_skip():
    pytest.skip("no IPv6")

@pytest.mark.skipif(True, reason="this kernel has no BTF")
def test_allowed_skipif():
    pass

def test_unlisted_skip():
    pytest.skip("needs tmux (as root, tests/setup.sh installs it)")
"""


def _run(tmp_path: Path, strict: str | None, *args: str, tests: str = TESTS_PY) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(tests))
    env = {k: v for k, v in os.environ.items() if k not in (policy.STRICT_ENV, "PYTEST_ADDOPTS")}
    if strict is not None:
        env[policy.STRICT_ENV] = strict
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_allowed_skips_pass_a_strict_run(tmp_path: Path) -> None:
    r = _run(tmp_path, "1", "-k", "not unlisted")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 2 skipped" in r.stdout
    assert "SKIPPED [1] test_generated.py:8: no IPv6" in r.stdout  # -rs still shows the allowed ones
    assert "WEDGECTL_STRICT_SKIPS=1: 2 skipped, each allowed by" in r.stdout
    assert "UNEXPECTED" not in r.stdout


def test_an_unlisted_skip_fails_a_strict_run_and_is_listed_last(tmp_path: Path) -> None:
    r = _run(tmp_path, "1")
    assert r.returncode == 1, r.stdout + r.stderr
    unexpected = [line for line in r.stdout.splitlines() if line.startswith("UNEXPECTED SKIP")]
    assert unexpected == ["UNEXPECTED SKIP test_generated.py::test_unlisted_skip: "
                          "needs tmux (as root, tests/setup.sh installs it)"]
    tail = r.stdout.splitlines()[-5:]
    assert any("1 unexpected skip: the run fails" in line for line in tail), tail
    assert "1 passed, 3 skipped" in tail[-1]


def test_an_unlisted_skip_of_a_whole_module_fails_too(tmp_path: Path) -> None:
    (tmp_path / "test_other.py").write_text("def test_passes():\n    assert sum([1, 2]) == 3\n")
    r = _run(tmp_path, "1", tests="""
        import pytest
        pytest.importorskip("wedgectl_no_such_module")

        def test_never():
            pass
    """)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "UNEXPECTED SKIP test_generated.py: could not import 'wedgectl_no_such_module'" in r.stdout


def test_a_parallel_run_sees_every_skip_its_workers_saw(tmp_path: Path) -> None:
    """Under `-n 2` the workers collect: a module skipped whole must still fail the run, once, and the
    allowed skips still count (the README's test command runs in parallel)."""
    (tmp_path / "test_allowed.py").write_text(textwrap.dedent(TESTS_PY).replace("def test_unlisted_skip", "def _no"))
    r = _run(tmp_path, "1", "-n", "2", "--dist", "loadgroup", tests="""
        import pytest
        pytest.importorskip("wedgectl_no_such_module")

        def test_never():
            pass
    """)
    assert r.returncode == 1, r.stdout + r.stderr
    unexpected = [line for line in r.stdout.splitlines() if line.startswith("UNEXPECTED SKIP")]
    assert len(unexpected) == 1, unexpected  # seen by both workers, listed once
    assert unexpected[0].startswith("UNEXPECTED SKIP test_generated.py: could not import 'wedgectl_no_such_module'")
    r = _run(tmp_path, "1", "-n", "2", "--dist", "loadgroup", tests="def test_passes():\n    pass\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WEDGECTL_STRICT_SKIPS=1: 2 skipped, each allowed by" in r.stdout


@pytest.mark.parametrize("strict", [None, "", "0"])
def test_without_the_variable_nothing_fails(tmp_path: Path, strict: str | None) -> None:
    r = _run(tmp_path, strict)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 3 skipped" in r.stdout and "needs tmux" in r.stdout  # -rs shows it; it fails nothing
    assert "UNEXPECTED" not in r.stdout and "WEDGECTL_STRICT_SKIPS" not in r.stdout


def test_a_failure_keeps_its_exit_status_and_no_tests_keeps_5(tmp_path: Path) -> None:
    r = _run(tmp_path, "1", "-k", "nothing_is_named_so")
    assert r.returncode == 5, r.stdout + r.stderr  # a run of nothing is not turned into a pass, nor a failure
    r = _run(tmp_path, "1", tests=TESTS_PY + "\ndef test_fails():\n    assert 1 == 2\n")
    assert r.returncode == 1 and "1 failed" in r.stdout and "UNEXPECTED SKIP" in r.stdout


def test_a_bad_value_is_one_line_and_a_usage_error(tmp_path: Path) -> None:
    r = _run(tmp_path, "yes")
    assert r.returncode == 4, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert err == ["ERROR: WEDGECTL_STRICT_SKIPS must be 1 (fail on unlisted skips) or 0, not 'yes'"]


# --- the allow-list itself ----------------------------------------------------------------------------


def _allowed(reason: str) -> bool:
    return any(a.reason.match(reason) for a in policy.load_allowed())


def test_every_entry_says_why() -> None:
    entries = policy.load_allowed()
    assert 5 <= len(entries) <= 12  # short: a long list would hide what CI does not test
    assert all(len(a.why) > 20 for a in entries)


def test_host_dependent_reasons_are_allowed(tmp_path: Path) -> None:
    """What the suite's skips say where the host, not its set-up, lacks something: the IPv6 and kernel
    reasons as written in the tests, and the eBPF reasons as the back-end checks compute them."""
    bare = ebpfhost.Host(root=tmp_path, euid=lambda: 0, machine="x86_64", release="6.8.0")
    no_btf = ebpfhost.check_rawtp(bare, probes.DEFAULT_PROBES)
    arm = ebpfhost.check_rawtp(ebpfhost.Host(root=tmp_path, euid=lambda: 0, machine="aarch64", release="6.8.0"),
                               probes.DEFAULT_PROBES)
    old = ebpfhost.check_rawtp(ebpfhost.Host(root=tmp_path, euid=lambda: 0, machine="x86_64", release="5.4.0"),
                               probes.DEFAULT_PROBES)
    (tmp_path / "tracing" / "events").mkdir(parents=True)
    no_tracepoints = ebpfhost.check_bpftrace(bare, probes.DEFAULT_PROBES, tmp_path / "tracing", "")
    assert not (no_btf.available or arm.available or old.available or no_tracepoints.available)
    for reason in ("no IPv6", "cannot bind ::", "no ::1", "no IPv6 in this kernel: nothing to find",
                   "no IPv6 loopback address here: nothing to find", "no /proc/PID/sched on this kernel",
                   "this kernel has no BTF", f"rawtp: {no_btf.reason}", f"rawtp: {arm.reason}", f"rawtp: {old.reason}",
                   f"eBPF: {no_tracepoints.reason}", "eBPF: /sys/kernel/tracing does not exist (kernel without "
                   "CONFIG_TRACEFS?)", "eBPF: tracefs is not mounted at /sys/kernel/tracing and `mount -t tracefs "
                   "nodev /sys/kernel/tracing` failed: mount: permission denied",
                   "unprivileged user and mount namespaces are not allowed here",
                   "cannot set a CPU limit on this host: [Errno 30] Read-only file system: '/sys/fs/cgroup/x'",
                   "WEDGECTL_NO_INSTALL set: managed vLLM runtime not installed at /root/.cache/wedgectl/vllm"):
        assert _allowed(reason), reason


def test_missing_tools_and_privileges_are_not(tmp_path: Path) -> None:
    """A skip for what tests/setup.sh installs, or for not being root, is a gap in CI: never allowed."""
    user = ebpfhost.Host(root=tmp_path, euid=lambda: 1000, cap_eff=lambda: 0, machine="x86_64", release="6.8.0")
    no_tool = ebpfhost.Host(root=tmp_path, euid=lambda: 0, which=lambda _: None)
    rawtp_user = ebpfhost.check_rawtp(user, probes.DEFAULT_PROBES)
    bpftrace_missing = ebpfhost.check_bpftrace(no_tool, probes.DEFAULT_PROBES, None, "")
    assert "needs root" in rawtp_user.reason and "not installed" in bpftrace_missing.reason
    for reason in (f"rawtp: {rawtp_user.reason}", f"eBPF: {bpftrace_missing.reason}",
                   "eBPF: needs root (loading eBPF programs does)", "rawtp: needs root (loading eBPF programs does)",
                   "needs tmux (as root, tests/setup.sh installs it)", "no promtool on PATH",
                   "no prometheus on PATH (tests/setup.sh installs Debian's)", "no openssl CLI",
                   "chown to nobody needs root", "plays other users with setpriv, as root",
                   "plays another user with setpriv: needs root", "no Python interpreter nobody may run",
                   "needs root and setpriv (util-linux; as root, tests/setup.sh installs it)",
                   "managed vLLM runtime not installed at /root/.cache/wedgectl/vllm",
                   "could not import 'httpx': No module named 'httpx'"):
        assert not _allowed(reason), reason


@pytest.mark.parametrize("text, says", [
    ("[[allow]]\nreason = 'x'\n", "must have exactly `reason` and `why`"),
    ("[[allow]]\nreason = '(x'\nwhy = 'because'\n", "`reason` is not a regex"),
    ("[[allow]]\nreason = 'x'\nwhy = ''\n", "`why` must be one non-empty line"),
    ("allow = 3\n", "expected only [[allow]] tables"),
    ("[[allow]\n", "Expected"),
])
def test_a_bad_allow_list_is_one_clear_line(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "skips.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        policy.load_allowed(path)
    assert str(info.value).startswith(f"{path}: ") and says in str(info.value) and "\n" not in str(info.value)


def test_ci_runs_the_readme_test_command_strict_and_showing_every_skip() -> None:
    readme = (TESTS.parent / "README.md").read_text()
    command = readme.split("## Run the tests", 1)[1].split("```sh\n", 1)[1].split("\n", 1)[0]
    assert f"{policy.STRICT_ENV}=1 .venv/bin/python -m pytest -q -rs " in command, command
    ci = (TESTS.parent / ".ci" / "run").read_text().splitlines()
    assert ci[ci.index("# The README's test command:") + 1] == f"{command} || rc=$?"
