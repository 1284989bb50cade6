"""One replica's stream after its hello: what it reads, and when it ends (contract §9, §11).

The stream's reader takes the replica's requests in sequence
(`services/common/sequence.py`): a request out of sequence (one went missing, or
came twice) ends the stream INVALID_ARGUMENT, and the replica reconnects and
sends again, in order, everything not yet acknowledged. Every envelope renews
the lease. A batch envelope's requests are handled in order as if each had come
alone; a batch of more than `MAX_BATCH_MESSAGES` ends the stream before any of
it is applied.

What the reader handles itself is a table by the request's oneof field
(`Session.AT_ONCE`): a heartbeat is acknowledged at once, even while the
database is away, so a replica keeps its lease; a draining replica gets no new
work. Anything else is a report: reports go, in order, to a worker that applies
whatever has queued as one batch (`reports.py`) while the previous batch is
being committed, then sends the batch's acks, grants and revokes. A report with
a stale epoch has its job revoked on this replica, so a replica that lost its
lease stops acting for the job.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import ClassVar

import grpc

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.batches import MAX_BATCH_MESSAGES
from services.common.errors import InvalidArgument
from services.common.sequence import InOrder, OutOfSequence
from services.scheduler import metrics
from services.scheduler.admission import Admission
from services.scheduler.health import DbHealth
from services.scheduler.leases import Lease, Leases
from services.scheduler.outbox import Outbox, Stream
from services.scheduler.reports import Reports

log = logging.getLogger(__name__)
Request = pb.ConnectControllerRequest
# Reports applied in one transaction, at most.
MAX_BATCH = 512


def unbatched(envelope: Request) -> Sequence[Request]:
    """The requests an envelope carries: itself, or its batch's.

    Raises:
        InvalidArgument: a batch of more than MAX_BATCH_MESSAGES requests.
    """
    if not envelope.HasField("batch"):
        return (envelope,)
    requests = envelope.batch.requests
    if len(requests) > MAX_BATCH_MESSAGES:
        raise InvalidArgument(
            f"batch.requests: at most {MAX_BATCH_MESSAGES} per message, got {len(requests)}",
            field="batch.requests",
        )
    return requests


class Session:
    """The reader and the report worker of one replica's stream."""

    def __init__(
        self,
        lease: Lease,
        stream: Stream,
        leases: Leases,
        reports: Reports,
        admission: Admission,
        outbox: Outbox,
        health: DbHealth,
    ) -> None:
        self.lease = lease
        self.stream = stream
        self.cid = lease.controller_id
        self.leases = leases
        self.reports = reports
        self.admission = admission
        self.outbox = outbox
        self.health = health

    def _heartbeat(self, request: Request) -> None:
        self.outbox.ack(self.cid, pb.ReportAck(ack_seq=request.seq, accepted=True))

    def _draining(self, request: Request) -> None:
        self.lease.draining = True
        self.admission.draining(self.cid)

    # What the reader handles itself, by the request's oneof field; the rest is reports.
    AT_ONCE: ClassVar[dict[str, Callable[[Session, Request], None]]] = {
        "heartbeat": _heartbeat,
        "draining": _draining,
    }

    @property
    def current(self) -> bool:
        """Whether this is still the replica's stream (a reconnect replaces it)."""
        return self.lease.stream is self.stream

    async def read(self, request_iterator: AsyncIterator[Request], hello_seq: int) -> None:
        """Reads the replica's messages, in sequence, until the stream ends."""
        work: list[Request] = []
        queued = asyncio.Event()
        worker = asyncio.create_task(self._work(work, queued))
        order = InOrder(resent_below=hello_seq)
        try:
            async for envelope in request_iterator:
                if not self.current:
                    return
                self.leases.renew(self.lease)
                for request in unbatched(envelope):
                    if not order.check(request.seq):
                        raise OutOfSequence(order.expected, request.seq)
                    handle = self.AT_ONCE.get(request.WhichOneof("message") or "")
                    if handle is not None:
                        handle(self, request)
                    else:
                        work.append(request)
                        queued.set()
            self.stream.hung_up = True
        except OutOfSequence as gap:
            log.warning(
                "replica stream out of sequence; ending it for a fresh one",
                extra={"controller_id": self.cid, "error": str(gap)},
            )
            metrics.stream_out_of_sequence()
            refused = InvalidArgument(
                f"{gap}: a request went missing or came twice; reconnect and send again "
                "what was not acknowledged",
                field="seq",
            )
            self.stream.close(refused)
        except InvalidArgument as bad:
            log.warning(
                "replica stream refused", extra={"controller_id": self.cid, "error": str(bad)}
            )
            self.stream.close(bad)
        except (grpc.aio.AioRpcError, grpc.aio.AbortError):
            self.stream.hung_up = True
            raise
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("replica stream failed", extra={"controller_id": self.cid})
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            if self.current:
                self.stream.close()

    async def _work(self, work: list[Request], queued: asyncio.Event) -> None:
        cid = self.cid
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
                    self.stream.close()
                    return
                if not self.current:
                    return
                for job_id, epoch in applied.grants:
                    self.outbox.grant(cid, job_id, epoch)
                for job_id, epoch in applied.revokes:
                    log.warning("stale report", extra={"controller_id": cid, "job_id": job_id})
                    self.outbox.revoke(cid, job_id, epoch)
                self.outbox.forget(cid, applied.finished)
                for ack in applied.acks:
                    self.outbox.ack(cid, ack)

    def ended(self) -> None:
        """The stream ended: if it is still the replica's, the replica is disconnected (no
        new work until it reconnects), and its lease ends at once when it was the
        replica's side that closed it."""
        if not self.current:
            return
        self.lease.connected = False
        self.lease.stream = None
        self.outbox.detach(self.cid, self.stream)
        self.admission.draining(self.cid)
        if self.stream.hung_up and not self.leases.closing:
            self.lease.closed = True
            self.lease.wake.set()
