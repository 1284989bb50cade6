"""Submission intake: concurrent submission calls share one transaction (group commit).

Each call (a SubmitJob, or a SubmitJobs of up to 1,000 jobs) is stored whole or
not at all. A call that finds the intake idle commits its own jobs at once, in
its own task: no hand-off to another task stands between the call and its
transaction. Calls that arrive while a commit is in flight queue; when it ends,
one worker commits the queued calls together, as many whole calls as fit in
`max_batch` jobs (a call is never split), and keeps on while more arrive. The
store's move hook counts the new jobs and kicks admission once they committed.

A shared transaction that fails stored nothing, and its calls are committed
again one by one, so one call's failure (a row the database refuses, a key
another writer took) fails that call alone. A shared transaction whose COMMIT
failed may or may not have happened: each of its calls gets that error, as a
call alone would (a retry with the same idempotency key is safe).
"""

from __future__ import annotations

import asyncio
import dataclasses

from services.scheduler.db import OutcomeUnknown
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob

Answer = tuple[int, bool]


@dataclasses.dataclass
class Call:
    jobs: list[NewJob]
    answer: asyncio.Future[list[Answer]]


class Intake:
    def __init__(self, store: Store, max_batch: int = 512) -> None:
        self._store = store
        self._max_batch = max_batch
        self._pending: list[Call] = []
        # A commit is in flight (a caller's own, or the worker's): new calls queue.
        self._busy = False
        # Never read: held so the event loop's weak reference is not the worker's only one.
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, job: NewJob) -> Answer:
        """Stores one job; (job_id, created)."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: list[NewJob]) -> list[Answer]:
        """Stores the jobs of one call, all of them or none; (job_id, created) each, in order."""
        if not self._busy:
            self._busy = True
            try:
                return await self._store.submit_many(jobs)
            finally:
                self._hand_on()
        call = Call(jobs, asyncio.get_running_loop().create_future())
        self._pending.append(call)
        return await call.answer

    def _hand_on(self) -> None:
        """A commit ended: the worker takes what queued meanwhile, or the intake is idle."""
        if self._pending:
            self._worker = asyncio.create_task(self._drain(), name="intake")
        else:
            self._busy = False

    def _next_batch(self) -> list[Call]:
        """The first queued calls whose jobs fit in `max_batch` (at least one call)."""
        size = 0
        for count, call in enumerate(self._pending):
            size += len(call.jobs)
            if count and size > self._max_batch:
                break
        else:
            count = len(self._pending)
        batch = self._pending[: max(count, 1)]
        del self._pending[: len(batch)]
        return batch

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._next_batch()
                try:
                    answers = await self._store.submit_many([j for c in batch for j in c.jobs])
                except OutcomeUnknown as error:
                    for call in batch:
                        _fail(call, error)
                    continue
                except Exception as error:
                    if len(batch) == 1:
                        _fail(batch[0], error)
                    else:
                        await self._one_by_one(batch)
                    continue
                for call in batch:
                    _answer(call, answers[: len(call.jobs)])
                    del answers[: len(call.jobs)]
        except asyncio.CancelledError:
            for call in self._pending:
                call.answer.cancel()
            self._pending.clear()
            raise
        finally:
            self._busy = False

    async def _one_by_one(self, batch: list[Call]) -> None:
        for call in batch:
            try:
                answers = await self._store.submit_many(call.jobs)
            except Exception as error:
                _fail(call, error)
            else:
                _answer(call, answers)


def _answer(call: Call, answers: list[Answer]) -> None:
    if not call.answer.done():
        call.answer.set_result(answers)


def _fail(call: Call, error: Exception) -> None:
    if not call.answer.done():
        call.answer.set_exception(error)
