"""This replica's view of its lease on the scheduler (contract §9).

The view never outlives the scheduler's lease: it is renewed from the time a
heartbeat was *sent* (when its ack comes back), not from when an answer
arrived, and ends a margin before the TTL. The scheduler renews on receipt,
which is later; so acks buffered through a stall (SIGSTOP, a long pause) cannot
make a stale replica believe it still holds its jobs. On a new stream the lease
counts only once a heartbeat sent on it is acknowledged: the scheduler may have
released this replica's jobs when the last stream closed, and it sends the
revokes for them before that first answer. A backend call that changes anything
waits for a lease the scheduler surely still counts (`Lease.wait`).

While the stream is down for longer than the TTL, `on_lost` fires: the scheduler
has given this replica's jobs away and the replica must stop acting for them.
The link (`services/controller/link.py`) says when a stream is welcomed and
when it ends, and which heartbeats were sent and answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from managedjobs.v1 import scheduler_service_pb2 as pb


class Lease:
    """The lease as this replica sees it, over the streams of its link.

    Args:
        connected: set while a welcomed stream is up (the link sets and clears it).
        on_lost: awaited once the stream stayed down past the TTL.
    """

    def __init__(
        self,
        connected: asyncio.Event,
        on_lost: Callable[[], Awaitable[None]],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self._connected = connected
        self._on_lost = on_lost
        self._clock = clock
        self._sleep = sleep
        self.ttl = 10.0
        self.heartbeat_interval = 2.0
        self.last_renewal = 0.0
        # Set (and replaced) at each renewal and when the stream ends; the welcomed
        # streams are counted, and the one a heartbeat's answer last renewed the lease on.
        self._renewal = asyncio.Event()
        self._streams = 0
        self._renewed_on = 0
        # When each heartbeat not yet answered on this stream left, by its number.
        self._sent_at: dict[int, float] = {}
        self._timer: asyncio.Task[None] | None = None

    @property
    def margin(self) -> float:
        """How long before the TTL this replica stops counting on its lease."""
        return min(self.heartbeat_interval, self.ttl / 4)

    def left(self) -> float:
        """Seconds the scheduler surely still counts this replica's lease (≤ 0: none)."""
        if not self.last_renewal:
            return 0.0
        return self.last_renewal + self.ttl - self.margin - self._clock()

    def valid(self) -> bool:
        """Whether the stream is up and the scheduler surely still counts the lease.

        The scheduler renews a lease when a message arrives; this view is renewed
        from when the acknowledged heartbeat was sent, and ends a margin early, so
        it runs out before the scheduler's. A pause (SIGSTOP) past the TTL shows
        here at once, before any further backend call. A new stream counts once a
        heartbeat sent on it is acknowledged.
        """
        return self._connected.is_set() and self._renewed_on == self._streams and self.left() > 0

    async def wait(self) -> bool:
        """Waits for a lease the scheduler surely still counts; True once there is one.

        While the stream is down: for it to come back, at most as long as the lease
        view lasts. While it is up without a fresh answer (answers slowed by load, or
        a new stream whose first heartbeat is not answered yet): for the next answer,
        at most one TTL. The scheduler keeps the lease until the stream falls silent,
        and ends the stream when it gives the jobs away; a late answer is no reason
        to drop them. On a new stream, the scheduler's revokes for the jobs this
        replica lost come before the first answer: a call for such a job is stopped
        with its runner before it can go ahead.
        """
        if self.valid():
            return True
        if not self._connected.is_set():
            left = self.left()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._connected.wait(), left)
            except TimeoutError:
                return False
        return await self._next_renewal()

    async def _next_renewal(self) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.ttl
        while self._connected.is_set():
            if self.valid():
                return True
            try:
                await asyncio.wait_for(self._renewal.wait(), max(0.0, end - loop.time()))
            except TimeoutError:
                return False
        return False

    # --- what the link tells ---------------------------------------------------------------

    def welcomed(self, welcome: pb.ControllerWelcome) -> None:
        """A new stream was welcomed: its lease counts once a heartbeat on it is answered."""
        self.ttl = welcome.lease_ttl_seconds or self.ttl
        self.heartbeat_interval = welcome.heartbeat_interval_seconds or self.heartbeat_interval
        self._streams += 1
        self._sent_at = {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def sent(self, seq: int) -> None:
        """Heartbeat `seq` left on the current stream now."""
        self._sent_at[seq] = self._clock()

    def answered(self, seq: int) -> None:
        """Request `seq` was acknowledged: a heartbeat renews the lease from when it left."""
        sent_at = self._sent_at.pop(seq, None)
        if sent_at is not None:
            self.renewed(sent_at)

    def renewed(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` on the current stream was answered."""
        self.last_renewal = max(self.last_renewal, sent_at)
        self._renewed_on = self._streams
        self._wake_waiters()

    def ended(self) -> None:
        """The stream ended: the lease runs out unless another is welcomed in time."""
        self._wake_waiters()
        if self._timer is None or self._timer.done():
            self._timer = asyncio.create_task(self._countdown())

    def _wake_waiters(self) -> None:
        self._renewal.set()
        self._renewal = asyncio.Event()

    async def _countdown(self) -> None:
        await self._sleep(max(0.0, self.last_renewal + self.ttl - self._clock()))
        if not self._connected.is_set():
            await self._on_lost()


__all__ = ["Lease"]
