"""Waiting in a test for a condition, never for a while.

A test that needs something to have happened waits for that thing: it polls a
probe until the probe returns something truthy, and returns that value. The
bound (`within`) only turns a condition that never comes into a clear failure,
naming what was awaited and the last value seen; nothing is concluded from how
long the wait took, so the bound is generous.

`wait_until` is for plain probes (a file, a query), `wait_for` for probes that
are coroutines, on an event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def _timed_out(what: str, within: float, value: object) -> AssertionError:
    return AssertionError(f"timed out after {within:g}s waiting for {what} (last: {value!r})")


def wait_until(
    probe: Callable[[], T | None], *, what: str, within: float = 10.0, every: float = 0.05
) -> T:
    """Polls `probe` until it returns something truthy; fails after `within` seconds."""
    deadline = time.monotonic() + within
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise _timed_out(what, within, value)
        time.sleep(every)
    return value


async def wait_for(
    probe: Callable[[], Awaitable[T | None]],
    *,
    what: str = "condition",
    within: float = 10.0,
    every: float = 0.02,
) -> T:
    """Awaits `probe` until it returns something truthy; fails after `within` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not (value := await probe()):
        if loop.time() > deadline:
            raise _timed_out(what, within, value)
        await asyncio.sleep(every)
    return value


async def reached(awaitable: Awaitable[T], *, what: str, within: float = 10.0) -> T:
    """Awaits an event, a future or a task; fails naming `what` after `within` seconds."""
    try:
        return await asyncio.wait_for(awaitable, within)
    except TimeoutError:
        raise AssertionError(f"timed out after {within:g}s waiting for {what}") from None
