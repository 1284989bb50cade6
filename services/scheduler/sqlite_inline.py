"""SQLite under SQLAlchemy's asyncio API, without a coroutine per call to the driver.

SQLAlchemy's asyncio extension runs its synchronous core in a greenlet. With the
aiosqlite dialect that greenlet leaves for the event loop on every call to the
driver (open a cursor, execute, fetch, close: three to four coroutines awaited
per statement), even when the call is run at once. The scheduler's SQLite
connections need none of that: those of the event loop's own thread (reads, and
clients' writes) run each call on the spot, and the writer of background work
makes one trip to its worker thread per statement (`sqlite_thread.py`).

`SQLiteDialect` is SQLAlchemy's own SQLite dialect (pysqlite) declared
asynchronous, so that `create_async_engine` takes it; its connections come from
the engine's `creator`. Through an `AsyncSession`, a statement run on the event
loop's thread cost ~115 us this way against ~180 us through aiosqlite's dialect
(a 2-core machine; the statement itself takes a few microseconds). The store runs
its statements on these connections' synchronous core directly, without a
greenlet (`session.py`): `AsyncConnection.execute` insists that a statement await
something and refuses them.

A read never waits for a lock (WAL: readers do not block the writer, nor the
writer them), and a client's write waits for none either (the scheduler's writes
take turns, so the lock is free when its turn comes); run inline, either holds
the loop only for its own work, as the Python that turns its rows into messages
does anyway.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any

from sqlalchemy import pool
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import URL

DRIVER = "managedjobs"


class SQLiteDialect(SQLiteDialect_pysqlite):
    """SQLite for `create_async_engine`, whose connections are made by the engine's
    `creator` (`inline_connector`, `sqlite_thread.thread_connector`)."""

    driver = DRIVER
    is_async = True
    supports_statement_cache = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # What opens a transaction ("BEGIN IMMEDIATE" for a writer; set per engine by
        # `db.py`): the connections are in autocommit mode, so SQLAlchemy's own begin
        # sends nothing. Here, not in a "begin" event listener: an engine with event
        # listeners dispatches its events on every statement (~15 us each, against
        # ~33 us for a one-row statement, on a 2-core machine).
        self.begin_statement = "BEGIN"
        # Told of every COMMIT (the checkpointer counts them), for the same reason.
        self.on_commit: Callable[[], object] | None = None

    def do_begin(self, dbapi_connection: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(self.begin_statement)
        finally:
            cursor.close()

    def do_commit(self, dbapi_connection: Any) -> None:
        dbapi_connection.commit()
        if self.on_commit is not None:
            self.on_commit()

    @classmethod
    def get_pool_class(cls, url: URL) -> type[pool.Pool]:
        # Waits for a free connection by awaiting, never by blocking the thread.
        return pool.AsyncAdaptedQueuePool


registry.register(f"sqlite.{DRIVER}", __name__, "SQLiteDialect")


def engine_url(path: str) -> str:
    """The URL of an engine of the SQLite file `path` on this dialect."""
    return URL.create(f"sqlite+{DRIVER}", database=path).render_as_string()


class InlineCursor(sqlite3.Cursor):
    """sqlite3's cursor, with what SQLAlchemy's asyncio results ask of a driver's cursor."""

    async def _async_soft_close(self) -> None:
        """Its rows are already fetched: nothing to release before the result is read."""


class InlineConnection(sqlite3.Connection):
    """A sqlite3 connection whose cursors are `InlineCursor`s; used on one thread."""

    def cursor(self, factory: Any = InlineCursor) -> Any:
        return super().cursor(factory)


def inline_connector(path: str, timeout: float) -> Callable[[], sqlite3.Connection]:
    """The engine's `creator`: connections to the SQLite file `path`, used where they
    are made (the event loop's thread)."""
    return lambda: sqlite3.connect(path, timeout=timeout, factory=InlineConnection)
