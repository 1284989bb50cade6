"""SQLite, the default database: one file, one writer thread, readers on the event loop.

The file is in WAL mode: readers never block the writer, nor it them. Reads run
on the event loop's own thread, start to end, on a connection of the read
engine: a read waits for no lock, so it holds the loop only for its own work.
Every write transaction runs whole on one writer thread (`Writer`), one hop
from the event loop per transaction: BEGIN IMMEDIATE, the body, COMMIT. The
loop goes on meanwhile (sqlite3 releases the GIL while it waits for the disk).

Durability: `synchronous=FULL` by default, so a COMMIT returns once the
write-ahead log is on disk, and an OK answer survives an OS crash or a power
loss. `synchronous=NORMAL` (`--sqlite-synchronous normal`) syncs only at
checkpoints: a commit survives a crash of the scheduler but the last ones may
be lost to an OS crash or power loss. Submissions that arrive together share
one transaction (the intake's group commit), so they share one sync.

No commit copies the log back into the database file: the `Checkpointer`'s
thread does, every `EVERY` commits, with a PASSIVE checkpoint that waits for no
lock and blocks nobody. SQLite's own checkpoints would run inside whichever
commit grew the log past its threshold, and that commit's writer turn would
take many times as long as the others.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)
T = TypeVar("T")

SYNCHRONOUS = ("full", "normal")
# How long a statement on the event loop's thread may wait for a lock, which only
# another process can hold: the loop stands still meanwhile, so it fails soon instead.
READ_BUSY_MS = 100
WRITE_BUSY_MS = 10_000
# Commits between checkpoints: the log stays near SQLite's own threshold.
EVERY = 100


def default_url(data_dir: str | Path) -> str:
    """A SQLite file in the data dir, readable and writable by the scheduler's user only
    (SQLite gives its journal files the same mode)."""
    path = Path(data_dir).resolve() / "scheduler.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    return f"sqlite:///{path}"


def check_synchronous(value: str) -> str:
    """The `--sqlite-synchronous` setting, lower-cased.

    Raises:
        ValueError: not one of `SYNCHRONOUS`.
    """
    lowered = value.strip().lower()
    if lowered not in SYNCHRONOUS:
        raise ValueError(f"must be one of {', '.join(SYNCHRONOUS)}, got {value!r}")
    return lowered


def _pragmas(dbapi_connection: Any, _record: Any, busy_ms: int, synchronous: str) -> None:
    # Autocommit at the driver: each transaction sends its own BEGIN (`database.py`).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cursor.execute(f"PRAGMA synchronous={synchronous.upper()}")
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def engine(url: str, *, busy_ms: int, synchronous: str, **options: Any) -> Engine:
    """An engine of the SQLite file at `url` with the scheduler's pragmas."""
    parsed = make_url(url)
    sync_url = parsed.set(drivername="sqlite+pysqlite")
    created = create_engine(sync_url, pool_reset_on_return=None, **options)
    listener = functools.partial(_pragmas, busy_ms=busy_ms, synchronous=synchronous)
    event.listen(created, "connect", listener)
    return created


def path_of(url: str) -> str:
    return make_url(url).database or ""


class Writer:
    """The one thread that runs every write transaction, in the order handed to it."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqlite-writer")

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Checkpointer:
    """Checkpoints the SQLite file `path` every `every` commits, on a thread of its own."""

    def __init__(self, path: str, synchronous: str, every: int = EVERY) -> None:
        self.path = path
        self.synchronous = synchronous
        self.every = every
        self.taken = 0
        self._commits = 0
        self._done = threading.Condition()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Counts a commit (on the writer thread); wakes the checkpointer every `every`."""
        self._commits += 1
        if self._commits >= self.every:
            self._commits = 0
            self._wake.set()

    def wait(self, checkpoints: int, timeout: float) -> bool:
        """Whether `checkpoints` checkpoints were taken within `timeout` seconds."""
        with self._done:
            return self._done.wait_for(lambda: self.taken >= checkpoints, timeout)

    def close(self) -> None:
        """Stops the thread, after one last checkpoint of whatever the log holds."""
        self._closing = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            # As the writers': with FULL, the database file is synced after each checkpoint.
            connection.execute(f"PRAGMA synchronous={self.synchronous.upper()}")
            while True:
                self._wake.wait()
                self._wake.clear()
                try:
                    connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as error:  # the log waits for the next one
                    log.warning("SQLite checkpoint failed: %s", error)
                with self._done:
                    self.taken += 1
                    self._done.notify_all()
                if self._closing:
                    return
        finally:
            connection.close()
