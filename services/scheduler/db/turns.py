"""Turns at the database's writers: clients first, never starving anyone.

A write transaction holds a turn from before its first statement until its
commit's effects are applied (`database.Database.write`), so transactions that
take turns one at a time commit, and are seen to commit, in one order.

SQLite has one writer; PostgreSQL `writers` (1 by default, 0 for no limit). A
client's transaction (a submission, a cancel) takes the next free turn before
waiting background work (reports, admission passes), but never twice in a row
while background work waits, so neither kind starves the other.

A quiet turn (`quiet`) waits until no write is under way and keeps new ones
from starting until it ends: the counters' reconcile compares them with the
database there. It goes before every turn asked for after it, so a steady
stream of writes cannot keep it waiting longer than the writes under way.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

Waiters = collections.deque[asyncio.Future[None]]


class Turns:
    def __init__(self, writers: int = 1) -> None:
        self.writers = writers
        self.holders = 0
        self._quiet_held = False
        self._last_was_client = False
        self._clients: Waiters = collections.deque()
        self._background: Waiters = collections.deque()
        self._quiet: Waiters = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._clients) + len(self._background) + len(self._quiet)

    @asynccontextmanager
    async def turn(self, client: bool = False) -> AsyncIterator[None]:
        """Holds a writer's turn for the block, once granted."""
        await self._wait(self._clients if client else self._background)
        try:
            yield
        finally:
            self.holders -= 1
            self._grant()

    @asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Holds the block while no write is under way, and none starts."""
        await self._wait(self._quiet)
        try:
            yield
        finally:
            self._quiet_held = False
            self._grant()

    async def _wait(self, queue: Waiters) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        self._grant()
        if waiter.done():
            return
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Granted as it was cancelled: hand the turn on.
                if queue is self._quiet:
                    self._quiet_held = False
                else:
                    self.holders -= 1
                self._grant()
            elif waiter in queue:
                queue.remove(waiter)
                self._grant()  # a quiet turn no longer waiting may unblock others
            raise

    def _grant(self) -> None:
        """Hands out every turn that can be had now."""
        if self._quiet_held:
            return
        _drop_cancelled(self._quiet)
        if self._quiet:
            if self.holders == 0:
                self._quiet.popleft().set_result(None)
                self._quiet_held = True
            return
        while self.writers == 0 or self.holders < self.writers:
            waiter = self._next()
            if waiter is None:
                return
            waiter.set_result(None)
            self.holders += 1

    def _next(self) -> asyncio.Future[None] | None:
        first, second = self._clients, self._background
        if self._last_was_client and _drop_cancelled(second):
            first, second = second, first
        for queue in (first, second):
            if _drop_cancelled(queue):
                self._last_was_client = queue is self._clients
                return queue.popleft()
        return None


def _drop_cancelled(queue: Waiters) -> bool:
    """Drops cancelled waiters from the head of `queue`; whether any remain."""
    while queue and queue[0].done():
        queue.popleft()
    return bool(queue)
