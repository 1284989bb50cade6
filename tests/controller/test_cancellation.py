"""Cancellation at every phase of a job (contract §8), against the sim cloud in this process.

Each row starts a job through `run_job`, waits until the job is in the phase
named by the row (waiting for a grant, launching, backing off, running,
recovering, cleaning up), requests the cancel, and asserts:
- the job ended, cleanup included, although what it was waiting for would never
  have come (a grant never given, a launch or a relaunch that never finishes, an
  hour's backoff, a task that runs for ever): the cancel interrupted the wait;
- from the cancel to the end the lifecycle slept on no timer: nothing stood
  between the request and the CANCELLED report but the cleanup itself;
- the exact statuses: the task in flight went CANCELLING then CANCELLED, tasks
  that never ran went straight to CANCELLED, finished tasks kept their status;
- the sim cloud's inventory shows every cluster of the job terminated.

How long a cancel takes (contract §15: p99 <= 1 s) is measured by
`bench/cancel.py`, on the whole system.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from harness.lifecycle_harness import (
    DEADLINE,
    REGIONS,
    BlockingTerminate,
    Hooks,
    Host,
    LongFirstRun,
    RunningJob,
    World,
    fast_config,
    layer,
    make_job,
    prelaunch,
    start_job,
)
from harness.waiting import reached, wait_for
from services.backends import Backend, cluster_name
from services.common.statuses import JobStatus

S = JobStatus
STARTING, RUNNING, RECOVERING = S.STARTING, S.RUNNING, S.RECOVERING
CANCELLING, CANCELLED, SUCCEEDED = S.CANCELLING, S.CANCELLED, S.SUCCEEDED
STOPPED = (CANCELLING, CANCELLED)
SPOT = "resources:\n  use_spot: true\n"
# A sim second is 1 ms: a million of them is a launch that never finishes within the test.
FOREVER = 1e6


@pytest.fixture
async def world() -> AsyncIterator[World]:
    opened = await World.open()
    try:
        yield opened
    finally:
        await opened.close()


# --- reaching a phase ---------------------------------------------------------------------------


async def slot_requested(job: RunningJob) -> None:
    await reached(job.host.slot.waiting.wait(), what="the launch slot to be requested")


async def launch_in_flight(job: RunningJob, clusters: int = 1) -> None:
    """The cloud holds the job's `clusters`-th cluster, still provisioning."""

    async def provisioning() -> bool:
        inventory = await job.world.inventory(job.job_id)
        return len(inventory) == clusters and not inventory[-1].HasField("up_time")

    await wait_for(provisioning, what=f"cluster {clusters} to be provisioning", every=0.005)


async def relaunch_in_flight(job: RunningJob) -> None:
    await launch_in_flight(job, clusters=2)


async def backing_off(job: RunningJob) -> None:
    async def released() -> bool:
        return any(r.startswith("backing off") for r in job.host.slot.releases)

    await wait_for(released, what="a backoff", every=0.005)


async def watching(job: RunningJob) -> None:
    await reached(job.host.watching.wait(), what="the watch to wait for news")


async def cleanup_holding(job: RunningJob) -> None:
    blocker = layer(job.host.recorder, BlockingTerminate)
    await reached(blocker.entered.wait(), what="a teardown to be under way")


async def slow_launches(world: World) -> None:
    await world.inject(launch_latency_seconds=FOREVER)


async def no_spot_anywhere(world: World) -> None:
    for region in REGIONS:
        await world.set_spot_capacity(region, 0)


async def preempt_with_slow_relaunch(world: World, host: Host) -> None:
    await world.inject(launch_latency_seconds=FOREVER)
    await world.preempt(cluster_name(host.job_id, 0))


def blocking_after(passes: int) -> Callable[[Backend], Backend]:
    return lambda backend: BlockingTerminate(backend, passes)


# --- the table ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
    id: str
    spec: str
    reached: Callable[[RunningJob], Awaitable[None]]
    # Per task: the statuses it reported, in order.
    statuses: tuple[tuple[JobStatus, ...], ...]
    # Clusters the job launched (all must be terminated at the end).
    clusters: int
    grant: bool = True
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    wrap: tuple[Callable[[Backend], Backend], ...] = ()
    hooks: Hooks = dataclasses.field(default_factory=Hooks)
    before: Callable[[World], Awaitable[None]] | None = None
    # Cancels requested; the later ones arrive while the cleanup holds (idempotence).
    cancels: int = 1


CHAIN = "name: chain\n---\nname: prep\n---\nname: train\nrun: t\n---\nname: eval\nrun: e\n"
PHASES = [
    Phase(
        "waiting-for-a-grant",
        CHAIN,
        slot_requested,
        ((STARTING, SUCCEEDED), (STARTING, *STOPPED), (CANCELLED,)),
        clusters=0,
        grant=False,
    ),
    Phase(
        "launching",
        f"name: slow\nrun: train\n{SPOT}",
        launch_in_flight,
        ((STARTING, *STOPPED),),
        clusters=1,
        before=slow_launches,
    ),
    Phase(
        "backing-off",
        f"name: full\nrun: train\n{SPOT}",
        backing_off,
        ((STARTING, *STOPPED),),
        clusters=0,
        config={"backoff_initial": 3600.0, "backoff_max": 3600.0},
        before=no_spot_anywhere,
    ),
    Phase(
        "running",
        f"name: long\nrun: train\n{SPOT}",
        watching,
        ((STARTING, RUNNING, *STOPPED),),
        clusters=1,
        wrap=(LongFirstRun,),
    ),
    Phase(
        "recovering",
        f"name: spot\nrun: train\n{SPOT}",
        relaunch_in_flight,
        ((STARTING, RUNNING, RECOVERING, *STOPPED),),
        clusters=2,
        wrap=(LongFirstRun,),
        hooks=Hooks(at_watch=preempt_with_slow_relaunch),
    ),
    Phase(
        "cleaning-up-a-cancel",
        f"name: twice\nrun: train\n{SPOT}",
        watching,
        ((STARTING, RUNNING, *STOPPED),),
        clusters=1,
        wrap=(LongFirstRun, blocking_after(0)),
        cancels=2,
    ),
    Phase(
        "cleaning-up-after-a-failure",
        "name: fails\n---\nname: a\nrun: a\nsim: {exit_code: 1}\n---\nname: b\nrun: b\n",
        cleanup_holding,
        ((STARTING, RUNNING, S.FAILED), (CANCELLED,)),
        clusters=1,
        # The teardown of the failed cluster holds: the cancel lands while it is under way,
        # and the cleanup tears the cluster down (it was not verified gone yet).
        wrap=(blocking_after(0),),
    ),
]


@pytest.mark.parametrize("phase", PHASES, ids=[p.id for p in PHASES])
async def test_a_cancel_interrupts_every_phase_at_once(world: World, phase: Phase) -> None:
    job_id = world.next_job_id()
    wrap = None
    if phase.wrap:
        layers = phase.wrap

        def wrap(backend: Backend) -> Backend:
            for one in reversed(layers):
                backend = one(backend)
            return backend

    running = await start_job(
        world,
        make_job(phase.spec, job_id),
        config=fast_config(**phase.config),
        wrap=wrap,
        grant=phase.grant,
        hooks=phase.hooks,
        before=phase.before,
    )
    try:
        await phase.reached(running)
        running.request_cancel()
        with contextlib.suppress(LookupError):
            # Hold the cleanup, request the later cancels meanwhile, then let it go on.
            blocker = layer(running.host.recorder, BlockingTerminate)
            await reached(blocker.entered.wait(), what="the cleanup's teardown")
            for _ in range(phase.cancels - 1):
                running.request_cancel()
            blocker.release.set()
        await running.finished(timeout=DEADLINE)
    finally:
        await running.stop()
    host = running.host
    after = host.timeline[host.timeline.index(("cancel",)) :]
    assert not [step for step in after if step[0] == "slept"], after
    statuses = [tuple(host.statuses(task_id)) for task_id in range(len(phase.statuses))]
    assert statuses == list(phase.statuses)
    assert ("report", str(len(phase.statuses) - 1), "CANCELLED") in after, after
    assert not host.slot.held
    inventory = await world.inventory(job_id)
    assert len(inventory) == phase.clusters
    assert all(c.HasField("terminate_time") for c in inventory), inventory


async def test_cancel_before_start_cancels_every_task_at_once(world: World) -> None:
    running = await start_job(world, make_job(CHAIN, 1, cancel_requested=True))
    await running.finished()
    assert [running.host.statuses(t) for t in range(3)] == [[CANCELLED]] * 3
    assert running.host.recorder.launches == []
    assert await world.inventory(1) == []


async def test_a_job_left_cancelling_by_a_dead_replica_is_cleaned_up_then_cancelled(
    world: World,
) -> None:
    # The previous holder had reported CANCELLING, then died before the cleanup.
    region = await prelaunch(world, 1, 0, {"runtime_seconds": FOREVER})
    job = make_job(f"name: orphan\nrun: train\n{SPOT}", 1, prior=(CANCELLING,), regions={0: region})
    running = await start_job(world, job, epoch=2)
    await running.finished()
    assert running.host.statuses(0) == [CANCELLED]
    assert running.host.recorder.launches == []
    [cluster] = await world.inventory(1)
    assert cluster.HasField("terminate_time")
