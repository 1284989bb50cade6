"""Submission intake (services/scheduler/intake.py): a lone submission commits in its own
task; calls made meanwhile go next, together, each whole and answered with its own ids;
one call's failure fails that call alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.scheduler.db import OutcomeUnknown
from services.scheduler.intake import Intake
from services.scheduler.submissions import NewJob


def job(name: str) -> NewJob:
    return NewJob(name=name, user="u", priority=0, pool="", idempotency_key="", tasks=[])


class FakeStore:
    """Records each commit (its jobs' names and the task it ran in); commits can be held;
    a batch holding a job named "down" fails whole, and one holding "unsure" fails in
    its COMMIT (outcome unknown)."""

    def __init__(self) -> None:
        self.commits: list[tuple[list[str], asyncio.Task[object] | None]] = []
        self.hold: asyncio.Event | None = None
        self.next_id = 0

    async def submit_many(self, jobs: Sequence[NewJob]) -> list[tuple[int, bool]]:
        self.commits.append(([j.name for j in jobs], asyncio.current_task()))
        if self.hold is not None:
            await self.hold.wait()
        if any(j.name == "down" for j in jobs):
            raise ConnectionError("the database is away")
        if any(j.name == "unsure" for j in jobs):
            raise OutcomeUnknown("the database failed during COMMIT")
        answers = []
        for _ in jobs:
            self.next_id += 1
            answers.append((self.next_id, True))
        return answers


def intake_over(store: FakeStore, max_batch: int = 512) -> Intake:
    return Intake(store, max_batch)  # type: ignore[arg-type]


async def test_a_lone_submission_commits_in_the_callers_own_task() -> None:
    store = FakeStore()
    intake = intake_over(store)

    async def caller() -> tuple[tuple[int, bool], asyncio.Task[object] | None]:
        return await intake.submit(job("a")), asyncio.current_task()

    answer, task = await asyncio.create_task(caller())
    assert answer == (1, True)
    assert store.commits == [(["a"], task)]


async def test_calls_made_during_a_commit_go_next_as_one_batch_each_with_its_own_id() -> None:
    store = FakeStore()
    store.hold = asyncio.Event()
    intake = intake_over(store)
    first = asyncio.create_task(intake.submit(job("a")))
    await asyncio.sleep(0)
    later = [asyncio.create_task(intake.submit(job(name))) for name in ("b", "c")]
    many = asyncio.create_task(intake.submit_many([job("d"), job("e")]))
    await asyncio.sleep(0)
    assert [names for names, _ in store.commits] == [["a"]]  # the others wait for it
    store.hold.set()
    assert await first == (1, True)
    assert [await t for t in later] == [(2, True), (3, True)]
    assert await many == [(4, True), (5, True)]
    assert [names for names, _ in store.commits] == [["a"], ["b", "c", "d", "e"]]
    # The queued batch went in a task of its own, not in any caller's.
    assert store.commits[1][1] not in (first, *later, many)


async def test_the_worker_batches_whole_calls_within_the_limit_and_the_intake_goes_idle() -> None:
    store = FakeStore()
    store.hold = asyncio.Event()
    intake = intake_over(store, max_batch=2)
    first = asyncio.create_task(intake.submit(job("a")))
    await asyncio.sleep(0)
    calls = [
        asyncio.create_task(intake.submit_many([job(n) for n in names]))
        for names in ("bc", "de", "f", "ghi")
    ]
    await asyncio.sleep(0)
    store.hold.set()
    await first
    answers = [await call for call in calls]
    assert [[job_id for job_id, _ in answer] for answer in answers] == [
        [2, 3], [4, 5], [6], [7, 8, 9]
    ]  # fmt: skip
    # A call is never split, even one larger than the limit.
    assert [names for names, _ in store.commits] == [
        ["a"], ["b", "c"], ["d", "e"], ["f", "g", "h", "i"]
    ] or [names for names, _ in store.commits] == [
        ["a"], ["b", "c"], ["d", "e"], ["f"], ["g", "h", "i"]
    ]  # fmt: skip
    # Idle again: the next lone call commits in its own task.
    assert await intake.submit(job("j")) == (10, True)
    assert store.commits[-1][0] == ["j"]
    assert store.commits[-1][1] is asyncio.current_task()


async def test_a_call_failing_in_a_shared_batch_fails_alone_and_the_others_are_stored() -> None:
    store = FakeStore()
    store.hold = asyncio.Event()
    intake = intake_over(store)
    first = asyncio.create_task(intake.submit(job("a")))
    await asyncio.sleep(0)
    good = asyncio.create_task(intake.submit_many([job("b"), job("c")]))
    bad = asyncio.create_task(intake.submit_many([job("d"), job("down")]))
    other = asyncio.create_task(intake.submit(job("e")))
    await asyncio.sleep(0)
    store.hold.set()
    await first
    results = await asyncio.gather(good, bad, other, return_exceptions=True)
    assert isinstance(results[1], ConnectionError)
    assert results[0] == [(2, True), (3, True)] and results[2] == (4, True)
    # The shared batch failed whole; then each call went alone.
    assert [names for names, _ in store.commits][1:] == [
        ["b", "c", "d", "down", "e"], ["b", "c"], ["d", "down"], ["e"]
    ]  # fmt: skip


async def test_a_shared_batch_whose_outcome_is_unknown_fails_every_call_without_a_retry() -> None:
    store = FakeStore()
    store.hold = asyncio.Event()
    intake = intake_over(store)
    first = asyncio.create_task(intake.submit(job("a")))
    await asyncio.sleep(0)
    calls = [asyncio.create_task(intake.submit(job(n))) for n in ("b", "unsure")]
    await asyncio.sleep(0)
    store.hold.set()
    await first
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, OutcomeUnknown) for r in results)
    assert [names for names, _ in store.commits][1:] == [["b", "unsure"]]


async def held(
    first_name: str,
) -> tuple[asyncio.Event, asyncio.Task[tuple[int, bool]], asyncio.Task[tuple[int, bool]]]:
    """A commit of `first_name` held in flight, and a call ("b") queued behind it."""
    store = FakeStore()
    store.hold = asyncio.Event()
    intake = intake_over(store)
    first = asyncio.create_task(intake.submit(job(first_name)))
    await asyncio.sleep(0)
    queued = asyncio.create_task(intake.submit(job("b")))
    await asyncio.sleep(0)
    return store.hold, first, queued


async def test_a_failed_commit_fails_its_own_callers_and_the_queue_goes_on() -> None:
    hold, first, queued = await held("down")
    hold.set()
    results = await asyncio.gather(first, queued, return_exceptions=True)
    assert isinstance(results[0], ConnectionError)
    assert results[1] == (1, True)


async def test_a_cancelled_caller_still_hands_the_queue_on() -> None:
    hold, first, queued = await held("a")
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    hold.set()
    assert await asyncio.wait_for(queued, 5) == (1, True)
