"""One sample of each process of a deployment (sample_process, sample_roles): its stat, CPU, RSS,
bytes read, start time, threads, sockets and accelerator devices, with procfs's reads and psutil only
where they fail; never raises, and reports what it could not read."""

from __future__ import annotations

from pathlib import Path

import psutil

from wedgectl.collect import procfs
from wedgectl.collect._failures import failure_from_oserror, permission_hint
from wedgectl.collect.roles import name_cmdline
from wedgectl.collect.sockets import TcpTables, own_tcp_addresses, sockets_from_tables
from wedgectl.model.types import CollectorFailure, FailureKind, ProcessSample, Role
from wedgectl.read.redact import redact_argv

COLLECTOR = "psutil"


# Device nodes through which a process holds an accelerator (and its memory): NVIDIA, AMD/Intel DRM,
# AMD KFD, Habana/AWS Neuron and the generic accel class.
_ACCEL_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd", "/dev/accel", "/dev/neuron", "/dev/hl")


def accelerator_devices(pid: int, proc_root: Path = procfs.PROC, links: list[str] | None = None) -> tuple[str, ...]:
    """The accelerator device nodes `pid` holds open (`links`: its procfs.fd_links, if read); () when
    none or unreadable."""
    if links is None:
        try:
            links = procfs.fd_links(pid, proc_root)
        except OSError:
            return ()
    return tuple(sorted({link for link in links if link.startswith(_ACCEL_PREFIXES)}))


# The processes whose main threads take every engine step: the EngineCore schedules it and
# collects its output, each Worker runs its shard of the model.
STEPPING_ROLES = frozenset({Role.ENGINE_CORE, Role.WORKER})

# top's memo of each process's fds, read at each tree walk (sample_roles):
# pid -> (listening addresses, established connections, accelerator devices)
FdsMemo = dict[int, tuple[tuple[str, ...], int | None, tuple[str, ...]]]


def _psutil_failure(exc: BaseException, pid: int, what: str) -> CollectorFailure:
    if isinstance(exc, psutil.NoSuchProcess):  # ZombieProcess too
        return CollectorFailure(COLLECTOR, FailureKind.GONE, f"{what}: process exited", str(pid))
    if isinstance(exc, psutil.AccessDenied):
        return CollectorFailure(COLLECTOR, FailureKind.PERMISSION, f"{what}: {permission_hint(pid)}", str(pid))
    if isinstance(exc, OSError):
        return failure_from_oserror(COLLECTOR, exc, str(pid), what, pid)
    return CollectorFailure(COLLECTOR, FailureKind.ERROR, f"{what}: {exc!r}", str(pid))


def sample_process(
    proc: psutil.Process | int,
    role: Role,
    with_threads: bool = True,
    proc_root: Path = procfs.PROC,
    timeout: float = 2.0,
    tables: tuple[TcpTables, frozenset[tuple[str, int]]] | None = None,
    threads_memo: procfs.ThreadMemo | None = None,
    fds_memo: FdsMemo | None = None,
) -> tuple[ProcessSample, tuple[CollectorFailure, ...]]:
    """One ProcessSample: state, CPU, RSS, bytes read, start time, threads (procfs), name and cmdline, sockets.

    `proc`: a psutil.Process or a pid. RSS (statm) and the start time (the stat line already read)
    are psutil's figures, read without psutil's objects: `top` samples every process every second;
    psutil is asked only where those reads fail. Never raises: whatever could not be read is left
    at its default and reported. Each blocking read is bounded by ``timeout``.
    """
    pid = proc if isinstance(proc, int) else proc.pid
    failures: list[CollectorFailure] = []
    stat, stat_failures = procfs.read_process_stat(pid, proc_root)
    failures.extend(stat_failures)
    if stat is None and any(f.kind is FailureKind.GONE for f in stat_failures):
        return ProcessSample(pid=pid, ppid=0, role=role, name="", state=""), tuple(failures)

    name = stat.comm if stat else ""
    cmdline: tuple[str, ...] = ()
    try:
        name, argv = name_cmdline(pid, proc_root, timeout, stat)
        cmdline = tuple(redact_argv(argv))  # redacted at capture: bundles never hold secrets
    except TimeoutError:
        failures.append(
            CollectorFailure(
                COLLECTOR,
                FailureKind.TIMEOUT,
                f"cmdline read blocked > {timeout:.1f}s (mmap lock held: a thread in state D?)",
                str(pid),
            )
        )
    except OSError as exc:
        failures.append(_psutil_failure(exc, pid, "name/cmdline"))

    rss = procfs.read_rss(pid, proc_root)
    started = stat.started(proc_root) if stat is not None else None
    if rss is None or started is None:
        try:
            ps = psutil.Process(pid) if isinstance(proc, int) else proc
            rss = rss if rss is not None else ps.memory_info().rss
            started = started if started is not None else _create_time(ps)
        except (psutil.Error, OSError) as exc:
            failures.append(_psutil_failure(exc, pid, "memory_info"))

    listening: tuple[str, ...] = ()
    connections: int | None = None
    devices: tuple[str, ...] = ()
    kept = fds_memo.get(pid) if fds_memo is not None else None
    if kept is not None:  # top: the ports, client connections and devices read at the last tree walk
        listening, connections, devices = kept
    else:
        try:
            links: list[str] | None = procfs.fd_links(pid, proc_root)  # read once: sockets and devices
        except OSError:
            links = None
        if tables is None:  # a lone process: a table of its own, and wedgectl's sockets read before its
            lone = TcpTables(proc_root)
            tables = (lone, own_tcp_addresses(lone))
        devices = accelerator_devices(pid, proc_root, links)
        try:
            listening, connections = sockets_from_tables(pid, *tables, links=links)
            if fds_memo is not None and links is not None:
                fds_memo[pid] = (listening, connections, devices)
        except OSError as exc:  # its fds unreadable (no CAP_SYS_PTRACE over it), or it exited
            failures.append(_psutil_failure(exc, pid, "sockets"))

    threads: tuple = ()
    if with_threads:
        # top (a memo) leaves out the switch counts: no verdict reads them, and status is the dearest read
        threads, thread_failures = procfs.read_threads(pid, proc_root, timeout=timeout, unchanged=threads_memo,
                                                       switches=threads_memo is None)
        failures.extend(thread_failures)

    main_sched = procfs.main_thread_sched(pid, proc_root) if role in STEPPING_ROLES else (None, None)
    # Bytes read: start-up progress where the CPU idles (weight loading from slow storage). Unreadable
    # without ptrace access over another user's process: None, and no failure (the classifier says so).
    io = procfs.read_io(pid, proc_root)
    sample = ProcessSample(
        pid=pid,
        ppid=stat.ppid if stat else 0,
        role=role,
        name=name,
        cmdline=cmdline,
        state=stat.state if stat else "",
        cpu_user_s=stat.utime_s if stat else 0.0,
        cpu_system_s=stat.stime_s if stat else 0.0,
        num_threads=stat.num_threads if stat else len(threads),
        rss_bytes=rss,
        listening=listening,
        connections=connections,
        threads=threads,
        started=started,
        devices=devices,
        main_quiet_s=main_sched[0],
        main_runq_s=main_sched[1],
        cpu_limit=procfs.read_cpu_limit(pid, proc_root) if role in STEPPING_ROLES else None,
        exiting=stat is not None and (stat.exiting or _killed(stat, role, proc_root)),
        io_rchar=io[0] if io is not None else None,
        io_read_bytes=io[1] if io is not None else None,
    )
    return sample, tuple(failures)


def _create_time(proc: psutil.Process) -> float | None:
    try:
        return proc.create_time()
    except (psutil.Error, OSError):
        return None


def _killed(stat: procfs.ProcessStat, role: Role, proc_root: Path) -> bool:
    """An engine process killed and yet to run its exit: as good as exited for a verdict. SIGKILL wakes
    a sleeper, so only a process that reads R or D can hold one pending: its status is read only then."""
    return role in STEPPING_ROLES and stat.state in ("R", "D") and procfs.kill_pending(stat.pid, proc_root)


def sample_roles(roles: dict[int, Role], threads_memo: procfs.ThreadMemo | None = None,
                 fds_memo: FdsMemo | None = None,
                 ) -> tuple[tuple[ProcessSample, ...], list[CollectorFailure]]:
    """One sample of each live process in `roles` (pid -> role); zombies and the exited are left out.
    `threads_memo`: top's memo of threads that have not run since its last refresh (procfs.read_threads);
    `fds_memo`: top's memo of each process's ports, established connections and devices (its fds:
    hundreds for a Worker; the TCP tables, whose read walks the kernel's whole connection hash,
    1.2 ms of CPU a table over sock_diag however few sockets it lists), kept until the tree is walked again, so the
    API server's client count in `top` is at most a walk old (5 s). A diagnose passes none."""
    if threads_memo is not None:
        threads_memo.forget_others(roles)
    failures: list[CollectorFailure] = []
    out = []
    tables = TcpTables()
    # wedgectl's own addresses read the table: only when some process's sockets will be read
    reading = any(fds_memo is None or pid not in fds_memo for pid in roles)
    ours = own_tcp_addresses(tables) if reading else frozenset()
    for pid, role in roles.items():
        sample, fails = sample_process(pid, role, tables=(tables, ours), threads_memo=threads_memo, fds_memo=fds_memo)
        if not sample.state and fails and fails[0].kind is FailureKind.GONE:
            continue  # gone before its stat was read: not part of this sample, as before it was found
        failures.extend(fails)
        if sample.state and sample.state not in ("Z", "X"):  # a zombie has exited; only its parent's wait is missing
            out.append(sample)
    return tuple(out), failures
