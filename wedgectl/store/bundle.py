"""Evidence bundles on disk: a directory or a .tar.gz holding manifest, samples, log and verdict.

The format is written down in docs/bundle.md. Raw data (metrics text, /proc
fields, py-spy JSON, log lines) is kept as captured so a newer classifier can
re-read an old bundle. Bundles come from other hosts and other people, so the
reader is bounded: it streams archives through a capped decompressor, reads
tar headers itself (`tarsafe`), and checks every field's JSON type against the model.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import io
import itertools
import json
import math
import os
import stat
import time
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from wedgectl.model import bounds
from wedgectl.model.errors import BadBundle, UnreadableInput, UnwritableOutput
from wedgectl.read.redact import redact_obj, redact_text
from wedgectl.store.sources import MAX_LOG_BYTES, open_regular, stat_input
from wedgectl.store.tarsafe import read_members
from wedgectl.model.types import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    Bundle,
    FailureKind,
    Manifest,
    Role,
    Sample,
    StackDump,
    Verdict,
    VerdictKind,
)

MANIFEST = "manifest.json"
SAMPLES = "samples.jsonl"
LOG = "log.txt"
VERDICT = "verdict.json"
MEMBERS = (MANIFEST, SAMPLES, LOG, VERDICT)

# Bounds on what a bundle may make us read (docs/bundle.md). A member's size is known from its tar
# header, so an oversized one is refused before a byte of it is inflated.
MAX_MEMBER_BYTES = MAX_LOG_BYTES + (64 << 20)  # log.txt holds up to a MAX_LOG_BYTES log tail, re-terminated
MAX_ARCHIVE_BYTES = 2 * MAX_MEMBER_BYTES  # everything inflated from one archive, skipped members included
MAX_HEADER_BYTES = 64 << 10  # one pax / GNU long-name header; tarfile parses big ones in quadratic time
MAX_ARCHIVE_MEMBERS = 1000  # a bundle has four files; a million empty ones is an attack on our time

# A value a newer writer added to an enum reads as the enum's catch-all (docs/bundle.md).
UNKNOWN_ENUM_VALUE: dict[type, enum.Enum] = {
    Role: Role.OTHER,
    FailureKind: FailureKind.ERROR,
    VerdictKind: VerdictKind.INCONCLUSIVE,
}
_MAX_INT = 1 << 64  # futex addresses and syscall arguments are unsigned 64-bit; nothing in a bundle is larger


def to_jsonable(obj: Any) -> Any:
    """dataclasses.asdict, with enums as their values and tuples as lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


# --- JSON to the model: every field's JSON type is checked against the dataclass annotation ----------

class _FieldError(Exception):
    """A value of the wrong JSON type: path is where it sits ('processes[0].cpu_user_s')."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or 'the record'}: {problem}")


_SKIP = object()  # a record of a kind this reader does not know: left out


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _record_kind(cls: type) -> Any:
    """The 'kind' a record class is tagged with (ProbeResult: 'probe'), or None."""
    return next((f.default for f in dataclasses.fields(cls) if f.name == "kind"), None)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """value (parsed JSON) as type tp; _FieldError when its JSON type is wrong."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        records = [a for a in options if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if len(records) > 1:  # tagged records (ProbeRecord): pick by "kind"; a newer kind is left out
            kind = value.get("kind") if isinstance(value, dict) else None
            chosen = next((a for a in records if _record_kind(a) == kind), None)
            return _SKIP if chosen is None else _build(chosen, value, path)
        return _convert(options[0], value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise _FieldError(path, f"expected an array, found {_json_kind(value)}")
        item = typing.get_args(tp)[0]
        out = (_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
        return tuple(v for v in out if v is not _SKIP)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _FieldError(path, f"expected an object, found {_json_kind(value)}")
        item = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        return {k: _convert(item, v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if not isinstance(value, str):
            raise _FieldError(path, f"expected a string, found {_json_kind(value)}")
        try:
            return tp(value)
        except ValueError:
            if tp in UNKNOWN_ENUM_VALUE:
                return UNKNOWN_ENUM_VALUE[tp]
            raise _FieldError(path, f"unknown value {value[:40]!r}") from None
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int and number and isinstance(value, int):
        if abs(value) > _MAX_INT:
            raise _FieldError(path, "number out of range")
        return value
    if tp is float and number:
        if abs(value) > _MAX_INT or not math.isfinite(value):
            raise _FieldError(path, "number out of range")
        return value
    wanted = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
    raise _FieldError(path, f"expected {wanted}, found {_json_kind(value)}")


def _build(cls: type, data: Any, path: str = "") -> Any:
    """A dataclass from a JSON object: unknown keys are ignored (newer writers add some)."""
    if not isinstance(data, dict):
        raise _FieldError(path, f"expected an object, found {_json_kind(data)}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _FieldError(where, "missing")
    for name, value in kwargs.items():
        _check_range(name, value, f"{path}.{name}" if path else name)
    if cls is StackDump:
        _check_pyspy_threads(kwargs.get("threads", ()), path)
    return cls(**kwargs)


# Times and durations are range-checked as they are read (docs/bundle.md): a sample time of 1e18 passed
# the type check, then broke the date a report prints (issue 33). A field named in TIME_FIELDS is a unix
# time, 0 (not recorded) up to wedgectl.model.bounds.MAX_UNIX_TIME; one whose name ends in _s holds seconds,
# 0 up to MAX_DURATION_S (a per-CPU clock offset may be negative). tests/test_security_numbers.py checks
# that every float of the model is one or the other.
TIME_FIELDS = frozenset({"t", "created", "started", "ended", "wait_started", "written_unix"})
_SIGNED_SECONDS = frozenset({"clock_offsets_s"})
# A process's cumulative bytes read (/proc/PID/io): 0 up to bounds.MAX_IO_BYTES, what the collector keeps.
BYTE_COUNTER_FIELDS = frozenset({"io_rchar", "io_read_bytes"})


def _check_range(name: str, value: Any, path: str) -> None:
    if name in TIME_FIELDS:
        lo, hi, what = 0.0, bounds.MAX_UNIX_TIME, "a unix time"
    elif name in BYTE_COUNTER_FIELDS:
        lo, hi, what = 0, bounds.MAX_IO_BYTES, "a count of bytes"
    elif name.endswith("_s"):
        lo, hi, what = (-bounds.MAX_DURATION_S if name in _SIGNED_SECONDS else 0.0), bounds.MAX_DURATION_S, "seconds"
    else:
        return
    items = value.items() if isinstance(value, dict) else (("", value),)
    for key, v in items:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not bounds.in_range(v, lo, hi):
            where = f"{path}.{key}" if key else path
            raise _FieldError(where, f"{v!r} is out of range for {what} ({bounds.describe(lo, hi)})")


def _check_pyspy_threads(threads: tuple[dict[str, Any], ...], path: str) -> None:
    """py-spy dumps stay raw, but the readers in stacks.py rely on their shape: frames are objects."""
    for i, thread in enumerate(threads):
        frames = thread.get("frames")
        if frames is not None and not (isinstance(frames, list) and all(isinstance(f, dict) for f in frames)):
            raise _FieldError(f"{path}.threads[{i}].frames", "expected an array of objects")


def from_jsonable(cls: type, data: Any, where: str) -> Any:
    """A model dataclass from parsed JSON; BadBundle naming the field when a value has the wrong type."""
    try:
        return _build(cls, data)
    except _FieldError as exc:
        raise BadBundle(f"{where}: {exc}") from None


def _loads(data: bytes | str, where: str) -> Any:
    """json.loads that refuses NaN/Infinity and reports every failure as BadBundle."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(data, parse_constant=refuse)
    except UnicodeDecodeError:
        raise BadBundle(f"{where} is not UTF-8 text") from None
    except RecursionError:
        raise BadBundle(f"{where} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN, an integer of thousands of digits
        raise BadBundle(f"{where} is not valid JSON (truncated?): {str(exc)[:80]}") from None


def encode(bundle: Bundle) -> dict[str, bytes]:
    """The bundle as {file name: bytes}, every string redacted (docs/bundle.md says what goes)."""
    files = {
        MANIFEST: json.dumps(redact_obj(to_jsonable(bundle.manifest)), indent=2).encode(),
        SAMPLES: "".join(json.dumps(redact_obj(to_jsonable(s))) + "\n" for s in bundle.samples).encode(),
        LOG: "".join(redact_text(line.rstrip("\n")) + "\n" for line in bundle.log_lines).encode(),
    }
    if bundle.verdict is not None:
        files[VERDICT] = json.dumps(redact_obj(to_jsonable(bundle.verdict)), indent=2).encode()
    return files


def decode(files: dict[str, bytes], origin: str) -> Bundle:
    """Rebuild a bundle from its files; BadBundle says what is wrong, naming the file and field."""
    if MANIFEST not in files:
        raise BadBundle(f"{origin}: not a wedgectl bundle (no {MANIFEST})")
    raw_manifest = _loads(files[MANIFEST], f"{origin}: {MANIFEST}")
    if not isinstance(raw_manifest, dict) or raw_manifest.get("format") != BUNDLE_FORMAT:
        raise BadBundle(f"{origin}: not a wedgectl bundle (manifest format is not {BUNDLE_FORMAT!r})")
    version = raw_manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BadBundle(f"{origin}: {MANIFEST}: version: expected an integer, found {_json_kind(version)}")
    if version > BUNDLE_VERSION:
        raise BadBundle(
            f"{origin}: bundle format v{version} is newer than this wedgectl reads (v{BUNDLE_VERSION}); upgrade "
            "wedgectl"
        )
    manifest = from_jsonable(Manifest, raw_manifest, f"{origin}: {MANIFEST}")
    samples = []
    for n, line in enumerate(files.get(SAMPLES, b"").splitlines(), 1):
        if line.strip():
            where = f"{origin}: {SAMPLES} line {n}"
            samples.append(from_jsonable(Sample, _loads(line.decode("utf-8", errors="replace"), where), where))
    log_lines = tuple(files.get(LOG, b"").decode("utf-8", errors="replace").splitlines())
    verdict = None
    if VERDICT in files:
        where = f"{origin}: {VERDICT}"
        verdict = from_jsonable(Verdict, _loads(files[VERDICT], where), where)
    return Bundle(manifest=manifest, samples=tuple(samples), log_lines=log_lines, verdict=verdict)


# --- writing: only new files, in directories of our own ----------------------------------------------

# A bundle file is created, never opened: an existing file or link at its name (planted by someone who
# would read what we write, or pointing at a file of ours) is refused, not truncated or followed.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_NAME_TRIES = 100  # wedgectl-top-STAMP-1.tar.gz ... when one second saw several bundles


def _refusal(path: Path, exc: OSError) -> UnwritableOutput:
    """One line saying why nothing was written at path."""
    shown = os.path.abspath(path)
    if isinstance(exc, FileExistsError):
        return UnwritableOutput(f"{shown}: already exists; a bundle is written only to a new path")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):  # O_DIRECTORY|O_NOFOLLOW: ENOTDIR
        return UnwritableOutput(f"{shown}: is a symbolic link; not followed")
    if exc.errno == errno.ENOTDIR:
        return UnwritableOutput(f"{shown}: not a directory (or under a file)")
    return UnwritableOutput(f"{shown}: cannot write a bundle here: {exc.strerror or exc}")


def _unsafe_dir(st: os.stat_result) -> str | None:
    """Why a directory is no place for bundles, or None: it must be ours and writable by us alone, as
    wedgectl makes it. In a directory another user owns or may write, they could swap, plant or read."""
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_bundle_dir(path: str | Path, fresh: bool = False, create: bool = True) -> int:
    """A directory to write bundles into, as a descriptor (O_DIRECTORY|O_NOFOLLOW) that every later
    step is relative to, so a path swapped afterwards changes nothing. Made 0700 when missing (its
    missing parents too) if create; with fresh, an existing one is refused; an existing one must not be
    a link, and must be owned by our euid and writable by no one else. UnwritableOutput says why not."""
    path = Path(path)
    made = False
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _refusal(path.parent, exc) from None
        try:
            os.mkdir(path, 0o700)
            made = True
        except FileExistsError:
            if fresh:
                raise _refusal(path, FileExistsError()) from None
        except OSError as exc:
            raise _refusal(path, exc) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refusal(path, exc) from None
    try:
        problem = _unsafe_dir(os.fstat(fd))
        if problem:
            raise UnwritableOutput(f"{os.path.abspath(path)}: {problem}; bundles go only into a directory of your own")
        if made:
            os.fchmod(fd, 0o700)  # on the descriptor: a chmod by path would follow a link swapped in
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create(name: str | Path, dir_fd: int | None, shown: Path) -> BinaryIO:
    """A new file, mode 0600 from its first byte; UnwritableOutput when anything is at its name."""
    try:
        fd = os.open(name, _CREATE, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(shown, exc) from None
    return os.fdopen(fd, "wb")


def _write_archive(files: dict[str, bytes], fh: BinaryIO, top: str) -> None:
    import tarfile  # here, not at the top: only a run that writes or reads a bundle pays for it

    with tarfile.open(fileobj=fh, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            info.mtime = int(time.time())
            info.mode = 0o600
            tar.addfile(info, io.BytesIO(data))


def _archive_top(name: str) -> str:
    return name.removesuffix(".tar.gz").removesuffix(".tgz") or "bundle"


def _unlink_own(path: Path) -> None:
    """Remove a regular file of ours (our euid, not a link) at path: anything else stays, and the
    writer then refuses it."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass


def write_bundle(bundle: Bundle, path: str | Path, replace_own: bool = False) -> Path:
    """Write to a new directory, or to a new .tar.gz when the path ends so. Returns the path.

    Only the owner may read it: files and the archive 0600, the directory 0700 (a bundle holds
    command lines, paths and logs even with secrets redacted). Nothing that exists is written over:
    an existing file, directory or link at path is refused (UnwritableOutput), as is every failure
    to write. replace_own (a .tar.gz in a folder of the caller's own, as repro's): a file of ours
    there is removed first, and the new one made in its place."""
    path = Path(path)
    files = encode(bundle)
    try:
        if path.name.endswith((".tar.gz", ".tgz")):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _refusal(path.parent, exc) from None
            if replace_own:
                _unlink_own(path)
            with _create(path, None, path) as fh:
                _write_archive(files, fh, _archive_top(path.name))
            return path
        dir_fd = open_bundle_dir(path, fresh=True)
        try:
            for name, data in files.items():
                with _create(name, dir_fd, path / name) as fh:
                    fh.write(data)
        finally:
            os.close(dir_fd)
    except OSError as exc:  # a write that failed half way (a full disk)
        raise _refusal(path, exc) from None
    return path


def write_archive_at(bundle: Bundle, dir_fd: int, names: Iterable[str], shown: str | Path = "") -> str:
    """Write the bundle as a .tar.gz into the directory dir_fd (open_bundle_dir's), under the first
    of names (plain file names) that is free. Returns that name; UnwritableOutput when none is."""
    files = encode(bundle)
    for name in itertools.islice(names, _MAX_NAME_TRIES):
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a plain file name: {name!r}")
        try:
            fd = os.open(name, _CREATE, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _refusal(Path(shown) / name, exc) from None
        try:
            with os.fdopen(fd, "wb") as fh:
                _write_archive(files, fh, _archive_top(name))
        except OSError as exc:
            raise _refusal(Path(shown) / name, exc) from None
        return name
    raise UnwritableOutput(f"{os.path.abspath(shown)}: every name tried for the bundle is taken")


def write_bundle_in(bundle: Bundle, directory: str | Path, names: Iterable[str]) -> Path:
    """Write the bundle as a .tar.gz into directory (made 0700, or an existing one of ours:
    open_bundle_dir), under the first of names that is free. Returns its path."""
    dir_fd = open_bundle_dir(directory)
    try:
        return Path(directory) / write_archive_at(bundle, dir_fd, names, directory)
    finally:
        os.close(dir_fd)


# --- reading archives: streamed, inflated under a cap, tar headers read here (store.tarsafe) ----------

def read_archive(fh: BinaryIO, origin: str) -> dict[str, bytes]:
    """The bundle's files from a tar (gzipped or not) stream, within MAX_* bounds (tarsafe.read_members:
    tarfile does not walk the archive, and headers are capped)."""
    return read_members(fh, origin, MEMBERS, max_member_bytes=MAX_MEMBER_BYTES, max_archive_bytes=MAX_ARCHIVE_BYTES,
                        max_header_bytes=MAX_HEADER_BYTES, max_members=MAX_ARCHIVE_MEMBERS)


def _read_member(path: Path) -> bytes | None:
    """One file of a bundle directory (None when absent), refused when not regular or too big."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        st = stat_input(path)  # raises with the message for this error
    if st.st_size > MAX_MEMBER_BYTES:
        raise BadBundle(f"{path}: {st.st_size} bytes (at most {MAX_MEMBER_BYTES}); refused")
    with open_regular(path) as fh:
        data = fh.read(MAX_MEMBER_BYTES + 1)
    if len(data) > MAX_MEMBER_BYTES:
        raise BadBundle(f"{path}: more than {MAX_MEMBER_BYTES} bytes; refused")
    return data


def read_bundle(path: str | Path) -> Bundle:
    """Read a bundle directory or archive; InputNotFound / UnreadableInput / BadBundle on bad input."""
    path = Path(path)
    if stat.S_ISDIR(stat_input(path).st_mode):
        files = {name: data for name in MEMBERS if (data := _read_member(path / name)) is not None}
        return decode(files, str(path))
    try:
        with open_regular(path) as fh:
            files = read_archive(fh, str(path))
    except OSError as exc:
        raise UnreadableInput(f"{path}: {exc.strerror or exc}") from None
    return decode(files, str(path))
