"""What this host supports for the probes: each back-end (rawtp, bcc, bpftrace, /proc), whether it can run, and why not.

rawtp where its program loads (collect/ebpfraw.py: x86_64, Linux 5.18+, BTF;
futexwait and offcpu only, no wake table), the cheapest and needing no tool;
else bcc where it can compile (the bcc module and this kernel's headers); else
bpftrace, which needs only tracepoints; else the /proc reader. Every eBPF
back-end needs root (or CAP_BPF + CAP_PERFMON); bcc and bpftrace also need
tracefs with the tracepoints. tracefs is mounted once when missing, and only when permitted: by
root or with CAP_SYS_ADMIN, unless WEDGECTL_NO_MOUNT_TRACEFS is set; a mount
always says so on stderr. A Host seam (a root path and the tools) lets unit
tests run detection on recorded host trees.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wedgectl.collect.procfs import PROC, parse_exec_start
from wedgectl.collect.control import run_bounded
from wedgectl.probes import DEFAULT_PROBES, load_probe
from wedgectl.model.types import BackendStatus

BACKENDS = ("rawtp", "bcc", "bpftrace", "procfs")
EBPF_BACKENDS = ("rawtp", "bcc", "bpftrace")
DISABLE_ENV = "WEDGECTL_PROBES_DISABLE"  # e.g. "bcc,bpftrace": force the fallback order in tests
NO_MOUNT_ENV = "WEDGECTL_NO_MOUNT_TRACEFS"  # any value: never mount tracefs, use what is mounted
MAX_ENTRIES = 4096  # per BPF map
CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39


@dataclass(frozen=True)
class Host:
    """The seam for back-end detection: a root to look for /sys, /lib/modules and bcc under, and the tools."""

    root: Path = Path("/")
    which: Callable[[str], str | None] = shutil.which
    euid: Callable[[], int] = os.geteuid
    release: str = field(default_factory=platform.release)
    machine: str = field(default_factory=platform.machine)
    cap_eff: Callable[[], int | None] = lambda: _cap_eff()
    mount_tracefs: bool = True  # try `mount -t tracefs` when it is missing (live hosts, NO_MOUNT_ENV unset)
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)


def _cap_eff() -> int | None:
    try:
        for line in (PROC / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _tracefs_dirs(host: Host) -> tuple[Path, ...]:
    return (host.root / "sys/kernel/tracing", host.root / "sys/kernel/debug/tracing")


def find_tracefs(host: Host = Host()) -> Path | None:
    for d in _tracefs_dirs(host):
        if (d / "events").is_dir():
            return d
    return None


def ensure_tracefs(host: Host = Host(), timeout: float = 5.0) -> tuple[Path | None, str]:
    """The tracefs mount with the tracepoints, mounting it once if needed; (None, why) when there is none."""
    found = find_tracefs(host)
    if found is not None:
        return found, f"tracefs at {found}"
    target = _tracefs_dirs(host)[0]
    if os.environ.get(NO_MOUNT_ENV):
        return None, f"tracefs is not mounted at {target} ({NO_MOUNT_ENV} is set: wedgectl does not mount it)"
    if not _may_mount(host):
        return None, f"tracefs is not mounted at {target}; mounting it needs root or CAP_SYS_ADMIN"
    if not host.mount_tracefs or host.root != Path("/"):
        return None, f"tracefs is not mounted at {target}"
    if not target.is_dir():
        return None, f"{target} does not exist (kernel without CONFIG_TRACEFS?)"
    # A mount changes the host for everyone: never silently, and the operator can forbid it.
    host.say(f"wedgectl: mounting tracefs at {target} for the eBPF probes (it stays mounted; "
             f"{NO_MOUNT_ENV}=1 prevents this)")
    try:
        r = subprocess.run(["mount", "-t", "tracefs", "nodev", str(target)], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"tracefs is not mounted at {target} and `mount -t tracefs` failed: {exc}"
    if r.returncode != 0 or find_tracefs(host) is None:
        why = (r.stderr or r.stdout).strip() or f"exit {r.returncode}"
        return None, f"tracefs is not mounted at {target} and `mount -t tracefs nodev {target}` failed: {why}"
    return target, f"tracefs mounted at {target} by wedgectl"


def _may_mount(host: Host) -> bool:
    """Root, or CAP_SYS_ADMIN: what mount(2) needs. Nobody else gets to try."""
    caps = host.cap_eff()
    if caps is not None:
        return bool(caps >> CAP_SYS_ADMIN & 1)
    return host.euid() == 0


def _privileged(host: Host) -> str | None:
    """None when we may load BPF programs and attach tracepoints, else why not."""
    if host.euid() == 0:
        return None
    caps = host.cap_eff()
    if caps is not None and (caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1)):
        return None
    return "needs root, or CAP_BPF + CAP_PERFMON (CAP_SYS_ADMIN on kernels before 5.8)"


def _missing_tracepoints(tracefs: Path, probes: Sequence[str]) -> list[str]:
    missing = []
    for name in probes:
        for tp in load_probe(name).TRACEPOINTS:
            group, event = tp.split(":")
            if not (tracefs / "events" / group / event).is_dir():
                missing.append(tp)
    return missing


def _cannot_attach(host: Host, probes: Sequence[str], tracefs: Path | None, tracefs_why: str) -> str | None:
    """Why neither eBPF back-end could attach the probes' tracepoints here (privilege, tracefs), or None."""
    if (why := _privileged(host)) is not None:
        return why
    if tracefs is None:
        return tracefs_why
    if missing := _missing_tracepoints(tracefs, probes):
        return f"tracepoints missing: {', '.join(missing)}"
    return None


def bcc_python_path(host: Host = Host()) -> Path | None:
    """Where Debian's python3-bpfcc put the bcc module (pure Python over libbcc: any python3 can import it)."""
    spec = importlib.util.find_spec("bcc") if host.root == Path("/") else None
    if spec is not None and spec.origin:
        return Path(spec.origin).parent.parent
    debian = host.root / "usr/lib/python3/dist-packages"
    for d in sorted((host.root / "usr/lib").glob("python3*/*-packages")) + [debian]:
        if (d / "bcc" / "__init__.py").exists():
            return d
    return None


def kernel_headers(host: Host = Host()) -> str | None:
    """Where bcc would find this kernel's headers, or None."""
    mods = host.root / "lib/modules" / host.release
    if (mods / "build" / "include").is_dir() or (mods / "source" / "include").is_dir():
        return str(mods / "build")
    if (host.root / "sys/kernel/kheaders.tar.xz").exists():
        return str(host.root / "sys/kernel/kheaders.tar.xz")
    if any(mods.glob("kernel/kernel/kheaders.ko*")):
        return f"{mods}/kernel/kernel/kheaders.ko (loaded by bcc on demand)"
    return None


def check_bcc(host: Host, probes: Sequence[str], tracefs: Path | None, tracefs_why: str,
              verify: bool = False) -> BackendStatus:
    where = bcc_python_path(host)
    if where is None:
        return BackendStatus("bcc", False, "the bcc Python module is not installed (Debian: python3-bpfcc)")
    headers = kernel_headers(host)
    if headers is None:
        mods = host.root / "lib/modules" / host.release
        return BackendStatus("bcc", False, f"bcc cannot compile: no kernel headers for {host.release} "
                             f"({mods}/build missing, no /sys/kernel/kheaders.tar.xz: CONFIG_IKHEADERS off)")
    if (why := _cannot_attach(host, probes, tracefs, tracefs_why)) is not None:
        return BackendStatus("bcc", False, why)
    if verify:
        ok, why = _trial_bcc(where)
        if not ok:
            return BackendStatus("bcc", False, f"bcc could not compile a tracepoint program: {why}")
    return BackendStatus("bcc", True, f"bcc from {where}; kernel headers at {headers}")


def _bpftrace_version(path: str) -> str:
    try:
        r = run_bounded([path, "--version"], capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "bpftrace (version unknown)"


def check_bpftrace(host: Host, probes: Sequence[str], tracefs: Path | None, tracefs_why: str,
                   verify: bool = False) -> BackendStatus:
    path = host.which("bpftrace")
    if path is None:
        return BackendStatus("bpftrace", False, "bpftrace is not installed (Debian: apt-get install bpftrace)")
    if (why := _cannot_attach(host, probes, tracefs, tracefs_why)) is not None:
        return BackendStatus("bpftrace", False, why)
    version = _bpftrace_version(path) if host.root == Path("/") else "bpftrace"
    tps = sorted({tp for n in probes for tp in load_probe(n).TRACEPOINTS})
    btf = host.root / "sys/kernel/btf/vmlinux"
    reason = f"{version}; " + (f"tracepoints {', '.join(tps)}" if tps else "uprobes") + f"; {tracefs_why}"
    reason += f"; BTF at {btf}" if btf.exists() else "; no BTF (tracepoints need none)"
    if verify:
        ok, why = _trial_bpftrace(path, probes)
        if not ok:
            return BackendStatus("bpftrace", False, f"bpftrace could not attach: {why}")
    return BackendStatus("bpftrace", True, reason)


def check_rawtp(host: Host, probes: Sequence[str]) -> BackendStatus:
    """The in-process back-end (collect/ebpfraw.py): futexwait and offcpu on raw sched_switch, loaded
    through bpf(2); no tracefs, no tool to install, no wake tracing. On a live host the program is
    loaded once (not attached), so that a kernel whose verifier refuses it falls to the next
    eBPF back-end rather than to /proc."""
    from wedgectl.collect import ebpfraw

    if (why := ebpfraw.unsupported(probes, host.machine, host.release)) is not None:
        return BackendStatus("rawtp", False, why)
    if (why := _privileged(host)) is not None:
        return BackendStatus("rawtp", False, why)
    btf = host.root / "sys/kernel/btf/vmlinux"
    if not btf.exists():
        return BackendStatus("rawtp", False, f"no kernel BTF at {btf} (CONFIG_DEBUG_INFO_BTF): the program reads "
                             "task fields at the offsets it gives")
    if host.root == Path("/"):
        try:
            ebpfraw.trial(tuple(probes))
        except (OSError, ValueError) as exc:
            return BackendStatus("rawtp", False, f"rawtp's program did not load: {exc}")
    return BackendStatus("rawtp", True, f"{' + '.join(probes)} on raw sched_switch through bpf(2), in-process; "
                         f"BTF at {btf}; no wake tracing (who called FUTEX_WAKE is not seen)")


def check_procfs(host: Host, proc_root: Path = PROC) -> BackendStatus:
    sched = proc_root / "self" / "sched"
    try:
        text = sched.read_text()
    except OSError:
        return BackendStatus("procfs", True, "futex addresses from /proc/PID/task/TID/syscall only: no "
                             "/proc/PID/sched (CONFIG_SCHED_DEBUG off), so no wait durations")
    if parse_exec_start(text) is None:
        return BackendStatus("procfs", True, "futex addresses from /proc; /proc/PID/sched has no se.exec_start")
    return BackendStatus("procfs", True, "futex addresses from /proc/PID/task/TID/syscall, wait durations from "
                         "se.exec_start in .../sched (CONFIG_SCHED_DEBUG); no wake tracing")


def disabled_backends(disable: Iterable[str] | None = None) -> frozenset[str]:
    names = set(disable or ())
    names |= {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    return frozenset(names)


def detect_backends(probes: Sequence[str] = DEFAULT_PROBES, host: Host = Host(), *,
                    disable: Iterable[str] | None = None, verify: bool = False,
                    proc_root: Path = PROC) -> tuple[BackendStatus, ...]:
    """Every back-end in preference order, each with whether it can run here and why (not)."""
    off = disabled_backends(disable)
    tracefs, tracefs_why = (None, "")
    if not {"bcc", "bpftrace"} <= off:
        tracefs, tracefs_why = ensure_tracefs(host)
    out = []
    for name in BACKENDS:
        if name in off:
            out.append(BackendStatus(name, False, f"disabled ({DISABLE_ENV} or --backend)"))
        elif name == "bcc":
            out.append(check_bcc(host, probes, tracefs, tracefs_why, verify))
        elif name == "bpftrace":
            out.append(check_bpftrace(host, probes, tracefs, tracefs_why, verify))
        elif name == "rawtp":
            out.append(check_rawtp(host, probes))
        else:
            out.append(check_procfs(host, proc_root))
    return tuple(out)


def choose_backend(statuses: Sequence[BackendStatus]) -> BackendStatus | None:
    return next((s for s in statuses if s.available), None)


def _trial_bpftrace(path: str, probes: Sequence[str]) -> tuple[bool, str]:
    tps = sorted({tp for n in probes for tp in load_probe(n).TRACEPOINTS})
    text = "".join(f"tracepoint:{tp} /pid == 0/ {{ }}\n" for tp in tps) + "BEGIN { exit(); }\n"
    try:
        r = run_bounded([path, "-e", text], capture_output=True, text=True, timeout=20,
                        env=bpftrace_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return r.returncode == 0, stderr_summary(r.stderr) or f"exit {r.returncode}"


def _trial_bcc(where: Path) -> tuple[bool, str]:
    code = "from bcc import BPF; BPF(text='TRACEPOINT_PROBE(sched, sched_switch) { return 0; }')"
    try:
        r = run_bounded([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60,
                        env=bcc_env(where))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return r.returncode == 0, stderr_summary(r.stderr) or f"exit {r.returncode}"


def bpftrace_env(max_entries: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # both spellings: bpftrace <= 0.18 reads the first, later ones the second
    env["BPFTRACE_MAP_KEYS_MAX"] = str(max_entries or MAX_ENTRIES)
    env["BPFTRACE_MAX_MAP_KEYS"] = str(max_entries or MAX_ENTRIES)
    return env


def bcc_env(where: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if where is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(where)) if p)
    return env


_NOISE = ("couldn't set RLIMIT_MEMLOCK",)  # no CAP_SYS_RESOURCE; memcg accounting makes it harmless


def stderr_summary(text: str, most: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not any(n in ln for n in _NOISE)]
    return " | ".join(lines[-most:])[:400]


def host_notes(host: Host = Host()) -> tuple[str, ...]:
    """Kernel features the probes could use that this kernel lacks, one line each."""
    tracefs = find_tracefs(host)
    if tracefs is None:
        return ()
    notes = []
    if not (tracefs / "kprobe_events").exists():
        notes.append("kprobes: not in this kernel (CONFIG_KPROBES off); the probes need none")
    if not (tracefs / "uprobe_events").exists():
        notes.append("uprobes: not in this kernel (CONFIG_UPROBE_EVENTS off): no pylockwait")
    return tuple(notes)


def forced_backend_status(name: str, probes: Sequence[str] = DEFAULT_PROBES, host: Host = Host()) -> BackendStatus:
    """Whether back-end NAME can run here, the others counted as disabled."""
    statuses = detect_backends(probes, host, disable=set(BACKENDS) - {name})
    return next(s for s in statuses if s.name == name)


def kernel_label(host: Host = Host()) -> str:
    """'6.18.44, x86_64': what the back-end list is about."""
    return f"{host.release}, {platform.machine()}"


def program_summaries(names: Sequence[str]) -> list[tuple[str, str, str]]:
    """(name, summary, overhead) of each probe, for `wedgectl probes`."""
    return [(n, load_probe(n).SUMMARY, load_probe(n).OVERHEAD) for n in names]
