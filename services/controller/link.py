"""The replica's one stream to the scheduler: its lease (contract §9).

`Link.run` keeps the stream up: it connects with exponential backoff, says
hello first (capacity and the jobs this replica still runs), sends heartbeats
(the first at once), and hands every message from the scheduler to the replica.
Requests that need an answer go through `call`, which waits for the matching
ack; requests not yet acked when a stream breaks are sent again, in order and
with their numbers, on the next one (`services/common/sequence.py`). Messages
from the scheduler are numbered per stream: one received twice is dropped, and
one past the next means a message went missing: the stream is given up for a
fresh one (the scheduler takes back the jobs of a stream a replica closes, and
reconciles the new hello with the database). While the
stream is down for longer than the lease, `on_lease_lost` fires: the scheduler
has given this replica's jobs away and the replica must stop acting for them.

The lease as this replica sees it never outlives the scheduler's: it is renewed
from the time a heartbeat was *sent* (when its ack comes back), not from when
an answer arrived, and ends a margin before the TTL. The scheduler renews on
receipt, which is later; so acks buffered through a stall (SIGSTOP, a long
pause) cannot make a stale replica believe it still holds its jobs. On a new
stream the lease counts only once a heartbeat sent on it is acknowledged: the
scheduler may have released this replica's jobs when the last stream closed,
and it sends the revokes for them before that first answer. A backend call
that changes anything also needs the stream to be up (`wait_lease`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential_jitter

from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.common.batches import Batches
from services.common.channels import ClientSecurity, open_channel
from services.common.sequence import InOrder, OutOfSequence
from services.controller import metrics

log = logging.getLogger(__name__)


def _why(error: BaseException | None) -> str:
    """One line on why a stream attempt failed (e.g. UNAUTHENTICATED: unknown token)."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


def unbatched(
    response: pb.ConnectControllerResponse,
) -> Sequence[pb.ConnectControllerResponse]:
    """The messages a response from the scheduler carries: itself, or its batch's."""
    if response.WhichOneof("message") == "batch":
        return response.batch.messages
    return (response,)


class StreamBroken(Exception):
    """The stream ended; reconnect."""


# What a stream attempt may end with that another attempt may cure.
_RECONNECT = (StreamBroken, grpc.aio.AioRpcError, OSError)


def _asked_to_stop() -> bool:
    """Whether the running task has a cancel pending.

    gRPC may end a call whose task is being cancelled with the call's own error (the
    scheduler went away at that moment: UNAVAILABLE), so the cancel never surfaces as
    CancelledError; reconnecting then would keep the link up for good.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Rejected(Exception):
    """The scheduler refused a request."""


class MovedAway(Rejected):
    """The job is not this replica's at this epoch any more: stop acting for it, silently."""


class Refused(Rejected):
    """The report broke a rule: the job must end FAILED_CONTROLLER, cleaned up."""


class LeaseLost(MovedAway):
    """This replica's lease ran out: it must not act for any job."""


class Link:
    def __init__(
        self,
        address: str,
        hello: Callable[[], pb.ControllerHello],
        on_message: Callable[[pb.ConnectControllerResponse], Awaitable[None]],
        on_lease_lost: Callable[[], Awaitable[None]],
        security: ClientSecurity | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        reconnect_max_wait: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        reconnect_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.address = address
        self._hello = hello
        self._on_message = on_message
        self._on_lease_lost = on_lease_lost
        self._security = security or ClientSecurity()
        self._metadata = metadata
        self._reconnect_max_wait = reconnect_max_wait
        self._clock = clock
        self._sleep = sleep
        # Between attempts to reach the scheduler (tests make it short).
        self._reconnect_sleep = reconnect_sleep
        # The number last given to a request (each gets one when first put on a stream).
        self._seq = 0
        # Requests posted and not yet answered, in the order posted; and their answers
        # to come, by number once they have one.
        self._posts = itertools.count()
        self._unacked: dict[
            int, tuple[pb.ConnectControllerRequest, asyncio.Future[pb.ReportAck]]
        ] = {}
        self._answers: dict[int, asyncio.Future[pb.ReportAck]] = {}
        self._outbox: asyncio.Queue[pb.ConnectControllerRequest | None] = asyncio.Queue()
        # Requests put on this stream's outbox and written to it; `_wrote` is set (and
        # replaced) after each write and when the stream ends.
        self._queued = 0
        self._written = 0
        self._wrote = asyncio.Event()
        self.connected = asyncio.Event()
        self.lease_ttl = 10.0
        self.heartbeat_interval = 2.0
        self.last_renewal = 0.0
        # Set (and replaced) at each renewal and when the stream ends; the welcomed
        # streams are counted, and the one a heartbeat's answer last renewed the lease on.
        self._renewal = asyncio.Event()
        self._streams = 0
        self._renewed_on = 0
        self._sent_at: dict[int, float] = {}
        self._lease_timer: asyncio.Task[None] | None = None

    @property
    def lease_margin(self) -> float:
        """How long before the TTL this replica stops counting on its lease."""
        return min(self.heartbeat_interval, self.lease_ttl / 4)

    def lease_left(self) -> float:
        """Seconds the scheduler surely still counts this replica's lease (≤ 0: none)."""
        if not self.last_renewal:
            return 0.0
        return self.last_renewal + self.lease_ttl - self.lease_margin - self._clock()

    def lease_valid(self) -> bool:
        """Whether the stream is up and the scheduler surely still counts the lease.

        The scheduler renews a lease when a message arrives; this view is renewed
        from when the acknowledged heartbeat was sent, and ends a margin early, so
        it runs out before the scheduler's. A pause (SIGSTOP) past the TTL shows
        here at once, before any further backend call. A new stream counts once a
        heartbeat sent on it is acknowledged.
        """
        return (
            self.connected.is_set() and self._renewed_on == self._streams and self.lease_left() > 0
        )

    async def wait_lease(self) -> bool:
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
        if self.lease_valid():
            return True
        if not self.connected.is_set():
            left = self.lease_left()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.connected.wait(), left)
            except TimeoutError:
                return False
        return await self._next_renewal()

    async def _next_renewal(self) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.lease_ttl
        while self.connected.is_set():
            if self.lease_valid():
                return True
            try:
                await asyncio.wait_for(self._renewal.wait(), max(0.0, end - loop.time()))
            except TimeoutError:
                return False
        return False

    # --- sending ---------------------------------------------------------------------------

    async def call(self, **message: Any) -> pb.ReportAck:
        """Sends a request and waits for its ack, across reconnects.

        Raises:
            Rejected: the scheduler answered accepted=false.
        """
        return await self.post(**message)

    def post(self, **message: Any) -> asyncio.Future[pb.ReportAck]:
        """Sends a request now (in order with every other) and returns its answer to come.

        Awaiting the answer raises like `call`; a caller may send more before awaiting
        it, keeping the order of its reports while not waiting a round trip for each.
        """
        request = pb.ConnectControllerRequest(**message)
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[pb.ReportAck] = loop.create_future()
        key = next(self._posts)
        self._unacked[key] = (request, acked)
        if self.connected.is_set():
            self._queue(request, acked)
        answer: asyncio.Future[pb.ReportAck] = loop.create_future()

        def settle(done: asyncio.Future[pb.ReportAck]) -> None:
            self._unacked.pop(key, None)
            self._answers.pop(request.seq, None)
            if answer.done():
                return
            if done.cancelled():
                answer.cancel()
                return
            ack = done.result()
            if ack.accepted:
                answer.set_result(ack)
            elif ack.refusal == pb.REPORT_REFUSAL_STALE_EPOCH:
                answer.set_exception(MovedAway(ack.reason))
            else:
                answer.set_exception(Refused(ack.reason or "refused"))

        def forget(done: asyncio.Future[pb.ReportAck]) -> None:
            # Whoever posted stopped waiting (the job was stopped): stop resending it too.
            # One never put on a stream has no number yet, so the numbers stay unbroken.
            if done.cancelled() and not acked.done():
                acked.cancel()

        acked.add_done_callback(settle)
        answer.add_done_callback(forget)
        return answer

    def notify(self, **message: Any) -> None:
        """Sends without waiting for an answer (dropped while disconnected)."""
        if self.connected.is_set():
            self._queue(pb.ConnectControllerRequest(**message))

    def _numbered(self, request: pb.ConnectControllerRequest) -> pb.ConnectControllerRequest:
        self._seq += 1
        request.seq = self._seq
        return request

    def _queue(
        self,
        request: pb.ConnectControllerRequest,
        answer: asyncio.Future[pb.ReportAck] | None = None,
    ) -> None:
        """Puts a request on the stream; numbered the first time (a resend keeps its number)."""
        if not request.seq:
            self._numbered(request)
            if answer is not None:
                self._answers[request.seq] = answer
        self._outbox.put_nowait(request)
        self._queued += 1

    async def written(self) -> None:
        """Returns once every request sent so far was written to the stream (not yet
        acked), or once the stream is down (what is unacked goes again on the next)."""
        streams, target = self._streams, self._queued
        while self.connected.is_set() and self._streams == streams and self._written < target:
            await self._wrote.wait()

    def _wake_writers(self) -> None:
        self._wrote.set()
        self._wrote = asyncio.Event()

    # --- the connection loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Keeps the stream up until cancelled.

        Reconnects back off exponentially while the scheduler stays away; a stream
        that was welcomed resets the backoff, so a scheduler restart is met at once
        rather than after the waits of every earlier outage.
        """
        while True:
            try:
                async for attempt in AsyncRetrying(
                    sleep=self._reconnect_sleep,
                    wait=wait_exponential_jitter(multiplier=0.1, max=self._reconnect_max_wait),
                    retry=retry_if_exception(
                        lambda error: isinstance(error, _RECONNECT) and not _asked_to_stop()
                    ),
                    before_sleep=lambda state: log.warning(
                        "scheduler stream down; reconnecting",
                        extra={
                            "address": self.address,
                            "attempt": state.attempt_number,
                            "error": _why(state.outcome.exception() if state.outcome else None),
                        },
                    ),
                ):
                    with attempt:
                        await self._session()
            except _RECONNECT:
                if _asked_to_stop():
                    raise asyncio.CancelledError() from None
                raise
            if _asked_to_stop():
                raise asyncio.CancelledError()

    async def _session(self) -> None:
        async with open_channel(self.address, self._security) as channel:
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
            self._outbox = asyncio.Queue()
            self._queued = self._written = 0
            hello = self._numbered(pb.ConnectControllerRequest(hello=self._hello()))
            self._sent_at = {}
            call = stub.ConnectController(self._requests(hello), metadata=self._metadata)
            heartbeats: asyncio.Task[None] | None = None
            order = InOrder()
            try:
                async for response in call:
                    for message in unbatched(response):
                        if not order.check(message.seq):
                            metrics.replayed_message()
                            continue  # received before on this stream, and handled
                        kind = message.WhichOneof("message")
                        if kind == "welcome":
                            self._welcomed(message.welcome)
                            heartbeats = asyncio.create_task(self._heartbeats())
                        elif kind == "ack":
                            self._acked(message.ack)
                        else:
                            await self._on_message(message)
            except OutOfSequence as gap:
                # A message went missing: a fresh stream, whose hello the scheduler
                # reconciles with the database, puts this replica back in step.
                metrics.resync()
                raise StreamBroken(f"out of sequence ({gap}); reconnecting to resync") from None
            except grpc.aio.AioRpcError:
                if heartbeats is None:
                    raise
                # A welcomed stream broke: reconnect at once (a fresh backoff).
            finally:
                self.connected.clear()
                self._outbox.put_nowait(None)
                self._wake_writers()
                self._wake_renewal_waiters()
                if heartbeats is not None:
                    heartbeats.cancel()
                self._arm_lease_timer()
            if heartbeats is None:
                raise StreamBroken("the scheduler closed the stream before welcoming us")
            log.warning("scheduler stream ended; reconnecting", extra={"address": self.address})

    async def _requests(
        self, hello: pb.ConnectControllerRequest
    ) -> AsyncIterator[pb.ConnectControllerRequest]:
        yield hello
        # Whatever queued while the last message was being written goes as one.
        batches = Batches(self._outbox)
        while batch := await batches.next():
            for request in batch:
                if request.WhichOneof("message") == "heartbeat":
                    # The lease is renewed from the moment the heartbeat leaves, once acked.
                    self._sent_at[request.seq] = self._clock()
            if len(batch) == 1:
                yield batch[0]
            else:
                yield pb.ConnectControllerRequest(batch=pb.RequestBatch(requests=batch))
            # gRPC asks for the next message once this one is written.
            self._written += len(batch)
            self._wake_writers()

    def _welcomed(self, welcome: pb.ControllerWelcome) -> None:
        self.lease_ttl = welcome.lease_ttl_seconds or self.lease_ttl
        self.heartbeat_interval = welcome.heartbeat_interval_seconds or self.heartbeat_interval
        # The lease counts on this stream once a heartbeat sent on it is answered.
        self._streams += 1
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        self.connected.set()
        # Everything not acked on the last stream goes again, in order (with its number).
        for request, answer in list(self._unacked.values()):
            self._queue(request, answer)
        log.info("connected to the scheduler", extra={"address": self.address})

    def _renewed(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` on the current stream was answered."""
        self.last_renewal = max(self.last_renewal, sent_at)
        self._renewed_on = self._streams
        self._wake_renewal_waiters()

    def _wake_renewal_waiters(self) -> None:
        self._renewal.set()
        self._renewal = asyncio.Event()

    def _acked(self, ack: pb.ReportAck) -> None:
        sent_at = self._sent_at.pop(ack.ack_seq, None)
        if sent_at is not None:
            self._renewed(sent_at)
        answer = self._answers.get(ack.ack_seq)
        if answer is not None and not answer.done():
            answer.set_result(ack)

    async def _heartbeats(self) -> None:
        # The first goes at once: a new stream's lease counts from its answer.
        while True:
            self.notify(heartbeat=pb.ControllerHeartbeat())
            await self._sleep(self.heartbeat_interval)

    def _arm_lease_timer(self) -> None:
        if self._lease_timer is None or self._lease_timer.done():
            self._lease_timer = asyncio.create_task(self._lease_countdown())

    async def _lease_countdown(self) -> None:
        await self._sleep(max(0.0, self.last_renewal + self.lease_ttl - self._clock()))
        if not self.connected.is_set():
            log.warning("lease lost; stopping every job", extra={"address": self.address})
            await self._on_lease_lost()
