"""How sure each verdict is: one named constant per kind of evidence a rule can rest on.

The scale: 0.95 when two independent live sources agree (the process table or the
heartbeat, and frozen counters) past any sane step time; 0.9 for a live reading vLLM
itself guarantees; 0.8-0.85 for one live source; 0.6-0.75 for a log read after the fact;
below 0.6 when the evidence fits another class as well. Rules pick among these, so a
reader compares two rules' certainty by name, not by number.
"""

from __future__ import annotations

# --- live rules --------------------------------------------------------------

# /health 503 (vLLM answers it only after EngineDeadError) or no EngineCore beside a listener.
ENGINE_DEAD_LIVE = 0.95

# Listener closed, process alive, and a second sign: the log's shutdown with connections still
# open, or the API server's stack in a shutdown path.
SHUTDOWN_CORROBORATED = 0.9
# Listener closed and process alive, with the log or the stack alone saying a shutdown began.
SHUTDOWN_NO_LISTENER = 0.8

# No API server, and its EngineCore / Workers alive, reparented to init: vLLM's EngineCore never
# watches its parent, so nothing ends them.
ORPHAN_REPARENTED = 0.95
# No API server and engine processes alive under a parent that is not one (a subreaper, or an
# offline LLM script: the process table cannot tell those apart).
ORPHAN_NO_API = 0.8
# No API server, and every engine process left is in its exit (PF_EXITING): a deployment killed
# whole reads so until the kernel has torn it down (seconds, on a loaded host); only one that
# stays there is left behind. Never certain: the capture goes on, and sees them go or stay.
ORPHAN_EXITING = 0.5

# Start-up quiet past STARTUP_QUIET_S with the engine parked, a stack naming the phase and the log's last line.
STARTUP_PARKED_CORROBORATED = 0.9
# The same with only the log or only the stacks to name the phase.
STARTUP_PARKED = 0.85
# Past STARTUP_DEADLINE_S in one phase with the engine busy: a very slow compile or load fits too.
STARTUP_PAST_DEADLINE = 0.7
# Weight loading or torch compile quiet past STARTUP_QUIET_S with the engine parked and reading no bytes
# (/proc/PID/io unchanged for NO_READS_MIN_S), only the log or only the stacks naming the phase: two live
# sources (CPU and reads) say it makes no progress, as STARTUP_PARKED's CPU does in the other phases.
STARTUP_NO_READS = 0.85

# Counters frozen past CERTAIN_FROZEN_S with the engine spinning, or the heartbeat counting empty
# steps: the busy loop runs and refuses the request every step.
WEDGE_CERTAIN = 0.95
# Counters frozen and the engine burning CPU, for less than CERTAIN_FROZEN_S.
WEDGE_SPINNING = 0.85
# Counters frozen past MIN_FROZEN_S, the engine spinning, every scrape refusing the request for
# capacity with the KV pool empty and the Workers outside the model (corroboration.py).
WEDGE_REFUSED_EMPTY_POOL = 0.9
# Gauges alone (no CPU, no heartbeat): they cannot tell a wedge from a blocked engine. A parked
# EngineCore inside execute_model would read as a deadlock; with no CPU figure this is the ceiling.
WEDGE_METRICS_ONLY = 0.6

# The engine asleep (or its heartbeat frozen) past CERTAIN_FROZEN_S with work in flight; or every
# Worker stack sample inside execute_model; or a probe saw a main thread parked all window.
DEADLOCK_CERTAIN = 0.95
# The engine asleep with work in flight, for less than CERTAIN_FROZEN_S.
DEADLOCK_PARKED = 0.85
# No CPU figure, but the EngineCore's stack is inside execute_model.
DEADLOCK_IN_MODEL = 0.8
# Gauges alone with requests running: frozen counters fit a deadlock best, not only.
DEADLOCK_METRICS_ONLY = 0.55
# Gauges alone with requests only waiting: as likely an admission wedge seen without CPU.
DEADLOCK_WAITING_ONLY = 0.4
# The share of Worker stack samples inside execute_model that, with the engine asleep, is certain.
DEADLOCK_WORKER_SHARE = 0.9

# The engine's own report (a fresh one: its writer thread runs) has the EngineCore in a model stage
# (execute_model_wait, execute_model, sample_tokens) past CERTAIN_FROZEN_S with a request running: vLLM's
# step never takes that long, and the stage clock is the engine's own, not inferred from silence.
DEADLOCK_ENGINE_REPORT_CERTAIN = 0.95
# The same past MIN_FROZEN_S only: a very long step (a huge prefill on a slow device) fits too.
DEADLOCK_ENGINE_REPORT = 0.85
# The engine's report names a waiting request that needs more KV blocks than the pool holds in all, with
# nothing running and its step count rising: vLLM's scheduler refuses it every step, for ever.
WEDGE_ENGINE_REPORT = 0.9
# The same, with the token counter frozen on /metrics as well: two sources agree.
WEDGE_ENGINE_REPORT_CORROBORATED = 0.95

# Requests counted while a sample saw no client connection at all, every sample over the window:
# nothing in HTTP/1.1 can carry a request in progress without a connection.
LEAK_NO_CLIENTS = 0.9
# More requests counted than client connections in every sample: one HTTP request that fans out
# (n > 1, a list of prompts) is several engine requests on one connection, so this fits too.
LEAK_FEWER_CLIENTS = 0.75
# The API server's own report: it tracks the request, and its generator ended before the request did (the
# client went). No connection count or fan-out (n > 1) to infer from: the request is named.
LEAK_ENGINE_REPORT = 0.9
# The same before a second scrape gives the tokens/s the ghosts cost: short of certain, so the capture goes on.
LEAK_ENGINE_REPORT_FIRST = 0.85

# Tokens advance, the queue does not drain and nothing was admitted in the window.
STARVED_LIVE = 0.85
# The same, with every scrape over MIN_FROZEN_S showing vLLM's own reason: waiting for capacity.
STARVED_CAPACITY = 0.9
# Tokens advance between scrapes: vLLM counts a token only when a step produced it.
PROGRESSING_LIVE = 0.9
# Nothing running or waiting, and the engine not spinning.
IDLE_LIVE = 0.9
# Nothing running or waiting by the gauges, yet the engine burns CPU: gauges may be stale.
IDLE_ENGINE_BUSY = 0.6
# Nothing running or waiting by the gauges, yet a thread of the engine, under a CPU limit, is runnable: an idle
# engine sleeps, and one its limit holds back may not have published the request it was handed. Not certain,
# so the capture runs its window and reads the limit's throttling (Facts.engine_throttled).
IDLE_ENGINE_HELD = 0.7

# --- log rules ---------------------------------------------------------------

# EngineDeadError (or 'EngineCore encountered a fatal error') printed by vLLM itself.
ENGINE_DEAD_LOG = 0.9
# Start-up lines, then silence past the deadline; the log cannot tell a hung start from a killed one.
STARTUP_LOG = 0.6
# A shutdown began, uvicorn waits for connections, and no 'Finished server process'.
SHUTDOWN_LOG_WAITING = 0.75
# A shutdown began and no 'Finished server process' (the log may just have been cut).
SHUTDOWN_LOG = 0.6
# Stats stopped with requests running, silence measured on a clock.
DEADLOCK_LOG_TIMED = 0.8
# Stats stopped with requests running, silence known only from answered scrapes or shm warnings.
DEADLOCK_LOG_SILENT = 0.7
# One whole stats interval at 0 tokens/s with requests running, and the log not (yet) silent.
DEADLOCK_LOG_ZERO_INTERVAL = 0.6
# Waiting, none running, no tokens, and the stats lines stopped.
WEDGE_LOG_SILENT = 0.75
# Waiting, none running, no tokens over one whole stats interval, stats still coming.
WEDGE_LOG_INTERVAL = 0.65
# Generation flows over three or more stats lines while the queue neither drains nor admits.
STARVED_LOG = 0.8
# The last stats line shows generation throughput.
PROGRESSING_LOG = 0.7
# The last stats line shows nothing running or waiting.
IDLE_LOG = 0.7
# After start-up, no stats line and no inference request, only probes: quiet past two stats
# intervals by a clock (vLLM logs a line at INFO within one interval of a request's first tokens).
IDLE_LOG_QUIET = 0.75
# The same, quiet for less than two intervals or for a time the log cannot measure.
IDLE_LOG_QUIET_SHORT = 0.5

# The evidence does not decide.
INCONCLUSIVE = 0.0
