"""What this replica sends the scheduler: numbered, in order, kept until answered.

Reports go out in the order they are sent, on the stream of the moment. One
that needs an answer (`post`, `call`) is kept until its ack comes, across
streams: when a stream breaks, every report not yet acknowledged goes again on
the next one, in order and with its number, before anything new. A request gets
its number when first put on a stream (`services/common/sequence.py`), so the
numbers stay unbroken even when a report is given up before it went out. One
sent without an answer (`notify`) is dropped while the stream is down.

The link (`services/controller/link.py`) says when a stream starts, is welcomed
and ends, writes what this outbox queues, and hands it the acks.
"""

from __future__ import annotations

import asyncio
import itertools

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.controller.messages import Report, refusal, request

Answer = asyncio.Future[pb.ReportAck]


class Outbox:
    """The replica's requests to the scheduler, over the streams of its link.

    Args:
        connected: set while a welcomed stream is up (the link sets and clears it).
    """

    def __init__(self, connected: asyncio.Event) -> None:
        self._connected = connected
        # The number last given to a request (each gets one when first put on a stream).
        self._seq = 0
        # Requests posted and not yet answered, in the order posted; and their answers
        # to come, by number once they have one.
        self._posts = itertools.count()
        self._unacked: dict[int, tuple[pb.ConnectControllerRequest, Answer]] = {}
        self._answers: dict[int, Answer] = {}
        self._queue: asyncio.Queue[pb.ConnectControllerRequest | None] = asyncio.Queue()
        # Requests put on this stream's queue and written to it; `_wrote` is set (and
        # replaced) after each write and when the stream ends.
        self._streams = 0
        self._queued = 0
        self._written = 0
        self._wrote = asyncio.Event()

    async def call(self, report: Report) -> pb.ReportAck:
        """Sends a report and waits for its ack, across reconnects.

        Raises:
            Rejected: the scheduler answered accepted=false.
        """
        return await self.post(report)

    def post(self, report: Report) -> Answer:
        """Sends a report now (in order with every other) and returns its answer to come.

        Awaiting the answer raises like `call`; a caller may send more before awaiting
        it, keeping the order of its reports while not waiting a round trip for each.
        """
        envelope = request(report)
        loop = asyncio.get_running_loop()
        acked: Answer = loop.create_future()
        key = next(self._posts)
        self._unacked[key] = (envelope, acked)
        if self._connected.is_set():
            self._put(envelope, acked)
        answer: Answer = loop.create_future()

        def settle(done: Answer) -> None:
            self._unacked.pop(key, None)
            self._answers.pop(envelope.seq, None)
            if answer.done():
                return
            if done.cancelled():
                answer.cancel()
                return
            ack = done.result()
            if ack.accepted:
                answer.set_result(ack)
            else:
                answer.set_exception(refusal(ack))

        def forget(done: Answer) -> None:
            # Whoever posted stopped waiting (the job was stopped): stop resending it too.
            # One never put on a stream has no number yet, so the numbers stay unbroken.
            if done.cancelled() and not acked.done():
                acked.cancel()

        acked.add_done_callback(settle)
        answer.add_done_callback(forget)
        return answer

    def notify(self, report: Report) -> None:
        """Sends without waiting for an answer (dropped while disconnected)."""
        if self._connected.is_set():
            self._put(request(report))

    def numbered(self, envelope: pb.ConnectControllerRequest) -> pb.ConnectControllerRequest:
        """Gives a request the next number."""
        self._seq += 1
        envelope.seq = self._seq
        return envelope

    def _put(self, envelope: pb.ConnectControllerRequest, answer: Answer | None = None) -> None:
        """Puts a request on the stream; numbered the first time (a resend keeps its number)."""
        if not envelope.seq:
            self.numbered(envelope)
            if answer is not None:
                self._answers[envelope.seq] = answer
        self._queue.put_nowait(envelope)
        self._queued += 1

    async def written(self) -> None:
        """Returns once every request sent so far was written to the stream (not yet
        acked), or once the stream is down (what is unacked goes again on the next)."""
        streams, target = self._streams, self._queued
        while self._connected.is_set() and self._streams == streams and self._written < target:
            await self._wrote.wait()

    def _wake_writers(self) -> None:
        self._wrote.set()
        self._wrote = asyncio.Event()

    # --- what the link tells ---------------------------------------------------------------

    def started(self) -> asyncio.Queue[pb.ConnectControllerRequest | None]:
        """A new stream is starting: the queue its requests are written from (None ends it)."""
        self._streams += 1
        self._queue = asyncio.Queue()
        self._queued = self._written = 0
        return self._queue

    def welcomed(self) -> None:
        """The stream was welcomed: everything not acked goes again, in order (with its number)."""
        for envelope, answer in list(self._unacked.values()):
            self._put(envelope, answer)

    def wrote(self, count: int) -> None:
        """`count` more requests were written to the stream."""
        self._written += count
        self._wake_writers()

    def answered(self, ack: pb.ReportAck) -> None:
        """The scheduler answered request `ack.ack_seq`."""
        answer = self._answers.get(ack.ack_seq)
        if answer is not None and not answer.done():
            answer.set_result(ack)

    def ended(self) -> None:
        """The stream ended: its writer stops, and nothing waits for it to write more."""
        self._queue.put_nowait(None)
        self._wake_writers()


__all__ = ["Answer", "Outbox"]
