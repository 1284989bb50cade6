"""The scheduler's records: one door in (`Store.transaction`), one door out (the hooks).

Every write goes through `transaction(body)`: `body` is a plain synchronous
function of a `Txn` (`txn.py`) that runs SQLAlchemy Core statements, run whole in
one transaction by the database (`db/`). Exactly when it has committed, even if
its caller was cancelled meanwhile, the store publishes the transaction's events
to watchers and hands its moves to `on_moves`, the one place the admission
counters follow. Nothing else changes a counter, so counters and the database
cannot drift apart by a forgotten call; a transaction whose outcome is unknown
(its COMMIT failed) has the database call its `on_doubt`, and the counters are
reconciled with a recount.

The bodies live with their concerns: submissions (`submissions.py`), reads
(`queries.py`), schedule-state moves (`moves.py`), task status changes
(`transitions.py`), the end of a job (`endings.py`), releases (`releases.py`),
reports (`reports.py`) and cancels (`cancels.py`). This class holds the database,
the event bus and the hook, and opens the doors: `transaction(body)` for a write,
`read(body, *args)` for a read (`store.read(queries.job, job_id)`), and
`submit_many`, the one write with more to it (a lost race on an idempotency key is
retried; inserted jobs are counted for the planner's statistics, `db/statistics.py`).

Invariants kept by those bodies, whatever the caller does:
- A schedule-state change is one conditional UPDATE whose row count is the answer.
- A task status only changes along `TASK_TRANSITIONS`.
- Every change writes an event row in the same transaction, each task's status
  change its own. An assignment's event carries the new epoch; a replica's report
  carries the report's epoch; a move of a held job carries the job's epoch at the
  move. Only the scheduler's own events of jobs no replica holds carry 0.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from services.scheduler.db import Database
from services.scheduler.db.statistics import Statistics
from services.scheduler.events import EventBus
from services.scheduler.submissions import NewJob, insert_jobs
from services.scheduler.txn import Move, Txn

T = TypeVar("T")
P = ParamSpec("P")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Store:
    def __init__(
        self, db: Database, bus: EventBus, clock: Callable[[], dt.datetime] = utcnow
    ) -> None:
        self.db = db
        self.bus = bus
        self.clock = clock
        # The hook: set by the scheduler app (the counters and admission follow moves).
        self.on_moves: Callable[[Sequence[Move]], None] = lambda moves: None
        self.statistics = Statistics(db)

    # --- the doors ------------------------------------------------------------------------

    async def transaction(self, body: Callable[[Txn], T], client: bool = False) -> T:
        """Runs `body` in a write transaction; its events and moves are published exactly
        when it committed.

        `client`: a client waits for it (a submission, a cancel), so it goes before
        waiting background work.

        Raises:
            OutcomeUnknown: the COMMIT failed; the counters are reconciled.
        """

        def run(conn: Connection) -> tuple[Txn, T]:
            txn = Txn(conn, self.clock())
            value = body(txn)
            txn.write_back()
            txn.write_events()
            return txn, value

        _, value = await self.db.write(run, client=client, committed=self._committed)
        return value

    def _committed(self, outcome: tuple[Txn, object]) -> None:
        txn = outcome[0]
        self.bus.publish(txn.published)
        if txn.moves:
            self.on_moves(txn.moves)
        for call in txn.after:
            call()

    async def read(
        self, body: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Runs `body(conn, *args, **kwargs)` in a read transaction."""
        return await self.db.read(lambda conn: body(conn, *args, **kwargs))

    # --- writes ---------------------------------------------------------------------------

    async def submit(self, job: NewJob) -> tuple[int, bool]:
        """Stores a job with its tasks and first event; returns (job_id, created)."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: Sequence[NewJob]) -> list[tuple[int, bool]]:
        """Stores jobs in one transaction, all of them or none (`insert_jobs`); (job_id,
        created) for each."""
        body = functools.partial(insert_jobs, jobs=jobs)
        try:
            answers = await self.transaction(body, client=True)
        except IntegrityError:
            # Another writer stored one of the keys meanwhile: its job is the answer now.
            answers = await self.transaction(body, client=True)
        self.statistics.grew(sum(created for _, created in answers))
        return answers
