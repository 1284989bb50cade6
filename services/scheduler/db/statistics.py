"""The planner's statistics on PostgreSQL, gathered again as the tables grow.

PostgreSQL plans by the statistics ANALYZE gathers. A table that grew since they
were gathered is planned as if it were still small: a batch's idempotency keys
were looked up by reading every job of the user. Autovacuum gathers them when it
runs, if it runs; the scheduler also does after the first `ANALYZE_FIRST` jobs it
inserts, then each time that count grew `ANALYZE_GROWTH` times, in a task of its
own that blocks no write (`Database.maintenance`). SQLite needs none of this.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.exc import SQLAlchemyError

from services.scheduler.db.database import Database

log = logging.getLogger(__name__)

ANALYZE_FIRST = 1000
ANALYZE_GROWTH = 4
ANALYZE = "ANALYZE jobs, tasks, attempts, events"


class Statistics:
    """Counts the jobs inserted and gathers statistics when they grew enough."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.inserted = 0
        self._analyze_at = ANALYZE_FIRST
        self.analyzing: asyncio.Task[None] | None = None

    def grew(self, inserted: int) -> None:
        """Counts `inserted` new jobs; on PostgreSQL, gathers statistics when due."""
        self.inserted += inserted
        if self.db.is_sqlite or self.inserted < self._analyze_at:
            return
        if self.analyzing is not None and not self.analyzing.done():
            return
        self._analyze_at = self.inserted * ANALYZE_GROWTH
        self.analyzing = asyncio.create_task(self._analyze(), name="analyze")

    async def _analyze(self) -> None:
        try:
            await self.db.maintenance(ANALYZE)
        except (SQLAlchemyError, OSError) as error:
            log.warning("gathering table statistics failed", extra={"error": str(error)})
            return
        log.info("table statistics gathered", extra={"jobs_inserted": self.inserted})

    async def stop(self) -> None:
        """Cancels a gathering under way."""
        if self.analyzing is not None:
            self.analyzing.cancel()
            await asyncio.gather(self.analyzing, return_exceptions=True)
