"""Background work of a service: one named task running a coroutine until it is stopped.

A service's tickers, watchdogs, pollers, pumps and flushers each run as a
`Background`: `start` creates the task (a start while it runs does nothing, one
after it ended starts it again), `stop` cancels it and returns once it has ended,
its `finally` blocks run. A task that ends with an exception it did not handle is
logged with its name as it ends, rather than unnoticed until it is collected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Background:
    """The task `name`, running `run()` from `start` until `stop`."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, object]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[object] | None = None

    @property
    def running(self) -> bool:
        """Whether the task was started and has not ended."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Starts the task on the running event loop, unless it runs already."""
        if self.running:
            return
        self._task = asyncio.create_task(self._run(), name=self.name)
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[object]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("background task failed", exc_info=error, extra={"task": self.name})

    async def stop(self) -> None:
        """Cancels the task and waits until it has ended (nothing to do if it never ran)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
