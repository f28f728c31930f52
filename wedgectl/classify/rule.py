"""A rule: a named predicate over the facts, and the verdict (evidence, advice) it gives when it holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from wedgectl.classify.facts import Facts
from wedgectl.model.types import Verdict


@dataclass(frozen=True)
class Rule:
    """`holds` recognises one hang (its docstring says which, and what vLLM behaviour it relies
    on); `verdict` builds the answer with its evidence, only once `holds` is true."""

    holds: Callable[[Facts], bool]
    verdict: Callable[[Facts], Verdict]

    @property
    def name(self) -> str:
        return self.holds.__name__

    def __call__(self, facts: Facts) -> Verdict | None:
        return self.verdict(facts) if self.holds(facts) else None
