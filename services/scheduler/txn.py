"""One write transaction (`Txn`): its connection, its clock reading, and what it wrote.

A transaction body is a plain synchronous function of a `Txn` that runs
SQLAlchemy Core statements on `Txn.conn` (the store runs it whole in one
transaction, `store.Store.transaction`). Whatever the body changes, it records
here: every event it writes (`Txn.event`: contract §4, every change is an event),
every schedule-state move it makes (`Move`, for the counters), what must run on
the event loop once it committed (`Txn.after`), and the rows it read as plain
values and changed in Python (`Txn.track`, written back before the events and
the commit).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, Table, insert

from managedjobs.v1 import job_pb2
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import convert
from services.scheduler.db.models import EVENTS
from services.scheduler.db.rows import Tracked, write_back

INSERT_EVENTS = insert(EVENTS).returning(EVENTS.c.id, sort_by_parameter_order=True)


@dataclasses.dataclass(frozen=True)
class Move:
    """A schedule-state change that happened, as the counters see it."""

    job_id: int
    old_controller: str | None
    new_controller: str | None
    epoch: int
    old: ScheduleState
    new: ScheduleState


@dataclasses.dataclass
class Txn:
    """One write transaction: its connection, its clock reading, what it wrote."""

    conn: Connection
    now: dt.datetime
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    moves: list[Move] = dataclasses.field(default_factory=list)
    # Run on the event loop once the transaction committed, in commit order (metrics,
    # messages to replicas that depend on the commit).
    after: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    # The events as written, with their ids (set as the transaction ends).
    published: list[job_pb2.JobEvent] = dataclasses.field(default_factory=list)
    # What a writer read up front for the rest of the transaction (e.g. a batch's rows).
    cache: dict[str, object] = dataclasses.field(default_factory=dict)
    # Rows read as plain values and changed in Python (`rows.py`): written back before a
    # statement that may read or move them, and before the commit.
    tracked: list[Tracked] = dataclasses.field(default_factory=list)

    def track(self, table: Table, values: dict[str, Any]) -> Tracked:
        """A row read in this transaction (`rows.values_of`), as a `Tracked` row it writes
        back."""
        tracked = Tracked(table, values)
        self.tracked.append(tracked)
        return tracked

    def track_new(self, table: Table, **values: Any) -> Tracked:
        """A row this transaction inserts (when it writes back)."""
        tracked = Tracked.new(table, **values)
        self.tracked.append(tracked)
        return tracked

    def write_back(self) -> None:
        """Writes the tracked rows' changes (and new rows) now."""
        write_back(self.conn, self.tracked)

    def event(
        self,
        job_id: int,
        task_id: int,
        status: JobStatus,
        schedule_state: ScheduleState,
        message: str,
        epoch: int = 0,
    ) -> None:
        self.events.append(
            {
                "job_id": job_id,
                "task_id": task_id,
                "status": status,
                "schedule_state": schedule_state,
                "time": self.now,
                "message": message,
                "epoch": epoch,
            }
        )

    def order_events(self, start: int, job_ids: Sequence[int]) -> None:
        """Puts the events written since `start` in the order of their jobs in `job_ids`
        (a job's own events keep theirs): moves grouped into one statement per replica
        are still logged in the order they were decided."""
        rank = {job_id: index for index, job_id in enumerate(job_ids)}
        self.events[start:] = sorted(
            self.events[start:], key=lambda e: rank.get(e["job_id"], len(rank))
        )

    def write_events(self) -> None:
        """Inserts the events recorded so far, one statement for them all; `published`
        holds them as written, with their ids."""
        if not self.events:
            return
        ids = self.conn.scalars(INSERT_EVENTS, self.events).all()
        self.published = [
            convert.event_message(convert.NewEvent(i, **values))
            for i, values in zip(ids, self.events, strict=True)
        ]
