"""Epoch fencing of the local backend across replicas sharing one clusters root."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harness.local_clusters import (
    processes_with,
    remove_all,
    request,
    sleeps_running,
    unique_sleep,
    wait_end,
    wait_for,
)
from services.backends import ClusterStatus, StaleEpochError, TaskStatus
from services.backends.local.backend import LocalBackend
from services.backends.local.cluster import is_supervisor

Replicas = tuple[LocalBackend, LocalBackend]


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    """Two backends on one root, as two controller replicas of one host have."""
    root = tmp_path / "clusters"
    first = LocalBackend(root, workdir_roots=[tmp_path])
    second = LocalBackend(root, workdir_roots=[tmp_path])
    try:
        yield first, second
    finally:
        await remove_all(first)


async def test_a_stale_launch_is_refused_and_changes_nothing(replicas: Replicas) -> None:
    holder, stale = replicas
    sleep, marker = unique_sleep()
    handle = await holder.launch(request("mj-1-0", epoch=2, run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="the holder's task")

    with pytest.raises(StaleEpochError, match="epoch 2"):
        await stale.launch(request("mj-1-0", epoch=1, run="echo stale"))
    # Another task of the same job is fenced as well: the epoch is the job's.
    with pytest.raises(StaleEpochError):
        await stale.launch(request("mj-1-1", task_id=1, epoch=1, run="echo stale"))

    assert (await stale.observe(handle)).cluster is ClusterStatus.UP
    assert stale.handle_for("mj-1-0").data["pid"] == handle.data["pid"]
    assert await sleeps_running(marker)
    assert not await stale.cluster_exists("mj-1-1")


async def test_a_stale_terminate_is_refused_but_an_operator_cleanup_is_not(
    replicas: Replicas,
) -> None:
    holder, other = replicas
    sleep, marker = unique_sleep()
    await holder.launch(request("mj-1-0", epoch=2, run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="the holder's task")
    handle = other.handle_for("mj-1-0")

    with pytest.raises(StaleEpochError):
        await other.terminate(handle, epoch=1)
    assert (await other.observe(handle)).cluster is ClusterStatus.UP
    assert await sleeps_running(marker)

    await other.terminate(handle, epoch=0)
    assert not await holder.cluster_exists("mj-1-0")
    assert not processes_with(marker)


async def test_a_terminate_by_a_newer_epoch_fences_the_older_one(replicas: Replicas) -> None:
    old, new = replicas
    await old.launch(request("mj-1-0", epoch=2, run="true"))

    await new.terminate(new.handle_for("mj-1-0"), epoch=3)

    with pytest.raises(StaleEpochError, match="epoch 3"):
        await old.launch(request("mj-1-0", epoch=2, run="true"))
    assert not await old.cluster_exists("mj-1-0")


async def test_a_relaunch_by_the_current_or_a_newer_epoch_replaces_the_cluster(
    replicas: Replicas,
) -> None:
    first, second = replicas
    sleep, marker = unique_sleep()
    old = await first.launch(request("mj-1-0", epoch=2, run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="the first attempt's task")

    again = await second.launch(request("mj-1-0", epoch=2, run="echo again"))
    assert again.data["pid"] != old.data["pid"]
    assert not processes_with(marker)
    await wait_end(second, again)
    assert await second.read_logs(again) == b"again\n"

    newer = await first.launch(request("mj-1-0", epoch=3, run="echo newer"))
    assert newer.data["pid"] != again.data["pid"]
    await wait_end(first, newer)
    assert await first.read_logs(newer) == b"newer\n"


async def test_concurrent_launches_of_one_attempt_start_one_supervisor(
    replicas: Replicas,
) -> None:
    first, second = replicas
    sleep, marker = unique_sleep()
    attempt = request("mj-1-0", epoch=2, run=f"echo once; {sleep}")

    handles = await asyncio.gather(first.launch(attempt), second.launch(attempt))

    assert handles[0].data["pid"] == handles[1].data["pid"]
    await wait_for(lambda: sleeps_running(marker), what="the task")
    cluster_dir = first.layout("mj-1-0").dir
    started = [p for p in processes_with(str(cluster_dir)) if is_supervisor(p, cluster_dir)]
    # The supervisor and its guardian (a fork of it) carry the folder on their command line.
    assert len(started) == 2 and handles[0].data["pid"] in {p.pid for p in started}
    assert await first.read_logs(handles[0]) == b"once\n"


async def test_concurrent_launches_by_two_epochs_leave_the_newer_one(
    replicas: Replicas,
) -> None:
    first, second = replicas
    results = await asyncio.gather(
        first.launch(request("mj-1-0", epoch=2, run="echo old")),
        second.launch(request("mj-1-0", epoch=3, run="echo new")),
        return_exceptions=True,
    )

    # Whichever ran first, the newer epoch's cluster is the one that remains.
    assert not isinstance(results[1], BaseException)
    assert isinstance(results[0], StaleEpochError) or not isinstance(results[0], BaseException)
    seen = await wait_end(second, second.handle_for("mj-1-0"))
    assert seen.end is not None and seen.end.status is TaskStatus.SUCCEEDED
    assert await second.read_logs(second.handle_for("mj-1-0")) == b"new\n"


async def test_a_stale_preemption_notice_is_refused(replicas: Replicas) -> None:
    holder, stale = replicas
    sleep, marker = unique_sleep()
    handle = await holder.launch(request("mj-1-0", epoch=2, run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="the task")

    with pytest.raises(StaleEpochError):
        await stale.notify_preemption(handle, epoch=1, deadline=time.time() + 30)

    assert not holder.layout("mj-1-0").notice_file.exists()
    assert await sleeps_running(marker)
