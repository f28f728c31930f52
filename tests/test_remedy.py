"""`wedgectl remedy`: the plan for each verdict class, on bundles recorded from real repros (vLLM 0.32, CPU);
the exit codes; SOCK_DESTROY on real sockets of this process; the command's refusals."""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from wedgectl.capture.diagnosis import Diagnosis
from wedgectl.classify import classify
from wedgectl.collect import sockets, sockkill
from wedgectl.lab import remedy as rm
from wedgectl.model import exitcodes
from wedgectl.model.types import Role, VerdictKind as V
from wedgectl.render.text import render_remedy
from wedgectl.store.bundle import read_bundle

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


def recorded(name: str):
    b = read_bundle(BUNDLES / f"{name}.tar.gz")
    return b, classify(b).verdict


@pytest.mark.parametrize("name, kind, action", [
    ("admission-wedge", V.ADMISSION_WEDGE, rm.IN_PLACE),
    ("orphaned-engine", V.ORPHANED_ENGINE, rm.STOP_ORPHANS),
    ("shutdown-hang", V.SHUTDOWN_HANG, rm.KILL),
    ("starved", V.STARVED, rm.NOTHING),
    ("idle", V.IDLE, rm.NOTHING),
    ("healthy-loaded", V.PROGRESSING, rm.NOTHING),
])
def test_each_class_gets_its_act(name, kind, action):
    b, got = recorded(name)
    assert got is kind
    plan = rm.plan_for(b, got, restart=False)
    assert plan.action == action and plan.why
    assert plan.acts == (action != rm.NOTHING)
    procs = next(s.processes for s in reversed(b.samples) if s.processes)
    if action == rm.IN_PLACE:  # the API server alone, and the port it listens on
        (api,) = [p for p in procs if p.role is Role.API_SERVER]
        assert plan.pids == (api.pid,) and plan.port == int(api.listening[0].rsplit(":", 1)[1])
        assert "SOCK_DESTROY" in plan.steps[0] and str(plan.port) in plan.steps[0]
    elif action in (rm.STOP_ORPHANS, rm.KILL):  # every process the evidence saw, and only those
        assert sorted(plan.pids) == sorted(p.pid for p in procs)
        assert all(str(p) in plan.steps[0] for p in plan.pids)
    else:
        assert plan.pids == () and plan.steps == ()


@pytest.mark.parametrize("name, kind", [("engine-deadlock", V.ENGINE_DEADLOCK), ("collective-hang", V.COLLECTIVE_HANG),
                                        ("startup-hang", V.STARTUP_HANG), ("engine-dead", V.ENGINE_DEAD),
                                        ("leaked-capacity", V.LEAKED_CAPACITY)])
def test_the_classes_only_a_restart_ends_need_restart(name, kind):
    b, got = recorded(name)
    assert got is kind
    without = rm.plan_for(b, got, restart=False)
    assert without.action == rm.NOTHING and without.why.endswith("run again with --restart")
    bare = rm.plan_for(b, got, restart=True)
    assert bare.action == rm.RESTART and "wedgectl swap" in bare.steps[0]
    supervised = rm.plan_for(b, got, restart=True, supervised="systemd")
    assert supervised.action == rm.RESTART and "systemd starts it again" in supervised.steps[0]


@pytest.mark.parametrize("name", ["admission-wedge", "shutdown-hang", "orphaned-engine", "engine-deadlock"])
def test_evidence_without_the_processes_gets_no_act(name):
    """--url alone (or no access to the processes): the verdict and why nothing can be done, never an act."""
    b, got = recorded(name)
    blind = replace(b, samples=tuple(replace(s, processes=()) for s in b.samples))
    for restart in (False, True):
        plan = rm.plan_for(blind, got, restart=restart)
        assert plan.action == rm.NOTHING and "run again with --pid" in plan.why and plan.pids == ()


def test_a_wedge_whose_api_server_port_was_not_seen_has_no_connection_to_end():
    b, got = recorded("admission-wedge")
    deaf = replace(b, samples=tuple(replace(s, processes=tuple(
        replace(p, listening=()) if p.role is Role.API_SERVER else p for p in s.processes)) for s in b.samples))
    plan = rm.plan_for(deaf, got, restart=False)
    assert plan.action == rm.NOTHING and "no connection to end" in plan.why


def _outcome(name: str, **kw) -> rm.Outcome:
    b, got = recorded(name)
    return rm.Outcome(Diagnosis(classify(b), b), rm.plan_for(b, got, restart=False), **kw)


def test_exit_codes_say_what_happened():
    assert _outcome("admission-wedge").exit_code == 11  # plan only: the verdict's code, as diagnose
    assert _outcome("admission-wedge", acted=True, gone=True).exit_code == exitcodes.OK
    assert _outcome("admission-wedge", acted=True, gone=False).exit_code == exitcodes.REMEDY_FAILED == 48
    assert _outcome("admission-wedge", failed="needs CAP_NET_ADMIN").exit_code == exitcodes.REMEDY_NO_PATH == 47
    assert _outcome("starved").exit_code == 10  # nothing to do: the verdict's code
    others = {v for k, v in vars(exitcodes).items() if k.isupper() and isinstance(v, int)
              and not k.startswith(("REMEDY_", "PROBES_"))} | set(exitcodes.VERDICT_CODES.values())
    assert exitcodes.REMEDY_NO_PATH not in others and exitcodes.REMEDY_FAILED not in others


def test_the_report_shows_plan_acts_and_after_and_json_carries_them():
    o = _outcome("admission-wedge", acted=True, gone=True, same_pids=True, done=["ended 127.0.0.1:5 -> 127.0.0.1:8"])
    text = "\n".join(render_remedy(o))
    assert "Remedy: end-client-connections." in text and "done: ended 127.0.0.1:5" in text
    assert "the server kept its processes (no restart)" in text and text.endswith("the hang is over")
    obj = json.loads("\n".join(render_remedy(o, as_json=True)))
    assert obj["plan"]["action"] == "end-client-connections" and obj["gone"] is True and obj["same_pids"] is True
    plan_only = "\n".join(render_remedy(_outcome("admission-wedge")))
    assert plan_only.endswith("plan only: nothing was touched; run again with --yes to carry it out")


# ------------------------------------------------------------------ SOCK_DESTROY, on this process's sockets


def _pair(family: int, host: str):
    server = socket.socket(family)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, 0))
    server.listen()
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=5)
    accepted, _ = server.accept()
    return server, client, accepted


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")])
def test_the_kernel_ends_a_servers_client_connections_and_only_those(family, host):
    """A server socket (IPv4, and IPv6 serving an IPv4 client), one client connection ended from the
    server's side; another connection of the same process, on another port, is not touched."""
    server, client, accepted = _pair(family, host)
    other_server, other_client, other_accepted = _pair(socket.AF_INET, "127.0.0.1")
    try:
        port = server.getsockname()[1]
        conns = sockkill.client_connections(os.getpid(), port)
        assert [c.remote for c in conns] == [("127.0.0.1", client.getsockname()[1])]
        assert conns[0].local == ("127.0.0.1", port)
        try:
            sockkill.destroy(conns[0])
        except OSError as exc:  # a kernel without CONFIG_INET_DIAG_DESTROY, or no CAP_NET_ADMIN
            pytest.fail(f"SOCK_DESTROY refused on this host: {exc}")
        client.settimeout(2)
        with pytest.raises(ConnectionResetError):
            client.recv(1)
        with pytest.raises(OSError) as gone:  # named by its cookie: destroyed once, then it is not there
            sockkill.destroy(conns[0])
        assert gone.value.errno == errno.ENOENT
        other_client.sendall(b"x")
        other_accepted.settimeout(2)
        assert other_accepted.recv(1) == b"x"  # untouched
        excluded = sockkill.client_connections(os.getpid(), other_server.getsockname()[1],
                                               exclude=frozenset({other_client.getsockname()[:2]}))
        assert excluded == []
    finally:
        for s in (server, client, accepted, other_server, other_client, other_accepted):
            s.close()


def test_the_destroy_request_is_what_the_kernel_reads():
    row = sockets.DiagRow(socket.AF_INET, sockets.TCP_ESTABLISHED, (bytes([127, 0, 0, 1]), 8000),
                          (bytes([10, 0, 0, 2]), 51000), b"\x01\x02\x03\x04\x05\x06\x07\x08", 4242)
    msg = sockkill.destroy_request(row, seq=7)
    length, kind, flags, seq, _pid = struct.unpack_from("=IHHII", msg)
    assert (length, kind, seq) == (len(msg), sockkill.SOCK_DESTROY, 7) and len(msg) == 16 + 56
    assert flags == sockets.NLM_F_REQUEST | sockkill.NLM_F_ACK
    family, proto, _ext, _pad, states = struct.unpack_from("=BBBBI", msg, 16)
    assert (family, proto, states) == (socket.AF_INET, socket.IPPROTO_TCP, sockkill.ALL_STATES)
    sport, dport = struct.unpack_from(">HH", msg, 24)
    assert (sport, dport) == (8000, 51000)
    assert msg[28:32] == bytes([127, 0, 0, 1]) and msg[44:48] == bytes([10, 0, 0, 2])
    assert msg[-8:] == row.cookie
    ack = struct.pack("=IHHIIi", 36, sockets.NLMSG_ERROR, 0, 7, 0, -errno.EPERM) + bytes(16)
    assert sockkill.ack_error(ack) == errno.EPERM
    assert sockkill.ack_error(struct.pack("=IHHIIi", 36, sockets.NLMSG_ERROR, 0, 7, 0, 0)) == 0
    for bad in (b"", b"\0" * 10, struct.pack("=IHHIIi", 36, 20, 0, 7, 0, 0)):
        with pytest.raises(ValueError):
            sockkill.ack_error(bad)


# ------------------------------------------------------------------ the command


def _remedy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wedgectl", "remedy", *args], capture_output=True, text=True,
                          timeout=60)


def test_remedy_needs_a_pid_and_refuses_a_dead_one_in_one_line(tmp_path):
    r = _remedy("--yes")
    assert r.returncode == exitcodes.USAGE and "--pid" in r.stderr
    r = _remedy("--url", "http://127.0.0.1:9", "-q", "--save-bundle", str(tmp_path / "u.tar.gz"))
    assert r.returncode == exitcodes.UNREACHABLE and len(r.stderr.strip().splitlines()) == 1, r.stderr
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    r = _remedy("--pid", str(gone.pid), "--save-bundle", str(tmp_path / "b.tar.gz"))
    assert r.returncode == exitcodes.NO_SUCH_PROCESS, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = _remedy("--pid", str(os.getpid()), "--save-bundle", "/dev/null")
    assert r.returncode == exitcodes.UNWRITABLE_OUTPUT and "Traceback" not in r.stderr


def test_a_zombie_or_a_reused_pid_does_not_run_as_planned():
    from wedgectl.collect.control import runs_as_planned
    from wedgectl.collect.procfs.stat import start_ticks

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ticks = start_ticks(child.pid)
        assert ticks is not None and runs_as_planned(child.pid, ticks)
        assert not runs_as_planned(child.pid, ticks + 1) and not runs_as_planned(child.pid, None)
        child.stdin.close()  # it exits; unreaped, a zombie
        deadline = time.monotonic() + 10
        while runs_as_planned(child.pid, ticks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert start_ticks(child.pid) == ticks  # still there, as a zombie
        assert not runs_as_planned(child.pid, ticks)
    finally:
        child.kill()
        child.wait()
