"""The real probes on real processes: a deadlock parked before the probe attached, a wait that begins
in the window, wakes, a spinner against a parked thread, the fallback order, and every detach path."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from wedgectl import probes
from wedgectl.store.bundle import to_jsonable
from wedgectl.collect import ebpf, ebpfhost, procfs

if TYPE_CHECKING:
    from conftest import Target  # the FIFO target helper and the `spawn` fixture live in conftest.py

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TARGETS = REPO / "tests" / "targets"


def _ebpf_ready() -> str | None:
    if os.geteuid() != 0:
        return "needs root (loading eBPF programs does)"
    if shutil.which("bpftrace") is None:
        return "bpftrace is not installed (as root, tests/setup.sh installs it from Debian)"
    st = {s.name: s for s in ebpfhost.detect_backends()}
    return None if st["bpftrace"].available else st["bpftrace"].reason


NO_EBPF = _ebpf_ready()
needs_ebpf = pytest.mark.skipif(NO_EBPF is not None, reason=f"eBPF: {NO_EBPF}")


def _rawtp_ready() -> str | None:
    if NO_EBPF is not None:
        return NO_EBPF
    st = ebpfhost.check_rawtp(ebpfhost.Host(), probes.DEFAULT_PROBES)
    return None if st.available else st.reason


NO_RAWTP = _rawtp_ready()
needs_rawtp = pytest.mark.skipif(NO_RAWTP is not None, reason=f"rawtp: {NO_RAWTP}")
BACKENDS = ["bpftrace", pytest.param("rawtp", marks=needs_rawtp)]


def _threads(records: tuple) -> dict[int, dict]:
    """tid -> the thread's record as the bundle and --json carry it (typed records, or JSON already)."""
    return {r["tid"]: r for r in to_jsonable(records) if r["kind"] == "thread"}


def _header(records: tuple) -> dict:
    return next(r for r in to_jsonable(records) if r["kind"] == "probe")


def _no_probe_children() -> bool:
    """No bpftrace (or bcc runner) left among our children: everything detached."""
    def alive() -> list[psutil.Process]:
        out = []
        for c in psutil.Process().children(recursive=True):
            try:
                if c.name() == "bpftrace" or "wedgectl.collect.ebpfbcc" in " ".join(c.cmdline()):
                    out.append(c)
            except psutil.Error:
                continue
        return out
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive()


class Steal:
    """The host's steal time on the most-stolen CPU since this was made (/proc/stat).

    A wait begun before the attach is read from se.exec_start, on its CPU's task clock, which stops
    while the hypervisor steals the CPU: the probe's wait then reads short, and its start late, by
    the steal since the park (documented: a lower bound). On a quiet VM that is milliseconds; on a
    crowded host under the hogged suite it was 0.6 s of a 7 s wait. Bounds on such a wait widen by it."""

    def __init__(self) -> None:
        self.then = procfs.cpu_steal_s()

    def since(self) -> float:
        now = procfs.cpu_steal_s()
        return max((now[c] - self.then.get(c, now[c]) for c in now), default=0.0) + 0.01  # 10 ms ticks


def assert_wait_spans(wait_s: float, parked: tuple[float, float], window_end: tuple[float, float],
                      slack: float = 0.1, short_by: float = 0.0) -> None:
    """A probe measures a wait at its window's end: the wait began within `parked` and the window ended
    within `window_end` (CLOCK_MONOTONIC bounds, ours and the target's alike), so wait_s lies between the
    shortest and the longest span the two allow. Bounds, not "about now minus then": on a loaded host the
    time from the window's end to our next line (the tracer's exit, the parse) is not small. short_by: how
    much shorter it may read (a wait read from se.exec_start misses the steal time since; see Steal)."""
    lo = window_end[0] - parked[1] - slack - short_by
    hi = window_end[1] - parked[0] + slack
    assert lo <= wait_s <= hi, (wait_s, lo, hi, short_by)


def _proc_futex(pid: int, tid: int) -> int | None:
    threads, _ = procfs.read_threads(pid)
    return next(t.futex_addr for t in threads if t.tid == tid)


# --- a real deadlock, parked long before the probe attached ------------------------


@needs_ebpf
@pytest.mark.parametrize("backend", BACKENDS)
def test_deadlock_parked_before_attach(spawn: Callable[..., Target], backend: str) -> None:
    t_spawn, wall_spawn, steal = time.monotonic(), time.time(), Steal()
    target = spawn(TARGETS / "deadlock.py")
    info = target.expect("ready")
    t_ready, wall_ready = time.monotonic(), time.time()  # both threads were parked (in the second acquire) by now
    time.sleep(3.0)
    t_call = time.monotonic()
    records, failures = ebpf.run_probes([target.pid], 2.0, backend=backend)
    t_done, stolen = time.monotonic(), steal.since()
    assert not [f for f in failures if f.kind.value != "gone"], failures
    header, threads = _header(records), _threads(records)
    assert header["backend"] == backend and header["probes"] == ["futexwait", "offcpu"]
    assert 1.5 < header["window_s"] < 4.0
    for key in ("a", "b"):
        t = threads[info[key]]
        print(f"deadlock thread {key}: {t}")
        assert t["futex_addr"] == _proc_futex(target.pid, info[key]) != None  # noqa: E711
        assert t["wait_source"] == "sched" and t["parked_throughout"] is True
        # parked before the probe attached: the wait counts from the park (3 s and more before the window), not the attach
        assert_wait_spans(t["wait_s"], (t_spawn, t_ready), (t_call + header["window_s"], t_done), short_by=stolen)
        assert t["wait_s"] > 3.0 + header["window_s"] - 0.1 - stolen
        # rawtp sees no FUTEX_WAKE calls: how many were made is unknown, not none
        assert t["wakes_on_addr"] == (0 if backend == "bpftrace" else None) and t["wakers"] == [] and t["waits"] == 0
        assert t["oncpu_s"] < 0.05 and t["offcpu_s"] > 0.9 * t["window_s"]
        assert wall_spawn - 0.1 <= t["wait_started"] <= wall_ready + 0.1 + stolen, \
            (t["wait_started"], wall_spawn, wall_ready, stolen)
    assert threads[info["a"]]["futex_addr"] != threads[info["b"]]["futex_addr"]
    assert _no_probe_children()


# --- a wait that begins inside the window, and wakes ---------------------------------

WAKER = textwrap.dedent(
    """
    import sys, threading, time
    from _announce import announce, wait_until_parked

    held = threading.Lock(); held.acquire()  # never released: whoever takes it next is stuck
    ping = threading.Lock(); ping.acquire()  # released by main every 50 ms: its waiter is woken
    go = threading.Event()

    def stuck():
        go.wait()
        announce("parking", t=time.monotonic())
        held.acquire()

    def pinged():
        while True:
            ping.acquire()

    s = threading.Thread(target=stuck, daemon=True); s.start()
    p = threading.Thread(target=pinged, daemon=True); p.start()
    wait_until_parked(s.native_id); wait_until_parked(p.native_id)
    announce("ready", stuck=s.native_id, pinged=p.native_id, main=threading.get_native_id())
    sys.stdin.readline()
    go.set()
    while True:
        time.sleep(0.05)
        try:
            ping.release()
        except RuntimeError:
            pass
    """
)


@needs_ebpf
def test_wait_begun_in_window_and_who_woke_which_address(spawn: Callable[..., Target], tmp_path: Path) -> None:
    script = tmp_path / "waker.py"
    script.write_text(WAKER)
    target = spawn(script, stdin=subprocess.PIPE)
    info = target.expect("ready")
    run = ebpf.start_probes([target.pid], "on", backend="bpftrace", max_s=20)
    try:
        target.proc.stdin.write(b"go\n")
        target.proc.stdin.flush()
        t_parking = target.expect("parking")["t"]  # the target's CLOCK_MONOTONIC, the same as ours
        t_read = time.monotonic()
        time.sleep(2.0)
    finally:
        t_stop = time.monotonic()
        records, failures = run.stop()
    t_done = time.monotonic()
    assert not failures, failures
    threads = _threads(records)
    stuck, pinged = threads[info["stuck"]], threads[info["pinged"]]
    print(f"stuck: {stuck}\npinged: {pinged}")
    assert stuck["wait_source"] == "tracepoint" and not stuck["parked_throughout"]
    assert stuck["waits"] >= 1  # the lock (the Event wait began before the attach: it ends as "carried")
    assert stuck["futex_addr"] == _proc_futex(target.pid, info["stuck"])
    # it parks just after it announced: allow it a second to get there on a loaded host
    assert_wait_spans(stuck["wait_s"], (t_parking, t_read + 1.0), (t_stop, t_done))
    assert stuck["wakes_on_addr"] == 0
    # the pinged thread's lock is released by main every 50 ms: main shows as its waker. A release
    # calls FUTEX_WAKE only while the pinged thread is back in its wait, and on a loaded host main's
    # 50 ms sleeps stretch and the pinged thread waits for a CPU before it waits on the lock again
    # (measured at load 15: 19 wakes in 4.8 s, not ~96): the counts are bounded below loosely, the
    # waker exactly.
    assert pinged["waits"] >= 5 and pinged["wakes_on_addr"] >= 5 and pinged["wakers"] == [info["main"]]
    assert pinged["total_wait_s"] > 0.5 * pinged["window_s"]
    rows = [w for w in _header(records)["wakes"] if w["addr"] == pinged["futex_addr"]]
    assert rows and rows[0]["waker"] == info["main"] and rows[0]["woken"] >= 5


@needs_ebpf
def test_pylockwait_lock_pointer_is_the_futex_address(spawn: Callable[..., Target], tmp_path: Path) -> None:
    """A Python lock is a sem_t* whose first word is the futex: the uprobe's lock pointer equals futexwait's address."""
    script = tmp_path / "waker.py"
    script.write_text(WAKER)
    target = spawn(script, stdin=subprocess.PIPE)
    info = target.expect("ready")
    run = ebpf.start_probes([target.pid], "on", probes=probes.ALL_PROBES, backend="bpftrace", max_s=20)
    try:
        assert run.libs, "no libpython or python executable found for the uprobe"
        target.proc.stdin.write(b"go\n")
        target.proc.stdin.flush()
        target.expect("parking")
        time.sleep(1.5)
    finally:
        records, failures = run.stop()
    assert not failures, failures
    assert "pylockwait" in _header(records)["probes"]
    threads = _threads(records)
    stuck, pinged = threads[info["stuck"]], threads[info["pinged"]]
    print(f"stuck: {stuck}")
    assert stuck["pylock_addr"] == stuck["futex_addr"] is not None
    assert stuck["pylock_waits"] >= 1 and stuck["pylock_wait_s"] > 1.0
    assert pinged["pylock_waits"] >= 10


# --- spinning against parked -------------------------------------------------------


@needs_ebpf
@pytest.mark.parametrize("backend", BACKENDS)
def test_spinner_and_parked_thread_read_differently(spawn: Callable[..., Target], backend: str) -> None:
    target = spawn(TARGETS / "spinner.py")
    spinner = target.expect("ready")["spinner"]
    records, failures = ebpf.run_probes([target.pid], 2.0, backend=backend)
    assert _header(records)["backend"] == backend, failures
    threads = _threads(records)
    spin, main = threads[spinner], threads[target.pid]
    print(f"spinner {spin}\nmain {main}")
    w = spin["window_s"]
    assert spin["futex_addr"] is None and spin["oncpu_s"] + spin["runq_s"] > 0.8 * w and spin["offcpu_s"] < 0.2 * w
    assert main["futex_addr"] is not None and main["offcpu_s"] > 0.9 * w and main["oncpu_s"] < 0.05


# --- the fallback order, each back-end forced off ---------------------------------------


@needs_ebpf
def test_fallback_order_on_a_real_deadlock(spawn: Callable[..., Target], monkeypatch: pytest.MonkeyPatch) -> None:
    t_spawn, steal = time.monotonic(), Steal()
    target = spawn(TARGETS / "deadlock.py")
    info = target.expect("ready")
    t_ready = time.monotonic()
    addr = _proc_futex(target.pid, info["a"])
    seen = {}
    first = ("rawtp",) if NO_RAWTP is None else ("bcc", "bpftrace")
    for disabled, want in (("", first), ("rawtp", ("bcc", "bpftrace")), ("rawtp,bcc", ("bpftrace",)),
                           ("rawtp,bcc,bpftrace", ("procfs",))):
        monkeypatch.setenv(ebpfhost.DISABLE_ENV, disabled)
        t_call = time.monotonic()
        records, _ = ebpf.run_probes([target.pid], 1.0)
        t_done = time.monotonic()
        header, t = _header(records), _threads(records)[info["a"]]
        seen[disabled] = header["backend"]
        assert header["backend"] in want, (disabled, header)
        assert t["futex_addr"] == addr
        assert_wait_spans(t["wait_s"], (t_spawn, t_ready), (t_call, t_done), short_by=steal.since())
        skipped = {s["backend"]: s["reason"] for s in header["skipped"]}
        if header["backend"] == "procfs":
            assert t["wakes_on_addr"] is None and t["waits"] is None
            assert "disabled" in skipped["bpftrace"] and "disabled" in skipped["rawtp"] and "bcc" in skipped
        elif header["backend"] == "rawtp":  # it sees no wake calls: unknown, not none
            assert t["wakes_on_addr"] is None and t["waits"] == 0 and t["parked_throughout"] is True
        else:
            assert t["wakes_on_addr"] == 0
        print(f"{disabled or 'nothing'} off -> {header['backend']}; skipped: {skipped}")
    # every back-end off: still a /proc reading, said so
    monkeypatch.setenv(ebpfhost.DISABLE_ENV, "rawtp,bcc,bpftrace,procfs")
    records, _ = ebpf.run_probes([target.pid], 0.5)
    assert "every back-end is disabled" in _header(records)["reason"]
    # "on" with no eBPF back-end: the data, and a failure that says why
    monkeypatch.setenv(ebpfhost.DISABLE_ENV, "rawtp,bcc,bpftrace")
    records, failures = ebpf.run_probes([target.pid], 0.5, mode="on")
    assert any(f.kind.value == "missing_tool" and "--ebpf on" in f.message for f in failures)
    print(f"back-ends chosen: {seen}")


# --- detaching on every exit path ------------------------------------------------------


@needs_ebpf
def test_a_late_exit_keeps_the_window_the_timer_ended(spawn: Callable[..., Target]) -> None:
    """bpftrace acts on its timer's exit() in user space; on a loaded host that can come after the timer has fired
    again. Its process stopped across the second firing, the window is still the first's."""
    target = spawn(TARGETS / "deadlock.py")
    target.expect("ready")
    run = ebpf.start_probes([target.pid], "on", backend="bpftrace", max_s=2.0)  # returns once BEGIN has run
    assert run._proc is not None
    t_stop = time.monotonic()
    run._proc.send_signal(signal.SIGSTOP)
    stopped_in_window = run._proc.poll() is None and time.monotonic() - t_stop < 0.5
    time.sleep(4.5)  # the timer fires at 2 s and at 4 s, the second while bpftrace cannot act on the first
    run._proc.send_signal(signal.SIGCONT)
    records, failures = run.stop()
    header = _header(records)
    assert not failures and header["backend"] == "bpftrace", (failures, header)
    assert 1.95 <= header["window_s"] < 2.5, header  # the first firing's time; 4 s read the second's
    print(f"window {header['window_s']} s; bpftrace stopped before the first firing: {stopped_in_window}")


@needs_ebpf
def test_detach_on_timeout_error_and_ctrl_c(spawn: Callable[..., Target], monkeypatch: pytest.MonkeyPatch) -> None:
    target = spawn(TARGETS / "deadlock.py")
    info = target.expect("ready")
    # timeout: the program's own interval probe ends it; stop() still gets the maps
    run = ebpf.start_probes([target.pid], "on", backend="bpftrace", max_s=1.0)
    deadline = time.monotonic() + 15
    while run._proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run._proc.poll() is not None  # exited by itself
    records, failures = run.stop()
    # the in-kernel timer ended it, at 1 s (it exited by itself above; a late timer on a loaded host reads long)
    assert not failures and 0.95 <= _header(records)["window_s"] < 1.5, _header(records)
    assert _threads(records)[info["a"]]["wakes_on_addr"] == 0
    # error: a program bpftrace rejects -> /proc fallback with the reason, nothing left behind
    monkeypatch.setattr(ebpf, "bpftrace_program", lambda *a, **k: "BEGIN { @x = ; }\n")
    records, failures = ebpf.run_probes([target.pid], 0.5, backend="bpftrace")
    assert _header(records)["backend"] == "procfs"
    assert any("bpftrace could not start" in f.message and "syntax error" in f.message for f in failures), failures
    assert _threads(records)[info["a"]]["wait_s"] > 0
    monkeypatch.undo()
    assert _no_probe_children()
    # Ctrl-C on `wedgectl probes --pid` once the window has begun (its progress line says so):
    # the window ends, the results print, bpftrace is gone
    cli = subprocess.Popen([sys.executable, "-m", "wedgectl", "probes", "--pid", str(target.pid),
                            "--seconds", "60", "--backend", "bpftrace"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert cli.stderr is not None
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(cli.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("tracing" in line for line in said) and cli.poll() is None:
            time.sleep(0.05)
        assert any("tracing" in line and "bpftrace" in line for line in said), said
        kids = _probe_children(cli.pid)
        time.sleep(0.5)
        t0 = time.monotonic()
        cli.send_signal(signal.SIGINT)
        out, _ = cli.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
        reader.join(timeout=5)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, said
    assert out.startswith("back-end bpftrace:"), out
    window = float(out.splitlines()[1].split()[1])  # "window 0.6 s, pids [...]"
    assert 0.3 < window < 10, out
    assert kids and _gone(kids)
    # Ctrl-C while bpftrace is still compiling and attaching (sent as soon as the program's bpftrace
    # is spawned, not the `bpftrace --version` of detection): still exit 0 with results, the /proc
    # ones if the attach had not finished, saying why
    rc, out, err, kids = _ctrl_c_at_attach(["probes", "--pid", str(target.pid), "--seconds", "60",
                                            "--backend", "bpftrace", "--json"])
    assert rc == 0, err
    payload = json.loads(out)
    header = _header(tuple(payload["probes"]))
    assert header["window_s"] < 25
    if header["backend"] == "procfs":  # the usual case: bpftrace takes a good part of a second to attach
        assert any("interrupted while attaching" in f["message"] for f in payload["failures"]), payload["failures"]
        assert any(s["backend"] == "bpftrace" and "interrupted" in s["reason"] for s in header["skipped"]), header
    else:
        assert header["backend"] == "bpftrace"
    assert _threads(tuple(payload["probes"]))[info["a"]]["wait_s"] > 0
    assert _gone(kids)


@needs_rawtp
def test_rawtp_detaches_on_its_timer_and_closes_everything(spawn: Callable[..., Target]) -> None:
    """rawtp: in this process, detached by its timer at the window's end, and nothing of it left open."""
    target = spawn(TARGETS / "deadlock.py")
    info = target.expect("ready")
    before = _bpf_descriptors()
    t0 = time.monotonic()
    run = ebpf.start_probes([target.pid], "on", backend="rawtp", max_s=1.0)
    assert run.backend.name == "rawtp" and len(_bpf_descriptors()) == len(before) + 4  # 2 maps, program, link
    deadline = time.monotonic() + 15
    while run._raw.attached and time.monotonic() < deadline:
        time.sleep(0.05)
    t_seen = time.monotonic()
    assert not run._raw.attached  # the timer took it off the tracepoint
    time.sleep(0.5)
    records, failures = run.stop()
    # the window ends at the detach: a second at least, and no later than we saw it gone
    assert not failures and 1.0 <= _header(records)["window_s"] <= t_seen - t0 + 0.01, _header(records)
    assert _threads(records)[info["a"]]["parked_throughout"] and _bpf_descriptors() == before


def _bpf_descriptors() -> list[str]:
    """This process's open BPF objects (maps, programs, links), by what /proc/self/fd links to."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "bpf" in (target := os.readlink(f"/proc/self/fd/{fd}")):
                out.append(target)
        except OSError:
            continue
    return sorted(out)


def _ctrl_c_at_attach(args: list[str]) -> tuple[int, str, str, list[psutil.Process]]:
    """Run `wedgectl ARGS` and send it Ctrl-C as soon as its probe program's bpftrace is spawned:
    (exit status, stdout, stderr, that bpftrace). The detach is bounded by STOP_TIMEOUT_S, then SIGKILL."""
    cli = subprocess.Popen([sys.executable, "-m", "wedgectl", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        kids: list[psutil.Process] = []
        while time.monotonic() < deadline and not kids and cli.poll() is None:
            kids = _probe_children(cli.pid)
            time.sleep(0.01)
        assert kids, "bpftrace never started"
        t0 = time.monotonic()
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=40)
        assert time.monotonic() - t0 < ebpf.STOP_TIMEOUT_S + 5
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    return cli.returncode, out, err, kids


def _probe_children(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children(recursive=True)
                if c.name() == "bpftrace" and any(a.endswith(".bt") for a in c.cmdline())]
    except psutil.Error:
        return []


def _gone(procs: list[psutil.Process]) -> bool:
    """Every one of procs has exited (a zombie not yet reaped counts as gone)."""
    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    deadline = time.monotonic() + 5
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in procs)


# --- the CLI: `wedgectl probes` and `diagnose --json` ------------------------------------


@needs_ebpf
def test_ctrl_c_while_diagnose_attaches_leaves_no_probe_behind(spawn: Callable[..., Target],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C as soon as the capture's bpftrace program is spawned: diagnose says "interrupted"
    # (130) at once, and the half-attached bpftrace is detached, not left to its own timer
    # (rawtp, first in the order, has no child to leave behind: its descriptors close with wedgectl)
    monkeypatch.setenv(ebpfhost.DISABLE_ENV, "rawtp")
    target = spawn(TARGETS / "fake_vllm_serve.py", "serve")
    info = target.expect("ready", timeout=60)
    rc, _, err, kids = _ctrl_c_at_attach(["diagnose", "--pid", str(info["api"]), "--ebpf", "on", "--window", "30"])
    assert rc == 130 and err.strip().splitlines()[-1] == "wedgectl: interrupted", err
    assert _gone(kids)


@needs_ebpf
def test_diagnose_json_carries_per_thread_probe_results(spawn: Callable[..., Target]) -> None:
    # a stand-in deployment (API server -> EngineCore -> Worker), each main thread parked on an Event
    target = spawn(TARGETS / "fake_vllm_serve.py", "serve")
    info = target.expect("ready", timeout=60)
    time.sleep(1.0)
    r = subprocess.run([sys.executable, "-m", "wedgectl", "diagnose", "--pid", str(info["api"]), "--json",
                        "--window", "3", "--no-stacks", "--ebpf", "on"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    payload = json.loads(r.stdout)
    records = tuple(payload["probes"])
    backend = _header(records)["backend"]
    assert backend in ebpfhost.EBPF_BACKENDS
    assert {info["api"], info["engine"], info["worker"]} <= set(_header(records)["pids"])
    threads = _threads(records)
    for role in ("engine", "worker"):
        t = threads[info[role]]  # the process's main thread: tid == pid
        assert {"tid", "futex_addr", "wait_s"} <= set(t)
        assert t["futex_addr"] == _proc_futex(info[role], info[role]) and t["wait_s"] >= 3.0
        assert t["wakes_on_addr"] == (None if backend == "rawtp" else 0) and t["parked_throughout"]
    r = subprocess.run([sys.executable, "-m", "wedgectl", "probes"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0 and "<- used" in r.stdout
    print(r.stdout)


# --- rawtp: the counts at the scheduler, on waits of known length ------------------------

KNOWN_WAITS = textwrap.dedent(
    """
    import sys, threading, time
    from _announce import announce, wait_until_parked

    parked = threading.Event()  # set once the window is under way: a wait begun before the attach
    def waiter(s):
        for _ in range(3):
            threading.Event().wait(s)
            sum(range(100000))
        time.sleep(60)  # alive at the window's end, and not in a futex wait
    def carried():
        parked.wait()
        time.sleep(60)
    c = threading.Thread(target=carried, daemon=True); c.start()
    wait_until_parked(c.native_id)
    announce("ready", carried=c.native_id)
    sys.stdin.readline()
    ts = [threading.Thread(target=waiter, args=(s,), daemon=True) for s in (0.001, 0.1, 0.3)]
    [t.start() for t in ts]
    announce("started", tids=[t.native_id for t in ts])
    time.sleep(1.5)
    t = time.monotonic()
    parked.set()
    announce("released", t=t)
    sys.stdin.readline()
    """
)


@needs_rawtp
def test_rawtp_counts_known_waits_and_a_carried_one(spawn: Callable[..., Target], tmp_path: Path) -> None:
    """Threads that each wait three times on an Event for 1, 100 and 300 ms, and one parked since
    before the attach and released in the window: rawtp counts the waits over a 50 ms threshold
    and sums them, leaves the 1 ms ones out, and counts the parked one's wait from the attach as
    carried, not as a wait of its own. Bounds, not exact counts, where a loaded host can stretch a
    short wait (a wait ends when its thread is back on a CPU) or add one (the GIL is a futex too)."""
    script = tmp_path / "known.py"
    script.write_text(KNOWN_WAITS)
    target = spawn(script, stdin=subprocess.PIPE)
    carried = target.expect("ready")["carried"]
    run = ebpf.start_probes([target.pid], "on", backend="rawtp", max_s=30, min_wait_s=0.05)
    try:
        assert run.backend.name == "rawtp", run.failures
        t_attached = time.monotonic()
        target.proc.stdin.write(b"go\n")
        target.proc.stdin.flush()
        tids = target.expect("started")["tids"]
        t_released = target.expect("released", timeout=30)["t"]
        time.sleep(0.5)
    finally:
        records, failures = run.stop()
    assert not failures, failures
    header, threads = _header(records), _threads(records)
    assert header["backend"] == "rawtp" and header["wakes"] == [] and "50 ms" in header["reason"]
    short, mid, long_ = (threads[t] for t in tids)
    print(f"1 ms: {short}\n100 ms: {mid}\n300 ms: {long_}\ncarried: {threads[carried]}")
    # on a loaded host a GIL hand-off or a wait for a CPU can stretch past 50 ms now and then, and
    # counts as a futex wait (the GIL is a futex too): bounds, not exact counts, beyond the ones asked
    assert short["waits"] <= 2
    for t, each in ((mid, 0.1), (long_, 0.3)):
        assert 3 <= t["waits"] <= 5 and t["futex_addr"] is None and t["wakes_on_addr"] is None
        # each at least as long as asked (the end is the thread's return to a CPU, later on a loaded host)
        assert t["total_wait_s"] >= 3 * each - 0.005
    assert mid["total_wait_s"] < long_["total_wait_s"]
    # the parked thread's wait counts from the attach to its release, as carried: not one of its waits
    c = threads[carried]
    assert c["waits"] <= 1 and c["futex_addr"] is None and not c["parked_throughout"]
    assert c["total_wait_s"] >= t_released - t_attached - 0.05


@needs_rawtp
def test_the_kernels_count_of_a_probes_runs(spawn: Callable[..., Target]) -> None:
    """What bench/probe_overhead.py reads of a probe's cost: with the kernel's run-time statistics
    held, rawtp's program is a new program id, and its run count and time rise while a target
    thread sleeps and wakes; released, the count stops."""
    from wedgectl.collect import ebpfraw

    target = spawn(TARGETS / "deadlock.py")
    target.expect("ready")
    with ebpfraw.run_time_stats():
        before = set(ebpfraw.prog_ids())
        run = ebpf.start_probes([target.pid], "on", backend="rawtp", max_s=10)
        try:
            assert run.backend.name == "rawtp"
            new = [i for i in ebpfraw.prog_ids() if i not in before]
            assert len(new) == 1
            ns0, n0 = ebpfraw.prog_run_time(new[0])
            for _ in range(20):
                time.sleep(0.01)  # this process's sleeps are switches the program runs on too
            ns1, n1 = ebpfraw.prog_run_time(new[0])
        finally:
            run.stop()
    assert n1 - n0 >= 20 and ns1 > ns0
    deadline = time.monotonic() + 10
    while ebpfraw.prog_run_time(new[0]) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel frees a closed program after an RCU grace period
    assert ebpfraw.prog_run_time(new[0]) is None  # detached and closed: gone
