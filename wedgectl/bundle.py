"""Evidence bundles on disk: a directory or a .tar.gz holding manifest, samples, log and verdict.

The format is written down in docs/bundle.md. Raw data (metrics text, /proc
fields, py-spy JSON, log lines) is kept as captured so a newer classifier can
re-read an old bundle.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from wedgectl.errors import BadBundle, InputNotFound
from wedgectl.types import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    Bundle,
    CollectorFailure,
    Evidence,
    FailureKind,
    Manifest,
    MetricsScrape,
    ProcessSample,
    Role,
    Sample,
    StackDump,
    Target,
    ThreadSample,
    Verdict,
    VerdictKind,
)

MANIFEST = "manifest.json"
SAMPLES = "samples.jsonl"
LOG = "log.txt"
VERDICT = "verdict.json"
MAX_MEMBER_BYTES = 1 << 30  # refuse absurd members rather than exhaust memory


def to_jsonable(obj: Any) -> Any:
    """dataclasses.asdict, with enums as their values and tuples as lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (VerdictKind, Role, FailureKind)):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def _build(cls: type, data: Any, **convert: Any) -> Any:
    """Build a dataclass from a dict, ignoring unknown keys (newer writers may add some)."""
    if not isinstance(data, dict):
        raise BadBundle(f"expected an object for {cls.__name__}, found {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            continue
        kwargs[key] = convert[key](value) if key in convert else value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise BadBundle(f"bad {cls.__name__} record: {exc}") from None


def _tuple(fn: Any = None) -> Any:
    return lambda xs: tuple(fn(x) for x in xs) if fn else tuple(xs)


def thread_from_dict(d: dict) -> ThreadSample:
    return _build(ThreadSample, d, syscall_args=_tuple())


def process_from_dict(d: dict) -> ProcessSample:
    return _build(
        ProcessSample,
        d,
        role=Role,
        cmdline=_tuple(),
        listening=_tuple(),
        threads=_tuple(thread_from_dict),
    )


def sample_from_dict(d: dict) -> Sample:
    return _build(
        Sample,
        d,
        metrics=lambda m: None if m is None else _build(MetricsScrape, m),
        processes=_tuple(process_from_dict),
        stacks=_tuple(lambda s: _build(StackDump, s, threads=_tuple())),
        probes=_tuple(),
        failures=_tuple(lambda f: _build(CollectorFailure, f, kind=FailureKind)),
    )


def manifest_from_dict(d: dict) -> Manifest:
    return _build(
        Manifest,
        d,
        target=lambda t: _build(Target, t, pids=_tuple()),
        notes=_tuple(),
    )


def verdict_from_dict(d: dict) -> Verdict:
    return _build(
        Verdict,
        d,
        verdict=VerdictKind,
        evidence=_tuple(lambda e: _build(Evidence, e)),
        advice=_tuple(),
    )


def encode(bundle: Bundle) -> dict[str, bytes]:
    """The bundle as {file name: bytes}."""
    files = {
        MANIFEST: json.dumps(to_jsonable(bundle.manifest), indent=2).encode(),
        SAMPLES: "".join(json.dumps(to_jsonable(s)) + "\n" for s in bundle.samples).encode(),
        LOG: "".join(line.rstrip("\n") + "\n" for line in bundle.log_lines).encode(),
    }
    if bundle.verdict is not None:
        files[VERDICT] = json.dumps(to_jsonable(bundle.verdict), indent=2).encode()
    return files


def decode(files: dict[str, bytes], origin: str) -> Bundle:
    """Rebuild a bundle from its files; BadBundle says what is wrong."""
    if MANIFEST not in files:
        raise BadBundle(f"{origin}: not a wedgectl bundle (no {MANIFEST})")
    try:
        raw_manifest = json.loads(files[MANIFEST])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadBundle(f"{origin}: {MANIFEST} is not valid JSON (truncated?)") from None
    if not isinstance(raw_manifest, dict) or raw_manifest.get("format") != BUNDLE_FORMAT:
        raise BadBundle(f"{origin}: not a wedgectl bundle (manifest format is not {BUNDLE_FORMAT!r})")
    version = raw_manifest.get("version")
    if not isinstance(version, int) or version > BUNDLE_VERSION:
        raise BadBundle(
            f"{origin}: bundle format v{version} is newer than this wedgectl reads (v{BUNDLE_VERSION}); upgrade wedgectl"
        )
    manifest = manifest_from_dict(raw_manifest)
    samples = []
    text = files.get(SAMPLES, b"").decode("utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            samples.append(sample_from_dict(json.loads(line)))
        except json.JSONDecodeError:
            raise BadBundle(f"{origin}: {SAMPLES} line {n} is not valid JSON (truncated?)") from None
    log_lines = tuple(files.get(LOG, b"").decode("utf-8", errors="replace").splitlines())
    verdict = None
    if VERDICT in files:
        try:
            verdict = verdict_from_dict(json.loads(files[VERDICT]))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadBundle(f"{origin}: {VERDICT} is not valid JSON (truncated?)") from None
    return Bundle(manifest=manifest, samples=tuple(samples), log_lines=log_lines, verdict=verdict)


def write_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Write to a directory, or to a .tar.gz when the path ends so. Returns the path."""
    path = Path(path)
    files = encode(bundle)
    if path.name.endswith((".tar.gz", ".tgz")):
        path.parent.mkdir(parents=True, exist_ok=True)
        top = path.name.removesuffix(".tar.gz").removesuffix(".tgz") or "bundle"
        with tarfile.open(path, "w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(f"{top}/{name}")
                info.size = len(data)
                info.mtime = int(time.time())
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
        return path
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def _read_tar(path: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = member.name.rsplit("/", 1)[-1]
                if name not in (MANIFEST, SAMPLES, LOG, VERDICT):
                    continue
                if member.size > MAX_MEMBER_BYTES:
                    raise BadBundle(f"{path}: {member.name} is larger than {MAX_MEMBER_BYTES} bytes")
                handle = tar.extractfile(member)
                if handle is not None:
                    files[name] = handle.read()
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as exc:
        raise BadBundle(f"{path}: not a readable bundle archive ({exc or 'truncated'})") from None
    return files


def read_bundle(path: str | Path) -> Bundle:
    """Read a bundle directory or archive; InputNotFound / BadBundle on bad input."""
    path = Path(path)
    if not path.exists():
        raise InputNotFound(f"{path}: no such file or directory")
    if path.is_dir():
        files = {}
        for name in (MANIFEST, SAMPLES, LOG, VERDICT):
            p = path / name
            if p.is_file():
                try:
                    files[name] = p.read_bytes()
                except OSError as exc:
                    raise BadBundle(f"{p}: {exc.strerror}") from None
        return decode(files, str(path))
    return decode(_read_tar(path), str(path))
