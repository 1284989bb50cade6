"""Calls made in the same moment go out as one batched call.

Many lifecycles on a replica end at once when a user cancels all their jobs: each
stops its task and tears its cluster down, and one RPC per cluster costs each side
gRPC's fixed price per call. A `Coalescer` gathers the calls of one kind that are
made while a batch of that kind is in flight, or in the same turn of the event
loop, and sends them as one batched call; each caller still gets its own result,
or the error its item failed with alone.

Calls are grouped by a key: only items that would take the same time go together
(a stop with a 30 s grace must not hold up a teardown without one). A lone call
goes on the next turn of the event loop: batching never waits for company. A
caller that gives up before its batch leaves drops out of it; one that gives up
later leaves its item to finish without it (the batched calls are idempotent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")

MAX_BATCH = 1000

# Sends one batch: one outcome per item, in order; an item that failed alone is the
# exception it raised. An exception raised by the send itself fails every item.
Send = Callable[[K, list[T]], Awaitable[list[R | BaseException]]]


class Coalescer(Generic[K, T, R]):
    def __init__(self, send: Send[K, T, R], max_batch: int = MAX_BATCH) -> None:
        self._send = send
        self._max_batch = max_batch
        self._pending: dict[K, list[tuple[T, asyncio.Future[R]]]] = {}
        self._senders: dict[K, asyncio.Task[None]] = {}
        # Batches sent so far, for tests and metrics.
        self.batches = 0

    async def call(self, key: K, item: T) -> R:
        """Sends `item` with whatever else of the same key goes now; its own outcome."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append((item, future))
        if key not in self._senders:
            self._senders[key] = asyncio.create_task(self._drain(key), name="coalesce")
        return await future

    async def _drain(self, key: K) -> None:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        try:
            while waiting := [p for p in self._pending.pop(key, []) if not p[1].done()]:
                batch, rest = waiting[: self._max_batch], waiting[self._max_batch :]
                if rest:
                    self._pending[key] = rest
                self.batches += 1
                outcomes: list[R | BaseException]
                try:
                    outcomes = await self._send(key, [item for item, _ in batch])
                    if len(outcomes) != len(batch):
                        raise RuntimeError(f"{len(outcomes)} outcomes for {len(batch)} calls")
                except Exception as error:
                    outcomes = [error] * len(batch)
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if future.done():
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        finally:
            del self._senders[key]
            # Cancelled mid-send (the process is closing): nobody is left to answer these.
            for _, future in batch + self._pending.pop(key, []):
                if not future.done():
                    future.cancel()
