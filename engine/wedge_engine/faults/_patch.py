"""The one method patch each fault installs on a vLLM class, and takes back for tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

MARK = "__wedge_engine_fault__"


def is_fault(fn: Any) -> bool:
    """Whether `fn` is a fault's wrapper (a second activate() in one process must not wrap twice)."""
    return bool(getattr(fn, MARK, False))


class MethodPatch:
    """A class attribute a fault replaced, and what was there before, so `restore()` can put it back."""

    def __init__(self) -> None:
        self._saved: tuple[type, str, Any] | None = None

    @property
    def active(self) -> bool:
        return self._saved is not None

    def install(self, cls: type, name: str, original: Any, wrapper: Callable[..., Any]) -> None:
        setattr(wrapper, MARK, True)
        self._saved = (cls, name, original)
        setattr(cls, name, wrapper)

    def restore(self) -> None:
        if self._saved is None:
            return
        cls, name, original = self._saved
        setattr(cls, name, original)
        self._saved = None


class ParkAfter:
    """Lets `after` calls through, counting them; from then on (where `applies()` holds) parks each
    caller on `never` for good, and says so once through `announce(calls_so_far)`."""

    def __init__(self, after: int, never: threading.Event, announce: Callable[[int], None],
                 applies: Callable[[], bool] = lambda: True) -> None:
        self.after, self.never, self.announce, self.applies = after, never, announce, applies
        self._lock = threading.Lock()
        self._done = 0
        self._parked = False

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            park = self._done >= self.after and self.applies()
            if park and not self._parked:
                self._parked = True
                self.announce(self._done)
        if park:
            self.never.wait()
        out = fn(*args, **kwargs)
        with self._lock:
            self._done += 1
        return out
