"""Messages to replicas: one typed door (assign, grant, cancel, revoke, ack).

Each connected replica has one `Stream`: the queue its `ConnectController`
response stream drains, in order. Every message put on a stream takes the
stream's next number (`seq`, from 1 for the welcome; `services/common/sequence.py`),
so the replica notices a message gone missing or repeated. A message for a
replica that is not connected is dropped: when it reconnects, its hello is
reconciled with the database (the only truth), which re-sends what it must know.

The outbox remembers which assignment (job, epoch) it sent on the current
stream, so a periodic check can find a job the database assigns to a replica
that was never told (an admission pass whose commit was in doubt) and send it.
"""

from __future__ import annotations

import asyncio
import dataclasses

from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb

Message = pb.ConnectControllerResponse


@dataclasses.dataclass
class Stream:
    """The live stream of one replica: its queue, and the assignments sent on it."""

    controller_id: str
    queue: asyncio.Queue[Message | None] = dataclasses.field(default_factory=asyncio.Queue)
    sent: dict[int, int] = dataclasses.field(default_factory=dict)
    # Why the scheduler ends the stream, when the replica broke the protocol.
    error: Exception | None = None
    # The number of the last message put on the stream.
    seq: int = 0
    # Set when the replica's side ended the stream (it closed, or its connection did).
    hung_up: bool = False

    def numbered(self, message: Message) -> Message:
        """The message with the stream's next number."""
        self.seq += 1
        message.seq = self.seq
        return message

    def put(self, message: Message) -> None:
        self.queue.put_nowait(self.numbered(message))

    def close(self, error: Exception | None = None) -> None:
        self.error = self.error or error
        self.queue.put_nowait(None)


# An assignment larger than this is never sent: it would break the replica's stream (the
# gRPC limit is 4 MiB). The spec's bounds keep every job well under it; this is the guard.
MAX_ASSIGNMENT_BYTES = 3_500_000


class TooLarge(Exception):
    """An assignment that cannot go on a stream; its job must fail instead."""


class Outbox:
    def __init__(self) -> None:
        self._streams: dict[str, Stream] = {}
        self.sent_total = 0

    # --- streams --------------------------------------------------------------------------

    def attach(self, controller_id: str) -> Stream:
        """A new stream for the replica; the previous one (if any) is closed."""
        self.detach(controller_id)
        stream = Stream(controller_id)
        self._streams[controller_id] = stream
        return stream

    def detach(self, controller_id: str, stream: Stream | None = None) -> None:
        """Closes the replica's stream (only `stream`, when given and still current)."""
        current = self._streams.get(controller_id)
        if current is None or (stream is not None and current is not stream):
            return
        del self._streams[controller_id]
        current.close()

    def stream(self, controller_id: str) -> Stream | None:
        return self._streams.get(controller_id)

    def close(self) -> None:
        for controller_id in list(self._streams):
            self.detach(controller_id)

    # --- messages ---------------------------------------------------------------------------

    def _send(self, controller_id: str, message: Message) -> bool:
        stream = self._streams.get(controller_id)
        if stream is None:
            return False
        stream.put(message)
        self.sent_total += 1
        return True

    def assign(
        self,
        controller_id: str,
        job: job_pb2.Job,
        epoch: int,
        granted: bool,
        secrets: list[pb.TaskSecrets] | None = None,
    ) -> bool:
        """Run (or resume) this job: `job` as committed with its move to the replica.

        Raises:
            TooLarge: the assignment would not fit in a message; nothing was sent.
        """
        assignment = pb.JobAssignment(
            job=job, epoch=epoch, launch_granted=granted, secrets=secrets or []
        )
        size = assignment.ByteSize()
        if size > MAX_ASSIGNMENT_BYTES:
            raise TooLarge(f"the job's assignment is {size} bytes, over {MAX_ASSIGNMENT_BYTES}")
        stream = self._streams.get(controller_id)
        if stream is None:
            return False
        stream.sent[job.job_id] = epoch
        return self._send(controller_id, Message(assignment=assignment))

    def grant(self, controller_id: str, job_id: int, epoch: int) -> bool:
        grant = pb.LaunchSlotGrant(job_id=job_id, epoch=epoch)
        return self._send(controller_id, Message(launch_slot_grant=grant))

    def cancel(self, controller_id: str, job_id: int, epoch: int) -> bool:
        return self._send(controller_id, Message(cancel=pb.JobCancel(job_id=job_id, epoch=epoch)))

    def revoke(self, controller_id: str, job_id: int, epoch: int) -> bool:
        stream = self._streams.get(controller_id)
        if stream is not None and stream.sent.get(job_id) == epoch:
            del stream.sent[job_id]
        return self._send(controller_id, Message(revoke=pb.JobRevoke(job_id=job_id, epoch=epoch)))

    def ack(self, controller_id: str, ack: pb.ReportAck) -> bool:
        return self._send(controller_id, Message(ack=ack))

    def forget(self, controller_id: str, job_ids: list[int]) -> None:
        """The replica no longer holds these jobs (finished or handed back)."""
        stream = self._streams.get(controller_id)
        if stream is not None:
            for job_id in job_ids:
                stream.sent.pop(job_id, None)
