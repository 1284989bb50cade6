"""The event log fan-out behind WatchJobs.

Events are rows in the database (the durable log, ids increasing). After a
transaction that wrote events commits, the store publishes them here, and each
watcher's queue receives them at once: no watcher polls the database. A watcher
subscribes first, then reads the backlog from the database, then drains its
queue, skipping ids it has already sent, so nothing falls in the gap.

A watcher's queue holds at most `queue_limit` events (`QUEUE_LIMIT` by default).
One that falls that far behind is cut off (`WatcherOverflow`) and told where to
resume: just before the oldest event it was never sent, so resuming loses nothing
(it may see again some events it already had; ids tell them apart). Every subscription ends when its
stream ends, however it ends: `EventBus.subscriptions` counts the live ones.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

from managedjobs.v1 import job_pb2

# Events a watcher may have queued; one that falls further behind is cut off.
QUEUE_LIMIT = 10_000


class WatcherOverflow(Exception):
    """The watcher fell behind; reconnect with `after_event_id = resume_after`."""

    def __init__(self, resume_after: int) -> None:
        super().__init__(f"watcher fell behind; resume after event {resume_after}")
        self.resume_after = resume_after


class Subscription:
    """One watcher's queue of published events, cut off past the bus's `queue_limit`."""

    def __init__(self, bus: EventBus, job_ids: frozenset[int]) -> None:
        self._bus = bus
        self.job_ids = job_ids
        self._queue: collections.deque[job_pb2.JobEvent] = collections.deque()
        self._ready = asyncio.Event()
        self.overflowed = False
        # Where the watcher resumes once cut off: before every event it was not sent.
        self._resume_after = 0

    def offer(self, event: job_pb2.JobEvent) -> None:
        if self.overflowed or (self.job_ids and event.job_id not in self.job_ids):
            return
        if len(self._queue) >= self._bus.queue_limit:
            first_missed = min(event.event_id, *(e.event_id for e in self._queue))
            self._resume_after = max(first_missed - 1, 0)
            self.overflowed = True
            self._queue.clear()
            self._bus.unsubscribe(self)
        else:
            self._queue.append(event)
        self._ready.set()

    async def next(self) -> job_pb2.JobEvent:
        """The next event.

        Raises:
            WatcherOverflow: the watcher fell `queue_limit` events behind and was cut off.
        """
        while not self._queue:
            if self.overflowed:
                raise WatcherOverflow(self._resume_after)
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()

    async def take(self, limit: int) -> list[job_pb2.JobEvent]:
        """The next event and every other one queued behind it, at most `limit`, in order.

        Raises:
            WatcherOverflow: as `next`.
        """
        events = [await self.next()]
        queue = self._queue
        while queue and len(events) < limit:
            events.append(queue.popleft())
        return events

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    """Publishes committed events to every subscription; each holds at most `queue_limit`."""

    def __init__(self, queue_limit: int = QUEUE_LIMIT) -> None:
        self.queue_limit = queue_limit
        self._subscriptions: set[Subscription] = set()

    def subscribe(self, job_ids: Iterable[int] = ()) -> Subscription:
        sub = Subscription(self, frozenset(job_ids))
        self._subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)

    @property
    def subscriptions(self) -> int:
        """Live subscriptions: one per open WatchJobs stream (none leak from ended ones)."""
        return len(self._subscriptions)

    def publish(self, events: Iterable[job_pb2.JobEvent]) -> None:
        for event in events:
            for sub in list(self._subscriptions):
                sub.offer(event)
