"""Submission intake: concurrent SubmitJob calls share one transaction (group commit).

A submission that finds the intake idle commits its own jobs at once, in its own
task: no hand-off to another task stands between the call and its transaction, so
nothing else ready on the event loop (a batch of reports, say) runs first and
takes the writer. Calls that arrive while a commit is in flight queue and wait;
when it ends, one worker commits whatever has queued, up to `max_batch` at a
time, and keeps on while more arrives. The store's move hook counts the new jobs
and kicks admission once they committed.
"""

from __future__ import annotations

import asyncio

from services.scheduler.store import NewJob, Store


class Intake:
    def __init__(self, store: Store, max_batch: int = 512) -> None:
        self._store = store
        self._max_batch = max_batch
        self._pending: list[tuple[NewJob, asyncio.Future[tuple[int, bool]]]] = []
        # A commit is in flight (a caller's own, or the worker's): new calls queue.
        self._busy = False
        # Never read: held so the event loop's weak reference is not the worker's only one.
        self._worker: asyncio.Task[None] | None = None

    def gathering(self) -> bool:
        """Whether submissions are queued behind the commit in flight."""
        return bool(self._pending)

    async def submit(self, job: NewJob) -> tuple[int, bool]:
        """Stores one job (with whatever else is queued); (job_id, created)."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: list[NewJob]) -> list[tuple[int, bool]]:
        """Stores jobs, in order, in as few transactions as the batch size allows."""
        if not self._busy:
            self._busy = True
            try:
                answers: list[tuple[int, bool]] = []
                for start in range(0, len(jobs), self._max_batch):
                    batch = jobs[start : start + self._max_batch]
                    answers += await self._store.submit_many(batch)
                return answers
            finally:
                self._hand_on()
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[tuple[int, bool]]] = []
        for job in jobs:
            future: asyncio.Future[tuple[int, bool]] = loop.create_future()
            self._pending.append((job, future))
            futures.append(future)
        return [await future for future in futures]

    def _hand_on(self) -> None:
        """A commit ended: the worker takes what queued meanwhile, or the intake is idle."""
        if self._pending:
            self._worker = asyncio.create_task(self._drain(), name="intake")
        else:
            self._busy = False

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                try:
                    answers = await self._store.submit_many([job for job, _ in batch])
                except Exception as error:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), answer in zip(batch, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
        finally:
            self._busy = False
