"""Shared test helpers: fixture paths, the SIGINT disposition the Ctrl-C tests need, and the skip policy
of a strict run (WEDGECTL_STRICT_SKIPS=1, as .ci/run and the README's test command set it)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import time
import tomllib
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling

FIXTURES = Path(__file__).parent / "fixtures"

# A suite started as a background job of a non-interactive shell (`cmd &` in a CI script) inherits
# SIGINT ignored, and so would every child it starts: the tests of what Ctrl-C does (to wedgectl,
# to swap, to a probe run) would then test a signal that nobody receives. Give the suite, and the
# children it starts, the disposition a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


# --- the skip policy -----------------------------------------------------------------------------------
# With WEDGECTL_STRICT_SKIPS=1 a run fails (exit 1) on any skip whose reason matches no entry of
# tests/skips.toml, and lists those skips last; the allowed ones still show under -rs. Unset (or 0),
# nothing changes: a developer's partial run is not failed for the tools their machine lacks.

STRICT_ENV = "WEDGECTL_STRICT_SKIPS"
ALLOW_LIST = Path(__file__).parent / "skips.toml"


@dataclass(frozen=True)
class AllowedSkip:
    reason: re.Pattern[str]
    why: str


def load_allowed(path: Path = ALLOW_LIST) -> tuple[AllowedSkip, ...]:
    """The allow-list's entries; ValueError (one line, naming the file) on a file that is not one."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    entries = doc.get("allow")
    if not isinstance(entries, list) or set(doc) != {"allow"}:
        raise ValueError(f"{path}: expected only [[allow]] tables, each with `reason` and `why`")
    out = []
    for n, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or set(entry) != {"reason", "why"}:
            raise ValueError(f"{path}: [[allow]] #{n} must have exactly `reason` and `why`")
        reason, why = entry["reason"], entry["why"]
        if not (isinstance(why, str) and why.strip() and "\n" not in why):
            raise ValueError(f"{path}: [[allow]] #{n}: `why` must be one non-empty line")
        try:
            out.append(AllowedSkip(re.compile(reason), why))
        except (re.error, TypeError) as exc:
            raise ValueError(f"{path}: [[allow]] #{n}: `reason` is not a regex: {exc}") from None
    return tuple(out)


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """What a skip says, as -rs prints it (without pytest's "Skipped: " prefix)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipPolicy:
    """Records every skip of the run; at its end, fails it on those the allow-list does not name."""

    def __init__(self, allowed: tuple[AllowedSkip, ...], source: Path) -> None:
        self.allowed = allowed
        self.source = source
        self.skips: list[tuple[str, str]] = []  # (node id, reason)
        try:
            self.shown = str(source.relative_to(Path.cwd()))
        except ValueError:
            self.shown = str(source)

    def unexpected(self) -> list[tuple[str, str]]:
        return [(node, why) for node, why in self.skips if not any(a.reason.match(why) for a in self.allowed)]

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, skip_reason(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if session.exitstatus == pytest.ExitCode.OK and self.unexpected():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> Generator[None]:
        yield  # after pytest's own summary (-rs included), so that this comes last
        bad = self.unexpected()
        if not bad:
            if self.skips:
                terminalreporter.write_line(f"{STRICT_ENV}=1: {len(self.skips)} skipped, each allowed by {self.shown}")
            return
        terminalreporter.section(f"{len(bad)} unexpected skip{'s' * (len(bad) != 1)}: the run fails",
                                 sep="=", red=True, bold=True)
        for node, why in bad:
            terminalreporter.write_line(f"UNEXPECTED SKIP {node}: {why}", red=True)
        terminalreporter.write_line(f"{STRICT_ENV}=1 accepts only the skips {self.shown} names: install what "
                                    f"they lack (tests/setup.sh), or run without {STRICT_ENV}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run itself (xdist's controller, or a serial run), not a worker
        config.pluginmanager.register(ServerLeakCheck(), "wedgectl-server-leak-check")
    else:
        own_session()
    if parallel(config):
        config.option.loadscopereorder = False  # hand units out in the order collected (see work_unit)
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(GroupingCheck(), "wedgectl-grouping-check")
    strict = os.environ.get(STRICT_ENV, "")
    if strict not in ("", "0", "1"):
        raise pytest.UsageError(f"{STRICT_ENV} must be 1 (fail on unlisted skips) or 0, not {strict!r}")
    if strict == "1":
        try:
            allowed = load_allowed()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.pluginmanager.register(SkipPolicy(allowed, ALLOW_LIST), "wedgectl-skip-policy")


def own_session() -> None:
    """Put this xdist worker, and what it starts from now on, in a session of its own.

    With the kernel's autogroup on (most distributions' default), CPU time is shared between sessions first.
    Every vLLM server a test starts runs in a session of its own, and so does an operator's shell, but the
    workers all inherit the run's: the four of them, and every wedgectl they run, would share one session's
    share of the host against each server's. A kept hang that spins (the admission wedge's EngineCore and Worker
    took 1.2 of the 2 cores while its unit ran, measured from /proc) then starved the very commands that examine
    it, and lasted, and spun, the longer. One session per worker gives each test the share a command run by hand
    beside a server gets (measured: the suite 22.1 minutes before, 19.6 with it and the spinning units one at a
    time; the unit tests done at 7.3 minutes, not 10-11)."""
    try:
        os.setsid()
    except OSError:  # already a session leader (a worker started so), or not allowed: the run goes on as it was
        pass


# --- servers left behind ---------------------------------------------------------------------------------
# Every test stops every vLLM server it started, on every path. The run marks its environment with a session id
# of its own (inherited by its workers, the servers they start and the wedgectl commands that start theirs); at
# its end, a vLLM process that carries the mark and still runs was left behind: the run fails, naming it, and
# it is stopped. Nothing else on the host is looked at twice: another user's server, or the developer's own,
# carries no mark.

SESSION_ENV = "WEDGECTL_TEST_SESSION"
# a server stopped by the last test's teardown may take this long to be gone (the check's own test shortens it)
LEAK_WAIT_S = float(os.environ.get("WEDGECTL_LEAK_WAIT_S", "20"))


def marked_vllm_processes(session_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of each live vLLM process whose environment carries `session_id`."""
    import psutil

    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            # an API server (the launcher's _serve.py), an EngineCore or Worker (vLLM's titles), or a helper
            # process of the managed runtime's interpreter
            vllm = "VLLM::" in cmd or "_serve.py" in cmd or "/runtime/vllm-" in cmd
            if proc.info["status"] == psutil.STATUS_ZOMBIE or not vllm or proc.pid == os.getpid():
                continue
            if proc.environ().get(SESSION_ENV) == session_id:
                out.append((proc.pid, cmd[:160]))
        except (psutil.Error, OSError):
            continue
    return out


class ServerLeakCheck:
    def __init__(self) -> None:
        self.session_id = f"{os.getpid()}-{time.time_ns()}"
        os.environ[SESSION_ENV] = self.session_id  # a nested run (tests that run pytest) marks its own
        self.left: list[tuple[int, str]] = []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import psutil

        deadline = time.monotonic() + LEAK_WAIT_S
        while (left := marked_vllm_processes(self.session_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        self.left = left
        if not left:
            return
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        for pid, _cmd in left:  # this run's own servers: stopped, so that the next run starts clean
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.left:
            return
        terminalreporter.section(f"{len(self.left)} vLLM process(es) left running by this run: the run fails",
                                 sep="=", red=True, bold=True)
        for pid, cmd in self.left:
            terminalreporter.write_line(f"LEFT RUNNING pid {pid}: {cmd} (killed)", red=True)


# --- parallel runs ---------------------------------------------------------------------------------------
# The README's test command runs `pytest -n 4 --dist loadgroup`: four workers, fed one unit of work at a time.
# A unit is a test module (its module-scoped fixtures, a server say, then start once), or all the tests that
# share one session fixture that must exist once per run (ONE_PER_RUN), or a test that shares no module-scoped
# fixture (a unit of its own: see work_unit). Two lanes (LaneScheduling): the first two workers
# take the integration units, the largest first (the longest, started last, would leave one worker idle at the
# end); the other two take the unit tests beside them, which wait on the clock more than they use a CPU.
# Serial runs (no -n) keep pytest's own order.

ONE_PER_RUN = ("admission_wedge",)  # tests/integration/conftest.py: the kept admission wedge


UNIT_NAME_MAX = 200


def bounded(nodeid: str) -> str:
    """A test's node id as a unit's name, at most about UNIT_NAME_MAX characters: xdist appends the group to the
    node id that pytest puts in the test's environment (PYTEST_CURRENT_TEST), and a hostile-input test whose
    parameter is 100 KB long would pass exec's limit on one string (128 KiB: "Argument list too long")."""
    if len(nodeid) <= UNIT_NAME_MAX:
        return nodeid
    return nodeid[: UNIT_NAME_MAX // 2] + "..." + hashlib.sha256(nodeid.encode()).hexdigest()[:16]


def work_unit(item: pytest.Item) -> str:
    """The xdist group an item is run in: a fixture of ONE_PER_RUN, else its module; a test that shares no
    module-scoped fixture with its neighbours is a unit of its own, so that a module of many server-starting
    tests (test_patched's), or of slow unit tests (test_hostile_input's 100 s), is spread over the workers
    instead of queued on one. An integration unit's name starts with INTEGRATION_PREFIX: the lane it runs in
    (LaneScheduling)."""
    names = getattr(item, "fixturenames", ())
    integration = item.get_closest_marker("integration") is not None
    shared = [name for name in ONE_PER_RUN if name in names]
    if shared:
        unit = shared[0]
    elif not shares_module_fixture(item):
        unit = bounded(item.nodeid)
    else:
        unit = item.nodeid.split("::", 1)[0]
    if not integration:
        return unit
    return INTEGRATION_PREFIX + (SPINNING_TAG if any(n in names for n in SPINNING_FIXTURES) else "") + unit


# --- two lanes ---------------------------------------------------------------------------------------------
# Two lanes for a parallel run: the integration units on the first workers, the unit tests on the others.
#
# The integration tests are bound by CPU (a vLLM start is ~25 CPU s, a hung server spins a core); the unit tests
# mostly by the wall clock (hostile endpoints that trickle, deadlines waited out, real CLI runs). Run after the
# integration units on the same two workers, as plain `--dist loadgroup` does, the unit tests were the last
# ~200 s of a run with both cores half idle. Here the first INTEGRATION_WORKERS workers take the integration
# units (and, once none is left, unit tests); the others take the unit tests, alongside them, and then the light
# integration units (LIGHT_TAG: real processes, py-spy, eBPF, no vLLM server), and stop when none of either is
# left. So no third vLLM server's work lands on two cores, and the unit lanes, done after a third of the run,
# take ~90 s of the integration lanes' work (measured: the last minutes of a run had the cores 40-80 % idle).
#
# xdist's own LoadGroupScheduling does the rest: one unit at a time per worker, in the order the suite sorted
# them (pytest_collection_modifyitems, below). A unit is an integration one when its group name
# starts with INTEGRATION_PREFIX, which work_unit gives every integration test's group.

INTEGRATION_PREFIX = "integration:"
# A kept hang that spins a core for as long as its unit lasts (the admission wedge's engine loop, the collective
# hang's waiting rank), shared by the unit's tests. Two at once starve everything else, each other included: each
# lasts longer, so each spins longer (measured: the wedge's unit 361 s and the collective's 292 s side by side at
# the run's start; one after the other, with each worker in a session of its own, 270 s and 107 s). One runs at a
# time (LaneScheduling.next_unit_for).
SPINNING_FIXTURES = ("admission_wedge", "hung_tp2")
SPINNING_TAG = "spins:"
# An integration unit none of whose tests uses a vLLM server (SERVER_FIXTURES): the unit lanes take it too.
LIGHT_TAG = "light:"
# An integration unit with a test on the worker's stock server (STOCK_FIXTURE, tests/integration/conftest.py):
# only the first worker takes these, so one stock server is started for the run, not one per integration worker
# (a start is ~25 CPU s; the second one had been started beside the spinning wedge, 158 s of set-up, measured).
STOCK_TAG = "stock:"
STOCK_FIXTURE = "shared_vllm"
LANES_ENV = "WEDGECTL_INTEGRATION_WORKERS"
INTEGRATION_WORKERS = 2


def integration_workers(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """How many workers take integration units: $WEDGECTL_INTEGRATION_WORKERS (at least 1), else 2."""
    raw = environ.get(LANES_ENV, "").strip()
    if not raw:
        return INTEGRATION_WORKERS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{LANES_ENV} must be a whole number of workers, not {raw!r}") from None
    if value < 1:
        raise ValueError(f"{LANES_ENV} must be at least 1, not {value}")
    return value


def is_integration_unit(scope: str) -> bool:
    """Whether xdist's scope names an integration unit. xdist takes the group from after the last "@" only
    when no "]" follows it, so a parametrized test that is a unit of its own (its node id its group) keeps its
    whole node id, "...[param]@integration:...[param]", as its scope."""
    return scope.startswith(INTEGRATION_PREFIX) or "@" + INTEGRATION_PREFIX in scope


def has_tag(scope: str, tag: str) -> bool:
    """Whether xdist's scope names an integration unit with `tag` among the tags after INTEGRATION_PREFIX."""
    return re.search(re.escape(INTEGRATION_PREFIX) + r"(?:[a-z]+:)*" + re.escape(tag), scope) is not None


def is_spinning_unit(scope: str) -> bool:
    """Whether xdist's scope names a unit that keeps a spinning hang (SPINNING_FIXTURES)."""
    return has_tag(scope, SPINNING_TAG)


def is_light_unit(scope: str) -> bool:
    """Whether xdist's scope names an integration unit that starts no vLLM server (LIGHT_TAG)."""
    return has_tag(scope, LIGHT_TAG)


def is_stock_unit(scope: str) -> bool:
    """Whether xdist's scope names an integration unit that uses the worker's stock server (STOCK_TAG)."""
    return has_tag(scope, STOCK_TAG)


def tagged(unit: str, tag: str) -> str:
    """An integration unit's name with `tag` added after INTEGRATION_PREFIX."""
    return INTEGRATION_PREFIX + tag + unit.removeprefix(INTEGRATION_PREFIX)


def worker_index(node: Any) -> int:
    """xdist's worker number: 3 for gw3."""
    return int(str(node.gateway.id).removeprefix("gw"))


class LaneScheduling(LoadGroupScheduling):  # type: ignore[misc]
    """LoadGroupScheduling whose workers past the first `lanes` take no integration unit but a light one, and that
    only once no unit test is left."""

    def __init__(self, config: Any, log: Any = None, lanes: int = INTEGRATION_WORKERS) -> None:
        super().__init__(config, log)
        self.lanes = lanes

    def takes_integration(self, node: Any) -> bool:
        return worker_index(node) < self.lanes

    def spinning_now(self) -> bool:
        """Whether a unit that keeps a spinning hang is handed out and not finished."""
        return any(is_spinning_unit(scope) and not all(done.values())
                   for work in self.assigned_work.values() for scope, done in work.items())

    def next_unit_for(self, node: Any) -> str | None:
        """The first queued unit this worker may run, or None: an integration unit only on the integration
        workers (a spinning one only while no other is running; one on the stock server only on the first, which
        takes those before any other); on the others, a unit test, else a light integration unit."""
        if not self.takes_integration(node):
            return next((scope for scope in self.workqueue if not is_integration_unit(scope)),
                        next((scope for scope in self.workqueue if is_light_unit(scope)), None))
        spinning = self.spinning_now()
        allowed = [scope for scope in self.workqueue if not (spinning and is_spinning_unit(scope))]
        if worker_index(node) != 0:
            return next((scope for scope in allowed if not is_stock_unit(scope)), None)
        return next((scope for scope in allowed if is_stock_unit(scope)), next(iter(allowed), None))

    def _assign_work_unit(self, node: Any) -> None:
        scope = self.next_unit_for(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        pending = self._pending_of(self.assigned_work[node])
        if not self.workqueue or (pending == 0 and self.next_unit_for(node) is None):
            node.shutdown()  # nothing left that this worker may run
            return
        if pending > 2:
            return
        self._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under `--dist loadgroup`: the integration units on the first workers, the unit tests beside them on the
    others (LaneScheduling)."""
    if config.getoption("dist", "no") != "loadgroup":
        return None
    try:
        lanes = integration_workers()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return LaneScheduling(config, log, lanes)


def shares_module_fixture(item: pytest.Item) -> bool:
    """Whether the item uses a fixture that lives for its module (or class, or package): one set-up its
    module's other tests share, so they must run in one worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return True  # not a plain test function: keep it with its module
    return any(defs and defs[-1].scope in ("module", "class", "package")
               for defs in info.name2fixturedefs.values())


def parallel(config: pytest.Config) -> bool:
    return config.getoption("dist", "no") != "no" or hasattr(config, "workerinput")


class GroupingCheck:
    """Under `--dist loadgroup`: stop the run if xdist's grouping did not take.

    xdist groups a test by suffixing the node id a worker reports with `@group`; a pytest whose node id
    ignores that suffix (9.2, with xdist 3.8) would split every module across the workers, each starting
    its own copy of the module's vLLM server, and say nothing."""

    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        lost = [nodeid for nodeid in ids if "@" not in nodeid]
        if lost:
            pytest.exit(f"pytest-xdist did not group {len(lost)} of {len(ids)} tests (first: {lost[0]}): "
                        f"this pytest and pytest-xdist do not work together; install the versions "
                        f"pyproject.toml names", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not parallel(config):
        return
    cost: dict[str, int] = {}
    units = {item.nodeid: work_unit(item) for item in items}
    heavy = {units[item.nodeid] for item in items if on_server(item)}  # a unit with any test on a vLLM server
    stock = {units[item.nodeid] for item in items if STOCK_FIXTURE in getattr(item, "fixturenames", ())}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            unit = units[item.nodeid]
            if is_integration_unit(unit) and unit not in heavy:
                unit = tagged(unit, LIGHT_TAG)
            elif unit in stock:
                unit = tagged(unit, STOCK_TAG)
            item.add_marker(pytest.mark.xdist_group(unit))
        unit = group_of(item)
        cost[unit] = cost.get(unit, 0) + weight(item)
    first = {unit: n for n, unit in enumerate(dict.fromkeys(group_of(i) for i in items))}

    def order(item: pytest.Item) -> tuple[bool, int, int]:
        # Integration units first, the costliest first (the longest unit, started last, would leave one
        # worker idle at the end); then the unit tests as collected.
        unit = group_of(item)
        integration = item.get_closest_marker("integration") is not None
        return (not integration, -cost[unit] if integration else 0, first[unit])

    items.sort(key=order)  # stable: a unit's own order (the kept wedge's last user last) holds


# A test that drives a real vLLM server costs tens of seconds (a start is 20-40 s on 2 cores); most others,
# a fraction of one. Only the order of the work depends on it.
SERVER_FIXTURES = ("vllm_python", "tiny_model", "vllm_server", "admission_wedge", "older_python")
SERVER_TEST_COST = 30


def on_server(item: pytest.Item) -> bool:
    """Whether the test uses a vLLM server (one of SERVER_FIXTURES, itself or through another fixture)."""
    names = getattr(item, "fixturenames", ())
    return any(n in names for n in SERVER_FIXTURES)


def weight(item: pytest.Item) -> int:
    return SERVER_TEST_COST if on_server(item) else 1


def group_of(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark is not None and mark.args else work_unit(item)
