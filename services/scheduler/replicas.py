"""Controller replicas: `SchedulerService`, the door of their streams (contract §9).

A replica's `ConnectController` stream opens with a hello that carries its
capacity, its address and regions, and the jobs it still runs. The stream is
the replica's lease (`leases.py`); what it carries after the hello is read and
applied by its session (`session.py`).

Who may hold a stream: the hello must name the controller id the caller's token is
bound to (and, under mTLS, its certificate), and a replica id already holding a
live stream (heard from within two heartbeats) is refused rather than taken
over; both refusals are counted. A replica whose stream broke reconnects once
the scheduler has stopped hearing from the old one; a reconnect replaces the
replica's previous stream.

On hello, and periodically, the replica's view is reconciled with the database,
the only truth: what it should not hold is revoked, what it lost is released,
and what it holds gets its grants, cancels and any assignment it was never sent.
Whatever queued for the replica while the last message was being written goes
as one `ResponseBatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.common.batches import Batches
from services.common.bounds import BoundsError, check_controller_id, quote
from services.common.errors import (
    AlreadyExists,
    ApiError,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    rpc_errors,
)
from services.common.event_messages import NO_LONGER_RUNS_IT
from services.common.security.access import current_principal, require_controller
from services.common.statuses import ScheduleState
from services.scheduler import metrics, queries
from services.scheduler.admission import Admission
from services.scheduler.health import DbHealth
from services.scheduler.leases import Leases
from services.scheduler.outbox import Outbox, Stream, TooLarge
from services.scheduler.releases import release_replica
from services.scheduler.reports import Reports
from services.scheduler.session import Session
from services.scheduler.store import Store

log = logging.getLogger(__name__)
St = ScheduleState
# What a hello may carry: a host:port, the regions of a backend.
MAX_ADDRESS_CHARS = 256
MAX_REGIONS = 1000
MAX_REGION_CHARS = 128


def check_hello(hello: pb.ControllerHello) -> None:
    """The rest of a hello, once its controller id passed: what the scheduler keeps of it
    (capacity, address, regions, held jobs) must be in range.

    Raises:
        InvalidArgument: naming the field.
    """

    def refuse(field: str, message: str) -> NoReturn:
        raise InvalidArgument(f"hello.{field}: {message}", field=f"hello.{field}")

    capacity = hello.capacity
    for name, limit in (("max_launches", capacity.max_launches), ("max_jobs", capacity.max_jobs)):
        if limit < 0:
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


class Replicas(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        store: Store,
        reports: Reports,
        admission: Admission,
        outbox: Outbox,
        health: DbHealth,
        leases: Leases,
        heartbeat_interval: float = 2.0,
    ) -> None:
        self.store = store
        self.reports = reports
        self.admission = admission
        self.outbox = outbox
        self.health = health
        self.leases = leases
        self.heartbeat_interval = heartbeat_interval
        # Hellos refused: a controller id not bound to the caller, or already streaming.
        self.refused_hellos = 0

    async def close(self) -> None:
        """Ends every stream (before the server stops, so that no stream's end is taken for
        the replica's: the replicas keep their jobs and reconnect to the next scheduler)."""
        self.leases.close()
        self.outbox.close()

    @rpc_errors
    async def ConnectController(
        self,
        request_iterator: AsyncIterator[pb.ConnectControllerRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ConnectControllerResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("hello"):
            raise FailedPrecondition("the first message on the stream must be a hello")
        hello = first.hello
        cid = hello.controller_id
        self._admit(hello)
        await self.leases.ended(cid)
        if self.leases.closing:
            raise Unavailable("the scheduler is shutting down")
        # A reconnect replaces the previous stream of the same replica.
        stream = self.outbox.attach(cid)
        lease = self.leases.connected(cid, stream, hello.address)
        log.info("replica connected", extra={"controller_id": cid, "held": len(hello.held_jobs)})
        yield stream.numbered(
            pb.ConnectControllerResponse(
                welcome=pb.ControllerWelcome(
                    lease_ttl_seconds=self.leases.ttl,
                    heartbeat_interval_seconds=self.heartbeat_interval,
                )
            )
        )
        await self._reconcile(stream, hello)
        self.admission.connected(hello)
        session = Session(
            lease, stream, self.leases, self.reports, self.admission, self.outbox, self.health
        )
        reader = asyncio.create_task(session.read(request_iterator, first.seq))
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
        except (asyncio.CancelledError, GeneratorExit):
            stream.hung_up = True  # the call ended under us: the replica's side is gone
            raise
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            session.ended()
            log.info("replica stream closed", extra={"controller_id": cid})

    def _admit(self, hello: pb.ControllerHello) -> None:
        """Refuses (and counts) a hello that may not open a stream.

        Raises:
            FailedPrecondition: no controller id.
            InvalidArgument: a field out of range.
            PermissionDenied: the caller may not speak for that controller id.
            AlreadyExists: the replica's current stream is alive.
        """
        cid = hello.controller_id
        if not cid:
            raise FailedPrecondition("hello.controller_id is required")
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

    def _refuse_a_second_stream(self, controller_id: str) -> None:
        """Raises AlreadyExists while the replica's current stream is alive (heard lately)."""
        lease = self.leases.current.get(controller_id)
        if lease is None or not lease.connected:
            return
        if self.leases.clock() - lease.heard < 2 * self.heartbeat_interval:
            raise AlreadyExists(
                f"controller {controller_id} already has a live stream; a replica whose "
                "stream broke is taken back once the old stream falls silent",
                reason="STREAM_ALREADY_OPEN",
            )

    async def _reconcile(self, stream: Stream, hello: pb.ControllerHello) -> None:
        """The database is the only truth: revoke what the replica should not hold,
        re-send grants and cancels for what it does, and free what it lost."""
        cid = hello.controller_id
        truth = await self.store.read(queries.held_by, cid)
        held = {h.job_id: h.epoch for h in hello.held_jobs}
        for job_id, epoch in held.items():
            if truth.get(job_id) != epoch:
                self.outbox.revoke(cid, job_id, epoch)
        lost = [job_id for job_id, epoch in truth.items() if held.get(job_id) != epoch]
        if lost:
            await release_replica(self.store, cid, lost, reason=NO_LONGER_RUNS_IT)
        kept = [job_id for job_id, epoch in truth.items() if held.get(job_id) == epoch]
        stream.sent.update({job_id: truth[job_id] for job_id in kept})
        for job in await self.store.read(queries.jobs, kept):
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
            for cid, lease in list(self.leases.current.items()):
                stream = lease.stream
                if stream is None:
                    continue
                truth = await self.store.read(queries.held_by, cid)
                missing = [j for j, e in truth.items() if stream.sent.get(j) != e]
                if not missing:
                    continue
                log.warning(
                    "replica was never sent some assignments; sending them",
                    extra={"controller_id": cid, "jobs": missing[:20], "count": len(missing)},
                )
                secrets = await self.store.read(queries.secrets_of, missing)
                for job in await self.store.read(queries.jobs, missing, with_specs=True):
                    if job.schedule_state != St.DONE and job.controller_id == cid:
                        granted = job.schedule_state == St.LAUNCHING
                        epoch, kept = truth[job.job_id], secrets.get(job.job_id)
                        with contextlib.suppress(TooLarge):  # admission failed such a job
                            sent += self.outbox.assign(cid, job, epoch, granted, kept)
        return sent

    # --- operators ------------------------------------------------------------------------

    @rpc_errors
    async def GetSchedulerState(
        self, request: pb.GetSchedulerStateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetSchedulerStateResponse:
        state = self.admission.state()
        state.stale_reports = self.reports.refused_stale
        state.refused_hellos = self.refused_hellos
        state.invalid_reports = self.reports.refused_invalid
        state.replayed_reports = self.reports.replayed
        state.database_reachable = self.health.ok
        state.watch_streams = self.store.bus.subscriptions
        counters = self.admission.counters
        for cid, lease in sorted(self.leases.current.items()):
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
                int(time.time() + max(0.0, lease.deadline - self.leases.clock()))
            )
            state.replicas.append(replica)
        return state
