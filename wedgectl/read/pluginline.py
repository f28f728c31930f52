"""The wedge_engine plugin's own line about its fixes, read back from a server's log.

Each vLLM process the plugin runs in logs one line: its vLLM version, its role,
and in brackets the fixes on and off there (engine/wedge_engine/plugin.py,
`fixes_line`), e.g. ``wedge_engine: vLLM 0.19.1, engine process (pid 12)
[on=heartbeat,admission off=shutdown]: on: ...``. `swap` reads these from the new
server's log to say which fixes the swap turned on. The log is the target's:
one linear regex per line, bounded names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_LINE = re.compile(r"wedge_engine: vLLM (\S{1,40}), ([a-z]{1,16}) process \(pid (\d{1,10})\) "
                   r"\[on=([a-z,-]{0,400}) off=([a-z,-]{0,400})\]")


@dataclass(frozen=True)
class PluginFixes:
    """What the plugin's lines in one log say: the vLLM it ran on, the fixes on in some process, and the
    fixes off in some process and on in none (a fix runs in the processes whose code it patches)."""

    vllm: str | None
    on: tuple[str, ...]
    off: tuple[str, ...]
    processes: int  # how many process lines were read

    @property
    def found(self) -> bool:
        return self.processes > 0


def plugin_fixes(lines: Iterable[str]) -> PluginFixes:
    on: set[str] = set()
    off: set[str] = set()
    version = None
    count = 0
    for line in lines:
        if "wedge_engine: vLLM " not in line:
            continue
        m = _LINE.search(line[:4096])
        if m is None:
            continue
        count += 1
        version = m.group(1)
        on.update(n for n in m.group(4).split(",") if n)
        off.update(n for n in m.group(5).split(",") if n)
    return PluginFixes(version, tuple(sorted(on)), tuple(sorted(off - on)), count)
