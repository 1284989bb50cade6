"""SQLite's write-ahead log copied back into the database on a thread of its own.

By default SQLite checkpoints inside the COMMIT that grows its log past 1,000
pages: that commit copies the log's pages into the database file and syncs both
before it returns. A submission writes ~10 pages, so about one commit in 100
paid 3-7 ms instead of ~0.05 ms, on whichever connection made it:
a client's submission on the event loop's thread (the client's answer waits, and
so does everything else on the loop) or a background transaction (which holds
the writer meanwhile, so the next client waits for it).

The scheduler's connections therefore never checkpoint (`wal_autocheckpoint=0`).
Every `EVERY` commits, `Checkpointer` wakes its thread, which runs a PASSIVE
checkpoint on its own connection: it copies what no reader still needs, waits
for no lock and blocks nobody, and sqlite3 releases the GIL while it runs, so
the event loop goes on. Once a checkpoint has copied the whole log, the next
writer starts the log over from its beginning, as with SQLite's own checkpoints.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger(__name__)

# Commits between checkpoints: ~10 pages each, so the log stays near SQLite's own
# threshold of 1,000 pages (4 MB).
EVERY = 100


class Checkpointer:
    """Checkpoints the SQLite file `path` every `every` commits, on its thread."""

    def __init__(self, path: str, every: int = EVERY) -> None:
        self.path = path
        self.every = every
        self._taken = 0
        self._done = threading.Condition()
        self._commits = 0
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Counts a commit (called on the event loop's thread); wakes the thread every
        `every` commits."""
        self._commits += 1
        if self._commits >= self.every:
            self._commits = 0
            self._wake.set()

    @property
    def taken(self) -> int:
        """Checkpoints taken so far."""
        return self._taken

    def wait(self, checkpoints: int, timeout: float) -> bool:
        """Whether `checkpoints` checkpoints were taken within `timeout` seconds."""
        with self._done:
            return self._done.wait_for(lambda: self._taken >= checkpoints, timeout)

    def close(self) -> None:
        """Stops the thread, after one last checkpoint of whatever the log holds."""
        self._closing = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            # As the writers': the log is synced before its pages are copied, the
            # database file after.
            connection.execute("PRAGMA synchronous=NORMAL")
            while True:
                self._wake.wait()
                self._wake.clear()
                try:
                    connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as error:  # the log waits for the next one
                    log.warning("SQLite checkpoint failed: %s", error)
                with self._done:
                    self._taken += 1
                    self._done.notify_all()
                if self._closing:
                    return
        finally:
            connection.close()
