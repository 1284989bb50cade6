"""The recovery policy beyond SkyPilot (contract §18), one row per rule, against the sim cloud.

Each row runs a job through `run_job` in this process (harness/lifecycle_harness.py)
and checks the statuses it reported, its counts, its failure reason and what the
sim cloud's inventory says about its clusters (spot or on-demand, SIGTERM before
the end). Durations in specs are real seconds, kept small.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from harness.lifecycle_harness import (
    REGIONS,
    FirstRunExits,
    Hooks,
    Host,
    LongFirstRun,
    World,
    fast_config,
    make_job,
    start_job,
)
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from services.backends import Backend, LaunchPlan, cluster_name
from services.common.statuses import JobStatus

S = JobStatus
SPOT = "resources:\n  use_spot: true\n"


@pytest.fixture
async def world() -> AsyncIterator[World]:
    opened = await World.open()
    try:
        yield opened
    finally:
        await opened.close()


def preempt_each_running(times: int) -> Callable[[World, Host], Awaitable[None]]:
    """Preempts the task's cluster as soon as it runs, `times` times."""
    done = [0]

    async def preempt(world: World, host: Host) -> None:
        if done[0] < times:
            done[0] += 1
            await world.preempt(cluster_name(host.job_id, 0))

    return preempt


async def unreachable_for(seconds: float, world: World, host: Host) -> None:
    await world.inject(unreachable_seconds=seconds * 1000)  # the harness runs 1,000x


async def no_spot_anywhere(world: World) -> None:
    for region in REGIONS:
        await world.set_spot_capacity(region, 0)


def recovery(policy: str) -> str:
    return f"resources:\n  use_spot: true\n  job_recovery: {policy}\n"


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    spec: str
    statuses: tuple[JobStatus, ...]
    # (recovery_count, restart_count) as last reported.
    counts: tuple[int, int] = (0, 0)
    failure: str = ""
    hooks: Hooks = dataclasses.field(default_factory=Hooks)
    wrap: Callable[[Backend], Backend] | None = None
    before: Callable[[World], Awaitable[None]] | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Per cluster launched, in order: spot or not.
    spot: tuple[bool, ...] = ()
    notes: tuple[str, ...] = ()


RECOVERED = (S.STARTING, S.RUNNING, S.RECOVERING, S.RUNNING, S.SUCCEEDED)
ROWS = [
    Row(
        "exit-code-to-recover-is-recovered-without-a-restart",
        "name: j\nrun: train\n"
        + recovery("{max_restarts_on_errors: 2, recover_on_exit_codes: [75]}"),
        RECOVERED,
        counts=(1, 0),
        wrap=functools.partial(FirstRunExits, code=75),
        notes=("exit code 75 is in recover_on_exit_codes",),
    ),
    Row(
        "exit-code-to-fail-fails-at-once-with-restarts-left",
        "name: j\nrun: train\nsim: {exit_code: 7}\n"
        + recovery("{max_restarts_on_errors: 3, fail_on_exit_codes: [7]}"),
        (S.STARTING, S.RUNNING, S.FAILED),
        failure="exit code 7 is in fail_on_exit_codes",
    ),
    Row(
        "other-exit-codes-still-restart",
        "name: j\nrun: train\n" + recovery("{max_restarts_on_errors: 1, fail_on_exit_codes: [7]}"),
        RECOVERED,
        counts=(0, 1),
        wrap=functools.partial(FirstRunExits, code=3),
    ),
    Row(
        "max-recoveries-reached-ends-in-no-resource",
        "name: j\nrun: train\nsim: {runtime_seconds: 100000}\n"
        + recovery("{strategy: FAILOVER, max_recoveries: 1}"),
        (S.STARTING, S.RUNNING, S.RECOVERING, S.RUNNING, S.FAILED_NO_RESOURCE),
        counts=(1, 0),
        failure="max_recoveries is 1",
        hooks=Hooks(at_each_running=preempt_each_running(2)),
        spot=(True, True),
    ),
    Row(
        "on-demand-after-two-preemptions",
        "name: j\nrun: train\nsim: {runtime_seconds: 50}\n"
        + recovery("{on_demand_after_preemptions: 2}"),
        (S.STARTING, S.RUNNING, S.RECOVERING, S.RUNNING, S.RECOVERING, S.RUNNING, S.SUCCEEDED),
        counts=(2, 0),
        hooks=Hooks(at_each_running=preempt_each_running(2)),
        spot=(True, True, False),
        notes=("relaunching on on-demand capacity",),
    ),
    Row(
        "strategy-none-fails-on-preemption",
        "name: j\nrun: train\nsim: {runtime_seconds: 50}\n" + recovery("NONE"),
        (S.STARTING, S.RUNNING, S.FAILED_NO_RESOURCE),
        failure="recovery strategy is NONE",
        hooks=Hooks(at_each_running=preempt_each_running(1)),
        spot=(True,),
    ),
    Row(
        "max-duration-stops-the-task-gracefully-and-fails",
        "name: j\nrun: train\nmax_duration: 0.3\ngrace_period: 5\n"
        "sim: {runtime_seconds: 1000000}\n",
        (S.STARTING, S.RUNNING, S.FAILED),
        failure="max_duration of 0.3s exceeded",
        notes=("stopping it (grace 5s)",),
    ),
    Row(
        "max-pending-with-no-capacity-ends-in-no-resource",
        f"name: j\nmax_pending: 0.3\n---\nrun: train\n{SPOT}",
        (S.STARTING, S.FAILED_NO_RESOURCE),
        failure="max_pending of 0.3s exceeded",
        before=no_spot_anywhere,
        config={"backoff_initial": 0.05, "backoff_max": 0.05},
    ),
    Row(
        "launch-timeout-with-every-region-full-ends-in-no-resource",
        f"name: j\nrun: train\nlaunch_timeout: 0.3\n{SPOT}",
        (S.STARTING, S.FAILED_NO_RESOURCE),
        failure="launch_timeout of 0.3s exceeded: no capacity",
        before=no_spot_anywhere,
        config={"backoff_initial": 0.05, "backoff_max": 0.05},
    ),
    Row(
        "unreachable-shorter-than-the-timeout-is-not-relaunched",
        "name: j\nrun: train\nsim: {runtime_seconds: 500}\n" + recovery("{unreachable_timeout: 5}"),
        (S.STARTING, S.RUNNING, S.SUCCEEDED),
        hooks=Hooks(at_running=functools.partial(unreachable_for, 0.2)),
        notes=("unreachable since", "answers again"),
    ),
    Row(
        "unreachable-past-the-timeout-is-recovered-once",
        "name: j\nrun: train\nsim: {runtime_seconds: 500}\n"
        + recovery("{strategy: FAILOVER, unreachable_timeout: 0.2}"),
        RECOVERED,
        counts=(1, 0),
        hooks=Hooks(at_running=functools.partial(unreachable_for, 0.6)),
        notes=("stayed unreachable for 0.2s",),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
async def test_recovery_policy(world: World, row: Row) -> None:
    job = make_job(row.spec, 1)
    running = await start_job(
        world,
        job,
        config=fast_config(**row.config),
        wrap=row.wrap,
        hooks=row.hooks,
        before=row.before,
    )
    await running.finished()
    host = running.host
    assert tuple(host.statuses(0)) == row.statuses
    last = host.last(0)
    assert (last.recovery_count, last.restart_count) == row.counts
    if row.failure:
        assert row.failure in last.failure_reason, last
    inventory = await world.inventory(1)
    if row.spot:
        assert tuple(c.spot for c in inventory) == row.spot
    assert await world.live(1) == []
    for text in row.notes:
        assert any(text in note for note in host.notes), (text, host.notes)


async def test_max_duration_sends_sigterm_before_the_end_and_keeps_the_logs(
    world: World,
) -> None:
    job = make_job(
        "name: j\nrun: train\nmax_duration: 0.3\ngrace_period: 2\n"
        "sim: {runtime_seconds: 1000000, log_lines: [working]}\n",
        1,
    )
    running = await start_job(world, job)
    await running.finished()
    [cluster] = await world.inventory(1)
    assert cluster.HasField("sigterm_time") and cluster.HasField("terminate_time")
    assert cluster.sigterm_time.ToNanoseconds() <= cluster.terminate_time.ToNanoseconds()
    # The attempt's logs were copied once it stopped: they end with its SIGTERM, at which
    # the task, with no handler of its own, exited.
    [(_, _, data, _)] = running.host.fetched
    assert data == b"working\nreceived SIGTERM: stopping, SIGKILL in 2s\nexited (SIGTERM)\n"


async def test_a_cancel_stops_running_code_with_sigterm_first(world: World) -> None:
    job = make_job("name: j\nrun: train\ngrace_period: 2\nsim: {runtime_seconds: 1000000}\n", 1)
    running = await start_job(world, job, wrap=LongFirstRun)
    await running.host.watching.wait()
    running.request_cancel()
    await running.finished()
    assert running.host.statuses(0)[-2:] == [S.CANCELLING, S.CANCELLED]
    [cluster] = await world.inventory(1)
    # It exited at the SIGTERM, in the same simulated instant: nothing waited for the grace.
    assert cluster.HasField("sigterm_time") and cluster.exit_code == 143
    assert cluster.task_end_time == cluster.sigterm_time


async def test_a_pending_reclaim_is_announced_even_without_a_watch_event(world: World) -> None:
    """A notice seen in an observation (the first look) is passed on too."""

    async def reclaim_soon(world: World, host: Host) -> None:
        await world.operator.PreemptCluster(
            spb.PreemptClusterRequest(cluster_name=cluster_name(host.job_id, 0), notice_seconds=150)
        )

    job = make_job(f"name: j\nrun: train\n{SPOT}", 1)
    running = await start_job(world, job, hooks=Hooks(at_running=reclaim_soon), wrap=LongFirstRun)
    await running.finished()
    first = (await world.inventory(1))[0]
    assert first.HasField("notice_delivered_time")


def test_a_death_by_signal_matches_either_spelling() -> None:
    from services.controller.strategies import Failover, RecoveryPolicy

    policy = RecoveryPolicy(
        recover_on_exit_codes=frozenset({-9}), fail_on_exit_codes=frozenset({130})
    )
    strategy = Failover(None, print, policy)  # type: ignore[arg-type]
    assert strategy.on_exit(137) == strategy.on_exit(-9) == "recover"
    assert strategy.on_exit(-2) == strategy.on_exit(130) == "fail"
    assert strategy.on_exit(3) == "" and strategy.on_exit(None) == ""


class _FullEverywhere:
    """A backend with no capacity anywhere (only `launch` is ever called)."""

    async def launch(self, plan: Any) -> Any:
        from services.backends import ResourcesUnavailableError

        raise ResourcesUnavailableError("no spot capacity", regions_tried=[REGIONS[0]])


class _SlotTakenAfterFirst:
    """Grants the slot once; after that another job holds it for good."""

    def __init__(self) -> None:
        self.grants = 0

    async def acquire(self, reason: str) -> None:
        if self.grants:
            await asyncio.Event().wait()
        self.grants += 1

    async def release(self, wait_reason: str = "") -> None:
        return None


async def test_launch_timeout_in_the_slot_queue_names_the_failure_that_caused_it() -> None:
    """The timeout passes while the retry waits for the slot: the error names the capacity
    failure that kept the task from starting, not only the queue it ended in."""
    from services.controller.launching import ClusterLauncher, NoResources

    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    config = fast_config(
        backoff_initial=0.05, backoff_max=0.05, monotonic=lambda: clock[0], sleep=sleep
    )
    notes: list[str] = []
    launcher = ClusterLauncher(
        _FullEverywhere(),  # type: ignore[arg-type]
        _SlotTakenAfterFirst(),
        config,
        notes.append,
        launch_timeout=0.1,
    )
    request = LaunchPlan(job_id=1, task_id=0, epoch=1, cluster_name="c", use_spot=True)
    with pytest.raises(NoResources) as raised:
        await launcher.launch(request)
    message = str(raised.value)
    assert message.startswith(f"launch_timeout of 0.1s exceeded: no capacity in {REGIONS[0]}")
    assert "then waiting for a launch slot (task 0, attempt 2)" in message
