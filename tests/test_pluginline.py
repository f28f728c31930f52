"""swap reads the plugin's own line about its fixes back from the new server's log (read/pluginline.py):
the lines here are made by the plugin's own fixes_line, so a change of its format fails this test."""

from __future__ import annotations

import sys
from pathlib import Path

from wedgectl.read.pluginline import plugin_fixes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from wedge_engine.plugin import fixes_line  # noqa: E402


def test_the_fixes_on_in_any_process_and_off_in_all():
    log = [
        "INFO 12-06 07:54:37 [api_server.py:100] starting",
        "(EngineCore pid=12) WARNING 12-06 07:54:52 [plugin.py:201] "
        + fixes_line("engine", "0.19.1", ["heartbeat (steps recorded)", "admission (Scheduler.add_request, "
                                          "x (y); without vllm.exceptions.GracefulHTTPError.__init__)"],
                     ["shutdown (vllm.entrypoints.launchers.launcher does not import (ModuleNotFoundError))"], pid=12),
        "(APIServer pid=11) INFO 12-06 07:54:53 [plugin.py:217] "
        + fixes_line("api", "0.19.1", ["reaper (AsyncLLM.generate aborts, a, b)", "shutdown (uvicorn.Server.shutdown)"],
                     [], pid=11),
    ]
    got = plugin_fixes(log)
    assert (got.vllm, got.on, got.off, got.processes) == ("0.19.1", ("admission", "heartbeat", "reaper", "shutdown"),
                                                           (), 2)


def test_off_everywhere_is_off_and_no_line_is_not_found():
    got = plugin_fixes(["x " + fixes_line("engine", "0.11.0", [], ["admission (a)", "watchdog (b)"], pid=3)])
    assert got.on == () and got.off == ("admission", "watchdog") and got.found
    assert not plugin_fixes(["wedge_engine: vLLM 0.32.0 is not a known version", "nothing"]).found


def test_a_hostile_line_is_bounded():
    huge = "wedge_engine: vLLM " + "9" * 10_000 + ", api process (pid 1) [on=" + "a," * 100_000 + " off=]"
    got = plugin_fixes([huge])
    assert not got.found  # a version of 10k characters is not one
