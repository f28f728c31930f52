"""Leaked capacity: requests the engine counts (running, waiting, KV held) with no client connection behind them."""

from __future__ import annotations

from dataclasses import dataclass

from wedgectl.classify import confidence as C
from wedgectl.classify.evidence import counter_evidence, engine_cpu_evidence, fmt_duration, iso, present
from wedgectl.classify.facts import MIN_FROZEN_S, Facts
from wedgectl.classify.rule import Rule
from wedgectl.read.metrics import MetricsParseError, parse_metrics
from wedgectl.model.types import Evidence, Role, Verdict, VerdictKind


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
        "live_leaked_capacity", tuple(ev),
        (
            "Their clients are gone (timeouts shorter than generation, cancelled streams): the engine "
            "runs them to max_tokens or holds them forever. Restart the server to free the slots and KV.",
            "Run the patched engine: it aborts a request once its client is gone "
            "(wedge_engine:reaped_requests_total counts them).",
            "Give clients a timeout longer than the longest generation, and cap max_tokens.",
        ),
        facts,
    )


LEAK_RULE = Rule(live_leaked_capacity, _leaked_capacity_verdict)
