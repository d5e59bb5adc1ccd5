"""Clocks for the service shell (STYLE.md rule 1: the core takes ``now_ms`` as an argument).

Services keep one clock object in ``app.state.clock`` and pass ``clock.now_ms()`` down to the
sans-I/O core; tests install a :class:`ManualClock` and move time by hand.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Anything that tells the time in milliseconds since the Unix epoch."""

    def now_ms(self) -> int:
        """The current time in milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The wall clock (``time.time_ns``), in milliseconds since the Unix epoch."""

    __slots__ = ()

    def now_ms(self) -> int:
        """The current wall-clock time in milliseconds."""
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that moves only when told to; for tests."""

    __slots__ = ("_now_ms",)

    def __init__(self, now_ms: int = 0) -> None:
        self._now_ms = now_ms

    def now_ms(self) -> int:
        """The time this clock was last set or advanced to."""
        return self._now_ms

    def advance(self, ms: int) -> int:
        """Move the clock forward by ``ms`` milliseconds and return the new time.

        Raises:
            ValueError: ``ms`` is negative (this clock never moves backward).
        """
        if ms < 0:
            raise ValueError("a ManualClock never moves backward")
        self._now_ms += ms
        return self._now_ms

    def set(self, now_ms: int) -> None:
        """Set the clock to ``now_ms`` (any value, for tests of clock steps)."""
        self._now_ms = now_ms
