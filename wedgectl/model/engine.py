"""The engine report: the wedge_engine plugin's own word on one vLLM process, as frozen data with no I/O.

The plugin rewrites one JSON object per process every second (the contract: schema version 1, written
down in docs/bundle.md under "engine"). `EngineReport.from_dict` builds one from parsed JSON that a
target controls: a value of the wrong type or out of its bound is dropped (None, or left out of a
list), strings and lists are cut to the schema's bounds (wedgectl.model.bounds.ENGINE_REPORT_*), and
it never raises. `to_dict` gives the schema's JSON back. An `EngineReading` is one attempt to read a
pid's report at one sample: the report, or the reason there is none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wedgectl.model import bounds as B

# Stages the engine core reports (the schema's "Stages"); Workers and API servers use a few of them.
STARTING = "starting"
IDLE = "idle"
SCHEDULING = "scheduling"
EXECUTE_MODEL = "execute_model"
EXECUTE_MODEL_WAIT = "execute_model_wait"
SAMPLE_TOKENS = "sample_tokens"
UPDATE_OUTPUT = "update_output"
SHUTTING_DOWN = "shutting_down"
SERVING = "serving"
# The stages of a step inside the model: an engine that stays in one of these does not come back.
MODEL_STAGES = frozenset({EXECUTE_MODEL, EXECUTE_MODEL_WAIT, SAMPLE_TOKENS})
ROLES = frozenset({"api_server", "engine_core", "worker"})

# Why a reading holds no report: each reason string starts with one of these (then ": " and the detail).
NOT_FOUND = "not found"
UNREADABLE = "unreadable"
NOT_OURS = "not ours"
TOO_BIG = "too big"
MALFORMED = "malformed"
STALE_PROCESS = "stale process"
GONE = "gone"
# A report not rewritten for this many of its intervals while its process lives is stale: the
# writer's thread runs Python, so the process's threads are not running Python (the GIL held in C,
# the process stopped, or it starved of CPU).
STALE_INTERVALS = 3.0


# --- tolerant readers of JSON values: the right type within its bound, else None ----------------------

def _int(v: Any, lo: int = 0, hi: int = B.ENGINE_REPORT_MAX_INT) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


def _num(v: Any, lo: float, hi: float, *, above: bool = False) -> float | None:
    return float(v) if B.in_range(v, lo, hi, above=above) else None


def _str(v: Any, cap: int = B.ENGINE_REPORT_MAX_STRING) -> str | None:
    return v[:cap] if isinstance(v, str) else None


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any, cap: int) -> list[Any]:
    return v[:cap] if isinstance(v, list) else []


def _history(v: Any) -> tuple[tuple[int, ...], ...]:
    """A report's `history`: its writer's last writes as (written_mono_ns, steps, model_steps), oldest
    first, the newest ENGINE_REPORT_MAX_HISTORY kept; an entry that is not three counts is dropped."""
    out: list[tuple[int, ...]] = []
    for entry in v[-B.ENGINE_REPORT_MAX_HISTORY:] if isinstance(v, list) else ():
        ns, steps, model = (_int(x) for x in entry) if isinstance(entry, list) and len(entry) == 3 else (None,) * 3
        if ns is not None and steps is not None and model is not None:
            out.append((ns, steps, model))
    return tuple(out)


def _to_dict(obj: Any) -> Any:
    """A report's part as the schema's JSON (the dataclasses' fields are the schema's keys)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _to_dict(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, (list, tuple)):
        return [_to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_dict(x) for k, x in obj.items()}
    return obj


@dataclass(frozen=True)
class EngineStage:
    """Where the process is: a stage name, since when (CLOCK_MONOTONIC ns) and, while starting, the phase."""

    name: str
    since_mono_ns: int | None = None
    phase: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> EngineStage | None:
        d = _obj(d)
        name = _str(d.get("name"))
        if not name:
            return None
        return cls(name, _int(d.get("since_mono_ns")), _str(d.get("phase")))


@dataclass(frozen=True)
class KvBlocks:
    """The KV cache pool in blocks: free now, in all, and tokens per block."""

    free: int | None = None
    total: int | None = None
    block_size: int | None = None

    @classmethod
    def from_dict(cls, d: Any) -> KvBlocks | None:
        if not isinstance(d, dict):
            return None
        return cls(_int(d.get("free")), _int(d.get("total")), _int(d.get("block_size")))


@dataclass(frozen=True)
class SchedulerSummary:
    """The engine core's scheduler at the write: requests running and waiting, why they wait, the KV pool."""

    running: int | None = None
    waiting: int | None = None
    waiting_by_reason: dict[str, int] = field(default_factory=dict)
    paused: bool | None = None
    kv_blocks: KvBlocks | None = None

    @classmethod
    def from_dict(cls, d: Any) -> SchedulerSummary | None:
        if not isinstance(d, dict):
            return None
        reasons: dict[str, int] = {}
        for k, v in list(_obj(d.get("waiting_by_reason")).items())[:B.ENGINE_REPORT_MAX_REASONS]:
            n = _int(v)
            if n is not None:
                reasons[k[:B.ENGINE_REPORT_MAX_STRING]] = n
        return cls(_int(d.get("running")), _int(d.get("waiting")), reasons, _bool(d.get("paused")),
                   KvBlocks.from_dict(d.get("kv_blocks")))


@dataclass(frozen=True)
class RequestSample:
    """One request the scheduler holds: its id (no prompt, no output: never any text), state and KV needs."""

    id: str
    state: str = ""  # "running" | "waiting" (as the writer names it)
    age_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    blocks_held: int | None = None
    blocks_needed: int | None = None
    client_connected: bool | None = None  # API server: its client waits (True) or went (False); None: unknown
    disconnected_s: float | None = None  # API server: seconds since its client went, where it did

    @classmethod
    def from_dict(cls, d: Any) -> RequestSample | None:
        d = _obj(d)
        rid = _str(d.get("id"), B.ENGINE_REPORT_MAX_REQUEST_ID)
        if not rid:
            return None
        return cls(rid, _str(d.get("state")) or "", _num(d.get("age_s"), 0.0, B.MAX_DURATION_S),
                   _int(d.get("prompt_tokens")), _int(d.get("output_tokens")), _int(d.get("blocks_held")),
                   _int(d.get("blocks_needed")), _bool(d.get("client_connected")),
                   _num(d.get("disconnected_s"), 0.0, B.MAX_DURATION_S))

    def never_fits(self, kv: KvBlocks | None) -> bool:
        """It needs more KV blocks than the whole pool can ever give one request: no amount of freeing admits
        it. The pool's total is vLLM's num_gpu_blocks, one of which is the null block its BlockPool keeps
        for itself (never free, never allocated): a request fits in at most total - 1."""
        return (kv is not None and kv.total is not None and self.blocks_needed is not None
                and self.blocks_needed > kv.total - 1)


@dataclass(frozen=True)
class RankCollective:
    """The last collective a Worker rank entered or left (the plugin wraps vLLM's GroupCoordinator): its op
    ("all_reduce", "broadcast_tensor_dict", ...), its group as vLLM names it ("tp", "pp", "world"), the rank's
    own count of collectives up to it, since when (CLOCK_MONOTONIC ns: entered while inside, else returned)
    and whether the rank is inside it still. A collective inside a compiled or captured graph runs no Python
    and is never one."""

    op: str
    group: str | None = None
    seq: int | None = None
    since_mono_ns: int | None = None
    inside: bool | None = None

    @classmethod
    def from_dict(cls, d: Any) -> RankCollective | None:
        if not isinstance(d, dict):
            return None
        op = _str(d.get("op"), B.ENGINE_REPORT_MAX_NAME)
        if not op:
            return None
        return cls(op, _str(d.get("group"), B.ENGINE_REPORT_MAX_NAME), _int(d.get("seq")),
                   _int(d.get("since_mono_ns")), _bool(d.get("inside")))


@dataclass(frozen=True)
class EngineRank:
    """A Worker's place in the parallel groups; where the writer has them (optional), its own execute_model
    steps and its last collective."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    world_size: int | None = None
    steps: int | None = None
    collective: RankCollective | None = None

    @classmethod
    def from_dict(cls, d: Any) -> EngineRank | None:
        if not isinstance(d, dict):
            return None
        return cls(_int(d.get("tp")), _int(d.get("pp")), _int(d.get("dp")), _int(d.get("world_size")),
                   _int(d.get("steps")), RankCollective.from_dict(d.get("collective")))


@dataclass(frozen=True)
class StackFrame:
    file: str = ""
    line: int | None = None
    function: str = ""

    @classmethod
    def from_dict(cls, d: Any) -> StackFrame | None:
        if not isinstance(d, dict):
            return None
        return cls(_str(d.get("file")) or "", _int(d.get("line")), _str(d.get("function")) or "")


@dataclass(frozen=True)
class ThreadStack:
    """One thread of the writer's snapshot (sys._current_frames), frames innermost first."""

    name: str = ""
    id: int | None = None
    frames: tuple[StackFrame, ...] = ()

    @classmethod
    def from_dict(cls, d: Any) -> ThreadStack | None:
        if not isinstance(d, dict):
            return None
        frames = (StackFrame.from_dict(x) for x in _list(d.get("frames"), B.ENGINE_REPORT_MAX_FRAMES))
        return cls(_str(d.get("name")) or "", _int(d.get("id")), tuple(x for x in frames if x is not None))


@dataclass(frozen=True)
class EngineStacks:
    """The Python stacks the writer took because a stage was overdue, and why."""

    reason: str = ""
    taken_mono_ns: int | None = None
    threads: tuple[ThreadStack, ...] = ()

    @classmethod
    def from_dict(cls, d: Any) -> EngineStacks | None:
        if not isinstance(d, dict):
            return None
        threads = (ThreadStack.from_dict(x) for x in _list(d.get("threads"), B.ENGINE_REPORT_MAX_THREADS))
        return cls(_str(d.get("reason")) or "", _int(d.get("taken_mono_ns")),
                   tuple(x for x in threads if x is not None))


@dataclass(frozen=True)
class EngineReport:
    """One process's engine report (schema 1). Its field names are the schema's keys."""

    schema: int
    pid: int
    proc_start_ticks: int  # /proc/PID/stat field 22 of the writer: checked against the live process
    written_mono_ns: int
    role: str = "other"  # "api_server" | "engine_core" | "worker"; anything else reads "other"
    vllm: str = ""
    seq: int | None = None
    written_unix: float | None = None
    interval_s: float | None = None
    stage: EngineStage | None = None
    steps: int | None = None
    model_steps: int | None = None
    last_model_step_mono_ns: int | None = None
    scheduler: SchedulerSummary | None = None
    requests_total: int | None = None
    requests: tuple[RequestSample, ...] = ()
    rank: EngineRank | None = None
    stacks: EngineStacks | None = None
    # Optional (schema 1 reports before it have none): the writer's last writes, oldest first, this one last,
    # each (written_mono_ns, steps, model_steps); read through step_history.
    history: tuple[tuple[int, ...], ...] = ()
    # Optional, API server: its requests' clients, counted over all it tracks ({"connected": n, "gone": m}).
    clients_connected: int | None = None
    clients_gone: int | None = None

    @classmethod
    def from_dict(cls, d: Any) -> EngineReport | None:
        """A report from parsed JSON; None when a key a report cannot do without (schema, pid,
        proc_start_ticks, written_mono_ns) is missing or of the wrong type. Never raises."""
        if not isinstance(d, dict):
            return None
        schema, pid = _int(d.get("schema"), 1), _int(d.get("pid"), 1, B.MAX_PID)
        ticks, written = _int(d.get("proc_start_ticks")), _int(d.get("written_mono_ns"))
        if schema is None or pid is None or ticks is None or written is None:
            return None
        role = _str(d.get("role"))
        requests = (RequestSample.from_dict(x) for x in _list(d.get("requests"), B.ENGINE_REPORT_MAX_REQUESTS))
        return cls(
            schema, pid, ticks, written, role if role in ROLES else "other", _str(d.get("vllm")) or "",
            _int(d.get("seq")), _num(d.get("written_unix"), 0.0, B.MAX_UNIX_TIME, above=True),
            _num(d.get("interval_s"), 0.0, B.ENGINE_REPORT_MAX_INTERVAL_S, above=True),
            EngineStage.from_dict(d.get("stage")), _int(d.get("steps")), _int(d.get("model_steps")),
            _int(d.get("last_model_step_mono_ns")), SchedulerSummary.from_dict(d.get("scheduler")),
            _int(d.get("requests_total")), tuple(x for x in requests if x is not None),
            EngineRank.from_dict(d.get("rank")), EngineStacks.from_dict(d.get("stacks")), _history(d.get("history")),
            clients_connected=_int(_obj(d.get("clients")).get("connected")),
            clients_gone=_int(_obj(d.get("clients")).get("gone")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as the schema's JSON object (an empty history left out, as a report without one)."""
        out: dict[str, Any] = _to_dict(self)
        if not self.history:
            del out["history"]
        rank = out.get("rank")
        if isinstance(rank, dict):  # a rank without the optional parts reads back as it was written
            for key in ("steps", "collective"):
                if rank[key] is None:
                    del rank[key]
        for q in out["requests"]:  # optional, the API server's: left out where unknown, as the writer does
            if q.get("disconnected_s") is None:
                q.pop("disconnected_s", None)
        connected, gone = out.pop("clients_connected"), out.pop("clients_gone")
        if connected is not None or gone is not None:
            out["clients"] = {"connected": connected, "gone": gone}
        return out

    @property
    def step_history(self) -> tuple[tuple[int, int], ...]:
        """(written_mono_ns, steps) of the writes its history holds, oldest first: the newest
        ENGINE_REPORT_MAX_HISTORY entries of three counts, each written after the one before and none after
        this report (a bundle's report is hostile input too, and never went through from_dict)."""
        out: list[tuple[int, int]] = []
        for entry in self.history[-B.ENGINE_REPORT_MAX_HISTORY:]:
            if len(entry) != 3 or not all(_int(x) is not None for x in entry):
                continue
            ns, steps = entry[0], entry[1]
            if ns <= self.written_mono_ns and (not out or ns > out[-1][0]):
                out.append((ns, steps))
        return tuple(out)

    @property
    def period_s(self) -> float:
        """How often the writer rewrites it: its own interval_s, else the contract's."""
        return self.interval_s or B.ENGINE_REPORT_INTERVAL_S

    @property
    def stage_name(self) -> str | None:
        return self.stage.name if self.stage is not None else None

    @property
    def running(self) -> int | None:
        return self.scheduler.running if self.scheduler is not None else None

    @property
    def kv_blocks(self) -> KvBlocks | None:
        return self.scheduler.kv_blocks if self.scheduler is not None else None

    def requests_in(self, state: str) -> tuple[RequestSample, ...]:
        return tuple(r for r in self.requests if r.state == state)


@dataclass(frozen=True)
class EngineReading:
    """One pid's report as read at one sample: the report, where it lay and how old it was; or why none.

    age_s: seconds since the writer last wrote it (CLOCK_MONOTONIC at the read against written_mono_ns);
    stage_age_s: seconds the process had been in its stage. Both None without a report."""

    pid: int
    t: float  # unix time of the read
    path: str = ""
    report: EngineReport | None = None
    error: str | None = None  # NOT_FOUND, UNREADABLE, ...: then ": " and the detail
    age_s: float | None = None
    stage_age_s: float | None = None

    @property
    def problem(self) -> str | None:
        """The kind of failure (NOT_FOUND, UNREADABLE, ...) without its detail; None with a report."""
        return None if self.error is None else self.error.split(":", 1)[0]

    @property
    def fresh(self) -> bool:
        """Rewritten within STALE_INTERVALS of the writer's period: its writer thread ran lately."""
        report, age = self.report, self.age_s
        return report is not None and age is not None and age < STALE_INTERVALS * report.period_s

    @property
    def stale(self) -> bool:
        """A report its process has not rewritten for STALE_INTERVALS periods."""
        return self.report is not None and self.age_s is not None and not self.fresh
