"""What `swap` reads of its target from /proc: argv, environment, cwd, credentials, and the supervisor that would
restart it.

Every read is bounded in bytes and in time (procread.read_bounded): on a process
in D state a read of its cmdline or environ can block on the kernel's mm lock,
which is the very case wedgectl exists for. Parsing is kept apart from reading so unit tests
feed recorded /proc text; the readers take a ``proc_root``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from wedgectl.model import exitcodes
from wedgectl.collect import procread
from wedgectl.model.errors import NoSuchProcess, WedgectlError

PROC = Path("/proc")
STATUS_CAP = 64 * 1024
MAX_ANCESTORS = 32


class TargetUnreadable(WedgectlError):
    exit_code = exitcodes.PERMISSION


# ------------------------------------------------------------------ the command


def read_command(pid: int, proc_root: Path = PROC) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, cwd) of a process, read bounded (procread.read_bounded); NoSuchProcess when
    gone, TargetUnreadable when not ours to read, blocked, or too long to restart exactly."""
    base = proc_root / str(pid)
    try:
        raw, argv_cut = procread.read_bounded(base / "cmdline", procread.CMDLINE_CAP)
        env, env_cut = procread.read_environ(pid, proc_root)
        cwd = os.readlink(base / "cwd")
        if argv_cut or env_cut:
            raise TargetUnreadable(f"pid {pid}: its command line or environment is longer than wedgectl "
                                   f"reads, so it cannot be restarted as it was", exit_code=exitcodes.SWAP_FAILED)
        argv = [a.decode(errors="surrogateescape") for a in raw.split(b"\0") if a]
    except FileNotFoundError:
        raise NoSuchProcess(f"pid {pid}: no such process") from None
    except PermissionError:
        raise TargetUnreadable(f"pid {pid}: cannot read its environment or cwd (run as its user or root)") from None
    except TimeoutError as exc:
        raise TargetUnreadable(f"pid {pid}: {exc}", exit_code=exitcodes.SWAP_FAILED) from None
    return argv, env, cwd


def _read_text(path: Path) -> str:
    return procread.read_bounded(path, STATUS_CAP)[0].decode(errors="replace")


# ------------------------------------------------------------------ credentials


class PopenUser(TypedDict, total=False):
    """subprocess.Popen's arguments that run a child as another user (Credentials.popen_kwargs)."""

    user: int
    group: int
    extra_groups: list[int]
    preexec_fn: Callable[[], object]


@dataclass(frozen=True)
class Credentials:
    """Who a process runs as: real uid, gid and supplementary groups (from /proc/PID/status)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @property
    def popen_kwargs(self) -> PopenUser:
        """subprocess arguments that run a child as this user (nothing to change for root)."""
        if self.is_root and self.gid == 0:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def __str__(self) -> str:
        return f"uid {self.uid} gid {self.gid}"


def parse_status_credentials(text: str) -> Credentials:
    """Uid:/Gid:/Groups: of /proc/PID/status (the real ids: what the process was started as)."""
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            fields[key] = value.split()
    if not fields.get("Uid") or not fields.get("Gid"):
        raise ValueError("no Uid/Gid line")
    return Credentials(int(fields["Uid"][0]), int(fields["Gid"][0]),
                       tuple(int(g) for g in fields.get("Groups", [])))


def read_credentials(pid: int, proc_root: Path = PROC) -> Credentials:
    try:
        return parse_status_credentials(_read_text(proc_root / str(pid) / "status"))
    except FileNotFoundError:
        raise NoSuchProcess(f"pid {pid}: no such process") from None
    except (OSError, ValueError) as exc:
        raise TargetUnreadable(f"pid {pid}: cannot read who it runs as ({exc})") from None


# ------------------------------------------------------------------ supervisors


@dataclass(frozen=True)
class Supervisor:
    """Something that will restart (or replace) the server when swap stops it, and race it for the port."""

    kind: str  # "systemd", "kubernetes", "container", "supervisord", "runit", "s6"
    why: str  # the evidence: "cgroup /system.slice/vllm.service", "KUBERNETES_SERVICE_HOST in its environment"
    instead: str  # what to do rather than swap

    @property
    def line(self) -> str:
        return (f"it is run by {self.kind} ({self.why}), which would restart the old server and race the "
                f"new one for the port; instead, {self.instead} (or swap --force)")


_FIX = "WEDGE_ENGINE_FIXES=all"
# Process names of supervisors that restart a child that exits.
_SUPERVISOR_PARENTS = {
    "supervisord": "supervisord", "runsv": "runit", "s6-supervise": "s6", "supervise": "daemontools",
}
_CONTAINER_PARENTS = ("containerd-shim", "containerd-shim-runc-v2", "conmon", "runc", "crun", "docker-containerd-shim")
_CONTAINER_CGROUP = ("docker", "containerd", "crio", "libpod", "kubepods")


def parse_cgroup(text: str) -> tuple[str, ...]:
    """The cgroup paths of /proc/PID/cgroup ("0::/system.slice/x.service" -> "/system.slice/x.service")."""
    return tuple(line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2)


def parse_status_parent(text: str) -> tuple[str, int]:
    """(Name, PPid) of /proc/PID/status."""
    name, ppid = "", 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "PPid":
            ppid = int(value.strip() or 0)
    return name, ppid


def _unit(path: str) -> str | None:
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last if last.endswith(".service") and not last.startswith("user@") else None


def supervisor_from(env: Mapping[str, str], cgroups: Sequence[str], ancestors: Sequence[str],
                    own_cgroups: Sequence[str] = ()) -> Supervisor | None:
    """The supervisor these facts show, or None. Pure: fed from /proc by `detect_supervisor`.

    `ancestors` are the process names from the target's parent up; a cgroup the
    target shares with wedgectl itself (both in one container or unit) says
    nothing about who restarts the target.
    """
    cgroups = [c for c in cgroups if c not in set(own_cgroups)]
    if env.get("KUBERNETES_SERVICE_HOST") or any("kubepods" in c for c in cgroups):
        why = ("KUBERNETES_SERVICE_HOST in its environment" if env.get("KUBERNETES_SERVICE_HOST")
               else f"cgroup {next(c for c in cgroups if 'kubepods' in c)}")
        return Supervisor("kubernetes", why,
                          f"set {_FIX} in the Deployment's container env (kubectl set env deployment/NAME "
                          f"{_FIX}) and let Kubernetes roll the pods")
    for c in cgroups:
        unit = _unit(c)
        if unit:
            return Supervisor("systemd", f"cgroup {c}",
                              f"add Environment={_FIX} to {unit} (systemctl edit {unit}) and "
                              f"systemctl restart {unit}")
    if env.get("INVOCATION_ID"):
        return Supervisor("systemd", "INVOCATION_ID in its environment",
                          f"add Environment={_FIX} to its unit (systemctl edit UNIT) and systemctl restart UNIT")
    runtime = next((a for a in ancestors if a in _CONTAINER_PARENTS), None)
    if runtime or any(k in c for c in cgroups for k in _CONTAINER_CGROUP):
        why = f"{runtime} among its parents" if runtime else \
            f"cgroup {next(c for c in cgroups if any(k in c for k in _CONTAINER_CGROUP))}"
        return Supervisor("container", why,
                          f"set {_FIX} in the container's environment and restart the container "
                          f"through its runtime (docker/podman/compose)")
    if env.get("SUPERVISOR_ENABLED") or env.get("SUPERVISOR_PROCESS_NAME"):
        return Supervisor("supervisord", "SUPERVISOR_* in its environment",
                          f"add {_FIX} to the program's environment= and supervisorctl restart it")
    for name in ancestors:
        kind = _SUPERVISOR_PARENTS.get(name)
        if kind:
            return Supervisor(kind, f"{name} among its parents",
                              f"set {_FIX} in the service's environment and restart it through {kind}")
    return None


def ancestor_names(pid: int, proc_root: Path = PROC) -> list[str]:
    """Process names from pid's parent up to (not including) pid 1, bounded."""
    names: list[str] = []
    _, ppid = parse_status_parent(_read_text(proc_root / str(pid) / "status"))
    while ppid > 1 and len(names) < MAX_ANCESTORS:
        name, ppid = parse_status_parent(_read_text(proc_root / str(ppid) / "status"))
        names.append(name)
    return names


def detect_supervisor(pid: int, env: Mapping[str, str], proc_root: Path = PROC) -> Supervisor | None:
    """The supervisor that runs `pid`, from its environment, its cgroup and its parents; None if none shows."""
    try:
        cgroups = parse_cgroup(_read_text(proc_root / str(pid) / "cgroup"))
    except (OSError, ValueError):
        cgroups = ()
    try:
        own = parse_cgroup(_read_text(proc_root / "self" / "cgroup"))
    except (OSError, ValueError):
        own = ()
    try:
        ancestors = ancestor_names(pid, proc_root)
    except (OSError, ValueError):
        ancestors = []
    return supervisor_from(env, cgroups, ancestors, own)
