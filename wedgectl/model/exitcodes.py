"""Every exit code wedgectl returns, in one place (documented in the README)."""

from __future__ import annotations

from wedgectl.model.types import VerdictKind

OK = 0  # idle or progressing
USAGE = 2  # bad flags (typer/click's own code)

# One code per unhealthy verdict, so a supervisor can branch on it.
VERDICT_CODES: dict[VerdictKind, int] = {
    VerdictKind.IDLE: OK,
    VerdictKind.PROGRESSING: OK,
    VerdictKind.STARVED: 10,
    VerdictKind.ADMISSION_WEDGE: 11,
    VerdictKind.ENGINE_DEADLOCK: 12,
    VerdictKind.SHUTDOWN_HANG: 13,
    VerdictKind.ENGINE_DEAD: 14,
    VerdictKind.INCONCLUSIVE: 15,
    VerdictKind.STARTUP_HANG: 16,
    VerdictKind.ORPHANED_ENGINE: 17,
    VerdictKind.LEAKED_CAPACITY: 18,
    VerdictKind.COLLECTIVE_HANG: 19,
}

# Bad input: the evidence could not be read at all.
NO_SUCH_FILE = 20
UNREADABLE_INPUT = 21  # empty, binary, not a regular file (FIFO, device), permission denied
NO_VLLM_LINES = 22
BAD_BUNDLE = 23  # truncated, foreign, newer format, a field of the wrong type, past the size bounds
UNWRITABLE_OUTPUT = 24  # a bundle's destination exists, is a link, or is a directory another user could write
NO_SUCH_PROCESS = 30
NOT_VLLM = 31
UNREACHABLE = 32  # URL refused or never answered
BAD_METRICS = 33  # the page is not Prometheus text / has no vllm: series
PERMISSION = 34
RUNTIME_MISSING = 40  # the managed vLLM runtime is not installed
REPRO_FAILED = 41  # a repro did not reach the expected verdict
SERVER_FAILED = 42  # a vLLM server did not start
SWAP_FAILED = 43
SWAP_UNSAFE = 44  # swap refused: the target's interpreter or site-packages is writable by another user
SWAP_SUPERVISED = 45  # swap refused: a supervisor (systemd, Kubernetes, a container runtime) runs the target
REPRO_NOT_APPLICABLE = 46  # the vLLM release lacks the behaviour a repro needs (its `[requires]`): nothing started
REMEDY_NO_PATH = 47  # remedy: no act ends this hang here (no --restart, no CAP_NET_ADMIN, no connection to end)
REMEDY_FAILED = 48  # remedy acted, and the hang is still there (or the act failed midway)
INTERNAL = 70  # a bug in wedgectl; the message says where to report it
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)

# `wedgectl probes` only (wedgectl.probes' EXIT_* carry the same values)
PROBES_NO_BACKEND = 3  # only the /proc fallback can run here
PROBES_GONE = 5  # --pid is gone
PROBES_FAILED = 6  # the probe ran and reported nothing


def for_verdict(kind: VerdictKind) -> int:
    return VERDICT_CODES[kind]
