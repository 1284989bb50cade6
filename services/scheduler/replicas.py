"""Controller replicas: their streams, their leases, and what they report (contract §9).

A replica's `ConnectController` stream is its lease. The hello carries its
capacity and the jobs it still runs; every message it sends renews the lease.
When the stream breaks, the lease runs out TTL seconds after the last message,
and the replica's jobs move to other replicas with the next epoch. A watchdog
task per replica sleeps until the lease deadline; nothing polls.

Who may hold a stream: the hello must name the controller id the caller's token is
bound to (and, under mTLS, its certificate), and a replica id already holding a
live stream (heard from within two heartbeats) is refused rather than taken
over; both refusals are counted. A replica whose stream broke reconnects once
the scheduler has stopped hearing from the old one.

Reports are applied in batches (`reports.py`): whatever a replica sent while
the previous batch was being committed goes in the next one, in order. A report
with a stale epoch is refused (and counted) and its job revoked on that replica,
so a replica that lost its lease stops acting for the job.

On hello, and periodically, the replica's view is reconciled with the database,
the only truth: what it should not hold is revoked, what it lost is released,
and what it holds gets its grants, cancels and any assignment it was never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NoReturn

import grpc

from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.common.batches import MAX_BATCH_MESSAGES, Batches
from services.common.bounds import BoundsError, check_controller_id, quote
from services.common.errors import (
    AlreadyExists,
    ApiError,
    FailedPrecondition,
    InvalidArgument,
    rpc_errors,
)
from services.common.event_messages import NO_LONGER_RUNS_IT, lease_expired
from services.common.security.access import current_principal, require_controller
from services.common.statuses import ScheduleState
from services.scheduler import metrics
from services.scheduler.admission import Admission
from services.scheduler.health import DbHealth
from services.scheduler.outbox import Outbox, Stream, TooLarge
from services.scheduler.reports import Reports
from services.scheduler.store import Store

log = logging.getLogger(__name__)
St = ScheduleState
MAX_BATCH = 512
# What a hello may carry: a host:port, the regions of a backend.
MAX_ADDRESS_CHARS = 256
MAX_REGIONS = 1000
MAX_REGION_CHARS = 128


@dataclasses.dataclass
class Lease:
    """What the scheduler knows of one replica's lease, across its reconnects."""

    controller_id: str
    address: str = ""
    deadline: float = 0.0
    # When the current stream last carried a message (monotonic seconds).
    heard: float = 0.0
    connected: bool = False
    draining: bool = False
    watchdog: asyncio.Task[None] | None = None
    stream: Stream | None = None


def check_hello(hello: pb.ControllerHello) -> None:
    """The rest of a hello, once its controller id passed: what the scheduler keeps of it
    (capacity, address, regions, held jobs) must be in range.

    Raises:
        InvalidArgument: naming the field.
    """

    def refuse(field: str, message: str) -> NoReturn:
        raise InvalidArgument(f"hello.{field}: {message}", field=f"hello.{field}")

    for name in ("max_launches", "max_jobs"):
        if getattr(hello.capacity, name) < 0:
            refuse(f"capacity.{name}", "must not be negative")
    if len(hello.address) > MAX_ADDRESS_CHARS:
        refuse("address", f"at most {MAX_ADDRESS_CHARS} characters, got {quote(hello.address)}")
    if len(hello.regions) > MAX_REGIONS:
        refuse("regions", f"at most {MAX_REGIONS} regions, got {len(hello.regions)}")
    for index, region in enumerate(hello.regions):
        if not region or len(region) > MAX_REGION_CHARS:
            refuse(f"regions[{index}]", f"1 to {MAX_REGION_CHARS} characters, got {quote(region)}")
    for index, held in enumerate(hello.held_jobs):
        if held.job_id <= 0 or held.epoch < 0:
            refuse(f"held_jobs[{index}]", f"no job {held.job_id} at epoch {held.epoch}")


def _unbatched(
    envelope: pb.ConnectControllerRequest,
) -> Sequence[pb.ConnectControllerRequest]:
    """The requests an envelope carries: itself, or its batch's.

    Raises:
        InvalidArgument: a batch of more than MAX_BATCH_MESSAGES requests.
    """
    if envelope.WhichOneof("message") != "batch":
        return (envelope,)
    requests = envelope.batch.requests
    if len(requests) > MAX_BATCH_MESSAGES:
        raise InvalidArgument(
            f"batch.requests: at most {MAX_BATCH_MESSAGES} per message, got {len(requests)}",
            field="batch.requests",
        )
    return requests


class Replicas(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        store: Store,
        reports: Reports,
        admission: Admission,
        outbox: Outbox,
        health: DbHealth,
        lease_ttl: float = 10.0,
        heartbeat_interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.reports = reports
        self.admission = admission
        self.outbox = outbox
        self.health = health
        self.lease_ttl = lease_ttl
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.expired: list[tuple[str, float]] = []
        # Hellos refused: a controller id not bound to the caller, or already streaming.
        self.refused_hellos = 0

    # --- leases ----------------------------------------------------------------------------

    async def adopt_unknown(self) -> None:
        """After a scheduler start: replicas named in the database get one lease TTL to
        reconnect before their jobs move."""
        counts = await self.store.recount()
        for controller_id, state in counts:
            if controller_id is not None and state != St.DONE:
                self._lease(controller_id)

    def _lease(self, controller_id: str) -> Lease:
        lease = self.leases.get(controller_id)
        if lease is None:
            lease = Lease(controller_id)
            self.leases[controller_id] = lease
            lease.deadline = self.clock() + self.lease_ttl
            lease.watchdog = asyncio.create_task(self._watch_lease(lease))
        return lease

    def _renew(self, lease: Lease) -> None:
        lease.heard = self.clock()
        lease.deadline = lease.heard + self.lease_ttl

    async def _watch_lease(self, lease: Lease) -> None:
        while True:
            remaining = lease.deadline - self.clock()
            if remaining > 0:
                await asyncio.sleep(remaining)
                continue
            if not self.health.ok:
                # Nothing can move while the database is away; leases restart when it is back.
                await self.health.wait_reachable()
                lease.deadline = max(lease.deadline, self.clock() + self.lease_ttl)
                continue
            await self._expire(lease)
            return

    async def _expire(self, lease: Lease) -> None:
        cid = lease.controller_id
        log.warning("lease expired", extra={"controller_id": cid})
        metrics.lease_expired()
        if self.leases.get(cid) is lease:
            del self.leases[cid]
        self.admission.gone(cid)
        lease.connected = False
        self.outbox.detach(cid, lease.stream)
        self.expired.append((cid, self.clock()))
        await self.health.retry(
            lambda: self.reports.release_replica(cid, reason=lease_expired(cid)),
            limit=float("inf"),
        )

    def restart_leases(self) -> None:
        """Gives every replica a full lease from now (after the database came back)."""
        for lease in self.leases.values():
            lease.deadline = max(lease.deadline, self.clock() + self.lease_ttl)

    async def close(self) -> None:
        self.outbox.close()
        for lease in list(self.leases.values()):
            if lease.watchdog is not None:
                lease.watchdog.cancel()

    # --- the stream ------------------------------------------------------------------------

    @rpc_errors
    async def ConnectController(
        self,
        request_iterator: AsyncIterator[pb.ConnectControllerRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ConnectControllerResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "hello":
            raise FailedPrecondition("the first message on the stream must be a hello")
        hello = first.hello
        if not hello.controller_id:
            raise FailedPrecondition("hello.controller_id is required")
        cid = hello.controller_id
        try:
            try:
                check_controller_id(cid, "hello.controller_id")
            except BoundsError as bad:
                raise InvalidArgument(str(bad), field=bad.field) from None
            require_controller(current_principal(), cid)
            check_hello(hello)
            self._refuse_a_second_stream(cid)
        except ApiError as refused:
            self.refused_hellos += 1
            metrics.hello_refused(refused.reason)
            log.warning(
                "hello refused", extra={"controller_id": cid[:64], "reason": refused.reason}
            )
            raise
        lease = self._lease(cid)
        # A reconnect replaces the previous stream of the same replica.
        stream = self.outbox.attach(cid)
        lease.stream = stream
        lease.connected = True
        lease.draining = False
        lease.address = hello.address
        self._renew(lease)
        log.info("replica connected", extra={"controller_id": cid, "held": len(hello.held_jobs)})
        yield pb.ConnectControllerResponse(
            seq=0,
            welcome=pb.ControllerWelcome(
                lease_ttl_seconds=self.lease_ttl,
                heartbeat_interval_seconds=self.heartbeat_interval,
            ),
        )
        await self._reconcile(stream, hello)
        self.admission.connected(hello)
        reader = asyncio.create_task(self._read(lease, stream, request_iterator))
        batches = Batches(stream.queue)
        try:
            # Whatever queued while the last message was being written goes as one.
            while batch := await batches.next():
                if len(batch) == 1:
                    yield batch[0]
                else:
                    yield pb.ConnectControllerResponse(batch=pb.ResponseBatch(messages=batch))
            if stream.error is not None:
                raise stream.error
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if lease.stream is stream:
                lease.connected = False
                lease.stream = None
                self.outbox.detach(cid, stream)
                self.admission.draining(cid)  # no new work until it reconnects
            log.info("replica stream closed", extra={"controller_id": cid})

    def _refuse_a_second_stream(self, controller_id: str) -> None:
        """Raises AlreadyExists while the replica's current stream is alive (heard lately)."""
        lease = self.leases.get(controller_id)
        if lease is None or not lease.connected:
            return
        if self.clock() - lease.heard < 2 * self.heartbeat_interval:
            raise AlreadyExists(
                f"controller {controller_id} already has a live stream; a replica whose "
                "stream broke is taken back once the old stream falls silent",
                reason="STREAM_ALREADY_OPEN",
            )

    async def _reconcile(self, stream: Stream, hello: pb.ControllerHello) -> None:
        """The database is the only truth: revoke what the replica should not hold,
        re-send grants and cancels for what it does, and free what it lost."""
        cid = hello.controller_id
        truth = await self.store.held_by(cid)
        held = {h.job_id: h.epoch for h in hello.held_jobs}
        for job_id, epoch in held.items():
            if truth.get(job_id) != epoch:
                self.outbox.revoke(cid, job_id, epoch)
        lost = [job_id for job_id, epoch in truth.items() if held.get(job_id) != epoch]
        if lost:
            await self.reports.release_replica(cid, lost, reason=NO_LONGER_RUNS_IT)
        kept = [job_id for job_id, epoch in truth.items() if held.get(job_id) == epoch]
        stream.sent.update({job_id: truth[job_id] for job_id in kept})
        for job in await self.store.get_jobs(kept):
            epoch = truth[job.job_id]
            if job.schedule_state == St.LAUNCHING:
                self.outbox.grant(cid, job.job_id, epoch)
            if job.cancel_requested:
                self.outbox.cancel(cid, job.job_id, epoch)

    async def sync_assignments(self) -> int:
        """Sends every replica the assignments the database gives it but it was never sent
        on its current stream (an admission commit whose outcome was unknown).

        Compares in a quiet turn of the writers, when every committed assignment has been
        sent; returns how many were sent.
        """
        sent = 0
        async with self.store.db.quiet():
            for cid, lease in list(self.leases.items()):
                stream = lease.stream
                if stream is None:
                    continue
                truth = await self.store.held_by(cid)
                missing = [j for j, e in truth.items() if stream.sent.get(j) != e]
                if not missing:
                    continue
                log.warning(
                    "replica was never sent some assignments; sending them",
                    extra={"controller_id": cid, "jobs": missing[:20], "count": len(missing)},
                )
                secrets = await self.store.secrets(missing)
                for job in await self.store.get_jobs(missing, with_specs=True):
                    if job.schedule_state != St.DONE and job.controller_id == cid:
                        granted = job.schedule_state == St.LAUNCHING
                        epoch, kept = truth[job.job_id], secrets.get(job.job_id)
                        with contextlib.suppress(TooLarge):  # admission failed such a job
                            sent += self.outbox.assign(cid, job, epoch, granted, kept)
        return sent

    async def _read(
        self,
        lease: Lease,
        stream: Stream,
        request_iterator: AsyncIterator[pb.ConnectControllerRequest],
    ) -> None:
        """Reads the replica's messages. Heartbeats are acked at once, even while the
        database is away, so a replica keeps its lease; reports go, in order, to a
        worker that applies whatever has queued as one batch."""
        work: list[pb.ConnectControllerRequest] = []
        queued = asyncio.Event()
        worker = asyncio.create_task(self._work(lease, stream, work, queued))
        try:
            async for envelope in request_iterator:
                if lease.stream is not stream:
                    return
                self._renew(lease)
                for request in _unbatched(envelope):
                    kind = request.WhichOneof("message")
                    if kind == "heartbeat":
                        ack = pb.ReportAck(ack_seq=request.seq, accepted=True)
                        self.outbox.ack(lease.controller_id, ack)
                    elif kind == "draining":
                        lease.draining = True
                        self.admission.draining(lease.controller_id)
                    else:
                        work.append(request)
                        queued.set()
        except InvalidArgument as bad:
            log.warning(
                "replica stream refused",
                extra={"controller_id": lease.controller_id, "error": str(bad)},
            )
            stream.close(bad)
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("replica stream failed", extra={"controller_id": lease.controller_id})
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            if lease.stream is stream:
                stream.close()

    async def _work(
        self,
        lease: Lease,
        stream: Stream,
        work: list[pb.ConnectControllerRequest],
        queued: asyncio.Event,
    ) -> None:
        cid = lease.controller_id
        while True:
            await queued.wait()
            queued.clear()
            while work:
                batch = work[:MAX_BATCH]
                del work[:MAX_BATCH]
                try:
                    applied = await self.health.retry(
                        functools.partial(self.reports.apply, cid, batch)
                    )
                except Exception:
                    # Unacked, the replica sends them again on its next stream.
                    log.exception("reports failed", extra={"controller_id": cid})
                    stream.close()
                    return
                if lease.stream is not stream:
                    return
                for job_id, epoch in applied.grants:
                    self.outbox.grant(cid, job_id, epoch)
                for job_id, epoch in applied.revokes:
                    log.warning("stale report", extra={"controller_id": cid, "job_id": job_id})
                    self.outbox.revoke(cid, job_id, epoch)
                finished = [
                    r.job_finished.job_id
                    for r, ack in zip(batch, applied.acks, strict=True)
                    if ack.accepted and r.WhichOneof("message") == "job_finished"
                ]
                self.outbox.forget(cid, finished)
                for ack in applied.acks:
                    self.outbox.ack(cid, ack)

    # --- operators ------------------------------------------------------------------------

    @rpc_errors
    async def GetSchedulerState(
        self, request: pb.GetSchedulerStateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetSchedulerStateResponse:
        state = self.admission.state()
        state.stale_reports = self.reports.refused_stale
        state.refused_hellos = self.refused_hellos
        state.invalid_reports = self.reports.refused_invalid
        state.database_reachable = self.health.ok
        state.watch_streams = self.store.bus.subscriptions
        counters = self.admission.counters
        for cid, lease in sorted(self.leases.items()):
            info = self.admission.replicas.get(cid)
            slots = counters.slots(cid)
            replica = pb.ReplicaState(
                controller_id=cid,
                address=lease.address,
                connected=lease.connected,
                draining=lease.draining,
                launching=slots.launching,
                alive=slots.alive,
            )
            if info is not None:
                replica.capacity.CopyFrom(info.capacity)
            replica.lease_expire_time.FromSeconds(
                int(time.time() + max(0.0, lease.deadline - self.clock()))
            )
            state.replicas.append(replica)
        return state
