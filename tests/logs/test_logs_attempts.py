"""Logs per attempt (contract §18): every cluster a task ran on keeps its own log, read
whole or by attempt number, live or stored (`logs_harness`: real gRPC, a scripted
scheduler and in-memory clusters)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from harness.logs_harness import (
    DEADLINE,
    DONE,
    RECOVERING,
    RUNNING,
    SUCCEEDED,
    Follow,
    MemoryBackend,
    System,
    running_system,
)
from managedjobs.v1 import job_pb2
from services.logs import RECOVERED_MARKER, LogStore
from services.logs.reading import read_bytes

C = "mj-1-0"  # every attempt of job 1's task 0 runs on a cluster of this name
FAILED = job_pb2.JOB_STATUS_FAILED


@pytest.fixture
async def system(tmp_path: Path) -> AsyncIterator[System]:
    async with running_system(tmp_path, MemoryBackend()) as running:
        yield running


async def preempt_and_relaunch(system: System, first: bytes, *, fetch: bool = True) -> None:
    """Attempt 1 runs and writes `first`, is preempted (its logs fetched), attempt 2 runs."""
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, first)
    system.scheduler.update(1, status=RECOVERING)
    if fetch:
        await system.fetch(1, 0, attempt=1)  # what the replica does before the teardown
    system.backend.vanish(C)
    system.backend.relaunch(C)
    system.scheduler.update(1, status=RUNNING, recovery_count=1)


async def test_two_attempts_are_stored_apart_and_read_back_by_attempt(system: System) -> None:
    system.scheduler.add(1)
    await preempt_and_relaunch(system, b"first try")
    # Attempt 1 alone is one file: its index is written once a second attempt joins it.
    index_path = system.data_dir / "logs" / "1" / "task-0.sections.json"
    assert (system.data_dir / "logs" / "1" / "task-0.log").read_bytes() == b"first try"
    assert not index_path.exists()
    assert await system.read(job_id=1, attempt=1) == b"first try"
    system.backend.write(C, b"second try\n")
    system.backend.finish(C)
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0, attempt=2)
    system.backend.vanish(C)

    whole = b"first try\n" + RECOVERED_MARKER + b"second try\n"
    assert await system.read(job_id=1) == whole
    assert await system.read(job_id=1, attempt=1) == b"first try"
    assert await system.read(job_id=1, task_id=0, attempt=2) == b"second try\n"
    assert await system.read(job_id=1, attempt=2, tail_lines=1) == b"second try\n"
    assert await Follow(system, job_id=1, attempt=1).to_end() == b"first try"
    assert await Follow(system, job_id=1, attempt=2).to_end() == b"second try\n"
    index = json.loads(index_path.read_text())
    assert [(s["attempt"], s["cluster_name"]) for s in index["sections"]] == [(1, C), (2, C)]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.read(job_id=1, attempt=3)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no attempt 3" in (raised.value.details() or "")


async def test_a_refetch_of_an_attempt_replaces_it_in_place(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"one\n")
    await system.fetch(1, 0, attempt=1)
    system.backend.write(C, b"two\n")
    # Retried (say, the first answer was lost): the copy is replaced, not doubled.
    assert await system.fetch(1, 0, attempt=1) == 8
    assert await system.fetch(1, 0, attempt=1) == 8

    assert (system.data_dir / "logs" / "1" / "task-0.log").read_bytes() == b"one\ntwo\n"
    assert await system.read(job_id=1, attempt=1) == b"one\ntwo\n"


async def test_attempts_stay_in_order_whatever_order_they_were_fetched_in(
    tmp_path: Path,
) -> None:
    store = LogStore(tmp_path)
    await store.save_task_attempt(1, 0, 2, C, b"second\n")
    await store.save_task_attempt(1, 0, 1, C, b"first, short\n")
    await store.save_task_attempt(1, 0, 1, C, b"first\n")  # a retry of attempt 1

    stored = store.task_log(1, 0)
    assert stored is not None
    assert stored.path.read_bytes() == b"first\n" + RECOVERED_MARKER + b"second\n"
    assert [(s.attempt, s.size) for s in stored.sections] == [(1, 6), (2, 7)]
    second = stored.section(2)
    assert second is not None
    assert read_bytes(stored.path, second.offset, second.end) == b"second\n"
    assert stored.section(3) is None and stored.start_of(3) is None


async def test_the_current_attempt_is_read_live_and_earlier_ones_from_the_store(
    system: System,
) -> None:
    system.scheduler.add(1)
    await preempt_and_relaunch(system, b"a1\n")
    system.backend.write(C, b"b1\nb2\n")

    assert await system.read(job_id=1) == b"a1\n" + RECOVERED_MARKER + b"b1\nb2\n"
    assert await system.read(job_id=1, attempt=2) == b"b1\nb2\n"
    assert await system.read(job_id=1, attempt=2, tail_lines=1) == b"b2\n"
    assert await system.read(job_id=1, attempt=1) == b"a1\n"
    # A past attempt is complete: following it ends at once, even while the task runs.
    assert await Follow(system, job_id=1, attempt=1).to_end() == b"a1\n"


async def test_following_one_attempt_ends_with_it_and_sends_nothing_else(
    system: System,
) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"a1\n")
    first = Follow(system, job_id=1, attempt=1)
    await first.until(b"a1\n")
    system.backend.write(C, b"a2\n")
    await first.until(b"a2\n")
    system.backend.write(C, b"a3\n")  # written before the fetch, never tailed maybe
    system.backend.break_tails(C)
    system.scheduler.update(1, status=RECOVERING)
    await system.fetch(1, 0, attempt=1)
    system.backend.vanish(C)
    system.backend.relaunch(C)
    system.scheduler.update(1, status=RUNNING, recovery_count=1)

    assert await first.to_end() == b"a1\na2\na3\n"

    second = Follow(system, job_id=1, attempt=2, tail_lines=1)
    system.backend.write(C, b"b1\nb2\n")
    await second.until(b"b2\n")
    system.backend.write(C, b"b3\n")
    system.backend.finish(C)
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0, attempt=2)
    system.scheduler.update(1, schedule_state=DONE)
    data = await second.to_end()
    assert data.endswith(b"b2\nb3\n") and b"a" not in data and RECOVERED_MARKER not in data


async def test_a_restarted_attempt_waits_for_its_fetch(system: System) -> None:
    """A restart counts itself as soon as it is RECOVERING, before the old attempt's logs
    are fetched: a follower of the old attempt waits for them rather than ending short."""
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"crashed\n")
    system.backend.finish(C)
    follow = Follow(system, job_id=1, attempt=1)
    await follow.until(b"crashed\n")
    answered = system.scheduler.answered
    system.scheduler.update(1, status=RECOVERING, restart_count=1)
    read = asyncio.ensure_future(follow.to_end())
    # The follower re-reads the job after the event: RECOVERING must not end it.
    await asyncio.wait_for(answered.wait(), DEADLINE)
    system.backend.write(C, b"exit 3\n")
    await system.fetch(1, 0, attempt=1)

    assert await read == b"crashed\nexit 3\n"


async def test_a_cancelled_task_keeps_its_attempt_logs(system: System) -> None:
    system.scheduler.add(1)
    await preempt_and_relaunch(system, b"a\n")
    system.backend.write(C, b"b\n")
    system.scheduler.update(1, status=job_pb2.JOB_STATUS_CANCELLING)
    await system.fetch(1, 0, attempt=2)
    system.backend.vanish(C)
    system.scheduler.update(1, status=job_pb2.JOB_STATUS_CANCELLED, schedule_state=DONE)

    assert await system.read(job_id=1, attempt=1) == b"a\n"
    assert await system.read(job_id=1, attempt=2) == b"b\n"
    assert await Follow(system, job_id=1).to_end() == b"a\n" + RECOVERED_MARKER + b"b\n"


async def test_a_past_attempt_never_fetched_is_not_found(system: System) -> None:
    system.scheduler.add(1)
    await preempt_and_relaunch(system, b"lost\n", fetch=False)
    system.backend.write(C, b"b\n")
    system.backend.finish(C)
    system.scheduler.update(1, status=FAILED)
    await system.fetch(1, 0, attempt=2)
    system.scheduler.update(1, schedule_state=DONE)

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.read(job_id=1, attempt=1)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no logs were kept of attempt 1" in (raised.value.details() or "")
    assert await Follow(system, job_id=1, attempt=1).to_end() == b""
    assert await system.read(job_id=1) == b"b\n"
