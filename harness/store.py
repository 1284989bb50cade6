"""The scheduler's store driven directly: jobs, assignments, reports, and counters that
follow its moves, as the scheduler's own parts do."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from sqlalchemy import func, select

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import queries
from services.scheduler.counters import Counters, live_counts
from services.scheduler.moves import move_held, move_many
from services.scheduler.reports import Reports
from services.scheduler.spec.parse import parse_job_spec
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob
from services.scheduler.txn import Move

S = JobStatus
St = ScheduleState


def new_job(
    spec: str = "name: hello\nrun: echo hi\n", user: str = "alice", key: str = "", priority: int = 0
) -> NewJob:
    parsed = parse_job_spec(spec)
    return NewJob(parsed.name, user, priority, "", key, parsed.tasks)


def chain(length: int) -> str:
    return "name: chain\n" + "".join(f"---\nname: t{i}\nrun: echo {i}\n" for i in range(length))


async def count(store: Store, model: type) -> int:
    query = select(func.count()).select_from(model)
    return int(await store.read(lambda conn: conn.scalar(query)) or 0)


async def move_jobs(
    store: Store,
    job_ids: Sequence[int],
    old: ScheduleState,
    new: ScheduleState,
    *,
    controller_id: str | None = None,
    assign_to: str | None = None,
) -> list[Move]:
    """Moves jobs from `old` to `new` in a transaction of their own (`moves.move_many`)."""
    body = functools.partial(move_many, job_ids=job_ids, old=old, new=new,
                             controller_id=controller_id, assign_to=assign_to)  # fmt: skip
    moves, _ = await store.transaction(body)
    return moves


async def move_job(
    store: Store,
    job_id: int,
    old: ScheduleState,
    new: ScheduleState,
    *,
    epoch: int,
    cid: str,
    wait_reason: str | None = None,
) -> Move | None:
    """Moves a replica's job from `old` to `new` iff it is there at that epoch (`move_held`)."""
    return await store.transaction(
        lambda txn: move_held(txn, job_id, old, new, epoch, cid, wait_reason)
    )


async def assign(store: Store, job_id: int, controller: str = "c1") -> int:
    moves = await move_jobs(store, [job_id], St.WAITING, St.LAUNCHING, assign_to=controller)
    assert len(moves) == 1
    return moves[0].epoch


# Reports are numbered as a replica numbers them: each with the next number.
NUMBERS = itertools.count(1)


def transition(
    job_id: int, epoch: int, status: JobStatus, task_id: int = 0, **kw: object
) -> pb.ConnectControllerRequest:
    return pb.ConnectControllerRequest(
        seq=next(NUMBERS),
        transition=pb.TaskTransition(
            job_id=job_id,
            epoch=epoch,
            task_id=task_id,
            status=int(status),
            **kw,  # type: ignore[arg-type]
        ),
    )


def finished(job_id: int, epoch: int, reason: str = "") -> pb.ConnectControllerRequest:
    return pb.ConnectControllerRequest(
        seq=next(NUMBERS),
        job_finished=pb.JobFinished(job_id=job_id, epoch=epoch, failure_reason=reason),
    )


async def report(
    store: Store, cid: str, *requests: pb.ConnectControllerRequest
) -> list[pb.ReportAck]:
    for request in requests:
        request.seq = request.seq or next(NUMBERS)
    return (await Reports(store).apply(cid, requests)).acks


async def accepted(store: Store, cid: str, *requests: pb.ConnectControllerRequest) -> None:
    acks = await report(store, cid, *requests)
    assert all(a.accepted for a in acks), acks


class Followed:
    """Counters that follow the store's moves, as in the scheduler."""

    def __init__(self, store: Store) -> None:
        self.counters = Counters(store)
        store.on_moves = self.counters.apply

    async def matches_a_recount(self, store: Store) -> bool:
        return live_counts(self.counters.counts) == live_counts(await store.read(queries.recount))
