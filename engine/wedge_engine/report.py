"""The engine report: one small JSON file per vLLM process saying where it is and what its scheduler holds.

Pure Python, no vLLM. The contract with wedgectl's reader is
schema 1 of issue 37 ("The engine report"); what fills the
role-specific fields (the stage hooks, the scheduler reading) is
``fixes/report.py``.

Where: ``$WEDGE_ENGINE_REPORT_DIR`` when set and absolute, else
``/tmp/wedge-engine-reports-<euid>`` (literally /tmp: a reader that knows only
the pid and its owner finds it). The directory is made 0711 (others may open a
file whose name they know, never list it) and refused, with one log line, when
it is a link, someone else's, or writable by group or others. Each process
writes ``wedge-engine-<pid>.report.json`` (0644) through a ``.tmp`` sibling
opened ``O_CREAT|O_EXCL|O_NOFOLLOW`` and ``os.replace``: a reader never sees a
half-written report, and a link planted in the directory is never written
through. Reports of pids that are gone are removed when a writer starts and
when one exits: a process SIGKILLed (vLLM's own shutdown kills its EngineCore
and Workers; a hang ends that way) cannot remove its own.

When: a daemon thread ("wedge-engine-report") rewrites it every
``REPORT_INTERVAL_S``. It takes no lock the engine takes and never raises into
vLLM; a failure is logged once until a write succeeds again. Stacks
(``sys._current_frames``) are taken only while a stage other than a steady one
("idle", "serving") is older than ``STACKS_AFTER_S``, at most once per
``STACKS_AFTER_S``, and are kept until the stage changes. Frames are listed
innermost first (as py-spy prints them); a deeper stack keeps its innermost
``MAX_FRAMES``. A process that counts steps (the engine core) carries its last
``HISTORY`` writes' ``[written_mono_ns, steps, model_steps]`` (``history``,
oldest first, this write last), so one read shows whether its steps rise.

Cost: ``Stage.enter`` is one ``monotonic_ns`` and one attribute store of a
tuple (it runs several times per engine step); the thread wakes once a second
and writes about 1-4 KiB.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import multiprocessing.util
import os
import re
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("vllm.wedge_engine")

SCHEMA = 1
REPORT_ENV = "WEDGE_ENGINE_REPORT"
REPORT_DIR_ENV = "WEDGE_ENGINE_REPORT_DIR"
REPORT_INTERVAL_S = 1.0
REPORT_MAX_BYTES = 262144
STACKS_AFTER_S = 5.0
MAX_REQUESTS = 20
MAX_THREADS = 64
MAX_FRAMES = 48
MAX_STR = 200
MAX_ID = 128
HISTORY = 5  # the last writes' (written_mono_ns, steps, model_steps) each report carries; the reader keeps 8
THREAD_NAME = "wedge-engine-report"
DIR_MODE = 0o711
FILE_MODE = 0o644
# Stages a process may rightly sit in for ever (no stacks for them): an engine or worker waiting for work,
# an API server serving (its stage runs from start-up on).
STEADY_STAGES = frozenset({"idle", "serving"})
# Our role names (fixes.process_role) as the schema spells them.
ROLES = {"api": "api_server", "engine": "engine_core", "worker": "worker"}

_now_ns = time.monotonic_ns


class ReportDirError(OSError):
    """The report directory is not one only we can write in; no report is written."""


# ------------------------------------------------------------------ the stage


class Stage:
    """Where the process is: (name, phase, since_mono_ns), replaced whole on every change.

    ``enter`` is one clock read and one attribute store (hooks run several times per engine step); the
    report thread reads ``current`` once, so it always sees a name with its own phase and time.
    """

    __slots__ = ("current",)

    def __init__(self, name: str = "starting", phase: str | None = None) -> None:
        self.current: tuple[str, str | None, int] = (name, phase, _now_ns())

    def enter(self, name: str, phase: str | None = None) -> None:
        self.current = (name, phase, _now_ns())


# ------------------------------------------------------------------ where it lives


def default_dir(environ: Mapping[str, str] | None = None) -> str:
    """$WEDGE_ENGINE_REPORT_DIR when set and absolute, else /tmp/wedge-engine-reports-<euid>."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(REPORT_DIR_ENV, "")
    if chosen and os.path.isabs(chosen):
        return chosen
    return f"/tmp/wedge-engine-reports-{os.geteuid()}"


def report_dir(environ: Mapping[str, str] | None = None) -> str:
    """The report directory, made 0711 if missing; ReportDirError when it is not safely ours.

    Refused: a symlink, a non-directory, another owner, group- or other-writable. Checked with lstat, then
    again on the directory opened O_NOFOLLOW (so the checked directory is the one the mode is set on).
    """
    path = default_dir(environ)
    created = False
    try:
        os.mkdir(path, DIR_MODE)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise ReportDirError(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ReportDirError(f"cannot stat {path}: {exc.strerror or exc}") from None
    _check_dir(path, st)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ReportDirError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        _check_dir(path, os.fstat(fd))
        if created:
            os.fchmod(fd, DIR_MODE)  # the umask may have taken the others' search bit
    finally:
        os.close(fd)
    return path


def _check_dir(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ReportDirError(f"{path} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise ReportDirError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise ReportDirError(f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}")
    if st.st_mode & 0o022:
        raise ReportDirError(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})")


def report_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"wedge-engine-{pid}.report.json")


_REPORT_NAME = re.compile(r"wedge-engine-(\d+)\.report\.json(\.tmp)?")


def remove_stale(directory: str, limit: int = 4096) -> int:
    """Remove the reports (and tmps) of pids that no longer exist; the number removed.

    A process killed in a hang (SIGKILL, os._exit) cannot remove its own; without this they would pile up.
    A pid that exists again is left: its new owner replaces the file, and the reader checks start ticks."""
    removed = 0
    try:
        names = os.listdir(directory)[:limit]
    except OSError:
        return 0
    for name in names:
        match = _REPORT_NAME.fullmatch(name)
        if match is None or not _gone(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (killed, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read(4096)
    except OSError:
        return True
    state = text[text.rfind(b")") + 2:][:1]
    return state in (b"Z", b"X")


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data` (0644): a fresh `path`.tmp (O_EXCL|O_NOFOLLOW, a stale one unlinked), then
    os.replace. A reader sees the old report or the new one, never part of one."""
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)  # a tmp left by a crash, or a planted link: unlink removes the link, not its target
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ------------------------------------------------------------------ what goes in


def proc_start_ticks(stat_text: str | None = None) -> int | None:
    """Field 22 of /proc/self/stat (start time in clock ticks), read after the last ')' of the comm field."""
    try:
        if stat_text is None:
            with open("/proc/self/stat", "rb") as handle:
                stat_text = handle.read(4096).decode("ascii", "replace")
        fields = stat_text[stat_text.rindex(")") + 2:].split()
        return int(fields[19])  # fields after the comm start at field 3: 22 - 3
    except (OSError, ValueError, IndexError):
        return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def clip(value: Any, limit: int = MAX_STR) -> str:
    """`value` as a string of at most `limit` characters."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit]


def blocks_for(tokens: int, block_size: int | None) -> int | None:
    """ceil(tokens / block_size); None when the block size is unknown."""
    if not block_size or block_size <= 0:
        return None
    return math.ceil(max(0, tokens) / block_size)


def format_frames(frame: Any, limit: int = MAX_FRAMES) -> list[dict]:
    """A thread's frames from its innermost `frame` outwards, at most `limit` (the innermost kept)."""
    out: list[dict] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append({"file": clip(code.co_filename), "line": frame.f_lineno or 0, "function": clip(code.co_name)})
        frame = frame.f_back
    return out


def capture_stacks(reason: str, frames: Mapping[int, Any] | None = None, names: Mapping[int, str] | None = None,
                   skip: frozenset[int] = frozenset(), now_ns: int | None = None) -> dict:
    """{"reason", "taken_mono_ns", "threads"}: every thread's stack but `skip`'s (sys._current_frames by
    default), the main thread first, at most MAX_THREADS."""
    frames = sys._current_frames() if frames is None else frames
    if names is None:
        names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    main = threading.main_thread().ident
    order = sorted((tid for tid in frames if tid not in skip), key=lambda tid: (tid != main, tid))
    threads = [{"name": clip(names.get(tid, "?")), "id": tid, "frames": format_frames(frames[tid])}
               for tid in order[:MAX_THREADS]]
    return {"reason": clip(reason), "taken_mono_ns": _now_ns() if now_ns is None else now_ns, "threads": threads}


def encode_bounded(report: dict, max_bytes: int = REPORT_MAX_BYTES) -> bytes:
    """`report` as compact JSON of at most `max_bytes`: request samples beyond MAX_REQUESTS dropped, then, to
    fit, the stacks, then request samples (halved until it fits). `report` is changed in place."""
    report["requests"] = list(report.get("requests") or ())[:MAX_REQUESTS]

    def encode() -> bytes:
        return json.dumps(report, separators=(",", ":"), allow_nan=False, default=str).encode()

    data = encode()
    if len(data) <= max_bytes:
        return data
    report["stacks"] = None
    data = encode()
    while len(data) > max_bytes and report["requests"]:
        report["requests"] = report["requests"][: len(report["requests"]) // 2]
        data = encode()
    if len(data) > max_bytes:  # only a caller's oversized field can get here: keep what the reader needs first
        keep = ("schema", "pid", "proc_start_ticks", "role", "vllm", "seq", "written_mono_ns", "written_unix",
                "interval_s", "stage")
        for key in list(report):
            if key not in keep:
                report[key] = [] if key == "requests" else None
        data = encode()
    return data


# ------------------------------------------------------------------ the writer


class Reporter:
    """Builds this process's report: the common head, the stage, the role's fields, stacks when overdue."""

    def __init__(self, role: str, vllm: str | None, stage: Stage, collect: Callable[[], dict] | None = None,
                 pid: int | None = None) -> None:
        self.role = ROLES.get(role, role)
        self.vllm = clip(vllm) if vllm else None
        self.stage = stage
        self.collect = collect
        self.pid = os.getpid() if pid is None else pid
        self.start_ticks = proc_start_ticks()
        self.seq = 0
        self.interval_s = REPORT_INTERVAL_S
        self._stacks: dict | None = None
        self._stacks_stage: tuple | None = None
        self._stacks_taken_ns: int | None = None
        self.collect_failed = False
        self._history: deque[list[int]] = deque(maxlen=HISTORY)  # [written_mono_ns, steps, model_steps], oldest first

    def build(self, now_ns: int | None = None, skip_threads: frozenset[int] = frozenset()) -> dict:
        now = _now_ns() if now_ns is None else now_ns
        current = self.stage.current
        name, phase, since = current
        self.seq += 1
        report: dict[str, Any] = {
            "schema": SCHEMA, "pid": self.pid, "proc_start_ticks": self.start_ticks, "role": self.role,
            "vllm": self.vllm, "seq": self.seq, "written_mono_ns": now, "written_unix": round(time.time(), 3),
            "interval_s": self.interval_s,
            "stage": {"name": clip(name), "since_mono_ns": since, "phase": clip(phase) if phase else None},
            "steps": None, "model_steps": None, "last_model_step_mono_ns": None, "scheduler": None,
            "requests_total": None, "clients": None, "requests": [], "rank": None, "stacks": None, "history": None,
        }
        if self.collect is not None:
            try:
                fields = self.collect()
            except Exception:
                if not self.collect_failed:
                    logger.exception("wedge_engine report: reading the %s state failed; reporting the stage only "
                                     "(said once)", self.role)
                self.collect_failed = True
            else:
                self.collect_failed = False
                report.update((k, v) for k, v in fields.items() if k in report and k not in ("stacks", "history"))
        report["history"] = self._history_with(now, report["steps"], report["model_steps"])
        report["stacks"] = self._stacks_for(current, now, skip_threads)
        return report

    def _history_with(self, now: int, steps: Any, model_steps: Any) -> list[list[int]] | None:
        """The last HISTORY writes' [written_mono_ns, steps, model_steps], oldest first, this one last: a reader
        that reads the report once sees the step count rise over seconds. None where the role counts no steps."""
        if not (_is_count(steps) and _is_count(model_steps)):
            return list(self._history) or None
        self._history.append([now, steps, model_steps])
        return list(self._history)

    def _stacks_for(self, current: tuple, now: int, skip_threads: frozenset[int]) -> dict | None:
        """Stacks while the stage is overdue; the same ones until the stage changes, fresh every STACKS_AFTER_S."""
        name, _phase, since = current
        if current is not self._stacks_stage:
            self._stacks, self._stacks_stage = None, current
        age_ns = now - since
        after_ns = int(STACKS_AFTER_S * 1e9)
        if name in STEADY_STAGES or age_ns < after_ns:
            return self._stacks
        if self._stacks_taken_ns is None or now - self._stacks_taken_ns >= after_ns:
            self._stacks = capture_stacks(f"stage {name} for {age_ns / 1e9:.1f} s", skip=skip_threads, now_ns=now)
            self._stacks_taken_ns = now
        return self._stacks


class ReportWriter:
    """The thread that rewrites the report every `interval_s`, and removes it at exit."""

    def __init__(self, reporter: Reporter, directory: str, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.reporter = reporter
        reporter.interval_s = interval_s
        self.directory = directory
        self.path = report_path(directory, reporter.pid)
        self.interval_s = interval_s
        self.failed = False  # the last write failed (logged once until one succeeds)
        self.writes = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # ours alone: a write and the removal at exit never interleave
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def write_once(self) -> bool:
        """Build and write one report; False (logged once) when that failed. Never raises."""
        try:
            with self._lock:
                if self._stop.is_set():
                    return False
                skip = frozenset({threading.get_ident()})
                data = encode_bounded(self.reporter.build(skip_threads=skip))
                write_atomic(self.path, data)
        except Exception as exc:
            if not self.failed:
                logger.warning("wedge_engine report: cannot write %s (%s: %s); retrying every %g s, said once",
                               self.path, type(exc).__name__, exc, self.interval_s)
            self.failed = True
            return False
        if self.failed:
            logger.info("wedge_engine report: writing %s again", self.path)
        self.failed = False
        self.writes += 1
        return True

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.write_once()
            except BaseException:  # write_once catches Exception; anything else must not end the thread silently
                if self._stop.is_set():
                    return
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        atexit.register(self.close)
        # A multiprocessing child that ends through os._exit (a forked one) skips atexit, not its finalizers.
        multiprocessing.util.Finalize(None, self.close, exitpriority=0)

    def close(self) -> None:
        """Stop writing and remove the report (best effort; only in the process that wrote it)."""
        self._stop.set()
        if os.getpid() != self._pid:  # a forked child: the report is its parent's
            return
        acquired = self._lock.acquire(timeout=2.0)
        try:
            _unlink_quietly(self.path)
            _unlink_quietly(self.path + ".tmp")
            # vLLM ends its EngineCore and Workers with SIGKILL (0.32's shutdown, timeout 0): the API server,
            # which outlives them, removes what they left.
            remove_stale(self.directory)
        finally:
            if acquired:
                self._lock.release()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread


def start_writer(reporter: Reporter, environ: Mapping[str, str] | None = None,
                 interval_s: float = REPORT_INTERVAL_S) -> ReportWriter | None:
    """Start the report thread for `reporter`; None (one log line) when the directory is refused."""
    try:
        directory = report_dir(environ)
    except ReportDirError as exc:
        logger.warning("wedge_engine report: no report for this %s process: %s", reporter.role, exc)
        return None
    remove_stale(directory)
    writer = ReportWriter(reporter, directory, interval_s)
    writer.start()
    return writer
