"""Messages taken off a queue in batches: whatever waits now, within bounds.

A stream that sends one gRPC message per envelope pays gRPC's cost per message
(a write, a wake-up of the other side's poller, an event-loop turn on each side)
for every envelope. Under load envelopes queue up while a write is in flight;
taking all of them at once and sending them as one batch pays that cost once.
When nothing else waits, a message goes alone and at once: batching never holds
a message back to wait for company.

A batch stays within `max_messages` and `max_bytes` (under gRPC's 4 MiB limit on
a message, so a batch of big assignments is split, never refused); one message
that is larger alone still goes alone.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from google.protobuf.message import Message

MAX_BATCH_MESSAGES = 1000
MAX_BATCH_BYTES = 3_500_000
# What each message adds when nested in a batch: a field tag and a length.
_NESTING_BYTES = 6

M = TypeVar("M", bound=Message)


class Batches(Generic[M]):
    """Batches from a queue that a None closes; one reader only."""

    def __init__(
        self,
        queue: asyncio.Queue[M | None],
        max_messages: int = MAX_BATCH_MESSAGES,
        max_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self._queue = queue
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        # A message taken off the queue that did not fit the last batch: the next one's first.
        self._carried: M | None = None
        self._closed = False

    async def next(self) -> list[M]:
        """The next messages in order (at least one); an empty list once the queue is closed."""
        first = self._carried
        self._carried = None
        if first is None:
            if self._closed:
                return []
            first = await self._queue.get()
            if first is None:
                self._closed = True
                return []
        batch = [first]
        size = first.ByteSize() + _NESTING_BYTES
        queue = self._queue
        while len(batch) < self._max_messages and not queue.empty():
            message = queue.get_nowait()
            if message is None:
                self._closed = True
                break
            size += message.ByteSize() + _NESTING_BYTES
            if size > self._max_bytes:
                self._carried = message
                break
            batch.append(message)
        return batch
