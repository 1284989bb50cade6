"""Schedule-state moves: a job's place in admission (contract §5), changed conditionally.

A move is one conditional UPDATE: its from-state, and for a replica's job its
epoch and controller, are in the WHERE clause, and its row count is the answer,
never a read then a write. Only moves `schedule_transition` allows are made.
Assigning hands a job nobody holds to a replica with the next epoch (whose
reports are numbered afresh). Each move writes its event: a move of a held job
carries the job's epoch at the move (an assignment's, the new one); only the
scheduler's own moves of jobs no replica holds carry 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, update

from managedjobs.v1 import job_pb2
from services.common.statuses import ScheduleState, schedule_transition
from services.scheduler.db.id_lists import in_ids
from services.scheduler.db.models import JOBS
from services.scheduler.queries import IDS, with_tasks
from services.scheduler.txn import Move, Txn

J = JOBS.c


def _moves(*returning: Any) -> dict[tuple[bool, bool], Any]:
    """Moves of many jobs returning `returning`: by (assigning, held by a given replica)."""
    moving = update(JOBS).where(in_ids(J.id, param=IDS), J.schedule_state == bindparam("old"))
    plain = moving.values(schedule_state=bindparam("new"), wait_reason="").returning(*returning)
    assign = (
        moving.where(J.controller_id.is_(None))
        .values(
            schedule_state=bindparam("new"),
            wait_reason="",
            controller_id=bindparam("to"),
            epoch=J.epoch + 1,
            report_seq=0,
        )
        .returning(*returning)
    )
    held = plain.where(J.controller_id == bindparam("cid"))
    return {(False, False): plain, (True, False): assign, (False, True): held}


MOVES = _moves(J.id, J.epoch, J.status, J.current_task)
# The same, returning the whole rows of the moved jobs (what their assignment sends).
MOVES_FETCHING = _moves(*JOBS.c)
MOVE_ONE = (
    update(JOBS)
    .where(
        J.id == bindparam("job_id"),
        J.schedule_state == bindparam("old"),
        J.epoch == bindparam("at_epoch"),
        J.controller_id == bindparam("cid"),
    )
    .values(schedule_state=bindparam("new"))
    .returning(J.status, J.current_task)
)
MOVE_ONE_WITH_REASON = MOVE_ONE.values(wait_reason=bindparam("reason"))


def move_many(
    txn: Txn,
    job_ids: Sequence[int],
    old: ScheduleState,
    new: ScheduleState,
    *,
    controller_id: str | None = None,
    assign_to: str | None = None,
    message: str = "",
    fetch: bool = False,
) -> tuple[list[Move], list[job_pb2.Job]]:
    """Moves many jobs from `old` to `new` in one conditional UPDATE (admission batches).

    Only jobs still in `old` (and held by `controller_id`, when given; by nobody when
    assigning) move; `assign_to` hands them to that replica with the next epoch.
    With `fetch`, the moved jobs (with their task specs, and the cancel flag as
    committed with the move) are read in the same transaction.
    """
    if not job_ids:
        return [], []
    schedule_transition(old, new)
    params = {"ids": list(job_ids), "old": old, "new": new}
    if assign_to is not None:
        params["to"] = assign_to
    elif controller_id is not None:
        params["cid"] = controller_id
    held = assign_to is None and controller_id is not None
    query = (MOVES_FETCHING if fetch else MOVES)[(assign_to is not None, held)]
    moves: list[Move] = []
    # In the order asked for (a database returns an UPDATE's rows in any order).
    rank = {job_id: index for index, job_id in enumerate(job_ids)}
    rows = sorted(
        txn.conn.execute(query, params).all(),
        key=lambda row: rank.get(row.id, len(rank)),
    )
    for row in rows:
        epoch = row.epoch
        # A held job's event carries its epoch (an assignment's, the new one), so the log
        # tells who held what and on whose behalf each move was made.
        held_by = assign_to or controller_id
        txn.event(row.id, row.current_task, row.status, new, message or new.name,
                  epoch if held_by else 0)  # fmt: skip
        moves.append(Move(int(row.id), controller_id, assign_to or controller_id, epoch, old, new))
    txn.moves += moves
    jobs: list[job_pb2.Job] = []
    if fetch and rows:
        # The rows as the UPDATE left them; their tasks with their specs.
        jobs = with_tasks(txn.conn, rows, with_specs=True)
    return moves, jobs


def move_held(
    txn: Txn,
    job_id: int,
    old: ScheduleState,
    new: ScheduleState,
    epoch: int,
    controller_id: str,
    wait_reason: str | None = None,
    message: str = "",
) -> Move | None:
    """Moves a replica's job from `old` to `new` within `txn`, iff it is there at that epoch."""
    schedule_transition(old, new)
    params = {"job_id": job_id, "old": old, "at_epoch": epoch, "cid": controller_id, "new": new}
    query = MOVE_ONE
    if wait_reason is not None:
        query, params["reason"] = MOVE_ONE_WITH_REASON, wait_reason
    row = txn.conn.execute(query, params).first()
    if row is None:
        return None
    txn.event(job_id, row[1], row[0], new, message or new.name, epoch)
    move = Move(job_id, controller_id, controller_id, epoch, old, new)
    txn.moves.append(move)
    return move
