"""SQLite writes on aiosqlite's worker thread, one round trip per statement.

Background writes (admission, reports; see `db.py`) run on a worker thread, so
that the event loop gathers the next batch of reports while one is written.
SQLAlchemy's aiosqlite dialect makes three to four round trips to that thread per
statement (open a cursor, execute, fetch the rows, close), each a hand-off and a
wake-up of the event loop: an admission pass of five statements made ~25 and held
SQLite's writer 3-4 ms while clients waited for it.

`ThreadConnection` is the DB-API connection that SQLAlchemy's synchronous core
sees (through `sqlite_inline.SQLiteDialect`): a statement is one trip, on which a
cursor is opened, run, its rows fetched and closed, and SQLAlchemy's greenlet
waits for that trip's answer and for nothing else. aiosqlite provides the thread
and its queue (aiosqlite 0.22's internals: `_execute`, `_conn`).

Each trip also waits for the event loop to take its answer, behind whatever else
is ready there, and the transaction holds the writer all the while: a client's
submission that arrived meanwhile waited p50 0.9, p99 6.3 ms for its turn (one
sequential client, each job launched meanwhile). So once a lone client waits
(`WriteGate.lone_client_waiting`), a transaction under way runs its remaining
statements and its COMMIT on the event loop's thread, on the same connection (no
trip is in flight then), without yielding: the client's wait fell to p50 0.7,
p99 3.6 ms. Not when more clients' writes are gathering to go together: then
the time the writer is busy is what lets the batch grow (with 64 clients,
hurrying halved single-call submissions per second).
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import aiosqlite
from sqlalchemy.util.concurrency import await_only, in_greenlet

from services.common import cpus

Row = tuple[Any, ...]
IsolationLevel = Literal["DEFERRED", "EXCLUSIVE", "IMMEDIATE"] | None


class _Ran:
    """What a statement left behind, read on the worker thread."""

    __slots__ = ("description", "lastrowid", "rowcount", "rows")

    def __init__(self, connection: sqlite3.Connection, sql: str, parameters: Any, many: bool):
        cursor = connection.cursor()
        try:
            if many:
                cursor.executemany(sql, parameters)
            else:
                cursor.execute(sql, parameters)
            self.description = cursor.description
            self.rows: list[Row] = cursor.fetchall() if cursor.description else []
            self.rowcount = cursor.rowcount
            self.lastrowid = cursor.lastrowid
        finally:
            cursor.close()


class ThreadCursor:
    """A DB-API cursor whose execute runs on the worker thread and brings its rows back in
    the same trip (what the dialect's buffered results read: no server-side cursor)."""

    arraysize = 1

    def __init__(self, connection: ThreadConnection) -> None:
        self._connection = connection
        self._ran: _Ran | None = None
        self._rows: collections.deque[Row] = collections.deque()

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> ThreadCursor:
        return self._run(sql, parameters, many=False)

    def executemany(self, sql: str, parameters: Sequence[Sequence[Any]]) -> ThreadCursor:
        return self._run(sql, parameters, many=True)

    def _run(self, sql: str, parameters: Any, many: bool) -> ThreadCursor:
        connection = self._connection
        if connection.hurry():
            self._ran = _Ran(connection.sqlite, sql, parameters, many)
        else:
            self._ran = await_only(connection.on_thread(sql, parameters, many))
        self._rows = collections.deque(self._ran.rows)
        return self

    def fetchone(self) -> Row | None:
        return self._rows.popleft() if self._rows else None

    def fetchmany(self, size: int | None = None) -> list[Row]:
        count = min(self.arraysize if size is None else size, len(self._rows))
        return [self._rows.popleft() for _ in range(count)]

    def fetchall(self) -> list[Row]:
        rows = list(self._rows)
        self._rows.clear()
        return rows

    def close(self) -> None:
        self._rows.clear()

    async def _async_soft_close(self) -> None:
        """Its rows are already fetched: nothing to release before the result is read."""

    @property
    def description(self) -> Any:
        return self._ran.description if self._ran else None

    @property
    def rowcount(self) -> int:
        return self._ran.rowcount if self._ran else -1

    @property
    def lastrowid(self) -> int | None:
        return self._ran.lastrowid if self._ran else None


class ThreadConnection:
    """A DB-API connection whose statements run on aiosqlite's worker thread, called from
    SQLAlchemy's greenlet (each call waits for the thread's answer)."""

    def __init__(self, worker: aiosqlite.Connection, client_waits: Callable[[], bool]) -> None:
        self._worker = worker
        self._client_waits = client_waits

    @property
    def sqlite(self) -> sqlite3.Connection:
        return self._worker._conn

    def hurry(self) -> bool:
        """Whether to run the next statement (or the COMMIT) here, on the event loop's
        thread, in one go: inside a transaction, which holds SQLite's writer (nothing
        it runs waits for a lock), while a lone client waits for its turn."""
        return self.sqlite.in_transaction and self._client_waits()

    def on_thread(self, sql: str, parameters: Any, many: bool) -> Awaitable[_Ran]:
        """Runs one statement on the worker thread; what it left, or its error."""
        return self._worker._execute(_Ran, self.sqlite, sql, parameters, many)

    def cursor(self) -> ThreadCursor:
        return ThreadCursor(self)

    def commit(self) -> None:
        if self.hurry():
            self.sqlite.commit()
        else:
            await_only(self._worker.commit())

    def rollback(self) -> None:
        await_only(self._worker.rollback())

    def close(self) -> None:
        if in_greenlet():
            await_only(self._worker.close())
        else:  # (a pool emptied outside the event loop's greenlets): close without waiting
            self._worker.stop()

    @property
    def isolation_level(self) -> IsolationLevel:
        return self.sqlite.isolation_level

    @isolation_level.setter
    def isolation_level(self, value: IsolationLevel) -> None:
        self.sqlite.isolation_level = value

    def create_function(self, *args: Any, **kwargs: Any) -> None:
        self.sqlite.create_function(*args, **kwargs)


def thread_connector(
    path: str, timeout: float, client_waits: Callable[[], bool] = lambda: False
) -> Callable[[], ThreadConnection]:
    """The engine's `creator` (called in SQLAlchemy's greenlet): connections to the SQLite
    file `path`, each with its worker thread; `client_waits` tells when to hurry."""

    def connect() -> ThreadConnection:
        worker = aiosqlite.Connection(
            lambda: sqlite3.connect(path, timeout=timeout, check_same_thread=False),
            iter_chunk_size=64,
        )
        # A scheduler that stops without closing its engines (it failed to start) must
        # not wait at exit for this thread; SQLite's journal covers a write cut short.
        worker._thread.daemon = True
        connection = ThreadConnection(await_only(worker), client_waits)
        # With the scheduler kept to one CPU (`--cpus`), this thread may still run on
        # every CPU: kept to the event loop's, it ran only when the loop gave way, the
        # background writes stopped overlapping the clients' and concurrent submissions
        # stopped gathering (64 single-call clients: ~500/s against ~1,550/s).
        if worker._thread.native_id is not None:
            cpus.unpin_thread(worker._thread.native_id)
        return connection

    return connect
