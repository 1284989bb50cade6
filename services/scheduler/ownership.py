"""Which jobs a user owns, for filtering a user's unfiltered WatchJobs stream (contract §14).

Live events carry a job id, not the job's owner, so a watch that must show a user
only their own jobs asks the store once per job id it has not seen yet and
remembers the answer; a job's owner never changes. The backlog is filtered in
the query itself. The memory is bounded: past `MAX_KNOWN` ids it starts afresh.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler import queries
from services.scheduler.store import Store

MAX_KNOWN = 100_000


class OwnedJobs:
    """The jobs of `user`, learned from the store as their ids come by."""

    def __init__(self, store: Store, user: str) -> None:
        self._store = store
        self.user = user
        self._known: dict[int, bool] = {}

    async def learn(self, job_ids: Iterable[int]) -> None:
        """Looks up, in one query, the owners of the ids not known yet."""
        unknown = {job_id for job_id in job_ids if job_id not in self._known}
        if not unknown:
            return
        if len(self._known) + len(unknown) > MAX_KNOWN:
            self._known.clear()
        owners = await self._store.read(queries.job_owners, unknown)
        for job_id in unknown:
            self._known[job_id] = owners.get(job_id) == self.user

    async def owns(self, job_id: int) -> bool:
        """Whether the job is the user's."""
        if job_id not in self._known:
            await self.learn([job_id])
        return self._known.get(job_id, False)
