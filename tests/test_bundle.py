"""Bundles: round trips through a directory and a .tar.gz, and every way a bundle can be bad."""

import gzip
import io
import json
import os
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

import wedgectl.store.bundle as bundle_mod
from wedgectl.store.bundle import read_archive, read_bundle, write_bundle
from wedgectl.classify import classify
from wedgectl.model.errors import BadBundle, InputNotFound, UnreadableInput
from wedgectl.store.sources import bundle_from_log, read_log_lines
from wedgectl.model.types import FailureKind, Role

LOGS = Path(__file__).parent / "fixtures" / "logs"


@pytest.mark.parametrize("suffix", ["dir", "b.tar.gz"])
@pytest.mark.parametrize("log", ["seed000_starved.log", "seed002_deadlock.log", "seed003_cpp.log"])
def test_round_trip_reclassifies_the_same(tmp_path, suffix, log):
    b = bundle_from_log(LOGS / log)
    v = classify(b)
    path = write_bundle(replace(b, verdict=v), tmp_path / suffix)
    back = read_bundle(path)
    assert back.log_lines == b.log_lines
    assert back.verdict == v
    assert classify(back) == v


def test_missing(tmp_path):
    with pytest.raises(InputNotFound):
        read_bundle(tmp_path / "nope")


def test_foreign_directory(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(BadBundle, match="not a wedgectl bundle"):
        read_bundle(tmp_path)


def test_newer_version_is_refused(tmp_path):
    b = bundle_from_log(LOGS / "seed000_starved.log")
    path = write_bundle(b, tmp_path / "b")
    m = json.loads((path / "manifest.json").read_text())
    m["version"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BadBundle, match="newer"):
        read_bundle(path)


def test_truncated_archive(tmp_path):
    path = write_bundle(bundle_from_log(LOGS / "seed002_deadlock.log"), tmp_path / "b.tar.gz")
    data = path.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadBundle):
        read_bundle(cut)


def test_truncated_samples_line(tmp_path):
    path = write_bundle(bundle_from_log(LOGS / "seed000_starved.log"), tmp_path / "b")
    (path / "samples.jsonl").write_text('{"t": 1.0, "metrics": {"t": 1.0, "url"\n')
    with pytest.raises(BadBundle, match="line 1"):
        read_bundle(path)


def test_a_log_file_is_not_a_bundle(tmp_path):
    with pytest.raises(BadBundle):
        read_bundle(LOGS / "seed000_starved.log")


def test_archive_without_manifest(tmp_path):
    p = tmp_path / "x.tar.gz"
    other = tmp_path / "readme.txt"
    other.write_text("hi")
    with tarfile.open(p, "w:gz") as tar:
        tar.add(other, arcname="x/readme.txt")
    with pytest.raises(BadBundle, match="no manifest"):
        read_bundle(p)


# --- the bounded reader: the tar shapes other tools write, and the caps -----------------------------

def _archive_files(tmp_path, fmt=tarfile.PAX_FORMAT, top="b"):
    path = write_bundle(bundle_from_log(LOGS / "seed002_deadlock.log"), tmp_path / "src")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for p in sorted(path.iterdir()):
            tar.add(p, arcname=f"{top}/{p.name}")
    return out.getvalue(), read_bundle(path)


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_names_pax_and_gnu_headers_are_read(tmp_path, fmt):
    top = "x" * 60 if fmt == tarfile.USTAR_FORMAT else "é" * 150  # long and non-ASCII: pax / GNU long names
    raw, want = _archive_files(tmp_path, fmt, top)
    path = tmp_path / "b.tar.gz"
    path.write_bytes(gzip.compress(raw))
    assert read_bundle(path) == want


def test_plain_tar_and_concatenated_gzip_members_are_read(tmp_path):
    raw, want = _archive_files(tmp_path)
    plain = tmp_path / "b.tar"
    plain.write_bytes(raw)
    assert read_bundle(plain) == want
    split = tmp_path / "split.tar.gz"
    split.write_bytes(gzip.compress(raw[:5000]) + gzip.compress(raw[5000:]))
    assert read_bundle(split) == want


def test_member_over_the_cap_is_refused_from_its_header(tmp_path, monkeypatch):
    raw, _ = _archive_files(tmp_path)
    monkeypatch.setattr(bundle_mod, "MAX_MEMBER_BYTES", 1000)
    with pytest.raises(BadBundle, match="at most 1000"):
        read_archive(io.BytesIO(gzip.compress(raw)), "b.tar.gz")


def test_inflating_past_the_archive_cap_stops_there(tmp_path, monkeypatch):
    raw, _ = _archive_files(tmp_path)
    monkeypatch.setattr(bundle_mod, "MAX_ARCHIVE_BYTES", 4096)
    with pytest.raises(BadBundle, match="expands past 4096 bytes"):
        read_archive(io.BytesIO(gzip.compress(raw)), "b.tar.gz")


def test_too_many_members(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "MAX_ARCHIVE_MEMBERS", 5)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(30):
            tar.addfile(tarfile.TarInfo(f"b/empty{i}"), io.BytesIO(b""))
    with pytest.raises(BadBundle, match="more than 5 members"):
        read_archive(io.BytesIO(out.getvalue()), "many.tar")


def test_directory_member_over_the_cap(tmp_path, monkeypatch):
    path = write_bundle(bundle_from_log(LOGS / "seed000_starved.log"), tmp_path / "b")
    monkeypatch.setattr(bundle_mod, "MAX_MEMBER_BYTES", 100)
    with pytest.raises(BadBundle, match=r"manifest.json: \d+ bytes \(at most 100\)"):
        read_bundle(path)


def test_unknown_enum_values_read_as_the_catch_all(tmp_path):
    path = write_bundle(bundle_from_log(LOGS / "seed000_starved.log"), tmp_path / "b")
    sample = {"t": 1.0, "processes": [{"pid": 1, "ppid": 0, "role": "router", "name": "r", "gpu": 1}],
              "failures": [{"collector": "gpu", "kind": "quota", "message": "m"}]}
    (path / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    back = read_bundle(path)
    assert back.samples[0].processes[0].role is Role.OTHER
    assert back.samples[0].failures[0].kind is FailureKind.ERROR


def test_wrong_type_names_the_file_line_and_field(tmp_path):
    path = write_bundle(bundle_from_log(LOGS / "seed000_starved.log"), tmp_path / "b")
    (path / "samples.jsonl").write_text('{"t": 1.0}\n{"t": 2.0, "metrics": {"t": 2.0, "url": 5}}\n')
    with pytest.raises(BadBundle, match=r"samples.jsonl line 2: metrics.url: expected a string, found a number"):
        read_bundle(path)


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_log_that_is_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "log"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(UnreadableInput, match="FIFO|directory"):
        read_log_lines(path)


def test_a_growing_log_is_read_only_to_the_bound(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("x" * 100 + "\n" + "(APIServer pid=1) INFO 12-01 08:00:00 [a.py:1] hello\n" * 50)
    lines, notes = read_log_lines(path, max_bytes=1000)
    assert sum(len(line) + 1 for line in lines) <= 1000
    assert notes and "read its last 1000" in notes[0]
