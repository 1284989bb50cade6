"""Submission intake: concurrent SubmitJob calls share one transaction (group commit).

Each call queues its job and waits. One worker commits whatever has queued, up
to `max_batch` at a time; while a commit is in flight the next batch gathers.
A lone submission commits at once, so batching adds no latency when idle. The
store's move hook counts the new jobs and kicks admission once they committed.
"""

from __future__ import annotations

import asyncio

from services.scheduler.store import NewJob, Store


class Intake:
    def __init__(self, store: Store, max_batch: int = 512) -> None:
        self._store = store
        self._max_batch = max_batch
        self._pending: list[tuple[NewJob, asyncio.Future[tuple[int, bool]]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, job: NewJob) -> tuple[int, bool]:
        """Stores one job (with whatever else is queued); (job_id, created)."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: list[NewJob]) -> list[tuple[int, bool]]:
        """Stores jobs, in order, in as few transactions as the batch size allows."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[tuple[int, bool]]] = []
        for job in jobs:
            future: asyncio.Future[tuple[int, bool]] = loop.create_future()
            self._pending.append((job, future))
            futures.append(future)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name="intake")
        return list(await asyncio.gather(*futures))

    async def _drain(self) -> None:
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
