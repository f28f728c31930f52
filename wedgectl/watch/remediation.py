"""`watch --remediate`: when the watcher acts on a target's hang, and when it stops acting.

Pure policy, no act: the daemon asks `due()` at each look of a target in an open episode, runs the
remedy (wedgectl.lab.remedy) off the tick when it says yes, and tells the result back (`acted`).

- Only the classes named by --remediate, only once the episode has lasted --grace.
- At most --remediate-budget acts per target in any hour.
- One act at a time per target: none while the last one (and its second diagnosis) runs.
- A storm stops it: the same class coming back within STORM_WINDOW_S of an act that ended it means the
  act treats a symptom. The target then gets no more automatic act until watch restarts; the operator
  is told (an episode event, `wedgectl_remediation_storm`, the WedgectlRemediationStorm alert).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wedgectl.model.types import VerdictKind

STORM_WINDOW_S = 3600.0
BUDGET_WINDOW_S = 3600.0

# What an act came to (the `result` label of wedgectl_remediations_total)
GONE = "gone"  # the hang is over
NOT_GONE = "not_gone"  # it acted; the hang is still there
NO_PATH = "no_path"  # no act ends it here (no CAP_NET_ADMIN, no connection, ...)
ERROR = "error"  # the act failed midway
RESULTS = (GONE, NOT_GONE, NO_PATH, ERROR)


@dataclass(frozen=True)
class Policy:
    classes: frozenset[VerdictKind]
    budget: int = 1  # acts per target per BUDGET_WINDOW_S
    storm_window_s: float = STORM_WINDOW_S


@dataclass(frozen=True)
class Act:
    """One act of the watcher on a target."""

    t: float  # when it began (unix)
    verdict: VerdictKind
    action: str  # lab.remedy's action name
    result: str  # one of RESULTS
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        from wedgectl.watch.state import iso

        return {"time": iso(self.t), "verdict": self.verdict.value, "action": self.action, "result": self.result,
                "detail": self.detail}


@dataclass
class TargetRemediation:
    """A target's acts, the one under way, and whether a storm stopped them."""

    acts: list[Act] = field(default_factory=list)
    pending_since: float | None = None
    storm: str | None = None  # why automatic acts stopped, once they did

    def due(self, policy: Policy, kind: VerdictKind, hang_since: float | None, now: float,
            grace_s: float) -> tuple[bool, str | None]:
        """(act now?, why not, when it is held for a reason the operator should see: budget or storm)."""
        if kind not in policy.classes or hang_since is None or now - hang_since <= grace_s:
            return False, None
        if self.storm is not None:
            return False, self.storm
        if self.pending_since is not None:
            return False, None
        recent = [a for a in self.acts if now - a.t < BUDGET_WINDOW_S]
        if len(recent) >= policy.budget:
            return False, f"--remediate-budget {policy.budget} per hour spent"
        return True, None

    def begin(self, now: float) -> None:
        self.pending_since = now

    def cancel(self) -> None:
        """The remedy's own diagnosis did not confirm the hang: no act, none counted."""
        self.pending_since = None

    def acted(self, act: Act) -> None:
        self.pending_since = None
        self.acts.append(act)

    def episode_opened(self, policy: Policy, kind: VerdictKind, now: float) -> str | None:
        """A new episode of `kind` began: a storm when an act ended the same class within the window.
        Returns why, the first time it is a storm."""
        if self.storm is not None:
            return None
        last = next((a for a in reversed(self.acts) if a.verdict is kind and a.result == GONE), None)
        if last is None or now - last.t >= policy.storm_window_s:
            return None
        self.storm = (f"{kind.value} came back {now - last.t:.0f}s after a remedy ({last.action}) ended it: "
                      "no more automatic acts on this target until watch restarts")
        return self.storm


def parse_classes(text: str) -> frozenset[VerdictKind]:
    """--remediate CLASSES: comma-separated verdict names (admission_wedge,orphaned_engine); ValueError
    names what is not one, or a class no act is for."""
    from wedgectl.watch.state import HANG_CLASSES

    out = set()
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        try:
            kind = VerdictKind(name)
        except ValueError:
            raise ValueError(f"{name[:40]!r} is not a verdict (one of {', '.join(k.value for k in HANG_CLASSES)})"
                             ) from None
        if kind not in HANG_CLASSES:
            raise ValueError(f"{kind.value} is not a hang: nothing to remedy")
        out.add(kind)
    if not out:
        raise ValueError("name at least one class")
    return frozenset(out)


__all__ = ["Act", "Policy", "RESULTS", "TargetRemediation", "parse_classes"]
