"""Parse vLLM server logs into stats, access, shutdown, failure and start-up records; no I/O.

`parse_log(lines)` reads what a vLLM API server (and the uvicorn inside it)
writes: the periodic "Engine 000: Avg prompt throughput ..." stats line, the
uvicorn access log, the shutdown sequence, engine failures and the start-up
facts that size the KV pool. It never raises on input it does not understand:
garbage, binary and over-long lines are counted and skipped.

Time: vLLM stamps are "MM-DD HH:MM:SS" with no year. A stamp becomes seconds
since 2000-01-01 00:00:00 (2000 is a leap year, so "02-29" parses); when a
stamp falls more than 180 days behind the previous one the log has crossed a
new year and a year is added, so t stays monotonic across a rollover. Full
"YYYY-MM-DD HH:MM:SS" stamps count from the same epoch and also set the year
that later year-less stamps are read in (`logstamp`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from wedgectl.read.logstamp import Clock, format_stamp, parse_stamp, split_header

__all__ = [
    "AccessLine",
    "FailureLine",
    "ParsedLog",
    "ShutdownLine",
    "StartupFact",
    "StatsLine",
    "format_stamp",
    "parse_log",
    "parse_stamp",
]

MAX_LINE_CHARS = 65536  # matched prefix of a line; vLLM's longest lines are a few KB
MAX_TEXT_CHARS = 2000  # kept in a record's `text`

SHUTDOWN_KINDS = (
    "signal",
    "vllm_shutdown",
    "uvicorn_shutting_down",
    "waiting_connections",
    "waiting_background",
    "application_shutdown",
    "finished",
)
FAILURE_KINDS = ("engine_dead", "shm_broadcast_timeout", "engine_core_failed", "traceback")


@dataclass(frozen=True)
class StatsLine:
    """One periodic stats line of the API server's LoggingStatLogger."""

    lineno: int  # 1-based line number in the input
    t: float | None  # seconds since 2000-01-01; None if the line has no stamp
    stamp: str | None  # the raw "MM-DD HH:MM:SS" text
    pid: int | None  # from the "(APIServer pid=851)" prefix
    engine: int | None  # "Engine 000" -> 0; None when aggregated or absent
    prompt_tps: float
    gen_tps: float
    running: int
    waiting: int
    kv_kind: str  # "GPU", "CPU", "XPU": the word before "KV cache usage"
    kv_usage_pct: float  # 0..100 as printed
    prefix_hit_pct: float | None
    deferred: int | None
    preemptions: int | None


@dataclass(frozen=True)
class AccessLine:
    """One uvicorn access-log line; it has no stamp of its own."""

    lineno: int
    t: float | None  # of the most recent stamped line before it; None if none yet
    pid: int | None
    client: str  # "10.109.20.86:59146"
    method: str
    path: str
    status: int


@dataclass(frozen=True)
class ShutdownLine:
    """One step of a shutdown: the signal, vLLM's [shutdown] trace, uvicorn's waits."""

    lineno: int
    t: float | None  # own stamp, else the most recent one before it
    pid: int | None
    kind: str  # one of SHUTDOWN_KINDS
    text: str


@dataclass(frozen=True)
class FailureLine:
    """A line that says the engine died, timed out on its broadcast queue, or raised."""

    lineno: int
    t: float | None  # own stamp, else the most recent one before it
    pid: int | None
    kind: str  # one of FAILURE_KINDS
    text: str


@dataclass(frozen=True)
class StartupFact:
    """One fact the server states while starting: versions, model, KV pool geometry."""

    lineno: int
    t: float | None  # own stamp, else the most recent one before it
    key: str
    value: int | float | str
    text: str
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedLog:
    """Everything `parse_log` recognised, in input order."""

    stats: tuple[StatsLine, ...]
    access: tuple[AccessLine, ...]
    shutdown: tuple[ShutdownLine, ...]
    failures: tuple[FailureLine, ...]
    startup: tuple[StartupFact, ...]
    n_lines: int
    n_recognised: int  # lines that gave a record or carry vLLM's log header
    first_t: float | None  # first and last stamps read from the lines themselves
    last_t: float | None
    # Lines vLLM's own logger wrote (logstamp.Header.vllm_own). None: the file is not a vLLM log, whatever
    # words it holds (prose naming EngineDeadError, a script's string literals, another server's log).
    n_vllm: int = 0

    @property
    def metrics_scrapes(self) -> tuple[AccessLine, ...]:
        """The GET /metrics requests: the scraper that keeps a wedged server looking alive."""
        return tuple(
            a for a in self.access if a.method == "GET" and _path_only(a.path) == "/metrics"
        )

    @property
    def last_stats(self) -> StatsLine | None:
        return self.stats[-1] if self.stats else None

    @property
    def facts(self) -> dict[str, int | float | str]:
        """Start-up facts by key; a later line wins, since a restart supersedes."""
        return {f.key: f.value for f in self.startup}

    def access_after(self, lineno: int) -> tuple[AccessLine, ...]:
        """Access lines that come after line `lineno` (e.g. the last stats line)."""
        return tuple(a for a in self.access if a.lineno > lineno)


# --- cleaning ---------------------------------------------------------------

# CSI sequences (colours, cursor moves) and the two-byte ESC forms.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def _clean(raw: object) -> str | None:
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        return None
    line = raw[:MAX_LINE_CHARS]
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    return line.rstrip("\r\n").rstrip()


# --- numbers ----------------------------------------------------------------

_INT = r"\d[\d,]{0,30}(?![\d,])"
_NUM = r"(?:\d[\d,]{0,30}(?:\.\d{1,20})?|\.\d{1,20}|nan|inf)"


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _float(text: str) -> float:
    return float(text.replace(",", ""))


# --- stats lines ------------------------------------------------------------

_PROMPT = re.compile(r"Avg prompt throughput:\s*(" + _NUM + r")\s*tokens/s")
_GEN = re.compile(r"Avg generation throughput:\s*(" + _NUM + r")\s*tokens/s")
_ENGINE = re.compile(r"Engine\s+(\d{1,6}):\s*Avg prompt throughput")
_RUNNING = re.compile(r"\bRunning:\s*(" + _INT + r")\s*reqs?")
# "Pending" is the pre-V1 name for the waiting queue.
_WAITING = re.compile(r"\b(?:Waiting|Pending):\s*(" + _INT + r")\s*reqs?")
_DEFERRED = re.compile(r"\bDeferred:\s*(" + _INT + r")\s*reqs?")
_PREEMPTIONS = re.compile(r"\bPreemptions:\s*(" + _INT + r")")
_KV_USAGE = re.compile(r"\b(\w{1,16}) KV cache usage:\s*(" + _NUM + r")\s*%")
_PREFIX_HIT = re.compile(
    r"(?<!External )(?:(?:GPU|CPU|XPU) )?[Pp]refix cache hit rate:\s*(" + _NUM + r")\s*%"
)


def _parse_stats(
    msg: str, lineno: int, t: float | None, stamp: str | None, pid: int | None
) -> StatsLine | None:
    if "Avg prompt throughput" not in msg or "KV cache usage" not in msg:
        return None
    prompt, gen = _PROMPT.search(msg), _GEN.search(msg)
    running, waiting = _RUNNING.search(msg), _WAITING.search(msg)
    kv = _KV_USAGE.search(msg)
    if not (prompt and gen and running and waiting and kv):
        return None
    engine = _ENGINE.search(msg)
    prefix = _PREFIX_HIT.search(msg)
    deferred = _DEFERRED.search(msg)
    preempt = _PREEMPTIONS.search(msg)
    return StatsLine(
        lineno=lineno,
        t=t,
        stamp=stamp,
        pid=pid,
        engine=int(engine.group(1)) if engine else None,
        prompt_tps=_float(prompt.group(1)),
        gen_tps=_float(gen.group(1)),
        running=_int(running.group(1)),
        waiting=_int(waiting.group(1)),
        kv_kind=kv.group(1),
        kv_usage_pct=_float(kv.group(2)),
        prefix_hit_pct=_float(prefix.group(1)) if prefix else None,
        deferred=_int(deferred.group(1)) if deferred else None,
        preemptions=_int(preempt.group(1)) if preempt else None,
    )


# --- access lines -----------------------------------------------------------

_ACCESS = re.compile(
    r'(?P<client>\S{1,300})\s+-\s+"(?P<method>[A-Z]{3,10})\s+(?P<path>\S{1,8000})'
    r'\s+HTTP/[\d.]{1,5}"\s+(?P<status>\d{3})\b'
)


def _path_only(path: str) -> str:
    return path.split("?", 1)[0]


# --- shutdown and failure lines ---------------------------------------------

_SIGNAL = re.compile(
    r"(?i:\b(?:received|receiving|caught|got)\s+signal\b|\bon signal \d+)"
    r"|\bSIG(?:TERM|INT|QUIT|HUP|KILL)\b"
)
_SHUTDOWN_TEXT = (
    ("waiting_connections", "Waiting for connections to close"),
    ("waiting_background", "Waiting for background tasks to complete"),
    ("application_shutdown", "Waiting for application shutdown"),
    ("application_shutdown", "Application shutdown complete"),
    ("application_shutdown", "Application shutdown failed"),
    ("finished", "Finished server process"),
)
_UVICORN_SHUTTING_DOWN = re.compile(r"Shutting down\.?")


def _shutdown_kind(msg: str) -> str | None:
    if msg.startswith("[shutdown]"):
        return "vllm_shutdown"
    if _SIGNAL.search(msg):
        return "signal"
    if _UVICORN_SHUTTING_DOWN.fullmatch(msg):
        return "uvicorn_shutting_down"
    for kind, needle in _SHUTDOWN_TEXT:
        if needle in msg:
            return kind
    return None


_ENGINE_CORE_FAILED = re.compile(
    r"Engine core proc(?:ess)? \S{1,200} died"
    r"|EngineCore failed to start"
    r"|Engine core initialization failed"
)
_SHM_TIMEOUT = re.compile(r"No available shared memory broadcast block found in \d{1,9} seconds?")


def _failure_kind(line: str) -> str | None:
    if "EngineDeadError" in line:
        return "engine_dead"
    if _ENGINE_CORE_FAILED.search(line):
        return "engine_core_failed"
    if _SHM_TIMEOUT.search(line):
        return "shm_broadcast_timeout"
    if "Traceback (most recent call last):" in line:
        return "traceback"
    return None


# --- start-up facts ---------------------------------------------------------

_AUTOFIT_REDUCED = re.compile(
    r"(?i:auto-fit max_model_len):\s*reduced from\s+(" + _INT + r")\s+to\s+(" + _INT + r")"
)
_AUTOFIT_FITS = re.compile(
    r"(?i:auto-fit max_model_len):\s*full model context length\s+(" + _INT + r")\s+fits"
)
_AUTOFIT_GEOMETRY = re.compile(r"\((" + _INT + r")\s+blocks?\s*x\s*(" + _INT + r")\s+tokens?\)")
_AUTOFIT_GIB = re.compile(r"\((" + _NUM + r")\s*GiB")
_KV_SIZE = re.compile(r"\b(\w{1,16}(?: \+ host)?) KV cache size:\s*(" + _INT + r")\s*tokens")
_MAX_CONCURRENCY = re.compile(
    r"Maximum concurrency for\s+(" + _INT + r")\s+tokens per request:\s*(" + _NUM + r")x"
)
_OVERRIDE = re.compile(
    r"Overriding num_gpu_blocks=(" + _INT + r") with num_gpu_blocks_override=(" + _INT + r")"
)
_NUM_BLOCKS = re.compile(r"(?:num_gpu_blocks is:|# GPU blocks:)\s*(" + _INT + r")")
_VERSION = (
    re.compile(r"vLLM (?:API )?server version\s+([^\s,]{1,100})"),
    re.compile(r"Initializing a V1 LLM engine \(v([^)\s]{1,100})\)"),
    re.compile(r"█\s+version\s+(\S{1,100})"),  # the start-up logo
)
_MODEL = (
    re.compile(r"with config:\s*model=(?:'([^']{1,1000})'|\"([^\"]{1,1000})\"|([^,\s]{1,1000}))"),
    re.compile(r"serving model\s+(\S{1,1000})"),
    re.compile(r"█\s+model\s+(\S{1,1000})"),
)
# Searched from the marker's position on: a leading ".*?" would be quadratic.
_ARGS_MARK = "non-default args:"
_ARG_MODEL = re.compile(r"'model':\s*'([^']{1,1000})'")
_ARG_BLOCK_SIZE = re.compile(r"'block_size':\s*(" + _INT + r")")
_ARG_OVERRIDE = re.compile(r"'num_gpu_blocks_override':\s*(" + _INT + r")")
_ARG_MAX_LEN = re.compile(r"'max_model_len':\s*(-?" + _INT + r")")
_CONFIG_MARK = "with config:"
_MAX_SEQ_LEN = re.compile(r"\bmax_seq_len=(" + _INT + r")")
_LISTENING = (
    re.compile(r"Uvicorn running on\s+(\S{1,500})"),
    re.compile(r"Starting vLLM (?:API )?server(?: \d+)? on\s+(\S{1,500})"),
)


def _first_group(m: re.Match) -> str:
    return next(g for g in m.groups() if g is not None)


def _startup_facts(line: str) -> list[tuple[str, int | float | str, dict]]:
    """(key, value, extra) for each start-up fact stated on one line."""
    facts: list[tuple[str, int | float | str, dict]] = []
    m = _AUTOFIT_REDUCED.search(line) or _AUTOFIT_FITS.search(line)
    if m:
        old = _int(m.group(1))
        new = _int(m.group(2)) if m.re is _AUTOFIT_REDUCED else old
        extra: dict = {"from": old, "to": new}
        geo = _AUTOFIT_GEOMETRY.search(line, m.end())
        if geo:
            extra["blocks"], extra["block_size"] = _int(geo.group(1)), _int(geo.group(2))
        gib = _AUTOFIT_GIB.search(line, m.end())
        if gib:
            extra["available_gib"] = _float(gib.group(1))
        facts.append(("max_model_len_autofit", new, extra))
        if geo:
            facts.append(("num_blocks", extra["blocks"], {}))
            facts.append(("block_size", extra["block_size"], {}))
    m = _KV_SIZE.search(line)
    if m:
        facts.append(("kv_cache_tokens", _int(m.group(2)), {"kind": m.group(1)}))
    m = _MAX_CONCURRENCY.search(line)
    if m:
        facts.append(
            ("max_concurrency", _float(m.group(2)), {"tokens_per_request": _int(m.group(1))})
        )
    m = _OVERRIDE.search(line)
    if m:
        facts.append(("num_gpu_blocks_override", _int(m.group(2)), {"from": _int(m.group(1))}))
    m = _NUM_BLOCKS.search(line)
    if m:
        facts.append(("num_blocks", _int(m.group(1)), {}))
    args_at = line.find(_ARGS_MARK)
    model_from_args = None
    if args_at >= 0:
        m = _ARG_OVERRIDE.search(line, args_at)
        if m:
            facts.append(("num_gpu_blocks_override", _int(m.group(1)), {"source": "args"}))
        m = _ARG_BLOCK_SIZE.search(line, args_at)
        if m:
            facts.append(("block_size", _int(m.group(1)), {"source": "args"}))
        m = _ARG_MAX_LEN.search(line, args_at)
        if m:
            facts.append(("max_model_len", int(m.group(1).replace(",", "")), {"source": "args"}))
        m = _ARG_MODEL.search(line, args_at)
        model_from_args = m.group(1) if m else None
    config_at = line.find(_CONFIG_MARK)
    if config_at >= 0:
        m = _MAX_SEQ_LEN.search(line, config_at)
        if m:
            facts.append(("max_model_len", _int(m.group(1)), {"source": "engine_config"}))
    for pattern in _VERSION:
        m = pattern.search(line)
        if m:
            facts.append(("vllm_version", m.group(1), {}))
            break
    if model_from_args is not None:
        facts.append(("model", model_from_args, {}))
    else:
        for pattern in _MODEL:
            m = pattern.search(line)
            if m:
                facts.append(("model", _first_group(m), {}))
                break
    for pattern in _LISTENING:
        m = pattern.search(line)
        if m:
            facts.append(("listening", m.group(1).rstrip(".,;)"), {}))
            break
    return facts


# --- the parser -------------------------------------------------------------


def parse_log(lines: Iterable[str]) -> ParsedLog:
    """Read vLLM server log lines (str, or bytes decoded as UTF-8) into a ParsedLog."""
    stats: list[StatsLine] = []
    access: list[AccessLine] = []
    shutdown: list[ShutdownLine] = []
    failures: list[FailureLine] = []
    startup: list[StartupFact] = []
    clock = Clock()
    n_lines = n_recognised = n_vllm = 0
    first_t: float | None = None
    last_t: float | None = None
    for lineno, raw in enumerate(lines, start=1):
        n_lines = lineno
        line = _clean(raw)
        if not line:
            continue
        head = split_header(line)
        n_vllm += head.vllm_own
        own_t = clock.read(head.stamp_parts) if head.stamp_parts else None
        if own_t is not None:
            first_t = own_t if first_t is None else first_t
            last_t = own_t
        t = own_t if own_t is not None else last_t
        text = line[:MAX_TEXT_CHARS]
        found = False

        stamp = head.stamp if own_t is not None else None
        st = _parse_stats(head.msg, lineno, own_t, stamp, head.pid)
        if st is not None:
            stats.append(st)
            n_recognised += 1
            continue
        if head.vllm_like:
            m = _ACCESS.match(head.msg)
            if m:
                access.append(
                    AccessLine(
                        lineno=lineno,
                        t=t,
                        pid=head.pid,
                        client=m.group("client"),
                        method=m.group("method"),
                        path=m.group("path"),
                        status=int(m.group("status")),
                    )
                )
                n_recognised += 1
                continue

        kind = _shutdown_kind(head.msg)
        if kind is not None:
            shutdown.append(ShutdownLine(lineno=lineno, t=t, pid=head.pid, kind=kind, text=text))
            found = True
        kind = _failure_kind(line)
        if kind is not None:
            failures.append(FailureLine(lineno=lineno, t=t, pid=head.pid, kind=kind, text=text))
            found = True
        for key, value, extra in _startup_facts(head.msg):
            startup.append(
                StartupFact(lineno=lineno, t=t, key=key, value=value, text=text, extra=extra)
            )
            found = True
        if found or head.vllm_like:
            n_recognised += 1

    return ParsedLog(
        stats=tuple(stats),
        access=tuple(access),
        shutdown=tuple(shutdown),
        failures=tuple(failures),
        startup=tuple(startup),
        n_lines=n_lines,
        n_recognised=n_recognised,
        first_t=first_t,
        last_t=last_t,
        n_vllm=n_vllm,
    )
