"""A process's engine report: found where the wedge_engine plugin writes it, opened safely, read bounded.

The report is the engine's own word (docs/bundle.md, "engine"), written by a thread in the target, so
it answers where ptrace cannot (no CAP_SYS_PTRACE, Yama): a file read, no waiting, nothing asked of
the target. Where it is looked for, in order (the first report that passes every check wins):

1. the directory in wedgectl's own WEDGE_ENGINE_REPORT_DIR (absolute);
2. the process's own WEDGE_ENGINE_REPORT_DIR, from /proc/PID/environ when that is readable (often it
   is not: another user's process; which is why the report exists);
3. /tmp/wedge-engine-reports-<the process's euid> (the writer's default: literally /tmp);

each also under /proc/PID/root/ when that is readable and is not our own root (a container's /tmp).
A file is opened O_NOFOLLOW|O_NONBLOCK relative to its directory's descriptor (a swapped path changes
nothing, a FIFO never blocks); the directory must be owned by the process's euid or root and writable
by no one else, the file regular, owned by the same, and at most ENGINE_REPORT_MAX_BYTES. Its pid and
proc_start_ticks must be the live process's: else it is an earlier process's report with that pid.
Every failure is the reading's reason (model.engine: NOT_FOUND, UNREADABLE, NOT_OURS, TOO_BIG,
MALFORMED, STALE_PROCESS, GONE); nothing raises. Seams: the proc root, the environment, /tmp, the clock.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from wedgectl.collect import procfs, procread
from wedgectl.model import bounds as B
from wedgectl.model.engine import (GONE, MALFORMED, NOT_FOUND, NOT_OURS, STALE_PROCESS, TOO_BIG, UNREADABLE,
                                   EngineReading, EngineReport)
from wedgectl.read.enginereport import parse_report

REPORT_DIR_ENV = "WEDGE_ENGINE_REPORT_DIR"
TMP = "/tmp"  # the writer's default lies under /tmp itself, not $TMPDIR, so a reader knowing a pid finds it
DEFAULT_DIR = "wedge-engine-reports-{uid}"
FILE_NAME = "wedge-engine-{pid}.report.json"
ENVIRON_TIMEOUT_S = 0.5  # /proc/PID/environ is read under the target's mmap lock: abandoned past this
FUTURE_SLACK_NS = 1_000_000_000  # a report written later than now by more than this is not on our clock
_MEMO_MAX = 512  # processes whose directories are remembered (pid, start) -> where to look
# O_PATH: the directory is 0711 (others may open a file they can name, never list it): opening it to read
# would need the read bit, an O_PATH descriptor needs only search, and serves as dir_fd and for fstat.
_OPEN_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class _Process:
    """What a process says of itself that does not change while it lives: its euid, the pid it knows
    itself by, and its own WEDGE_ENGINE_REPORT_DIR (None: unset, relative or unreadable)."""

    euid: int
    own_pid: int
    env_dir: str | None


_memo: dict[tuple[str, int, int], _Process] = {}
_memo_lock = threading.Lock()


def _process_env_dir(pid: int, proc_root: Path) -> tuple[str | None, bool]:
    """(the process's own WEDGE_ENGINE_REPORT_DIR when absolute, whether that answer may be kept): a read
    refused or gone is kept (it will not change for this process), one that timed out is not."""
    try:
        env, _ = procread.read_environ(pid, proc_root, timeout=ENVIRON_TIMEOUT_S)
    except TimeoutError:
        return None, False
    except OSError:
        return None, True
    value = env.get(REPORT_DIR_ENV, "")
    return (value if value.startswith("/") else None), True


def _roots(pid: int, proc_root: Path) -> tuple[str, ...]:
    """"" (our own root), then the process's root when readable and not ours."""
    root = f"{proc_root}/{pid}/root"
    try:
        theirs, ours = os.stat(root), os.stat("/")
    except OSError:
        return ("",)
    return ("",) if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino) else ("", root)


def where_to_look(pid: int, euid: int, proc_root: Path = procfs.PROC, environ: Mapping[str, str] | None = None,
                  tmp: str = TMP, env_dir: str | None = None) -> tuple[str, ...]:
    """The directories a pid's report may lie in, in the order they are tried (the module's docstring)."""
    own = (os.environ if environ is None else environ).get(REPORT_DIR_ENV, "")
    bases = [d for d in (own if own.startswith("/") else None, env_dir, f"{tmp}/{DEFAULT_DIR.format(uid=euid)}") if d]
    out: list[str] = []
    for base in bases:
        for root in _roots(pid, proc_root):
            path = root + base
            if path not in out:
                out.append(path)
    return tuple(out)


def _identify(pid: int, ticks: int, proc_root: Path) -> _Process | None:
    """The process's _Process, read once per process (pid and start) and remembered."""
    key = (str(proc_root), pid, ticks)
    with _memo_lock:
        known = _memo.get(key)
    if known is not None:
        return known
    uids = procfs.owner_uids(pid, proc_root)
    if uids is None:
        return None
    env_dir, keep = _process_env_dir(pid, proc_root)
    found = _Process(uids[1], procfs.innermost_pid(pid, proc_root) or pid, env_dir)
    if keep:
        with _memo_lock:
            if len(_memo) >= _MEMO_MAX:
                _memo.pop(next(iter(_memo)))
            _memo[key] = found
    return found


def _errno_reason(exc: OSError, what: str) -> str:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"{NOT_FOUND}: {what}"
    if exc.errno == errno.ELOOP:
        return f"{NOT_OURS}: {what} is a symbolic link (not followed)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{UNREADABLE}: EACCES on {what}"
    return f"{UNREADABLE}: {errno.errorcode.get(exc.errno or 0, 'error')} on {what}"


def _owner_problem(st: os.stat_result, euid: int, what: str) -> str | None:
    if st.st_uid not in (euid, 0):
        return f"{NOT_OURS}: {what} is owned by uid {st.st_uid}; the process runs as uid {euid}"
    return None


def _read_file(directory: str, name: str, euid: int) -> bytes | str:
    """The bytes of directory/name, or the reason they were not read."""
    path = f"{directory}/{name}"
    try:
        dfd = os.open(directory, _OPEN_DIR)
    except OSError as exc:
        return _errno_reason(exc, directory)
    try:
        dst = os.fstat(dfd)
        problem = _owner_problem(dst, euid, directory)
        if problem:
            return problem
        if dst.st_mode & 0o022:
            return f"{NOT_OURS}: {directory} is writable by others (mode {stat.S_IMODE(dst.st_mode):04o})"
        try:
            fd = os.open(name, _OPEN_FILE, dir_fd=dfd)
        except OSError as exc:
            return _errno_reason(exc, path)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"{NOT_OURS}: {path} is not a regular file"
        problem = _owner_problem(st, euid, path)
        if problem:
            return problem
        cap = B.ENGINE_REPORT_MAX_BYTES
        if st.st_size > cap:
            return f"{TOO_BIG}: {path} holds {st.st_size} bytes (at most {cap})"
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, cap + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > cap:
            return f"{TOO_BIG}: {path} grew past {cap} bytes"
        return b"".join(chunks)
    except OSError as exc:
        return _errno_reason(exc, path)
    finally:
        os.close(fd)


def _check(report: EngineReport, pid: int, proc: _Process, ticks: int, now_ns: int) -> str | None:
    """Why a parsed report is not this process's current one, or None."""
    if report.pid not in (pid, proc.own_pid):
        return f"{MALFORMED}: it names pid {report.pid}, not {pid}"
    if report.proc_start_ticks != ticks:
        return (f"{STALE_PROCESS}: written by an earlier process with pid {pid} (started at tick "
                f"{report.proc_start_ticks}, this one at {ticks}); ignored")
    if report.written_mono_ns > now_ns + FUTURE_SLACK_NS:
        return (f"{MALFORMED}: written {(report.written_mono_ns - now_ns) / 1e9:.1f} s ahead of this host's "
                "monotonic clock (another time namespace?)")
    return None


def _age_s(then_ns: int | None, now_ns: int) -> float | None:
    return None if then_ns is None else min(B.MAX_DURATION_S, max(0.0, (now_ns - then_ns) / 1e9))


def read_engine_report(pid: int, proc_root: Path = procfs.PROC, environ: Mapping[str, str] | None = None,
                       tmp: str = TMP, clock: Callable[[], int] = time.monotonic_ns) -> EngineReading:
    """pid's engine report, or the reason there is none. Never raises; no wait beyond one bounded read of
    /proc/PID/environ the first time a process is met."""
    t = time.time()
    try:
        ticks = procfs.start_ticks(pid, proc_root)
        proc = None if ticks is None else _identify(pid, ticks, proc_root)
        if ticks is None or proc is None:
            return EngineReading(pid, t, error=f"{GONE}: pid {pid} exited or its /proc is unreadable")
        first_problem: tuple[str, str] | None = None
        dirs = where_to_look(pid, proc.euid, proc_root, environ, tmp, proc.env_dir)
        inside = f"{proc_root}/{pid}/root/"
        for directory in dirs:
            # inside the process's own root, its file is named by the pid it knows itself by (a container's)
            own = (proc.own_pid, pid) if directory.startswith(inside) else (pid,)
            for name in dict.fromkeys(FILE_NAME.format(pid=p) for p in own):
                got = _read_file(directory, name, proc.euid)
                path = f"{directory}/{name}"
                parsed = parse_report(got) if isinstance(got, bytes) else got
                if isinstance(parsed, EngineReport):
                    now = clock()
                    problem = _check(parsed, pid, proc, ticks, now)
                    if problem is None:
                        since = parsed.stage.since_mono_ns if parsed.stage is not None else None
                        return EngineReading(pid, t, path, parsed, None, _age_s(parsed.written_mono_ns, now),
                                             None if since is None or since > now else _age_s(since, now))
                    parsed = problem
                if first_problem is None and not parsed.startswith(NOT_FOUND):
                    first_problem = (path, parsed)
        if first_problem is not None:
            return EngineReading(pid, t, first_problem[0], error=first_problem[1])
        return EngineReading(pid, t, error=f"{NOT_FOUND}: no report in {', '.join(dirs)}")
    except Exception as exc:  # noqa: BLE001 - a collector reports failure as data; none is expected here
        return EngineReading(pid, t, error=f"{UNREADABLE}: {type(exc).__name__}: {str(exc)[:120]}")


def read_engine_reports(pids: Iterable[int], proc_root: Path = procfs.PROC,
                        environ: Mapping[str, str] | None = None, tmp: str = TMP,
                        clock: Callable[[], int] = time.monotonic_ns) -> tuple[EngineReading, ...]:
    """One reading per pid, in the order given."""
    return tuple(read_engine_report(p, proc_root, environ, tmp, clock) for p in pids)
