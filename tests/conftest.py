"""Shared test helpers: fixture paths, and the SIGINT disposition the Ctrl-C tests need."""

import signal
from pathlib import Path

import pytest

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
