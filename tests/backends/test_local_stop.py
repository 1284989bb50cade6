"""How local tasks end: their end outlives the supervisor, terminate gives a grace, and a
preemption notice reaches the ranks without tearing the cluster down (contract §18)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harness.local_clusters import (
    no_process_with,
    open_folder,
    processes_with,
    remove_all,
    request,
    sleeps_running,
    status_file,
    unique_sleep,
    wait_end,
    wait_for,
    wait_logs,
)
from services.backends import ClusterStatus, Observation, TaskEnd, TaskStatus
from services.backends.local.backend import LocalBackend
from services.backends.local.cluster import cluster_processes


@pytest.fixture
async def backend() -> AsyncIterator[LocalBackend]:
    # Ranks reach the notice file by its path, so every folder above it must be open.
    with open_folder(0o711) as data_dir:
        backend = LocalBackend(data_dir / "clusters", workdir_roots=[data_dir])
        try:
            yield backend
        finally:
            await remove_all(backend)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder the task's uid may write and the test may read after teardown."""
    with open_folder(0o1777) as path:
        yield path


@pytest.mark.parametrize(
    ("run", "status", "code"),
    [("echo done", TaskStatus.SUCCEEDED, 0), ("exit 3", TaskStatus.FAILED, 3)],
)
async def test_the_end_of_a_task_is_readable_after_its_supervisor_died(
    backend: LocalBackend, run: str, status: TaskStatus, code: int
) -> None:
    handle = await backend.launch(request("ended", run=run))
    await wait_end(backend, handle)
    end_time = status_file(backend, "ended")["end_time"]

    os.kill(handle.data["pid"], signal.SIGKILL)

    async def down() -> Observation | None:
        seen = await backend.observe(handle)
        return seen if seen.cluster is ClusterStatus.DOWN else None

    seen = await wait_for(down, what="cluster DOWN")
    assert seen == Observation(ClusterStatus.DOWN, None, TaskEnd(status, code, end_time))
    await backend.terminate(handle)
    assert await backend.observe(handle) == Observation(ClusterStatus.DOWN)


async def test_terminate_lets_ranks_that_stop_on_sigterm_exit_within_the_grace(
    backend: LocalBackend, shared: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.backends.local.processes")
    sleep, marker = unique_sleep()
    run = f"trap 'echo checkpointed > {shared}/marker; exit 0' TERM; echo ready; {sleep} & wait"
    handle = await backend.launch(request("graceful", num_nodes=2, run=run))
    await wait_logs(backend, handle, b"(rank=1) ready")
    await wait_for(lambda: sleeps_running(marker, 2), what="both ranks' sleeps")
    cluster_dir = backend.layout("graceful").dir

    await backend.terminate(handle, grace=2.0)

    assert (shared / "marker").read_text() == "checkpointed\n"
    assert "outlived" not in caplog.text, "every rank exited before the grace ran out"
    assert not processes_with(marker) and not cluster_processes(cluster_dir)
    assert not await backend.cluster_exists("graceful")


async def test_terminate_kills_ranks_that_ignore_sigterm_once_the_grace_ran_out(
    backend: LocalBackend, shared: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.backends.local.processes")
    sleep, marker = unique_sleep()
    said = shared / "marker"
    # Past SIGTERM the rank waits for the test's go, says it still runs, and runs on.
    run = (
        f"trap 'echo ignored >> {said}' TERM; echo ready\n"
        f"until [ -e {shared}/go ]; do sleep 0.02; done\n"
        f"echo running after SIGTERM >> {said}\n"
        f"while :; do {sleep}; done\n"
    )
    handle = await backend.launch(request("stubborn", run=run))
    await wait_logs(backend, handle, b"ready")
    cluster_dir = backend.layout("stubborn").dir

    async def saying(text: str) -> bool:
        return said.exists() and said.read_text() == text

    stopping = asyncio.create_task(backend.terminate(handle, grace=2.0))
    await wait_for(lambda: saying("ignored\n"), what="SIGTERM to reach the rank")
    (shared / "go").touch()
    await wait_for(lambda: saying("ignored\nrunning after SIGTERM\n"), what="the rank to run on")
    await wait_for(lambda: sleeps_running(marker), what="the rank's sleep after SIGTERM")
    assert not stopping.done(), "terminate ended while the grace still ran"
    await stopping

    assert "ranks outlived the 2.0s grace; sent SIGKILL" in caplog.text
    assert not processes_with(marker) and not cluster_processes(cluster_dir)
    assert not await backend.cluster_exists("stubborn")


@pytest.mark.parametrize(
    ("trap", "grace"),
    [("echo checkpointed; exit 0", 5.0), ("echo ignored", 0.5)],
    ids=["exits-on-sigterm", "killed-after-the-grace"],
)
async def test_stop_ends_every_rank_and_keeps_what_they_wrote_until_terminate(
    backend: LocalBackend, trap: str, grace: float
) -> None:
    sleep, marker = unique_sleep()
    run = f"trap '{trap}' TERM; echo ready; while :; do {sleep}; done"
    handle = await backend.launch(request("stopped", num_nodes=2, run=run))
    await wait_logs(backend, handle, b"(rank=1) ready")
    await wait_for(lambda: sleeps_running(marker, 2), what="both ranks' sleeps")
    cluster_dir = backend.layout("stopped").dir

    await backend.stop(handle, epoch=0, grace=grace)

    assert not processes_with(marker) and not cluster_processes(cluster_dir)
    said = trap.split(";")[0].removeprefix("echo ")
    logs = await backend.read_logs(handle)
    assert logs.count(f"{said}\n".encode()) == 2, logs  # each rank's last words
    assert await backend.cluster_exists("stopped")
    await backend.terminate(handle)
    assert not await backend.cluster_exists("stopped")


async def test_a_preemption_notice_reaches_every_rank_and_the_cluster_stays_up(
    backend: LocalBackend,
) -> None:
    sleep, marker = unique_sleep()
    run = (
        "trap 'cp \"$MJ_PREEMPTION_NOTICE_FILE\" notice-$MJ_NODE_RANK' TERM; "
        f"echo ready; while :; do {sleep}; done"
    )
    handle = await backend.launch(request("noticed", num_nodes=2, run=run))
    await wait_logs(backend, handle, b"(rank=1) ready")
    await wait_for(lambda: sleeps_running(marker, 2), what="both ranks' sleeps")
    deadline = time.time() + 120.5
    workdir = backend.layout("noticed").workdir

    await backend.notify_preemption(handle, epoch=0, deadline=deadline)

    async def seen_by_both() -> bool:
        return all((workdir / f"notice-{rank}").exists() for rank in (0, 1))

    await wait_for(seen_by_both, what="both ranks' traps")
    for rank in (0, 1):
        assert float((workdir / f"notice-{rank}").read_text()) == deadline
    assert float(backend.layout("noticed").notice_file.read_text()) == deadline
    seen = await backend.observe(handle)
    assert seen == Observation(ClusterStatus.UP, TaskStatus.RUNNING)
    await wait_for(lambda: sleeps_running(marker, 2), what="the ranks going on")


async def test_a_preemption_notice_to_a_missing_cluster_does_nothing(
    backend: LocalBackend,
) -> None:
    await backend.notify_preemption(backend.handle_for("gone"), epoch=1, deadline=time.time())
    assert not await backend.cluster_exists("gone")


async def test_terminate_of_a_preempted_cluster_removes_what_is_left(
    backend: LocalBackend,
) -> None:
    sleep, marker = unique_sleep()
    handle = await backend.launch(request("preempted", run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="the sleep")
    os.kill(handle.data["pid"], signal.SIGKILL)
    await wait_for(lambda: no_process_with(marker), what="the ranks dying with it")

    # The grace is for live ranks: nothing is left to wait for.
    await asyncio.wait_for(backend.terminate(handle, grace=60.0), timeout=30.0)

    assert not await backend.cluster_exists("preempted")
