"""Injected time: the engine reads a real clock, the simulator and tests a manual one."""

import time


class Clock:
    """Seconds from an arbitrary origin, monotonic."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock(Clock):
    """A clock that moves only when told to (simulator, tests)."""

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError("a clock cannot go backwards")
        self._now = t
