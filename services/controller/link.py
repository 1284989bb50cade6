"""The replica's one stream to the scheduler: its session and reconnects (contract §9).

`Link.run` keeps the stream up: it connects with exponential backoff, says
hello first (capacity and the jobs this replica still runs), sends heartbeats
(the first at once) and writes what the outbox queues (`outbox.py`), several
at a time as one batch when they queued up. Messages from the scheduler are
numbered per stream: one received twice is dropped, and one past the next means
a message went missing: the stream is given up for a fresh one (the scheduler
takes back the jobs of a stream a replica closes, and reconciles the new hello
with the database). Every other message goes by its oneof's name through one
table (`Link.dispatch`): the welcome and the acks to the lease (`lease.py`) and
the outbox, each instruction to the replica's handler for it (`Instructions`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.common.batches import Batches
from services.common.channels import ClientSecurity, open_channel
from services.common.sequence import InOrder, OutOfSequence
from services.controller import metrics
from services.controller.lease import Lease
from services.controller.messages import Instructions, unbatched
from services.controller.outbox import Outbox

log = logging.getLogger(__name__)

Handler = Callable[[pb.ConnectControllerResponse], None]


def _why(error: BaseException | None) -> str:
    """One line on why a stream attempt failed (e.g. UNAUTHENTICATED: unknown token)."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


class StreamBroken(Exception):
    """The stream ended; reconnect."""


class Link:
    """The stream to the scheduler at `address`, with this replica's lease and outbox."""

    def __init__(
        self,
        address: str,
        hello: Callable[[], pb.ControllerHello],
        instructions: Instructions,
        on_lease_lost: Callable[[], Awaitable[None]],
        security: ClientSecurity | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        reconnect_max_wait: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.address = address
        self._hello = hello
        self._on_lease_lost = on_lease_lost
        self._security = security or ClientSecurity()
        self._metadata = metadata
        self._reconnect_max_wait = reconnect_max_wait
        self._sleep = sleep
        # Set while a welcomed stream is up.
        self.connected = asyncio.Event()
        self.lease = Lease(self.connected, self._lease_lost, clock, sleep)
        self.outbox = Outbox(self.connected)
        # The current stream's heartbeats, from its welcome on.
        self._heartbeats: asyncio.Task[None] | None = None
        on = instructions
        self._handlers: dict[str, Handler] = {
            "welcome": lambda m: self._welcomed(m.welcome),
            "ack": lambda m: self._acked(m.ack),
            "assignment": lambda m: on.assignment(m.assignment),
            "launch_slot_grant": lambda m: on.launch_slot_grant(m.launch_slot_grant),
            "cancel": lambda m: on.cancel(m.cancel),
            "revoke": lambda m: on.revoke(m.revoke),
        }

    def dispatch(self, message: pb.ConnectControllerResponse) -> None:
        """Hands one message from the scheduler to its handler (one it has none for: dropped)."""
        handler = self._handlers.get(message.WhichOneof("message") or "")
        if handler is not None:
            handler(message)

    async def run(self) -> None:
        """Keeps the stream up until cancelled.

        Reconnects back off exponentially while the scheduler stays away; a stream
        that was welcomed resets the backoff, so a scheduler restart is met at once
        rather than after the waits of every earlier outage.
        """
        while True:
            async for attempt in AsyncRetrying(
                wait=wait_exponential_jitter(multiplier=0.1, max=self._reconnect_max_wait),
                retry=retry_if_exception_type((StreamBroken, grpc.aio.AioRpcError, OSError)),
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

    async def _session(self) -> None:
        async with open_channel(self.address, self._security) as channel:
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
            queue = self.outbox.started()
            hello = self.outbox.numbered(pb.ConnectControllerRequest(hello=self._hello()))
            self._heartbeats = None
            call = stub.ConnectController(self._requests(hello, queue), metadata=self._metadata)
            order = InOrder()
            try:
                async for response in call:
                    for message in unbatched(response):
                        if not order.check(message.seq):
                            metrics.replayed_message()
                            continue  # received before on this stream, and handled
                        self.dispatch(message)
            except OutOfSequence as gap:
                # A message went missing: a fresh stream, whose hello the scheduler
                # reconciles with the database, puts this replica back in step.
                metrics.resync()
                raise StreamBroken(f"out of sequence ({gap}); reconnecting to resync") from None
            except grpc.aio.AioRpcError:
                if self._heartbeats is None:
                    raise
                # A welcomed stream broke: reconnect at once (a fresh backoff).
            finally:
                self.connected.clear()
                self.outbox.ended()
                if self._heartbeats is not None:
                    self._heartbeats.cancel()
                self.lease.ended()
            if self._heartbeats is None:
                raise StreamBroken("the scheduler closed the stream before welcoming us")
            log.warning("scheduler stream ended; reconnecting", extra={"address": self.address})

    async def _requests(
        self,
        hello: pb.ConnectControllerRequest,
        queue: asyncio.Queue[pb.ConnectControllerRequest | None],
    ) -> AsyncIterator[pb.ConnectControllerRequest]:
        yield hello
        # Whatever queued while the last message was being written goes as one.
        batches = Batches(queue)
        while batch := await batches.next():
            for request in batch:
                if request.HasField("heartbeat"):
                    # The lease is renewed from the moment the heartbeat leaves, once acked.
                    self.lease.sent(request.seq)
            if len(batch) == 1:
                yield batch[0]
            else:
                yield pb.ConnectControllerRequest(batch=pb.RequestBatch(requests=batch))
            # gRPC asks for the next message once this one is written.
            self.outbox.wrote(len(batch))

    def _welcomed(self, welcome: pb.ControllerWelcome) -> None:
        self.lease.welcomed(welcome)
        self.connected.set()
        self.outbox.welcomed()
        self._heartbeats = asyncio.create_task(self._heartbeat())
        log.info("connected to the scheduler", extra={"address": self.address})

    def _acked(self, ack: pb.ReportAck) -> None:
        self.lease.answered(ack.ack_seq)
        self.outbox.answered(ack)

    async def _heartbeat(self) -> None:
        # The first goes at once: a new stream's lease counts from its answer.
        while True:
            self.outbox.notify(pb.ControllerHeartbeat())
            await self._sleep(self.lease.heartbeat_interval)

    async def _lease_lost(self) -> None:
        log.warning("lease lost; stopping every job", extra={"address": self.address})
        await self._on_lease_lost()


__all__ = ["Link", "StreamBroken"]
