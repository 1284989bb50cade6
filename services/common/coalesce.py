"""Calls made in the same moment go out as one batched call.

Many lifecycles on a replica end at once when a user cancels all their jobs: each
stops its task and tears its cluster down, and one RPC per cluster costs each side
gRPC's fixed price per call. A `Coalescer` gathers the calls of one kind made in
the same turn of the event loop, or while `in_flight` batches of that kind are
out, and sends them as one batched call; each caller still gets its own result, or
the error its item failed with alone.

Calls are grouped by a key: only items that would take the same time go together
(a stop with a 30 s grace must not hold up a teardown without one). A call goes on
the next turn of the event loop with every other call of its key made until then;
when `in_flight` batches of the key are out already, it goes with the next batch,
once one of them is answered. Batching never waits for company; a call whose
answers may be slow (a stop answers once its task ended, a grace later) takes
`in_flight=None`, so no call ever waits for another's answer. A caller that
gives up before its batch leaves drops out of it; one that gives up later leaves
its item to finish without it (the batched calls are idempotent), and an item
that then succeeds for nobody is handed to `abandoned`, to be undone if need be.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")

MAX_BATCH = 1000
# Batches of one key sent at the same time at most: a batch gathered while others are in
# flight goes at once, rather than wait for them (their answers may be slow).
IN_FLIGHT = 4

# Sends one batch: one outcome per item, in order; an item that failed alone is the
# exception it raised. An exception raised by the send itself fails every item.
Send = Callable[[K, list[T]], Awaitable[list[R | BaseException]]]
# Told of an item that succeeded after its caller had given up: (item, its result).
Abandoned = Callable[[T, R], object]


class Coalescer(Generic[K, T, R]):
    def __init__(
        self,
        send: Send[K, T, R],
        max_batch: int = MAX_BATCH,
        in_flight: int | None = IN_FLIGHT,
        abandoned: Abandoned[T, R] | None = None,
    ) -> None:
        self._send = send
        self._max_batch = max_batch
        self._in_flight = in_flight
        self._abandoned = abandoned
        self._pending: dict[K, list[tuple[T, asyncio.Future[R]]]] = {}
        self._senders: dict[K, set[asyncio.Task[None]]] = {}
        # Keys with a sender started that has not yet taken its batch: a call made
        # meanwhile goes with it, rather than start a sender of its own.
        self._starting: set[K] = set()
        # Batches sent so far.
        self.batches = 0

    async def call(self, key: K, item: T) -> R:
        """Sends `item` with whatever else of the same key goes now; its own outcome."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append((item, future))
        senders = self._senders.setdefault(key, set())
        if key not in self._starting and (
            self._in_flight is None or len(senders) < self._in_flight
        ):
            # It starts on the next turn of the loop: calls made in this one go with it.
            self._starting.add(key)
            senders.add(asyncio.create_task(self._sender(key), name="coalesce"))
        return await future

    async def _sender(self, key: K) -> None:
        """Sends batches of the key while callers wait, one at a time."""
        batch: list[tuple[T, asyncio.Future[R]]] = []
        self._starting.discard(key)
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
                for (item, future), outcome in zip(batch, outcomes, strict=True):
                    if future.done():
                        if self._abandoned and not isinstance(outcome, BaseException):
                            self._abandoned(item, outcome)
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
                batch = []
        finally:
            senders = self._senders[key]
            senders.discard(asyncio.current_task())
            if not senders:
                del self._senders[key]
            # Cancelled mid-send (the process is closing): nobody is left to answer these.
            for _, future in batch:
                if not future.done():
                    future.cancel()
            if not senders:
                for _, future in self._pending.pop(key, []):
                    future.cancel()
