"""Leaked capacity: requests the engine counts (running, waiting, KV held) with no client connection behind them."""

from __future__ import annotations

from dataclasses import dataclass

from wedgectl.classify import confidence as C
from wedgectl.classify.enginerules import MOST_IDS, SOURCE, ids_text, stage_evidence
from wedgectl.classify.evidence import (counter_evidence, engine_cpu_evidence, fmt_duration, iso, metrics_evidence,
                                        present)
from wedgectl.classify.facts import MIN_FROZEN_S, Facts
from wedgectl.classify.rule import Rule
from wedgectl.read.metrics import MetricsParseError, parse_metrics
from wedgectl.model.engine import EngineReading, RequestSample
from wedgectl.model.types import Evidence, Role, Verdict, VerdictKind

_ADVICE = (
    "Their clients are gone (timeouts shorter than generation, cancelled streams): the engine "
    "runs them to max_tokens or holds them forever. Restart the server to free the slots and KV.",
    "Run the patched engine: it aborts a request once its client is gone "
    "(wedge_engine:reaped_requests_total counts them).",
    "Give clients a timeout longer than the longest generation, and cap max_tokens.",
)


@dataclass(frozen=True)
class CountPoint:
    """One sample's requests counted by the engine, beside the API servers' client connections then."""

    t: float
    running: float
    waiting: float
    connections: int
    kv_usage: float | None

    @property
    def counted(self) -> float:
        return self.running + self.waiting

    @property
    def unbacked(self) -> float:
        """Requests counted beyond one per client connection."""
        return self.counted - self.connections


def count_points(f: Facts) -> tuple[CountPoint, ...]:
    """Every sample that has both a parsed scrape and every API server's established-connection count.

    The two are read side by side within one sample (capture/sample.py's take_sample), so each pair is one
    instant; a sample whose connections were unreadable (no CAP_SYS_PTRACE) gives no point."""
    points = []
    for s in f.samples:
        apis = [p for p in s.processes if p.role == Role.API_SERVER]
        if s.metrics is None or not s.metrics.ok or not apis or any(p.connections is None for p in apis):
            continue
        try:
            m = parse_metrics(s.metrics.text or "")  # cached by text: the same parse Facts.scrapes made
        except MetricsParseError:
            continue
        if m.running is None or m.waiting is None:
            continue
        # Every API server of the deployment (--api-server-count) feeds the one engine.
        conns = sum(p.connections or 0 for p in apis)
        points.append(CountPoint(s.metrics.t, m.running, m.waiting, conns, m.kv_usage))
    return tuple(points)


def _stamp(t: float) -> str | None:
    try:
        return iso(t)
    except (ValueError, OverflowError, OSError):  # a hostile bundle's time no calendar holds
        return None


def live_leaked_capacity(f: Facts) -> bool:
    """Requests counted with no client behind them, held over the window: at every sample, running
    + waiting exceeds the API servers' established TCP connections, over at least MIN_FROZEN_S.

    What it relies on: uvicorn (vLLM's HTTP server) speaks HTTP/1.1 only (no HTTP/2 multiplexing,
    no pipelining in practice), so every request in progress holds its own connection, whoever
    sends it: a client, a pool reusing one connection for sequential requests, or a proxy (one
    upstream connection per request in flight). Keep-alive connections with no request, scrapers and
    probes only add connections, so they can hide a leak, never fake one. A burst cannot fake one
    either: vLLM's gauges trail the engine by one step (milliseconds), and the excess must hold in
    every sample. What can: one HTTP request that fans out (n > 1, best_of, a list of prompts in one
    /v1/completions) is several engine requests on one connection; the confidence says so. The
    engine talks to the API server over IPC, so its TCP connections are clients on the listener."""
    if f.exited:
        return False
    points = count_points(f)
    if len(points) < 2 or points[-1].t - points[0].t < MIN_FROZEN_S:
        return False
    return all(p.unbacked >= 1 for p in points)


def _leaked_capacity_verdict(f: Facts) -> Verdict:
    points = count_points(f)
    last = points[-1]
    leaked = min(p.unbacked for p in points)
    fewest = min(p.connections for p in points)
    most = max(p.connections for p in points)
    # A keep-alive connection that comes or goes mid-window (uvicorn closes an idle one after 5 s)
    # moves the count: the leak is the smallest excess, which the last sample alone may not show.
    conns = f"{last.connections} connection(s)" if fewest == most else f"{fewest}-{most} connections over the window"
    span = last.t - points[0].t
    g = f.gen_tokens
    api = f.api_server
    where = f" on {', '.join(api.listening)}" if api is not None and api.listening else ""
    ev = [
        Evidence(
            "proc",
            f"{last.counted:.0f} request(s) counted ({last.running:.0f} running, {last.waiting:.0f} waiting) "
            f"against {last.connections} client connection(s){where}; at least {leaked:.0f} with no client "
            f"in each of {len(points)} samples over {fmt_duration(span)}",
            t=_stamp(last.t),
            values={"counted": last.counted, "running": last.running, "waiting": last.waiting,
                    "client_connections": last.connections, "unbacked_min": leaked, "samples": len(points),
                    "connections_min": fewest, "connections_max": most},
        ),
    ]
    facts: dict[str, object] = {"counted": last.counted, "running": last.running, "waiting": last.waiting,
                                "client_connections": last.connections, "leaked": leaked,
                                "tokens_per_s": round(g.rate or 0, 2)}
    if last.kv_usage is not None:
        kv = f.kv
        growth = (f" (from {kv.first * 100:.1f}% {fmt_duration(kv.span_s)} before)"
                  if kv.first is not None and kv.span_s else "")
        facts["kv_usage_pct"] = round(last.kv_usage * 100, 2)
        ev.append(Evidence("metrics", f"KV cache {last.kv_usage * 100:.1f}% held{growth}",
                           values={"kv_usage_pct": round(last.kv_usage * 100, 2)}))
    ev += present(counter_evidence(f), engine_cpu_evidence(f))
    if fewest == 0:
        confidence = C.LEAK_NO_CLIENTS
    else:
        confidence = C.LEAK_FEWER_CLIENTS
        ev.append(Evidence("wedgectl", "one HTTP request with n > 1 or a list of prompts is several engine requests "
                           "on one connection: rule that out before aborting"))
    return Verdict(
        VerdictKind.LEAKED_CAPACITY, confidence,
        f"{leaked:.0f} request(s) counted with no client connection behind them "
        f"({last.counted:.0f} counted, {conns}); "
        + (f"the engine still spends {g.rate or 0:.0f} tokens/s on them." if g.rate
           else "the slots they hold are lost."),
        "live_leaked_capacity", tuple(ev), _ADVICE, facts,
    )


# ------------------------------------------------ the API server's own report: its requests and their clients


def ghosts(f: Facts) -> tuple[EngineReading, tuple[RequestSample, ...]] | None:
    """The API server's fresh report and the requests it still tracks whose client went MIN_FROZEN_S ago or more.

    What it relies on: the report's writer (engine/wedge_engine/fixes/report.py) marks a request's client gone
    when its AsyncLLM.generate ends before the request finished, which is what vLLM's handler does when its
    client disconnects (it cancels the handler; a stream's generator is closed). vLLM then aborts the request
    in the OutputProcessor and the engine at once, so one the OutputProcessor still tracks seconds later was
    never aborted: the engine runs it for nobody."""
    api = f.api_server
    r = f.engine_readings.get(api.pid) if api is not None else None
    if r is None or r.report is None or not r.fresh:
        return None
    gone = tuple(q for q in r.report.requests if q.client_connected is False
                 and q.disconnected_s is not None and q.disconnected_s >= MIN_FROZEN_S)
    return (r, gone) if gone else None


def live_engine_report_leak(f: Facts) -> bool:
    """The API server's own report tracks requests whose client went MIN_FROZEN_S or more ago (ghosts), while the
    process lives: no client connection count needed (none can be read without ptrace), and no n > 1 doubt."""
    return not f.exited and ghosts(f) is not None


def _engine_leak_verdict(f: Facts) -> Verdict:
    found = ghosts(f)
    assert found is not None
    r, gone = found
    rep = r.report
    assert rep is not None
    leaked = max(rep.clients_gone or 0, len(gone))
    oldest = max(q.disconnected_s or 0.0 for q in gone)
    ids = [q.id for q in gone]
    ev = [Evidence(SOURCE, f"requests with no client: {ids_text(gone)} (the API server pid {r.pid} still tracks "
                   f"them, their clients gone up to {fmt_duration(oldest)} ago: no abort reached the engine)",
                   values={"ids": ids[:MOST_IDS], "gone": leaked, "connected": rep.clients_connected,
                           "tracked": rep.requests_total, "disconnected_s_max": round(oldest, 1)})]
    held = {q.id: q for q in f.engine_requests}
    in_engine = [held[i] for i in ids if i in held]
    if in_engine:
        blocks = sum(q.blocks_held or 0 for q in in_engine)
        states = "; ".join(f"{q.id} {q.state}" + (f", {q.output_tokens} tokens out" if q.output_tokens else "")
                           for q in in_engine[:MOST_IDS])
        ev.append(Evidence(SOURCE, f"the EngineCore's scheduler still holds {len(in_engine)} of them, with "
                           f"{blocks} KV blocks: {states}",
                           values={"ids": [q.id for q in in_engine[:MOST_IDS]], "blocks_held": blocks}))
    if f.engine_report is not None:
        ev += present(stage_evidence(f, f.engine_report))
    if f.scrapes:
        ev += [metrics_evidence(f, f"{f.running:.0f} running, {f.waiting:.0f} waiting"), counter_evidence(f)]
    ev += present(engine_cpu_evidence(f))
    g = f.gen_tokens
    facts: dict[str, object] = {
        "counted": (f.running + f.waiting) if f.scrapes else rep.requests_total, "running": f.running,
        "waiting": f.waiting, "client_connections": rep.clients_connected, "leaked": leaked,
        "tokens_per_s": round(g.rate or 0, 2), "source": SOURCE, "request_ids": ids[:MOST_IDS],
    }
    return Verdict(
        # certain once the token rate is known (two scrapes): the capture takes the second sample for it
        VerdictKind.LEAKED_CAPACITY, C.LEAK_ENGINE_REPORT if g.rate is not None else C.LEAK_ENGINE_REPORT_FIRST,
        f"{leaked} request(s) the server still runs with no client behind them ({ids_text(gone)}); "
        + (f"the engine spends {g.rate or 0:.0f} tokens/s on them." if g.rate else "the slots they hold are lost."),
        "live_engine_report_leak", tuple(ev), _ADVICE, facts,
    )


ENGINE_LEAK_RULE = Rule(live_engine_report_leak, _engine_leak_verdict)
LEAK_RULE = Rule(live_leaked_capacity, _leaked_capacity_verdict)
