"""Database engines: a SQLite file by default, PostgreSQL when given a URL.

SQLite has one writer: write transactions take turns (`write_gate.py`, an
asyncio wait) instead of contending for SQLite's write lock and sleeping in its
busy handler; each starts with BEGIN IMMEDIATE. Background writes (admission,
reports) run on aiosqlite's worker thread, one round trip per statement
(`sqlite_thread`), so the event loop gathers the next batch of reports while one
is written; once a lone client waits for the writer, the rest of such a
transaction runs on the event loop's thread in one go. A client's write (a
submission, a cancel) runs on the event loop's own thread (`sqlite_inline`),
start to commit without a thread hand-off per statement and without other work
interleaved: its turn is short, and so is the wait of whatever comes next.
Background work stays on the thread even when small: run inline, an admission
pass's turns and the clients' fell into lockstep, one job each (single-call
admission dropped to ~300/s), and small report batches, written at once, did not
gather (a sequential client's job cost the scheduler ~6.3 ms of CPU with batches
of up to four reports inline, ~4.6 ms without).
Reads use a third engine (WAL mode: readers never block the writer), also
inline. No commit copies the write-ahead log back into the database: a thread of
its own does (`sqlite_checkpoint`). PostgreSQL uses one engine for everything;
its reads run concurrently, and its writes take the same turns, one at a time by
default (`--db-writers`): a writer that runs alone gathers what arrives
meanwhile into its next batch (single submissions from 64 clients: ~1,500/s with
one writer, ~1,100/s with two or with no limit, on a 2-core machine).
Migrations (alembic) run at start, on the same driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from services.scheduler.greenlets import run
from services.scheduler.session import Session
from services.scheduler.sqlite_checkpoint import Checkpointer
from services.scheduler.sqlite_inline import SQLiteDialect, engine_url, inline_connector
from services.scheduler.sqlite_thread import thread_connector
from services.scheduler.write_gate import WriteGate

MIGRATIONS = Path(__file__).parent / "migrations"


def default_url(data_dir: str | Path) -> str:
    """A SQLite file in the data dir, readable and writable by the scheduler's user only
    (SQLite gives its journal files the same mode)."""
    path = Path(data_dir).resolve() / "scheduler.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    return f"sqlite+aiosqlite:///{path}"


def normalize_url(url: str) -> str:
    """Accepts plain `postgresql://` and `sqlite:///` URLs and picks the async driver."""
    parsed = make_url(url)
    driver = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}.get(
        parsed.drivername, parsed.drivername
    )
    if parsed.drivername == "sqlite":
        driver = "sqlite+aiosqlite"
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


# How long a statement on the event loop's thread may wait for a SQLite lock, which
# only another process can hold (the scheduler's own writes take turns, and readers
# never wait in WAL mode): the loop stands still meanwhile, so the statement fails
# soon instead, as if the database were away.
INLINE_BUSY_MS = 100


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, busy_ms: int = 10_000) -> None:
    # Autocommit mode: the dialect sends each transaction's BEGIN itself (`SQLiteDialect.do_begin`).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # Checkpoints run on a thread of their own (`sqlite_checkpoint`), never in a commit.
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sqlite_engine(
    url: str, begin: str, inline: bool = False, gate: WriteGate | None = None, **pool: Any
) -> AsyncEngine:
    # No reset-on-return ROLLBACK: every transaction ends itself (`_transaction`), and on the
    # worker thread each statement is a round trip worth saving.
    busy_ms = INLINE_BUSY_MS if inline else 10_000
    path = make_url(url).database or ""
    if inline:
        pool["creator"] = inline_connector(path, busy_ms / 1000)
    else:
        client_waits = (lambda: gate.lone_client_waiting) if gate else (lambda: False)
        pool["creator"] = thread_connector(path, busy_ms / 1000, client_waits)
    engine = create_async_engine(engine_url(path), pool_reset_on_return=None, **pool)
    event.listen(engine.sync_engine, "connect", functools.partial(_sqlite_pragmas, busy_ms=busy_ms))
    _dialect(engine).begin_statement = begin
    return engine


def _dialect(engine: AsyncEngine) -> SQLiteDialect:
    dialect = engine.dialect
    if not isinstance(dialect, SQLiteDialect):
        raise TypeError(f"not an engine of the scheduler's SQLite dialect: {engine.url}")
    return dialect


@dataclasses.dataclass
class Database:
    """Transactions for reads and writes over one database (`session.Session`)."""

    url: str
    write_engine: AsyncEngine
    read_engine: AsyncEngine
    # SQLite: clients' writes, on the event loop's thread; the same one writer as
    # `write_engine`, in turns.
    inline_engine: AsyncEngine | None = None
    # Write transactions at once (0: no limit); SQLite has one writer whatever is asked.
    writers: int = 1
    # SQLite: copies the write-ahead log into the database, counting the writers' commits.
    checkpointer: Checkpointer | None = None
    # The writers' turns (made here by default: one per writer, none for no limit).
    gate: WriteGate | None = None

    @classmethod
    def open(cls, url: str, writers: int = 1) -> Database:
        """The database at `url`; on PostgreSQL, `writers` write transactions at once
        (0: as many as asked for)."""
        url = normalize_url(url)
        if url.startswith("sqlite"):
            gate = WriteGate()
            return cls(
                url,
                _sqlite_engine(url, "BEGIN IMMEDIATE", gate=gate, pool_size=1, max_overflow=0),
                _sqlite_engine(url, "BEGIN", inline=True),
                _sqlite_engine(url, "BEGIN IMMEDIATE", inline=True, pool_size=1, max_overflow=0),
                checkpointer=Checkpointer(make_url(url).database or ""),
                gate=gate,
            )
        engine = create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)
        return cls(url, engine, engine, writers=writers)

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")

    @asynccontextmanager
    async def write(self, urgent: bool = False) -> AsyncIterator[Session]:
        """A write transaction: committed on exit, rolled back on error.

        `urgent` (a client waiting) goes before waiting background work
        (`write_gate.py`); on SQLite it runs on the event loop's thread, background
        work on the worker thread.
        """
        engine = self.inline_engine if urgent and self.inline_engine else self.write_engine
        turn = self.gate.turn(urgent) if self.gate else contextlib.nullcontext()
        async with turn, _transaction(engine, inline=engine is self.inline_engine) as session:
            yield session

    @asynccontextmanager
    async def read(self) -> AsyncIterator[Session]:
        async with _transaction(self.read_engine, inline=self.is_sqlite) as session:
            yield session

    def __post_init__(self) -> None:
        writers = 1 if self.is_sqlite else self.writers
        if self.gate is None and writers:
            self.gate = WriteGate(writers)
        if self.checkpointer is not None:
            for engine in self.write_engines:
                _dialect(engine).on_commit = self.checkpointer.committed

    async def migrate(self) -> None:
        """Brings the schema to the newest alembic revision."""
        async with self.write_engine.begin() as conn:
            await conn.run_sync(_upgrade)

    @property
    def write_engines(self) -> list[AsyncEngine]:
        return [e for e in (self.write_engine, self.inline_engine) if e is not None]

    async def close(self) -> None:
        for engine in self.write_engines:
            await engine.dispose()
        if self.read_engine is not self.write_engine:
            await self.read_engine.dispose()
        if self.checkpointer is not None:
            await asyncio.to_thread(self.checkpointer.close)


@asynccontextmanager
async def _transaction(engine: AsyncEngine, inline: bool) -> AsyncIterator[Session]:
    """A transaction on a connection of `engine`; `inline`: its driver never waits
    (`sqlite_inline`), so statements run on the spot (`session.py`), and so do its
    BEGIN and its COMMIT or ROLLBACK. Elsewhere each runs in a greenlet that awaits
    the driver (`greenlets.py`), as SQLAlchemy's asyncio connection runs them.

    On SQLite the connection then goes back to its pool on the spot too: nothing is
    left to wait for (no transaction open, no ROLLBACK on return). SQLAlchemy's
    asyncio connection closes in a task of its own, shielded from cancellation, and
    its caller resumed two turns of the event loop later, behind whatever else was
    ready there, still holding the writer's turn (a client's submission waited for
    that). A transaction cut short while it ended (cancelled during its COMMIT on the
    worker thread), and every one on PostgreSQL (its pool sends a ROLLBACK as the
    connection returns), is closed that way.
    """
    sync = await run(engine.sync_engine.connect)
    try:
        if inline:
            with sync.begin():
                yield Session(sync, inline)
        else:
            transaction = (await run(sync.begin)).__enter__()
            try:
                yield Session(sync, inline)
            except BaseException as error:
                await run(transaction.__exit__, type(error), error, error.__traceback__)
                raise
            await run(transaction.__exit__, None, None, None)
    finally:
        if engine.dialect.name == "sqlite" and not sync.in_transaction():
            sync.close()
        else:
            await _to_completion(run(sync.close))


async def _to_completion(closing: Coroutine[Any, Any, None]) -> None:
    """Awaits `closing` in a task of its own, to its end even if the caller is cancelled
    meanwhile (the cancellation is raised after it)."""
    task = asyncio.ensure_future(closing)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if task.done():
                raise
            cancelled = error
    task.result()
    if cancelled is not None:
        raise cancelled


def _upgrade(connection: Connection) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
