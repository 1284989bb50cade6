"""Which replica holds a job: the check behind the logs RPCs only replicas call (contract §14).

A controller may fetch a task's logs and append lifecycle lines only for jobs
assigned to it at the epoch it gives. The scheduler is the one that knows (GetJob's
`controller_id` and `epoch`); asking it for every batch of lifecycle lines would cost
one GetJob per job per batch, so its answers are kept for a short while:

- a claim (job, controller, epoch) matching an answer younger than `ttl` is accepted
  without asking;
- a claim with an epoch older than the one last seen is refused without asking, since
  a job's epoch only ever grows;
- anything else (no answer yet, an old one, a newer epoch, another controller) asks
  the scheduler again and judges by its fresh answer.

So a replica that lost a job can go on appending for at most `ttl` seconds after the
move, and only until the job's new holder first calls. Jobs that do not exist are
never remembered (a later submission may create them). The cache is bounded
(least recently used answers go first), and the jobs a batch of claims must ask
about are asked about together: one ListJobs call per 1,000 jobs.

Under `--auth none` every caller is an anonymous admin and only the existence of the
job is checked.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable

from managedjobs.v1 import job_pb2
from services.common.errors import ApiError, NotFound, PermissionDenied, Unavailable
from services.common.security.access import require_controller
from services.common.security.auth import Principal, Role
from services.logs.directory import JobDirectory


@dataclasses.dataclass(frozen=True)
class Holding:
    """What the scheduler said of a job: who holds it, at which epoch, how many tasks."""

    controller_id: str
    epoch: int
    tasks: int
    seen: float

    @classmethod
    def of(cls, job: job_pb2.Job, now: float) -> Holding:
        return cls(job.controller_id, job.epoch, len(job.tasks), now)


def not_found(job_id: int) -> NotFound:
    return NotFound(f"job {job_id} not found", reason="JOB_NOT_FOUND", job_id=str(job_id))


def not_held(job_id: int, epoch: int, holding: Holding) -> PermissionDenied:
    holder = (
        f"held by {holding.controller_id!r} at epoch {holding.epoch}"
        if holding.controller_id
        else "not assigned to any replica"
    )
    return PermissionDenied(
        f"job {job_id} is not yours at epoch {epoch}: it is {holder}",
        reason="JOB_NOT_HELD",
        job_id=str(job_id),
    )


class Holders:
    """Checks replicas' claims on jobs against the scheduler, with a short-lived cache."""

    def __init__(
        self,
        directory: JobDirectory,
        *,
        ttl: float = 5.0,
        max_entries: int = 100_000,
        concurrency: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._directory = directory
        self._ttl = ttl
        self._max_entries = max_entries
        self._limit = asyncio.Semaphore(concurrency)
        self._clock = clock
        self._known: collections.OrderedDict[int, Holding] = collections.OrderedDict()

    async def check(self, principal: Principal, job_id: int, epoch: int) -> Holding:
        """The job, if the caller holds it at `epoch`.

        Raises:
            NotFound: the job does not exist (reason JOB_NOT_FOUND).
            PermissionDenied: the caller does not hold it at `epoch` (JOB_NOT_HELD), or
                its token or certificate is not a controller's (CONTROLLER_MISMATCH).
            Unavailable: the scheduler cannot be reached.
        """
        cached = self._from_cache(principal, job_id, epoch)
        if isinstance(cached, Holding):
            return cached
        if cached is not None:
            raise cached
        holding = await self._ask(job_id)
        refusal = self._judge(principal, job_id, epoch, holding)
        if refusal is not None:
            raise refusal
        return holding

    async def prefetch(self, job_ids: Iterable[int]) -> None:
        """Asks the scheduler, in one go, about those of `job_ids` the cache has no fresh
        answer for, so that checking each of a batch's claims alone asks nothing more.
        An unreachable scheduler is left for each check to meet on its own."""
        stale = [
            job_id
            for job_id in dict.fromkeys(job_ids)
            if job_id > 0 and not self._fresh(self._known.get(job_id))
        ]
        if stale:
            with contextlib.suppress(Unavailable):
                await self._ask_many(stale)

    async def check_many(
        self, principal: Principal, claims: Iterable[tuple[int, int]]
    ) -> dict[tuple[int, int], ApiError | None]:
        """Each (job_id, epoch) claim's refusal, or None when it holds; the claims the
        cache cannot judge are asked about in one go.

        Raises:
            Unavailable: the scheduler cannot be reached.
        """
        wanted = list(dict.fromkeys(claims))
        answers: dict[tuple[int, int], ApiError | None] = {}
        unsure: list[tuple[int, int]] = []
        for job_id, epoch in wanted:
            cached = self._from_cache(principal, job_id, epoch)
            if cached is None:
                unsure.append((job_id, epoch))
            else:
                answers[(job_id, epoch)] = None if isinstance(cached, Holding) else cached
        if unsure:
            holdings = await self._ask_many([job_id for job_id, _ in unsure])
            for job_id, epoch in unsure:
                holding = holdings.get(job_id)
                answers[(job_id, epoch)] = (
                    not_found(job_id)
                    if holding is None
                    else self._judge(principal, job_id, epoch, holding)
                )
        return {claim: answers[claim] for claim in wanted}

    def _from_cache(
        self, principal: Principal, job_id: int, epoch: int
    ) -> Holding | PermissionDenied | None:
        """Judges a claim by the cache alone: the fresh answer that accepts it, the
        refusal of an epoch older than the one last seen, or None: ask the scheduler."""
        known = self._known.get(job_id)
        if known is None:
            return None
        self._known.move_to_end(job_id)
        if self._fresh(known) and self._judge(principal, job_id, epoch, known) is None:
            return known
        if _claims(principal) and known.epoch > epoch:
            return not_held(job_id, epoch, known)
        return None

    def _fresh(self, known: Holding | None) -> bool:
        """An answer younger than the cache's life."""
        return known is not None and self._clock() - known.seen < self._ttl

    def _judge(
        self, principal: Principal, job_id: int, epoch: int, holding: Holding
    ) -> ApiError | None:
        if not _claims(principal):
            return None
        if holding.controller_id and holding.epoch == epoch:
            try:
                require_controller(principal, holding.controller_id)
            except PermissionDenied:
                return not_held(job_id, epoch, holding)
            return None
        return not_held(job_id, epoch, holding)

    async def _ask(self, job_id: int) -> Holding:
        async with self._limit:
            job = await self._directory.get_job(job_id)
        if job is None:
            self._known.pop(job_id, None)
            raise not_found(job_id)
        return self._remember(job)

    async def _ask_many(self, job_ids: list[int]) -> dict[int, Holding]:
        """What the scheduler says of each of `job_ids` it knows, asked all at once."""
        async with self._limit:
            jobs = await self._directory.get_jobs(job_ids)
        for job_id in job_ids:
            if job_id not in jobs:
                self._known.pop(job_id, None)
        return {job_id: self._remember(job) for job_id, job in jobs.items()}

    def _remember(self, job: job_pb2.Job) -> Holding:
        holding = Holding.of(job, self._clock())
        self._known[job.job_id] = holding
        self._known.move_to_end(job.job_id)
        while len(self._known) > self._max_entries:
            self._known.popitem(last=False)
        return holding


def _claims(principal: Principal) -> bool:
    """Whether the caller's claim on a job is checked: everyone but `--auth none`'s admin."""
    return not (principal.role is Role.ADMIN and not principal.user)
