"""Hostile input through the real CLI: archive bombs, FIFOs, devices, pax headers, newer writers, no access.

Each case runs `python -m wedgectl` in a child under a hard timeout and checks the exit code, the one
line on stderr, how long it took and (for the bombs) the child's peak memory.
"""

from __future__ import annotations

import ctypes
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from wedgectl.model import exitcodes
from wedgectl.store.bundle import MAX_ARCHIVE_BYTES, MAX_HEADER_BYTES, MAX_MEMBER_BYTES

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"
GIB = 1 << 30

# The child reports its own peak memory: RUSAGE_CHILDREN of a one-child wrapper is that child's peak.
_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run([sys.executable, '-m', 'wedgectl', *sys.argv[1:]]).returncode\n"
    "print(f'maxrss_kib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


@dataclass(frozen=True)
class Run:
    rc: int
    stdout: str
    stderr: str
    elapsed_s: float
    maxrss_mib: float

    @property
    def message(self) -> str:
        """What wedgectl said on stderr (the wrapper's line left out)."""
        return "\n".join(line for line in self.stderr.splitlines() if not line.startswith("maxrss_kib="))


def _drop_file_override() -> None:
    """Drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so root meets mode 000 too."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_cli(*args: str, timeout: float = 60, as_unprivileged: bool = False) -> Run:
    """The CLI in a child with a hard timeout: a hang fails the test instead of wedging the suite."""
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("WEDGECTL_DEBUG", None)
    drop = _drop_file_override if as_unprivileged and os.geteuid() == 0 else None
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True, preexec_fn=drop)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"wedgectl {' '.join(args)} still running after {timeout} s")
    elapsed = time.monotonic() - start
    rss = [int(line.split("=")[1]) for line in err.splitlines() if line.startswith("maxrss_kib=")]
    return Run(proc.returncode, out, err, elapsed, rss[0] / 1024 if rss else float("nan"))


def assert_one_clean_line(run: Run, *needles: str) -> None:
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr, run.stderr
    lines = run.message.splitlines()
    assert len(lines) == 1 and lines[0].startswith("wedgectl: "), run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- archives built here -----------------------------------------------------------------------------

class _Zeros(io.RawIOBase):
    """n zero bytes, produced as read: the 1 GiB member never exists in memory."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def _fixture_files(name: str = "admission-wedge.tar.gz") -> dict[str, bytes]:
    with tarfile.open(BUNDLES / name) as tar:
        return {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read() for m in tar if m.isfile()}


def write_archive(path: Path, members: list[tuple[str, bytes | int]], level: int = 9) -> Path:
    """A .tar.gz of (name, bytes) members and (name, n) members of n zeros, streamed through gzip."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=level, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
            for name, content in members:
                info = tarfile.TarInfo(f"bundle/{name}")
                if isinstance(content, int):
                    info.size = content
                    tar.addfile(info, io.BufferedReader(_Zeros(content), 1 << 20))
                else:
                    info.size = len(content)
                    tar.addfile(info, io.BytesIO(content))
    return path


def write_pax_archive(path: Path, pax_payload: bytes) -> Path:
    """A .tar.gz whose first header is a pax extended header carrying pax_payload, then the bundle."""
    blocks = bytearray()
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type = tarfile.XHDTYPE
    pax.size = len(pax_payload)
    blocks += pax.tobuf(format=tarfile.USTAR_FORMAT)
    blocks += pax_payload + bytes(-len(pax_payload) % 512)
    for name, data in _fixture_files().items():
        info = tarfile.TarInfo(f"bundle/{name}")
        info.size = len(data)
        blocks += info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)
    blocks += bytes(1024)
    path.write_bytes(gzip.compress(bytes(blocks), compresslevel=6, mtime=0))
    return path


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    """~1 MB on disk: a real manifest and samples, then a log.txt of 1 GiB of zeros."""
    files = _fixture_files()
    path = tmp_path_factory.mktemp("bomb") / "bomb.tar.gz"
    write_archive(path, [("manifest.json", files["manifest.json"]), ("samples.jsonl", files["samples.jsonl"]),
                         ("log.txt", GIB)])
    return path


def test_the_bomb_is_what_the_issue_says(bomb):
    data = bomb.read_bytes()
    assert len(data) < 2 << 20
    inflated = int.from_bytes(data[-4:], "little")  # gzip's ISIZE: the inflated size, mod 2**32
    assert inflated > GIB > MAX_MEMBER_BYTES


def test_archive_bomb_is_refused_at_once_in_little_memory(bomb):
    run = run_cli("diagnose", "--bundle", str(bomb))
    assert run.rc == exitcodes.BAD_BUNDLE == 23
    assert_one_clean_line(run, str(bomb), "log.txt", str(GIB), "refused")
    assert run.elapsed_s < 10  # interpreter start and imports on a loaded host; the read itself is milliseconds
    assert run.maxrss_mib < 300, f"peak {run.maxrss_mib:.0f} MiB"


def test_archive_bomb_through_top_is_refused_the_same(bomb):
    run = run_cli("top", "--bundle", str(bomb))
    assert run.rc == exitcodes.BAD_BUNDLE
    assert_one_clean_line(run, "log.txt", "refused")


def test_many_members_under_the_member_cap_stop_at_the_archive_cap(tmp_path):
    """Members each within MAX_MEMBER_BYTES but together past MAX_ARCHIVE_BYTES: inflation stops at the cap."""
    files = _fixture_files()
    n = MAX_ARCHIVE_BYTES // MAX_MEMBER_BYTES + 1
    path = write_archive(tmp_path / "wide.tar.gz", [("manifest.json", files["manifest.json"])]
                         + [(f"junk{i}.bin", MAX_MEMBER_BYTES) for i in range(n)], level=1)
    run = run_cli("diagnose", "--bundle", str(path))
    assert run.rc == exitcodes.BAD_BUNDLE
    assert_one_clean_line(run, f"expands past {MAX_ARCHIVE_BYTES} bytes")
    assert run.maxrss_mib < 300, f"peak {run.maxrss_mib:.0f} MiB"


def test_large_pax_header_is_refused_before_parsing(tmp_path):
    # Digits only: Python 3.11's tarfile searches such a header with a regex in quadratic time.
    path = write_pax_archive(tmp_path / "pax.tar.gz", b"1" * (1 << 20))
    run = run_cli("diagnose", "--bundle", str(path), timeout=60)
    assert run.rc == exitcodes.BAD_BUNDLE
    assert_one_clean_line(run, f"tar header of {1 << 20} bytes", f"at most {MAX_HEADER_BYTES}")
    assert run.elapsed_s < 10


def test_malformed_pax_header_under_the_cap_is_refused_quickly(tmp_path):
    path = write_pax_archive(tmp_path / "pax.tar.gz", b"1" * (MAX_HEADER_BYTES - 512))
    run = run_cli("diagnose", "--bundle", str(path), timeout=60)
    assert run.rc == exitcodes.BAD_BUNDLE
    assert_one_clean_line(run, "malformed pax header")
    assert run.elapsed_s < 10


def test_a_valid_pax_header_is_read(tmp_path):
    record = b" comment=written by a newer tar\n"
    record = str(len(record) + 2).encode() + record  # the length counts its own two digits
    path = write_pax_archive(tmp_path / "pax.tar.gz", record)
    run = run_cli("diagnose", "--bundle", str(path))
    assert run.rc == exitcodes.VERDICT_CODES[_recorded_verdict()], run.stderr


# --- files that are not files ------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [("diagnose", "--log"), ("diagnose", "--bundle"), ("top", "--bundle")])
def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path, flag):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    run = run_cli(*flag, str(fifo), timeout=30)
    assert run.rc == exitcodes.UNREADABLE_INPUT == 21
    assert_one_clean_line(run, str(fifo), "FIFO", "not a regular file")
    assert run.elapsed_s < 10


@pytest.mark.parametrize("flag", ["--log", "--bundle"])
def test_dev_zero_is_never_read(flag):
    run = run_cli("diagnose", flag, "/dev/zero", timeout=30)
    assert run.rc == exitcodes.UNREADABLE_INPUT
    assert_one_clean_line(run, "/dev/zero", "character device")
    assert run.maxrss_mib < 300


@pytest.mark.parametrize("flag", ["--log", "--bundle"])
def test_symlink_to_dev_zero_is_never_read(tmp_path, flag):
    link = tmp_path / "server.log"
    link.symlink_to("/dev/zero")
    run = run_cli("diagnose", flag, str(link), timeout=30)
    assert run.rc == exitcodes.UNREADABLE_INPUT
    assert_one_clean_line(run, str(link), "character device")


def test_bundle_directory_with_a_fifo_member(tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    os.mkfifo(bundle / "manifest.json")
    run = run_cli("diagnose", "--bundle", str(bundle), timeout=30)
    assert run.rc == exitcodes.UNREADABLE_INPUT
    assert_one_clean_line(run, "manifest.json", "FIFO")


def test_symlinked_log_that_is_a_regular_file_is_read(tmp_path):
    link = tmp_path / "current"
    link.symlink_to(BUNDLES / "admission-wedge.log")
    direct = run_cli("diagnose", "--log", str(BUNDLES / "admission-wedge.log"))
    run = run_cli("diagnose", "--log", str(link))
    assert run.rc == direct.rc == exitcodes.VERDICT_CODES[_verdict_kind("admission_wedge")]


# --- permission denied ---------------------------------------------------------------------------------

@pytest.mark.parametrize("command,flag,fixture", [("diagnose", "--log", "admission-wedge.log"),
                                                  ("diagnose", "--bundle", "admission-wedge.tar.gz"),
                                                  ("top", "--bundle", "admission-wedge.tar.gz")])
def test_permission_denied_input_gets_the_bad_input_code(tmp_path, command, flag, fixture):
    """Mode 000, and (as root) without the capabilities that override it: exit 21, not click's usage 2."""
    path = tmp_path / fixture
    path.write_bytes((BUNDLES / fixture).read_bytes())
    path.chmod(0)
    run = run_cli(command, flag, str(path), as_unprivileged=True)
    assert run.rc == exitcodes.UNREADABLE_INPUT, run.stderr
    assert_one_clean_line(run, str(path), "permission denied")


def test_bundle_directory_we_cannot_enter_gets_the_bad_input_code(tmp_path):
    bundle = _extracted(tmp_path)
    bundle.chmod(0)
    try:
        run = run_cli("diagnose", "--bundle", str(bundle), as_unprivileged=True)
    finally:
        bundle.chmod(0o755)
    assert run.rc == exitcodes.UNREADABLE_INPUT, run.stderr
    assert_one_clean_line(run, "manifest.json", "permission denied")


# --- bundles from a newer writer ---------------------------------------------------------------------

def _verdict_kind(value: str):
    from wedgectl.model.types import VerdictKind

    return VerdictKind(value)


def _recorded_verdict():
    return _verdict_kind(json.loads(_fixture_files()["verdict.json"])["verdict"])


def _extracted(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for name, data in _fixture_files().items():
        (bundle / name).write_bytes(data)
    return bundle


def _edit_samples(bundle: Path, edit) -> None:
    samples = [json.loads(line) for line in (bundle / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        edit(s)
    (bundle / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_unknown_enum_values_read_as_unknown_and_still_classify(tmp_path):
    bundle = _extracted(tmp_path)
    before = run_cli("diagnose", "--bundle", str(bundle), "--json")

    def newer(sample: dict) -> None:
        router = dict(sample["processes"][0], pid=999_999, role="router", name="vllm-router", threads=[])
        sample["processes"].append(router | {"numa_node": 0})  # and a key this reader does not know
        sample["failures"].append({"collector": "gpu", "kind": "quota_exceeded", "message": "no", "target": ""})
        sample["probes"].append({"kind": "gpu_kernel", "tid": 1})
        sample["attention_backend"] = "flash"

    _edit_samples(bundle, newer)
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").write_text(json.dumps(manifest | {"compression": "zstd", "signature": {"alg": "x"}}))
    verdict = json.loads((bundle / "verdict.json").read_text())
    (bundle / "verdict.json").write_text(json.dumps(verdict | {"verdict": "kv_thrash"}))
    run = run_cli("diagnose", "--bundle", str(bundle), "--json")
    assert run.rc == before.rc == exitcodes.VERDICT_CODES[_recorded_verdict()], run.stderr
    assert "Traceback" not in run.stderr and run.message == ""
    payload = json.loads(run.stdout)
    assert payload["verdict"] == json.loads(before.stdout)["verdict"]
    assert payload["recorded_verdict"] == "inconclusive"  # a verdict this reader does not know


@pytest.mark.parametrize("field,value,path", [
    ("cpu_user_s", "lots", "processes[0].cpu_user_s: expected a number, found a string"),
    ("threads", {"tid": 1}, "processes[0].threads: expected an array, found an object"),
    ("pid", 1.5, "processes[0].pid: expected an integer, found a number"),
    ("role", 7, "processes[0].role: expected a string, found a number"),
    ("cmdline", [1, 2], "processes[0].cmdline[0]: expected a string, found a number"),
])
def test_wrong_types_exit_23_naming_the_field(tmp_path, field, value, path):
    bundle = _extracted(tmp_path)

    def wrong(sample: dict) -> None:
        sample["processes"][0][field] = value

    _edit_samples(bundle, wrong)
    run = run_cli("diagnose", "--bundle", str(bundle))
    assert run.rc == exitcodes.BAD_BUNDLE, run.stderr
    assert_one_clean_line(run, "samples.jsonl line 1", path)


@pytest.mark.parametrize("member,text,needle", [
    ("samples.jsonl", '{"t": 1.0, "health_status": NaN}\n', "not valid JSON"),
    ("samples.jsonl", "[" * 100_000 + "\n", "samples.jsonl line 1"),
    ("samples.jsonl", '{"t": 1' + "0" * 5000 + "}\n", "not valid JSON"),
    ("samples.jsonl", '{"t": 1e400}\n', "samples.jsonl line 1: t: number out of range"),
    ("samples.jsonl", '{"t": 1.0, "stacks": [{"pid": 1, "t": 1.0, "threads": [{"frames": [3]}]}]}\n',
     "stacks[0].threads[0].frames: expected an array of objects"),
    ("verdict.json", '{"verdict": "idle", "confidence": "high", "summary": "", "rule": ""}', "verdict.json: confidence"),
    ("manifest.json", '{"format": "wedgectl-bundle", "version": true}', "manifest.json: version: expected an integer"),
])
def test_json_that_would_crash_a_reader_exits_23(tmp_path, member, text, needle):
    bundle = _extracted(tmp_path)
    (bundle / member).write_text(text)
    run = run_cli("diagnose", "--bundle", str(bundle))
    assert run.rc == exitcodes.BAD_BUNDLE, run.stderr
    assert_one_clean_line(run, needle)


def test_every_exit_code_is_in_the_readme():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = {v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)}
    codes |= set(exitcodes.VERDICT_CODES.values())
    rows = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")}
    assert {str(code) for code in codes} <= rows, sorted(codes - {int(r) for r in rows if r.isdigit()})
