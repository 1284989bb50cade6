"""WatchJobs: events from an id on, the backlog then live, none lost, none twice (contract §11).

A watch subscribes to the event bus first, then reads the backlog from the
database in pages (`WATCH_BATCH` events each), then takes live events from its
subscription. Transactions commit in id order but may publish out of it, so the
live part skips what was sent by id (`SentEvents`), not by "at most the last id
sent". A batched watch sends every event ready at once in one response.

A watch resumed after an event id past the newest is OUT_OF_RANGE (reason
EVENTS_AHEAD: the database was replaced, or the id was never issued) rather than
a wait for events that may never come; a watcher that falls `--watch-queue-limit`
events behind is cut off with RESOURCE_EXHAUSTED (reason WATCHER_OVERFLOW) and
ErrorInfo metadata `resume_after_event_id`, the id to resume after without
losing an event. A user's watch of every job shows their own jobs only
(`ownership.py`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Sequence

from managedjobs.v1 import job_pb2
from managedjobs.v1 import job_service_pb2 as pb
from services.common.errors import OutOfRange, ResourceExhausted
from services.scheduler import queries
from services.scheduler.events import EventBus, WatcherOverflow
from services.scheduler.ownership import OwnedJobs
from services.scheduler.store import Store

# Events in one response of a batched watch (a backlog page holds as many).
WATCH_BATCH = 1000


class SentEvents:
    """Ids of events a watcher was sent, forgetting those far below the newest."""

    KEEP = 100_000

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._top = 0

    def add(self, event_id: int) -> bool:
        """Records an id; False if it was sent already."""
        if event_id in self._ids:
            return False
        self._ids.add(event_id)
        self._top = max(self._top, event_id)
        if len(self._ids) > 2 * self.KEEP:
            floor = self._top - self.KEEP
            self._ids = {i for i in self._ids if i > floor}
        return True


def _responses(events: Sequence[job_pb2.JobEvent], batched: bool) -> Iterator[pb.WatchJobsResponse]:
    """A watch's responses for events ready at once: one for all of them when batched,
    else one each."""
    if not batched:
        yield from (pb.WatchJobsResponse(event=event) for event in events)
    elif events:
        yield pb.WatchJobsResponse(events=events)


async def not_ahead(store: Store, after_event_id: int) -> None:
    """Raises OutOfRange for a resume point past the newest event: no such event was
    ever sent (the database was replaced since), so waiting would wait forever."""
    if not after_event_id:
        return
    head = await store.read(queries.last_event_id)
    if after_event_id > head:
        raise OutOfRange(
            f"after_event_id: {after_event_id} is past the newest event ({head}); "
            "watch again from 0 or from an id you were sent",
            reason="EVENTS_AHEAD",
            field="after_event_id",
            head_event_id=str(head),
        )


async def watch(
    store: Store,
    bus: EventBus,
    request: pb.WatchJobsRequest,
    job_ids: Sequence[int],
    owned: OwnedJobs | None,
) -> AsyncGenerator[pb.WatchJobsResponse, None]:
    """The watch's responses: the events of `job_ids` (of every job when none, only the
    user's when `owned`) after `request.after_event_id`, until the caller stops."""
    subscription = bus.subscribe(job_ids)
    try:
        # Transactions commit in id order but may publish out of it, so the live
        # part skips what was sent by id, not by "at most the last id sent".
        sent = SentEvents()
        last = request.after_event_id
        while True:
            backlog = await store.read(
                queries.events_after,
                last,
                job_ids,
                user=owned.user if owned else "",
                limit=WATCH_BATCH,
            )
            for event in backlog:
                sent.add(event.event_id)
                last = event.event_id
            for response in _responses(backlog, request.batched):
                yield response
            if len(backlog) < WATCH_BATCH:
                break
        while True:
            try:
                ready = await subscription.take(WATCH_BATCH if request.batched else 1)
            except WatcherOverflow as overflow:
                resume = max(overflow.resume_after, request.after_event_id)
                raise ResourceExhausted(
                    f"this watch fell more than {bus.queue_limit:,} events behind and "
                    f"was cut off; watch again with after_event_id={resume}",
                    reason="WATCHER_OVERFLOW",
                    resume_after_event_id=str(resume),
                ) from None
            fresh = []
            for event in ready:
                if event.event_id <= request.after_event_id or not sent.add(event.event_id):
                    continue
                if owned is not None and not await owned.owns(event.job_id):
                    continue
                fresh.append(event)
            for response in _responses(fresh, request.batched):
                yield response
    finally:
        subscription.close()
