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

# Counters frozen past CERTAIN_FROZEN_S with the engine spinning, or the heartbeat counting empty
# steps: the busy loop runs and refuses the request every step.
WEDGE_CERTAIN = 0.95
# Counters frozen and the engine burning CPU, for less than CERTAIN_FROZEN_S.
WEDGE_SPINNING = 0.85
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

# Tokens advance, the queue does not drain and nothing was admitted in the window.
STARVED_LIVE = 0.85
# Tokens advance between scrapes: vLLM counts a token only when a step produced it.
PROGRESSING_LIVE = 0.9
# Nothing running or waiting, and the engine not spinning.
IDLE_LIVE = 0.9
# Nothing running or waiting by the gauges, yet the engine burns CPU: gauges may be stale.
IDLE_ENGINE_BUSY = 0.6

# --- log rules ---------------------------------------------------------------

# EngineDeadError (or 'EngineCore encountered a fatal error') printed by vLLM itself.
ENGINE_DEAD_LOG = 0.9
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

# The evidence does not decide.
INCONCLUSIVE = 0.0
