"""`in_ids`: a list of ids (or of id tuples) bound as one JSON parameter, on both databases."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Connection, select, update
from sqlalchemy.dialects import postgresql, sqlite

from services.common.statuses import ScheduleState
from services.scheduler.db import Database
from services.scheduler.db.id_lists import ids_param, in_ids
from services.scheduler.db.models import JOBS, TASKS
from services.scheduler.events import EventBus
from services.scheduler.spec.parse import parse_job_spec
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob

IDS = ids_param("ids")
PAIRS = ids_param("pairs")
BY_ID = select(JOBS.c.id).where(in_ids(JOBS.c.id, param=IDS)).order_by(JOBS.c.id)
BY_PAIR = (
    select(TASKS.c.job_id, TASKS.c.task_id)
    .where(in_ids(TASKS.c.job_id, param=IDS), in_ids(TASKS.c.job_id, TASKS.c.task_id, param=PAIRS))
    .order_by(TASKS.c.job_id, TASKS.c.task_id)
)
TWO_TASKS = "name: a\nrun: echo a\n---\nname: b\nrun: echo b\n"


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    db = Database.open(database_url)
    await db.migrate()
    yield Store(db, EventBus())
    await db.close()


async def _jobs(store: Store, count: int) -> list[int]:
    spec = parse_job_spec(TWO_TASKS)
    new = [NewJob("a", "alice", 0, "", "", spec.tasks) for _ in range(count)]
    return [job_id for job_id, _ in await store.submit_many(new)]


async def test_ids_and_pairs_select_exactly_the_rows_named(store: Store) -> None:
    ids = await _jobs(store, 6)

    def read(conn: Connection) -> None:
        picked = [ids[0], ids[3], ids[5], 10_000_000]  # one id that names no job
        assert conn.execute(BY_ID, {"ids": picked}).scalars().all() == picked[:3]
        assert conn.execute(BY_ID, {"ids": []}).scalars().all() == []
        pairs = [(ids[1], 1), (ids[2], 0), (ids[2], 7)]  # task 7 does not exist
        rows = conn.execute(BY_PAIR, {"ids": ids, "pairs": pairs}).all()
        assert [tuple(r) for r in rows] == [(ids[1], 1), (ids[2], 0)]
        # Values given with the condition instead of a named parameter: statements of the
        # same shape share one compiled form, and each runs with its own values.
        for values in ((ids[4], ids[1]), (ids[2],), (ids[0], ids[5], ids[3])):
            now = select(JOBS.c.id).where(in_ids(JOBS.c.id, values=values))
            assert sorted(conn.execute(now).scalars().all()) == sorted(values)

    await store.read(read)


async def test_a_write_moves_only_the_rows_named(store: Store) -> None:
    ids = await _jobs(store, 4)
    moved = await store.db.write(
        lambda conn: (
            conn.execute(
                update(JOBS)
                .where(
                    in_ids(JOBS.c.id, JOBS.c.epoch, values=[(ids[0], 0), (ids[1], 5), (ids[3], 0)])
                )
                .values(schedule_state=ScheduleState.DONE)
                .returning(JOBS.c.id)
            )
            .scalars()
            .all()
        )
    )
    assert sorted(moved) == [ids[0], ids[3]]  # job 1 is at epoch 0


def test_the_statement_is_the_same_whatever_the_list() -> None:
    """One text for every list length: one statement to cache (and to prepare)."""
    for dialect in (sqlite.dialect(), postgresql.dialect()):
        texts = {
            str(select(JOBS.c.id).where(in_ids(JOBS.c.id, values=v)).compile(dialect=dialect))
            for v in ([], [1], list(range(500)))
        }
        assert len(texts) == 1, texts


def test_a_parameter_or_values_not_both() -> None:
    with pytest.raises(TypeError):
        in_ids(JOBS.c.id)
    with pytest.raises(TypeError):
        in_ids(JOBS.c.id, param=IDS, values=[1])
