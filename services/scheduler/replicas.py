"""Controller replicas: their streams, their leases, and what they report (contract §9).

A replica's `ConnectController` stream is its lease. The hello carries its
capacity and the jobs it still runs; every message it sends renews the lease.
The lease ends, and the replica's jobs move to other replicas with the next
epoch, in one of two ways:

- the replica's side closes the stream (its process died, its connection
  dropped, it shut down): at once, since nothing more can come on that stream.
  Every report and every backend call is fenced by epoch, so the old holder
  changes nothing once the jobs are assigned again; a replica that reconnects
  is told on its new stream which of its jobs it no longer holds;
- the stream stays open but falls silent: TTL seconds after the last message.

A watchdog task per replica sleeps until the lease deadline (or until its
stream closes); nothing polls. A watchdog that wakes late (the event loop was
busy: a long synchronous step) first gives the stream readers a turn, so
heartbeats that arrived meanwhile and wait in the stream's buffer renew the
lease before it is judged. A stream the scheduler itself ends (a protocol
breach, a failed batch, a replacement, its own shutdown) keeps the TTL: the
replica reconnects to a lease that is still there.

Who may hold a stream: the hello must name the controller id the caller's token is
bound to (and, under mTLS, its certificate), and a replica id already holding a
live stream (heard from within two heartbeats) is refused rather than taken
over; both refusals are counted. A replica whose stream broke reconnects once
the scheduler has stopped hearing from the old one.

Requests are numbered (`services/common/sequence.py`): a request out of
sequence on a stream (one went missing, or came twice) ends the stream
INVALID_ARGUMENT, and the replica reconnects and sends again, in order,
everything not yet acknowledged; a report applied before is acknowledged as a
replay and not applied twice (`reports.py`).

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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
    Unavailable,
    rpc_errors,
)
from services.common.event_messages import (
    LEASE_ENDED,
    LEASE_EXPIRED,
    NO_LONGER_RUNS_IT,
    STREAM_CLOSED,
)
from services.common.security.access import current_principal, require_controller
from services.common.sequence import InOrder, OutOfSequence
from services.common.statuses import ScheduleState
from services.scheduler import metrics
from services.scheduler.admission import Admission
from services.scheduler.health import DbHealth
from services.scheduler.outbox import Outbox, Stream, TooLarge
from services.scheduler.reports import Reports
from services.scheduler.store import Move, Store

log = logging.getLogger(__name__)
St = ScheduleState
MAX_BATCH = 512
# What a hello may carry: a host:port, the regions of a backend.
MAX_ADDRESS_CHARS = 256
MAX_REGIONS = 1000
MAX_REGION_CHARS = 128
# A watchdog that wakes later than this after its deadline woke late: the event loop was
# busy. It naps this long once more before it judges the lease.
WATCHDOG_TICK = 0.1


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
    # The replica's side closed its last stream: nothing more can come on it.
    closed: bool = False
    watchdog: asyncio.Task[None] | None = None
    # Set to wake the watchdog before its deadline (the stream closed).
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
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
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.reports = reports
        self.admission = admission
        self.outbox = outbox
        self.health = health
        self.lease_ttl = lease_ttl
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self._sleep = sleep
        self.leases: dict[str, Lease] = {}
        # (controller id, when): the leases that ended, in order.
        self.expired: list[tuple[str, float]] = []
        # The watchdogs releasing an ended lease's jobs now: a hello of that replica waits.
        self._ending: dict[str, asyncio.Task[None]] = {}
        # Releases of jobs committed to a replica after its lease ended (see `moved`).
        self._strays: set[asyncio.Task[None]] = set()
        self._closing = False
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
        late = 0.0  # how late the last nap woke
        while True:
            now = self.clock()
            if not lease.closed:
                if lease.deadline > now:
                    late = await self._nap(lease, lease.deadline - now)
                    continue
                if late > WATCHDOG_TICK and now - lease.deadline < self.lease_ttl:
                    # The loop was busy: what the replica sent meanwhile may wait unread.
                    late = await self._nap(lease, WATCHDOG_TICK)
                    continue
            if not self.health.ok:
                # Nothing can move while the database is away; leases restart when it is back.
                await self.health.wait_reachable()
                lease.deadline = max(lease.deadline, self.clock() + self.lease_ttl)
                late = 0.0
                continue
            await self._end(lease)
            return

    async def _nap(self, lease: Lease, seconds: float) -> float:
        """Sleeps `seconds`, or until woken; returns how late it woke (0 when woken)."""
        due = self.clock() + seconds
        lease.wake.clear()
        napping = asyncio.ensure_future(self._sleep(seconds))
        woken = asyncio.ensure_future(lease.wake.wait())
        try:
            await asyncio.wait((napping, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            napping.cancel()
            woken.cancel()
        return 0.0 if lease.wake.is_set() else max(0.0, self.clock() - due)

    async def _end(self, lease: Lease) -> None:
        """Ends the lease: the replica's jobs go back to admission."""
        cid = lease.controller_id
        if lease.closed:
            log.warning("replica stream closed; releasing its jobs", extra={"controller_id": cid})
            metrics.stream_lost()
            reason = STREAM_CLOSED.format(cid)
        else:
            log.warning("lease expired", extra={"controller_id": cid})
            metrics.lease_expired()
            reason = LEASE_EXPIRED.format(cid)
        if self.leases.get(cid) is lease:
            del self.leases[cid]
        self.admission.gone(cid)
        lease.connected = False
        self.outbox.detach(cid, lease.stream)
        self.expired.append((cid, self.clock()))
        task = asyncio.current_task()
        if task is not None:
            self._ending[cid] = task
        try:
            await self.health.retry(
                lambda: self.reports.release_replica(cid, reason=reason), limit=float("inf")
            )
        finally:
            if self._ending.get(cid) is task:
                del self._ending[cid]

    def moved(self, moves: Sequence[Move]) -> None:
        """Releases at once the jobs a commit left with a replica whose lease has ended (an
        admission pass that planned before the lease ended): no lease of that replica will
        end again to move them. A replica that reconnects gets a new lease first."""
        if self._closing:
            return
        stray: dict[str, list[tuple[int, int]]] = {}
        for move in moves:
            cid = move.new_controller
            if cid is not None and move.new != St.DONE and cid not in self.leases:
                stray.setdefault(cid, []).append((move.job_id, move.epoch))
        for cid, pairs in stray.items():
            log.warning(
                "jobs assigned to a replica whose lease had ended; releasing them",
                extra={"controller_id": cid, "jobs": [j for j, _ in pairs][:20]},
            )
            task = asyncio.create_task(self._release_strays(cid, pairs))
            self._strays.add(task)
            task.add_done_callback(self._strays.discard)

    async def _release_strays(self, cid: str, pairs: list[tuple[int, int]]) -> None:
        await self.health.retry(
            lambda: self.reports.release_replica(cid, pairs=pairs, reason=LEASE_ENDED.format(cid)),
            limit=float("inf"),
        )

    def restart_leases(self) -> None:
        """Gives every replica a full lease from now (after the database came back)."""
        for lease in self.leases.values():
            lease.deadline = max(lease.deadline, self.clock() + self.lease_ttl)

    async def close(self) -> None:
        """Ends every stream (before the server stops, so that no stream's end is taken for
        the replica's: the replicas keep their jobs and reconnect to the next scheduler)."""
        self._closing = True
        self.outbox.close()
        for lease in list(self.leases.values()):
            if lease.watchdog is not None:
                lease.watchdog.cancel()
        for task in list(self._strays):
            task.cancel()

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
        ending = self._ending.get(cid)
        if ending is not None:
            # Its last lease is being ended: its jobs are released before this hello is
            # reconciled, so that what the replica is told to stop is what it lost.
            await asyncio.wait([ending])
        if self._closing:
            raise Unavailable("the scheduler is shutting down")
        lease = self._lease(cid)
        # A reconnect replaces the previous stream of the same replica.
        stream = self.outbox.attach(cid)
        lease.stream = stream
        lease.connected = True
        lease.closed = False
        lease.draining = False
        lease.address = hello.address
        self._renew(lease)
        log.info("replica connected", extra={"controller_id": cid, "held": len(hello.held_jobs)})
        yield stream.numbered(
            pb.ConnectControllerResponse(
                welcome=pb.ControllerWelcome(
                    lease_ttl_seconds=self.lease_ttl,
                    heartbeat_interval_seconds=self.heartbeat_interval,
                )
            )
        )
        await self._reconcile(stream, hello)
        self.admission.connected(hello)
        reader = asyncio.create_task(self._read(lease, stream, request_iterator, first.seq))
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
            if lease.stream is stream:
                lease.connected = False
                lease.stream = None
                self.outbox.detach(cid, stream)
                self.admission.draining(cid)  # no new work until it reconnects
                if stream.hung_up and not self._closing:
                    lease.closed = True
                    lease.wake.set()
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
        hello_seq: int,
    ) -> None:
        """Reads the replica's messages, in sequence. Heartbeats are acked at once, even
        while the database is away, so a replica keeps its lease; reports go, in order, to
        a worker that applies whatever has queued as one batch."""
        work: list[pb.ConnectControllerRequest] = []
        queued = asyncio.Event()
        worker = asyncio.create_task(self._work(lease, stream, work, queued))
        order = InOrder(resent_below=hello_seq)
        try:
            async for envelope in request_iterator:
                if lease.stream is not stream:
                    return
                self._renew(lease)
                for request in _unbatched(envelope):
                    if not order.check(request.seq):
                        raise OutOfSequence(order.expected, request.seq)
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
            stream.hung_up = True
        except OutOfSequence as gap:
            log.warning(
                "replica stream out of sequence; ending it for a fresh one",
                extra={"controller_id": lease.controller_id, "error": str(gap)},
            )
            metrics.stream_out_of_sequence()
            refused = InvalidArgument(
                f"{gap}: a request went missing or came twice; reconnect and send again "
                "what was not acknowledged",
                field="seq",
            )
            stream.close(refused)
        except InvalidArgument as bad:
            log.warning(
                "replica stream refused",
                extra={"controller_id": lease.controller_id, "error": str(bad)},
            )
            stream.close(bad)
        except (grpc.aio.AioRpcError, grpc.aio.AbortError):
            stream.hung_up = True
            raise
        except asyncio.CancelledError:
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
        state.replayed_reports = self.reports.replayed
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
