"""Property-based fuzz of the log parser and the bundle reader: any input gives a verdict or a clean error.

Deterministic (derandomize, no example database) and bounded: each example must finish within the
deadline, and inputs are small, so memory stays small too.
"""

from __future__ import annotations

import enum
import gzip
import io
import json
import tarfile
import tempfile
import time
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wedgectl.store.bundle import decode, encode, read_archive, read_bundle
from wedgectl.classify import classify
from wedgectl.model.errors import WedgectlError
from wedgectl.read.logparse import parse_log
from wedgectl.store.sources import bundle_from_log
from wedgectl.model.types import BUNDLE_FORMAT, Bundle, Manifest, Sample, Target, Verdict

FIXTURES = Path(__file__).parent / "fixtures"
PER_EXAMPLE_S = 5.0  # the deadline; an example past it is a failure, not a slow pass

FUZZ = settings(max_examples=200, deadline=timedelta(seconds=PER_EXAMPLE_S), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

REAL_LINES = [line for name in ("admission-wedge.log", "engine-deadlock.log")
              for line in (FIXTURES / "bundles" / name).read_text(errors="replace").splitlines()]
REAL_LINES += (FIXTURES / "logs" / "seed000_starved.log").read_text(errors="replace").splitlines()[:400]


def _mutated_line(draw_line: str, cut: int, insert: str) -> str:
    """A real vLLM line with a piece replaced: numbers, stamps and keywords go odd in ways text() rarely finds."""
    cut %= len(draw_line) + 1
    return draw_line[:cut] + insert + draw_line[cut + len(insert):]


log_lines = st.lists(
    st.one_of(
        st.text(max_size=300),
        st.sampled_from(REAL_LINES),
        st.builds(_mutated_line, st.sampled_from(REAL_LINES), st.integers(0, 400),
                  st.one_of(st.text(max_size=12), st.from_regex(r"-?[0-9]{1,30}(\.[0-9]{0,5})?(e[0-9]{1,4})?",
                                                                 fullmatch=True))),
    ),
    max_size=80,
)


def _verdict_or_clean_error(make) -> None:
    start = time.monotonic()
    try:
        verdict = make()
    except WedgectlError as exc:
        assert str(exc).strip(), type(exc)
        assert exc.exit_code in range(20, 40), exc
        return
    assert isinstance(verdict, Verdict), verdict
    assert time.monotonic() - start < PER_EXAMPLE_S


def _log_bundle(lines: list[str]) -> Bundle:
    return Bundle(manifest=Manifest(source="log", target=Target(log_path="fuzz.log")), log_lines=tuple(lines))


@FUZZ
@given(log_lines)
def test_log_parser_and_classifier_take_any_lines(lines):
    parsed = parse_log(lines)
    assert parsed.n_lines == len(lines)
    _verdict_or_clean_error(lambda: classify(_log_bundle(lines)))


@FUZZ
@given(st.one_of(st.binary(max_size=4000),
                 st.lists(st.sampled_from(REAL_LINES), max_size=40).map(lambda ls: "\n".join(ls).encode()),
                 st.tuples(st.lists(st.sampled_from(REAL_LINES), max_size=40), st.binary(max_size=200))
                 .map(lambda t: "\n".join(t[0]).encode() + t[1])))
def test_any_bytes_as_a_log_file(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "server.log"
        path.write_bytes(data)
        _verdict_or_clean_error(lambda: classify(bundle_from_log(path)))


# --- the bundle reader -----------------------------------------------------------------------------------

def _small_bundle_files() -> dict[str, bytes]:
    with tarfile.open(FIXTURES / "bundles" / "admission-wedge.tar.gz") as tar:
        files = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read() for m in tar if m.isfile()}
    files["samples.jsonl"] = b"".join(files["samples.jsonl"].splitlines(keepends=True)[:2])
    files["log.txt"] = b"".join(files["log.txt"].splitlines(keepends=True)[-40:])
    return files


SMALL = _small_bundle_files()


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"bundle/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


SMALL_TAR = _tar(SMALL)


def _read_and_classify(archive: bytes) -> Verdict:
    return classify(decode(read_archive(io.BytesIO(archive), "fuzz.tar.gz"), "fuzz.tar.gz"))


def _flipped(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out)


archives = st.one_of(
    st.binary(max_size=3000),
    st.binary(max_size=3000).map(gzip.compress),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=12)
    .map(lambda edits: gzip.compress(_flipped(SMALL_TAR, edits), compresslevel=1)),
    st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), min_size=1, max_size=12)
    .map(lambda edits: _flipped(SMALL_TAR, edits)),  # the headers of the first members, uncompressed
    st.integers(0, len(SMALL_TAR)).map(lambda n: gzip.compress(SMALL_TAR)[:n // 4]),  # truncated
)


@FUZZ
@given(archives)
def test_any_bytes_as_a_bundle_archive(data):
    _verdict_or_clean_error(lambda: _read_and_classify(data))


# JSON shaped like the model: each field present or not, of its own type or of any JSON type.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _mostly(typed):
    """Well typed about 19 times in 20 (a sample has dozens of fields), else any JSON value."""
    return st.integers(0, 19).flatmap(lambda n: typed if n else json_values)


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _shaped(tp, depth: int = 0):
    """A strategy for JSON that a writer of type tp might emit, now and then of the wrong type."""
    origin = typing.get_origin(tp)
    if tp is typing.Any or depth > 4:
        return json_values
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[st.none() if a is type(None) else _shaped(a, depth) for a in typing.get_args(tp)])
    if origin is tuple:
        return _mostly(st.lists(_shaped(typing.get_args(tp)[0], depth + 1), max_size=3))
    if origin is dict or tp is dict:
        return _mostly(st.dictionaries(st.text(max_size=8), json_values, max_size=3))
    if is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        required = {f.name: _shaped(hints[f.name], depth + 1) for f in fields(tp) if _required(f)}
        optional = {f.name: _shaped(hints[f.name], depth + 1) for f in fields(tp) if not _required(f)}
        return _mostly(st.fixed_dictionaries(required, optional=optional))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _mostly(st.sampled_from([m.value for m in tp] + ["from_a_newer_writer"]))
    base = {bool: st.booleans(), int: st.integers(-(1 << 66), 1 << 66),
            float: st.floats(allow_nan=False, allow_infinity=False) | st.integers(-10, 1 << 40),
            str: st.text(max_size=30)}.get(tp, json_values)
    return _mostly(base)  # mostly well typed, so the classifier sees odd values too


samples_lines = st.lists(_shaped(Sample), max_size=4)


@FUZZ
@given(samples_lines, st.one_of(st.none(), _shaped(Verdict)), st.dictionaries(st.text(max_size=8), json_values,
                                                                               max_size=3))
def test_any_json_members(samples, verdict, extra_manifest_keys):
    manifest = json.loads(SMALL["manifest.json"]) | extra_manifest_keys | {"format": BUNDLE_FORMAT, "version": 1}
    files = {
        "manifest.json": json.dumps(manifest).encode(),
        "samples.jsonl": "".join(json.dumps(s) + "\n" for s in samples).encode(),
        "log.txt": SMALL["log.txt"],
    }
    if verdict is not None:
        files["verdict.json"] = json.dumps(verdict).encode()
    _verdict_or_clean_error(lambda: classify(decode(files, "fuzz")))


@FUZZ
@given(st.lists(_shaped(Sample), max_size=3))
def test_what_the_reader_accepts_round_trips(samples):
    """A bundle the reader accepts is written and read back to the same bundle."""
    files = dict(SMALL, **{"samples.jsonl": "".join(json.dumps(s) + "\n" for s in samples).encode()})
    try:
        bundle = decode(files, "fuzz")
    except WedgectlError:
        return
    assert decode(encode(bundle), "again") == bundle


def test_the_fixture_bundles_still_read():
    for path in sorted((FIXTURES / "bundles").glob("*.tar.gz")):
        bundle = read_bundle(path)
        assert classify(bundle).verdict == bundle.verdict.verdict, path.name
