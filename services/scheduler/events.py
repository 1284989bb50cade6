"""The event log fan-out behind WatchJobs.

Events are rows in the database (the durable log, ids increasing). After a
transaction that wrote events commits, the store publishes them here, and each
watcher's queue receives them at once: no watcher polls the database. A watcher
subscribes first, then reads the backlog from the database, then drains its
queue, skipping ids it has already sent, so nothing falls in the gap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from managedjobs.v1 import job_pb2

# A watcher that falls this far behind is cut off and must resume from its last id.
QUEUE_LIMIT = 10_000


class WatcherOverflow(Exception):
    """The watcher fell behind; reconnect with after_event_id."""


class Subscription:
    def __init__(self, bus: EventBus, job_ids: frozenset[int]) -> None:
        self._bus = bus
        self.job_ids = job_ids
        self.queue: asyncio.Queue[job_pb2.JobEvent | None] = asyncio.Queue()
        self.overflowed = False

    def offer(self, event: job_pb2.JobEvent) -> None:
        if self.job_ids and event.job_id not in self.job_ids:
            return
        if self.queue.qsize() >= QUEUE_LIMIT:
            self.overflowed = True
            self.queue.put_nowait(None)
            self._bus.unsubscribe(self)
            return
        self.queue.put_nowait(event)

    async def next(self) -> job_pb2.JobEvent:
        event = await self.queue.get()
        if event is None:
            raise WatcherOverflow("watcher fell behind; resume with after_event_id")
        return event

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    def __init__(self) -> None:
        self._subscriptions: set[Subscription] = set()

    def subscribe(self, job_ids: Iterable[int] = ()) -> Subscription:
        sub = Subscription(self, frozenset(job_ids))
        self._subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)

    def publish(self, events: Iterable[job_pb2.JobEvent]) -> None:
        for event in events:
            for sub in list(self._subscriptions):
                sub.offer(event)
