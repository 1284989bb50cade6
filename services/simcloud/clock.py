"""Simulated time: a virtual clock and the one timer heap that drives the cloud.

Simulated time is seconds since the cloud started. `ScaledClock` runs it
`time_scale` times faster than real time, so tests live through hours of cloud
in seconds; `ManualClock` moves only when a test says so, which makes a whole
scenario exactly repeatable.

Every timed thing in the cloud (a launch finishing, setup ending, the run
ending, a preemption) is one entry in one `TimerHeap`, popped in (due time,
insertion order): there is no asyncio task or thread per cluster. An entry is a
small tuple naming what to do and to which cluster; a handler checks that the
cluster is still in the state the entry expects, so entries made stale by a
preemption or a termination are simply ignored when they come due.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any, Protocol


class Clock(Protocol):
    time_scale: float

    def now(self) -> float:
        """Simulated seconds since the cloud started."""

    def wall(self, sim_seconds: float) -> float:
        """The Unix time at which the simulated instant `sim_seconds` happens."""

    def real_delay(self, sim_seconds: float) -> float:
        """Real seconds until `sim_seconds` of simulated time have passed."""


class ScaledClock:
    """Simulated time = real time since start x `time_scale`."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = time_scale
        self._start_mono = time.monotonic()
        self.start_wall = time.time()

    def now(self) -> float:
        return (time.monotonic() - self._start_mono) * self.time_scale

    def wall(self, sim_seconds: float) -> float:
        return self.start_wall + sim_seconds / self.time_scale

    def real_delay(self, sim_seconds: float) -> float:
        return max(0.0, sim_seconds) / self.time_scale


class ManualClock:
    """Simulated time that moves only through `Cloud.advance` (tests)."""

    def __init__(self, start_wall: float = 1_700_000_000.0) -> None:
        self.time_scale = 1.0
        self.start_wall = start_wall
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def set(self, sim_seconds: float) -> None:
        self._now = max(self._now, sim_seconds)

    def wall(self, sim_seconds: float) -> float:
        return self.start_wall + sim_seconds

    def real_delay(self, sim_seconds: float) -> float:
        # Nothing moves by itself: waiting for simulated time means waiting for a test.
        return 3600.0


class TimerHeap:
    """Timed actions ordered by (due, insertion order); the order is the determinism."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, kind: str, target: Any) -> bool:
        """Schedules `kind` for `target` at simulated time `due`.

        Returns:
            True when the entry is now the earliest (the driver must wake earlier).
        """
        entry = (due, next(self._counter), kind, target)
        heapq.heappush(self._heap, entry)
        return self._heap[0] is entry

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> tuple[float, str, Any] | None:
        """The earliest entry due at or before `now`, removed; None if there is none."""
        if not self._heap or self._heap[0][0] > now:
            return None
        due, _, kind, target = heapq.heappop(self._heap)
        return due, kind, target
