"""SQLite writes on aiosqlite's worker thread, one thread round trip per statement.

SQLAlchemy's aiosqlite dialect makes four calls per statement (open a cursor,
execute, fetch the rows, close), and aiosqlite sends each to its worker thread
and waits for the answer: four hand-offs and four wake-ups of the event loop for
a statement that takes microseconds on a local file. An admission pass of five
statements made ~25 round trips and held SQLite's writer 3-4 ms while clients
waited for it. `OneTripConnection` keeps aiosqlite's interface, which the
dialect expects, and makes a statement one round trip: the cursor is opened and
its rows fetched on the thread with the execute, and closing it is queued behind
it without a wait.

The engine of background writes (admission, reports; see `db.py`) uses it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Self

import aiosqlite

Row = tuple[Any, ...]


class _Ran:
    """What a statement left behind, read on the worker thread."""

    __slots__ = ("description", "lastrowid", "rowcount", "rows")

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.description = cursor.description
        self.rows: list[Row] = cursor.fetchall() if cursor.description else []
        self.rowcount = cursor.rowcount
        self.lastrowid = cursor.lastrowid


class OneTripCursor:
    """An aiosqlite-like cursor whose execute brings its rows back in the same trip
    (what the dialect's buffered cursor calls: no server-side cursor uses it)."""

    arraysize = 1

    def __init__(self, connection: OneTripConnection) -> None:
        self._connection = connection
        self._cursor: sqlite3.Cursor | None = None
        self._ran: _Ran | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _run(self, call: Callable[[sqlite3.Cursor], object]) -> _Ran:
        """On the worker thread: runs `call` on the sqlite3 cursor, then reads its rows."""
        if self._cursor is None:
            self._cursor = self._connection.sqlite.cursor()
        call(self._cursor)
        return _Ran(self._cursor)

    async def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> Self:
        args = () if parameters is None else parameters
        self._ran = await self._connection.on_thread(self._run, lambda c: c.execute(sql, args))
        return self

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any]]) -> Self:
        self._ran = await self._connection.on_thread(
            self._run, lambda c: c.executemany(sql, parameters)
        )
        return self

    async def fetchall(self) -> list[Row]:
        rows = self._ran.rows if self._ran else []
        if self._ran:
            self._ran.rows = []
        return rows

    async def close(self) -> None:
        """Queues the close behind whatever the thread does next; nothing waits for it."""
        cursor, self._cursor = self._cursor, None
        if cursor is not None:
            self._connection.queue(cursor.close)

    @property
    def description(self) -> Any:
        return self._ran.description if self._ran else None

    @property
    def rowcount(self) -> int:
        return self._ran.rowcount if self._ran else -1

    @property
    def lastrowid(self) -> int | None:
        return self._ran.lastrowid if self._ran else None


class OneTripConnection(aiosqlite.Connection):
    """An aiosqlite connection whose cursors make one thread round trip per statement
    (aiosqlite 0.22's internals: its worker queue and `_execute`)."""

    def __init__(self, connector: Callable[[], sqlite3.Connection]) -> None:
        super().__init__(connector, iter_chunk_size=64)
        # A scheduler that stops without closing its engines (it failed to start) must
        # not wait at exit for this thread; SQLite's journal covers a write cut short.
        self._thread.daemon = True

    @property
    def sqlite(self) -> sqlite3.Connection:
        return self._conn

    def on_thread(self, function: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Runs `function(*args)` on the worker thread; its result, or its error."""
        return self._execute(function, *args)

    def queue(self, function: Callable[[], object]) -> None:
        """Runs `function` on the worker thread after what is queued, without an answer."""
        self._tx.put_nowait((None, function))

    def cursor(self) -> OneTripCursor:  # type: ignore[override]
        return OneTripCursor(self)


def one_trip_creator(path: str, timeout: float) -> Callable[[], Awaitable[OneTripConnection]]:
    """`async_creator` for `create_async_engine`: connections to the SQLite file `path`."""

    async def create() -> OneTripConnection:
        connection = OneTripConnection(
            lambda: sqlite3.connect(path, timeout=timeout, check_same_thread=False)
        )
        await connection
        return connection

    return create
