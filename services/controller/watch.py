"""Wakes a job's watch loop when the backend pushes news of its cluster.

Backends that push (`Backend.events()`) feed `ClusterWatch.notify`; a lifecycle
waits on its cluster with a timeout equal to the poll interval, so backends
that cannot push are polled and those that can are heard at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.backends import Backend

log = logging.getLogger(__name__)


class ClusterWatch:
    def __init__(self) -> None:
        self._flags: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None

    async def wait(self, cluster_name: str, timeout: float) -> None:
        """Returns at the next event for the cluster (or one not yet seen), or after `timeout`."""
        flag = self._flags.setdefault(cluster_name, asyncio.Event())
        if not flag.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flag.wait(), timeout)
        flag.clear()

    def track(self, cluster_name: str) -> None:
        """Starts keeping news of a cluster this replica cares about, before anyone waits."""
        self._flags.setdefault(cluster_name, asyncio.Event())

    def notify(self, cluster_name: str) -> None:
        flag = self._flags.get(cluster_name)
        if flag is not None:
            flag.set()

    def forget(self, cluster_name: str) -> None:
        self._flags.pop(cluster_name, None)

    def start(self, backend: Backend) -> None:
        if backend.events() is not None:
            self._task = asyncio.create_task(self._pump(backend), name="cluster-events")

    async def _pump(self, backend: Backend) -> None:
        while True:
            stream = backend.events()
            if stream is None:
                return
            try:
                async for event in stream:
                    self.notify(event.cluster_name)
            except Exception:
                log.exception("backend event stream failed; reopening")
            # A gap in events may have hidden a change: wake every watcher to look.
            for name in list(self._flags):
                self.notify(name)
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
