"""SQLite reads through SQLAlchemy's aiosqlite dialect, run on the event loop's own thread.

aiosqlite hands every call (cursor, execute, fetch, commit) to a worker thread
and waits for the answer: a thread hand-off and a wake-up of the event loop
each, so a read session of a few statements spent about a millisecond waiting
for statements that take microseconds on a local file. `InlineConnection`
keeps aiosqlite's interface, which the dialect expects, and runs each call at
once on the calling thread.

The read engine and the engine of clients' writes use it (see `db.py`).
Background writes keep aiosqlite's thread: a batch of reports in flight there
is what lets the next reports gather into the next batch. A read never waits
for a lock (WAL: readers do not block the writer, nor the writer them), and a
client's write waits for none either (the scheduler's writes take turns, so the
lock is free when its turn comes); run inline, either holds the loop only for
its own work, as the Python that turns its rows into messages does anyway.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import aiosqlite


class _RunNow:
    """Stands in for aiosqlite's queue to its worker thread: runs each call as it is queued."""

    def put_nowait(self, item: tuple[asyncio.Future[Any] | None, Callable[[], Any]]) -> None:
        future, function = item
        try:
            result = function()
        except BaseException as error:
            if future is None:
                raise
            future.set_exception(error)
        else:
            if future is not None:
                future.set_result(result)


class InlineConnection(aiosqlite.Connection):
    """An aiosqlite connection without its worker thread (aiosqlite 0.22's internals)."""

    def __init__(self, connector: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(connector, iter_chunk_size=64)
        self._tx = _RunNow()  # type: ignore[assignment]

    def __await__(self) -> Generator[Any, None, aiosqlite.Connection]:
        return self._connect().__await__()  # no worker thread to start


def inline_creator(path: str, timeout: float) -> Callable[[], Awaitable[InlineConnection]]:
    """`async_creator` for `create_async_engine`: connections to the SQLite file `path`."""

    async def create() -> InlineConnection:
        connection = InlineConnection(lambda: sqlite3.connect(path, timeout=timeout))
        await connection
        return connection

    return create
