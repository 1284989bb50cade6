"""The scheduler's database, behind two doors: `read(fn)` and `write(fn)`.

A transaction is the unit handed to the database: a plain synchronous function
of a SQLAlchemy `Connection` that runs Core statements and returns a value. The
database runs it whole in one transaction: on SQLite, a read on the event loop's
thread and a write on the one writer thread (`sqlite.py`); on PostgreSQL through
SQLAlchemy's asyncio API (`AsyncConnection.run_sync`), one connection each.

What a write promises:
- **Turns.** It runs in a writer's turn (`turns.py`): clients' writes before
  background ones, `--db-writers` at once on PostgreSQL, one on SQLite.
- **Never abandoned.** Once its body has been handed to the database, the
  caller's cancellation waits for the outcome, and is raised after it.
- **Seen exactly when it happened.** `committed(result)` runs on the event loop,
  still in the turn, if and only if the transaction committed: what follows a
  commit (events to watchers, counter moves) is applied once, in commit order,
  whether or not the caller is still there.
- **A known outcome, or doubt.** A body that fails rolls back: nothing happened.
  A COMMIT that fails (the connection lost during it) may or may not have
  happened: the write raises `OutcomeUnknown` and calls `on_doubt`, so that
  whoever keeps state beside the database checks it against the database.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from services.scheduler.db import sqlite
from services.scheduler.db.turns import Turns

T = TypeVar("T")
MIGRATIONS = Path(__file__).parent.parent / "migrations"


class OutcomeUnknown(Exception):
    """A write whose COMMIT failed: it may have happened, or not."""


def normalize_url(url: str) -> str:
    """Plain `postgresql://` and `sqlite:///` URLs (and their driver-named spellings) with
    the driver the scheduler uses."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif backend == "sqlite":
        parsed = parsed.set(drivername="sqlite")
    return parsed.render_as_string(hide_password=False)


def run_write(connection: Connection, fn: Callable[[Connection], T], begin: str = "") -> T:
    """Runs `fn` in a transaction on `connection` and commits it (`begin`: the statement
    that opens it, where the driver sends none)."""
    transaction = connection.begin()
    if begin:
        connection.exec_driver_sql(begin)
    try:
        result = fn(connection)
    except BaseException:
        with contextlib.suppress(Exception):  # a lost connection rolls back on its own
            transaction.rollback()
        raise
    try:
        transaction.commit()
    except Exception as error:
        raise OutcomeUnknown(f"the database failed during COMMIT: {error}") from error
    return result


def run_read(connection: Connection, fn: Callable[[Connection], T], begin: str = "") -> T:
    """Runs `fn` in a transaction on `connection` (one snapshot for all its statements)."""
    transaction = connection.begin()
    if begin:
        connection.exec_driver_sql(begin)
    try:
        return fn(connection)
    finally:
        with contextlib.suppress(Exception):  # what was read stands
            transaction.rollback()


class Database:
    """Transactions over one database: a SQLite file, or PostgreSQL."""

    def __init__(self, url: str, writers: int = 1, sqlite_synchronous: str = "full") -> None:
        self.url = normalize_url(url)
        self.is_sqlite = self.url.startswith("sqlite")
        self.turns = Turns(1 if self.is_sqlite else writers)
        # Called when a write's outcome is unknown (set by the scheduler app).
        self.on_doubt: Callable[[], None] = lambda: None
        # Writes that committed, and writes whose outcome was unknown.
        self.commits = 0
        self.doubts = 0
        self._async: AsyncEngine | None = None
        if self.is_sqlite:
            synchronous = sqlite.check_synchronous(sqlite_synchronous)
            self.synchronous = synchronous
            self._reader = sqlite.engine(
                self.url, busy_ms=sqlite.READ_BUSY_MS, synchronous=synchronous
            )
            self._writer_engine = sqlite.engine(
                self.url,
                busy_ms=sqlite.WRITE_BUSY_MS,
                synchronous=synchronous,
                pool_size=1,
                max_overflow=0,
                connect_args={"check_same_thread": False},
            )
            self._writer = sqlite.Writer()
            self.checkpointer = sqlite.Checkpointer(sqlite.path_of(self.url), synchronous)
        else:
            self._async = create_async_engine(
                self.url, pool_size=10, max_overflow=10, pool_pre_ping=True
            )

    @classmethod
    def open(cls, url: str, writers: int = 1, sqlite_synchronous: str = "full") -> Database:
        """The database at `url`; on PostgreSQL, `writers` write transactions at once
        (0: as many as asked for)."""
        return cls(url, writers, sqlite_synchronous)

    @property
    def read_engine(self) -> Engine:
        """The synchronous engine behind the reads (for SQLAlchemy's event hooks)."""
        return self._async.sync_engine if self._async is not None else self._reader

    @property
    def write_engine(self) -> Engine:
        """The synchronous engine behind the writes (for SQLAlchemy's event hooks)."""
        return self._async.sync_engine if self._async is not None else self._writer_engine

    # --- the two doors ----------------------------------------------------------------------

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """`fn`'s result, read in one transaction."""
        if self._async is None:
            with self._reader.connect() as connection:
                return run_read(connection, fn, "BEGIN")
        async with self._async.connect() as connection:
            return await connection.run_sync(run_read, fn)

    async def write(
        self,
        fn: Callable[[Connection], T],
        *,
        client: bool = False,
        committed: Callable[[T], None] | None = None,
    ) -> T:
        """`fn`'s result, once its transaction committed (see the module's promises).

        `client`: a client waits for it, so it goes before waiting background work.

        Raises:
            OutcomeUnknown: its COMMIT failed; it may have happened.
        """
        async with self.turns.turn(client):
            if self._async is None:
                future = asyncio.wrap_future(self._writer.submit(lambda: self._write_sqlite(fn)))
            else:
                connection = await self._async.connect()  # cancellable: nothing started yet
                future = asyncio.ensure_future(_write_postgres(connection, fn))
            return await self._outcome(future, committed)

    @asynccontextmanager
    async def quiet(self) -> AsyncIterator[None]:
        """Holds the block while no write is under way and none starts: what a read in it
        sees is what every committed write's `committed` has applied."""
        async with self.turns.quiet():
            yield

    async def maintenance(self, sql: str) -> None:
        """Runs `sql` (e.g. ANALYZE) outside the writers' turns: it blocks no write."""
        if self._async is None:
            with self._reader.connect() as connection:
                connection.exec_driver_sql(sql)
            return
        async with self._async.connect() as connection:
            await connection.exec_driver_sql(sql)
            await connection.commit()

    def _write_sqlite(self, fn: Callable[[Connection], T]) -> T:
        with self._writer_engine.connect() as connection:
            result = run_write(connection, fn, "BEGIN IMMEDIATE")
        self.checkpointer.committed()
        return result

    async def _outcome(self, future: asyncio.Future[T], committed: Callable[[T], None] | None) -> T:
        cancelled = False
        while not future.done():
            try:
                await asyncio.wait((future,))
            except asyncio.CancelledError:
                cancelled = True
        error = future.exception()
        if isinstance(error, OutcomeUnknown):
            self.doubts += 1
            self.on_doubt()
        elif error is None:
            self.commits += 1
            if committed is not None:
                committed(future.result())
        if cancelled:
            raise asyncio.CancelledError
        return future.result()

    # --- schema and life --------------------------------------------------------------------

    async def migrate(self) -> None:
        """Brings the schema to the newest alembic revision."""
        if self._async is None:
            await asyncio.wrap_future(self._writer.submit(self._migrate_sqlite))
            return
        async with self._async.connect() as connection:
            await connection.run_sync(run_write, _upgrade)

    def _migrate_sqlite(self) -> None:
        with self._writer_engine.connect() as connection:
            run_write(connection, _upgrade, "BEGIN IMMEDIATE")

    async def close(self) -> None:
        if self._async is not None:
            await self._async.dispose()
            return
        await asyncio.to_thread(self._writer.close)
        self._writer_engine.dispose()
        self._reader.dispose()
        await asyncio.to_thread(self.checkpointer.close)


async def _write_postgres(connection: AsyncConnection, fn: Callable[[Connection], T]) -> T:
    try:
        return await connection.run_sync(run_write, fn)
    finally:
        await connection.close()


def _upgrade(connection: Connection) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
