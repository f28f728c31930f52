"""Bundles: round trips through a directory and a .tar.gz, and every way a bundle can be bad."""

import json
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.bundle import read_bundle, write_bundle
from wedgectl.classify import classify
from wedgectl.errors import BadBundle, InputNotFound
from wedgectl.sources import bundle_from_log

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
