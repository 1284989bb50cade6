"""The database's writers (SQLite's one), handed out in turns that put a waiting client first.

SQLite runs one write transaction at a time, so writes queue for it (over two
connections, `db.py`: never both in a transaction). In arrival order a client's
submission waits behind whatever background work queued before it: an admission
pass, a batch of reports, each a few milliseconds (a sequential client's
`SubmitJob` waited ~12 ms there, four times its own transaction). The gate hands
the writer to an urgent waiter (a client's submission or cancel) before
background ones, but never to two urgent transactions in a row while background
work waits: under a stream of submissions the turns alternate, so admission and
reports are never starved. A client that waits alone (no other clients' writes
gathering behind it, `gathering`) also has the background holder hurry
(`sqlite_thread`).

PostgreSQL could run writes concurrently, but takes the same turns, one writer by
default (`--db-writers`; `writers` here): batches grow while the writer is busy.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class WriteGate:
    def __init__(self, writers: int = 1) -> None:
        self.writers = writers
        self._holders = 0
        self._last_urgent = False
        self._urgent: collections.deque[asyncio.Future[None]] = collections.deque()
        self._background: collections.deque[asyncio.Future[None]] = collections.deque()
        # Whether clients' writes are queued to go together into the next transaction
        # (set by the intake, which gathers submissions).
        self.gathering: Callable[[], bool] = lambda: False

    @property
    def lone_client_waiting(self) -> bool:
        """Whether a client's transaction waits for its turn with no other clients' writes
        gathering to go after it: the background holder had best hurry (`sqlite_thread`)."""
        return bool(self._urgent) and not self.gathering()

    @property
    def waiting(self) -> int:
        return len(self._urgent) + len(self._background)

    @asynccontextmanager
    async def turn(self, urgent: bool) -> AsyncIterator[None]:
        """Holds the writer for the block; waits for its turn first."""
        if self._holders >= self.writers:
            await self._wait(self._urgent if urgent else self._background)
        else:
            self._holders += 1
        self._last_urgent = urgent
        try:
            yield
        finally:
            self._pass_on()

    async def _wait(self, queue: collections.deque[asyncio.Future[None]]) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._pass_on()  # handed the turn as it was cancelled: pass it on
            elif waiter in queue:
                queue.remove(waiter)
            raise

    def _pass_on(self) -> None:
        """Hands a writer's turn to the next waiter (still held), or frees it."""
        first, second = self._urgent, self._background
        if self._last_urgent and second:
            first, second = second, first
        for queue in (first, second):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():  # (a cancelled one leaves on its own)
                    waiter.set_result(None)
                    return
        self._holders -= 1
