"""Every path of a job's lifecycle (contract §6) and of the strategies (§7), one row each.

Each row runs one job through `run_job` against the sim cloud in this process
(1,000 simulated seconds per real second) and asserts:
- the exact sequence of statuses each task reported;
- every launch the backend saw, in order: which task, where it asked (anywhere,
  "in" the candidate regions, "not" in the blocked ones) and what came of it
  (the region, "full: <regions tried>", "precheck", "unreachable"), each under a
  launch grant;
- recovery_count and restart_count as last reported, and the failure reason;
- the sim cloud's inventory: the job's clusters in launch order, every one
  terminated (unless the row is about a leak);
- the order of a success (SUCCEEDED, then logs fetched while the cluster is
  still up, then teardown), the resources in the STARTING report, the launch
  slot given back, and the lifecycle log naming the attempt and region of every
  launch.

The poll interval is an hour unless a row says otherwise, so watching relies on
the events the sim cloud pushes; the grace period is 50 ms and backoffs start
at 10 ms, so the whole table runs in seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from harness.lifecycle_harness import (
    EAST,
    EU,
    REGIONS,
    WEST,
    FailingTerminate,
    Hooks,
    Host,
    IgnoredTerminate,
    Islanded,
    LongFirstRun,
    NeverStartsFirst,
    NoPush,
    OddTaskStatus,
    UnconfirmedTerminate,
    UnreachableTerminate,
    VanishesAfterItsTask,
    World,
    build,
    fast_config,
    layer,
    make_job,
    prelaunch,
    start_job,
)
from harness.waiting import wait_for
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.v1 import job_pb2
from services.backends import Backend, ClusterHandle, cluster_name
from services.common.statuses import IllegalTransition, JobStatus
from services.controller.config import LifecycleConfig
from services.controller.launching import Backoff
from services.controller.messages import MovedAway, Refused
from services.controller.metrics import MeteredBackend
from services.controller.strategies import EagerNextRegion, Failover, strategy_for
from services.scheduler.spec.parse import parse_job_spec

S = JobStatus
STARTING, RUNNING, RECOVERING = S.STARTING, S.RUNNING, S.RECOVERING
SUCCEEDED, FAILED, CANCELLED = S.SUCCEEDED, S.FAILED, S.CANCELLED
RAN = (STARTING, RUNNING, SUCCEEDED)
ALL_FULL = f"full: {EAST},{WEST},{EU}"


@pytest.fixture
async def world() -> AsyncIterator[World]:
    opened = await World.open()
    try:
        yield opened
    finally:
        await opened.close()


# --- what rows do to the cloud ------------------------------------------------------------------


async def preempt_first_task(world: World, host: Host) -> None:
    await world.preempt(cluster_name(host.job_id, 0))
    host.marks["preempted"] = host.hub.observe_calls


async def fill_east_then_preempt(world: World, host: Host) -> None:
    await world.set_spot_capacity(EAST, 0)
    await preempt_first_task(world, host)


async def cloud_unreachable(world: World, host: Host) -> None:
    # 300 simulated seconds: 0.3 s of real time in which nothing can be asked.
    await world.inject(unreachable_seconds=300)


async def no_spot_anywhere(world: World) -> None:
    for region in REGIONS:
        await world.set_spot_capacity(region, 0)


def noticed_after_looks(looks: int) -> Callable[[Host], None]:
    """The preemption was noticed with at most `looks` backend calls for news after it:
    0 when it came pushed, 1 when the first poll after it saw it."""

    def check(host: Host) -> None:
        recovering = next(r for r in host.reports if r.sent.status == RECOVERING)
        asked = recovering.looks - host.marks["preempted"]
        assert 0 <= asked <= looks, f"{asked} backend calls for news; {looks} would do"

    return check


def released(*reasons: str) -> Callable[[Host], None]:
    """The launch slot was given back with these wait reasons (prefixes), in order."""

    def check(host: Host) -> None:
        assert len(host.slot.releases) == len(reasons), host.slot.releases
        for got, want in zip(host.slot.releases, reasons, strict=True):
            assert got.startswith(want), (got, want)

    return check


def backed_off_for_capacity(host: Host) -> None:
    """Three attempts, each under a grant; the slot given back while backing off between."""
    assert len(host.slot.acquires) == 3
    for reason in host.slot.releases[:2]:
        assert f"no capacity in {EAST}, {WEST}, {EU}" in reason, reason


def all_checks(*checks: Callable[[Host], None]) -> Callable[[Host], None]:
    def check(host: Host) -> None:
        for one in checks:
            one(host)

    return check


# --- the table ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    spec: str
    # Per task: the statuses it reported, in order.
    statuses: tuple[tuple[JobStatus, ...], ...]
    # Per launch: (task, where, outcome).
    launches: tuple[tuple[int, str, str], ...]
    # Per task: (recovery_count, restart_count) as last reported.
    counts: tuple[tuple[int, int], ...] = ((0, 0),)
    failure: str = ""
    # Resume: the tasks' statuses and regions as a previous holder left them, and the
    # tasks whose cluster it had launched.
    prior: tuple[JobStatus, ...] = ()
    prior_regions: tuple[str, ...] = ()
    prelaunch: tuple[int, ...] = ()
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    wrap: tuple[Callable[[Backend], Backend], ...] = ()
    hooks: Hooks = dataclasses.field(default_factory=Hooks)
    before: Callable[[World], Awaitable[None]] | None = None
    # Clusters the row expects to be left live (a cleanup that failed).
    leaked: int = 0
    notes: tuple[str, ...] = ()
    check: Callable[[Host], None] | None = None


SPOT = "resources:\n  use_spot: true\n"
ROWS = [
    Row(
        "single-task-succeeds",
        "name: ok\nrun: train\nsim: {log_lines: [hello, bye]}\n",
        (RAN,),
        ((0, "", EAST),),
        check=released(""),
    ),
    Row(
        "chain-with-a-task-without-run",
        "name: chain\n---\nname: a\nrun: a\n---\nname: b\n---\nname: c\nrun: c\n",
        (RAN, (STARTING, SUCCEEDED), RAN),
        ((0, "", EAST), (2, "", EAST)),
        counts=((0, 0), (0, 0), (0, 0)),
    ),
    Row(
        "resume-skips-a-succeeded-task",
        "name: two\n---\nname: a\nrun: a\n---\nname: b\nrun: b\n",
        ((), RAN),
        ((1, "", EAST),),
        counts=((0, 0), (0, 0)),
        prior=(SUCCEEDED, S.PENDING),
        notes=("task 0: already SUCCEEDED; skipped",),
    ),
    Row(
        "resume-running-watches-its-cluster",
        f"name: running\nrun: train\n{SPOT}",
        ((SUCCEEDED,),),
        (),
        prior=(RUNNING,),
        prior_regions=(EAST,),
        prelaunch=(0,),
        notes=("task 0: resumed; watching",),
    ),
    Row(
        # The previous holder's launch happened and its task finished: never run it again.
        "resume-starting-adopts-a-finished-cluster",
        f"name: starting\nrun: train\n{SPOT}",
        ((RUNNING, SUCCEEDED),),
        (),
        counts=((0, 0),),
        prior=(STARTING,),
        prelaunch=(0,),
        notes=("adopted",),
    ),
    Row(
        "resume-recovering-relaunches",
        f"name: recovering\nrun: train\n{SPOT}",
        ((RUNNING, SUCCEEDED),),
        ((0, f"not {EAST}", WEST),),
        counts=((1, 0),),
        prior=(RECOVERING,),
        prior_regions=(EAST,),
        notes=(f"task 0: recovery 1 with EAGER_NEXT_REGION; mj-1-0 was lost in {EAST}",),
    ),
    Row(
        "user-failure-without-restarts-fails",
        "name: crash\nrun: train\nsim: {exit_code: 1, log_lines: [boom]}\n",
        ((STARTING, RUNNING, FAILED),),
        ((0, "", EAST),),
        failure="user run exited non-zero",
    ),
    Row(
        "setup-failure-fails-setup",
        "name: setup\nsetup: pip install x\nrun: train\nsim: {setup_exit_code: 2}\n",
        ((STARTING, RUNNING, S.FAILED_SETUP),),
        ((0, "", EAST),),
        failure="user setup exited non-zero",
    ),
    Row(
        "user-failure-restarts-then-fails",
        "name: flaky\nrun: train\nresources:\n"
        "  job_recovery: {strategy: FAILOVER, max_restarts_on_errors: 2}\nsim: {exit_code: 1}\n",
        ((STARTING, RUNNING, RECOVERING, RUNNING, RECOVERING, RUNNING, FAILED),),
        ((0, "", EAST), (0, "", EAST), (0, "", EAST)),
        counts=((0, 2),),
        failure="after 2 restarts",
        notes=("restart 1 of 2", "restart 2 of 2"),
    ),
    Row(
        "preempted-failover-relaunches-in-the-same-region",
        f"name: fo\nrun: train\n{SPOT}  job_recovery: FAILOVER\n",
        ((STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED),),
        ((0, "", EAST), (0, f"in {EAST}", EAST)),
        counts=((1, 0),),
        wrap=(LongFirstRun,),
        hooks=Hooks(at_watch=preempt_first_task),
        notes=(f"FAILOVER: relaunching in {EAST} first",),
    ),
    Row(
        "preempted-failover-goes-elsewhere-when-the-region-is-full",
        f"name: fo-full\nrun: train\n{SPOT}  job_recovery: FAILOVER\n",
        ((STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED),),
        ((0, "", EAST), (0, f"in {EAST}", f"full: {EAST}"), (0, "", WEST)),
        counts=((1, 0),),
        wrap=(LongFirstRun,),
        hooks=Hooks(at_watch=fill_east_then_preempt),
        notes=(f"cannot relaunch in {EAST}",),
    ),
    Row(
        "preempted-eager-next-region-blocks-the-lost-region",
        f"name: eager\nrun: train\n{SPOT}  job_recovery: EAGER_NEXT_REGION\n",
        ((STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED),),
        ((0, "", EAST), (0, f"not {EAST}", WEST)),
        counts=((1, 0),),
        wrap=(LongFirstRun,),
        hooks=Hooks(at_watch=preempt_first_task),
    ),
    Row(
        "preempted-eager-pinned-to-its-region-falls-back-to-it",
        f"name: pinned\nrun: train\n{SPOT}  region: {EAST}\n",
        ((STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED),),
        ((0, "", EAST), (0, f"not {EAST}", "precheck"), (0, "", EAST)),
        counts=((1, 0),),
        wrap=(LongFirstRun,),
        hooks=Hooks(at_watch=preempt_first_task),
    ),
    Row(
        "preemption-noticed-by-push-with-hourly-polls",
        f"name: pushed\nrun: train\n{SPOT}",
        ((STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED),),
        ((0, "", EAST), (0, f"not {EAST}", WEST)),
        counts=((1, 0),),
        config={"poll_interval": 3600.0},
        wrap=(LongFirstRun,),
        hooks=Hooks(at_watch=preempt_first_task),
        check=noticed_after_looks(0),
    ),
    Row(
        "preemption-noticed-by-polling-a-backend-that-cannot-push",
        f"name: polled\nrun: train\n{SPOT}",
        ((STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED),),
        ((0, "", EAST), (0, f"not {EAST}", WEST)),
        counts=((1, 0),),
        config={"poll_interval": 0.05},
        wrap=(NoPush, LongFirstRun),
        hooks=Hooks(at_watch=preempt_first_task),
        check=noticed_after_looks(1),
    ),
    Row(
        "failure-on-a-cluster-lost-in-the-grace-period-is-a-preemption",
        f"name: grace\nrun: train\n{SPOT}sim: {{exit_code: 1}}\n",
        ((STARTING, RUNNING, RECOVERING, RUNNING, FAILED),),
        ((0, "", EAST), (0, f"not {EAST}", WEST)),
        counts=((1, 0),),
        failure="user run exited non-zero",
        hooks=Hooks(at_grace=preempt_first_task),
        notes=("went down: preempted",),
    ),
    Row(
        "unknown-task-status-fails-the-controller",
        "name: odd\nrun: train\n",
        ((STARTING, RUNNING, S.FAILED_CONTROLLER),),
        ((0, "", EAST),),
        failure="unknown task status",
        wrap=(OddTaskStatus,),
    ),
    Row(
        "unreachable-backend-concludes-nothing",
        "name: outage\nrun: train\nsim: {runtime_seconds: 100}\n",
        (RAN,),
        ((0, "", EAST),),
        hooks=Hooks(at_running=cloud_unreachable),
        notes=("unreachable since", "concluding nothing yet", "answers again"),
        check=lambda host: _condition_set_then_cleared(host),
    ),
    Row(
        "precheck-failure-is-never-retried",
        "name: mars\nrun: train\nresources:\n  region: mars-1\n",
        ((STARTING, S.FAILED_PRECHECKS),),
        ((0, "", "precheck"),),
        failure="mars-1",
        check=released(""),
    ),
    Row(
        "no-capacity-anywhere-ends-in-no-resource",
        f"name: full\nrun: train\n{SPOT}",
        ((STARTING, S.FAILED_NO_RESOURCE),),
        ((0, "", ALL_FULL),) * 3,
        failure="gave up after 3 failed launch attempts",
        config={"max_launch_retries": 3},
        before=no_spot_anywhere,
        check=all_checks(released("backing off", "backing off", ""), backed_off_for_capacity),
    ),
    Row(
        "task-that-never-starts-is-terminated-and-retried",
        "name: stuck\nrun: train\n",
        (RAN,),
        ((0, "", EAST), (0, "", EAST)),
        config={"start_checks": 3},
        wrap=(NeverStartsFirst,),
        notes=("the task did not start on mj-1-0",),
        check=released("backing off", ""),
    ),
    Row(
        "tasks-after-a-failed-one-are-cancelled",
        "name: three\n---\nname: a\nrun: a\n---\nname: b\nrun: b\nsim: {exit_code: 3}\n"
        "---\nname: c\nrun: c\n",
        (RAN, (STARTING, RUNNING, FAILED), (CANCELLED,)),
        ((0, "", EAST), (1, "", EAST)),
        counts=((0, 0), (0, 0), (0, 0)),
        failure="user run exited non-zero",
    ),
    Row(
        "cleanup-that-fails-ends-failed-controller",
        "name: leak\nrun: train\n",
        ((STARTING, RUNNING, SUCCEEDED, S.FAILED_CONTROLLER),),
        ((0, "", EAST),),
        failure="could not be terminated",
        config={"terminate_attempts": 2},
        wrap=(FailingTerminate,),
        leaked=1,
    ),
    Row(
        "a-terminate-that-does-nothing-is-caught-by-the-check",
        "name: leak\nrun: train\n",
        ((STARTING, RUNNING, SUCCEEDED, S.FAILED_CONTROLLER),),
        ((0, "", EAST),),
        failure="it still exists after terminate",
        config={"terminate_attempts": 2},
        wrap=(IgnoredTerminate,),
        leaked=1,
    ),
]


def _wrap(layers: tuple[Callable[[Backend], Backend], ...]) -> Callable[[Backend], Backend]:
    def wrap(backend: Backend) -> Backend:
        for wrapper in reversed(layers):
            backend = wrapper(backend)
        return backend

    return wrap


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
async def test_lifecycle_path(world: World, row: Row) -> None:
    job_id = world.next_job_id()
    assert job_id == 1  # the rows name clusters mj-1-N
    regions = dict(enumerate(row.prior_regions))
    prelaunched = [await prelaunch(world, job_id, task, {}) for task in row.prelaunch]
    for task in row.prelaunch:
        # Its task ends before the job is resumed: no event will come; only a first look sees it.
        handle = world.sim.handle_for(cluster_name(job_id, task))
        await wait_for(
            functools.partial(_finished, world, handle), what=f"task {task} to end", every=0.005
        )
    job = make_job(row.spec, job_id, prior=row.prior, regions=regions)
    running = await start_job(
        world,
        job,
        epoch=2 if row.prior else 1,
        config=fast_config(**row.config),
        wrap=_wrap(row.wrap) if row.wrap else None,
        hooks=row.hooks,
        before=row.before,
    )
    await running.finished()
    host = running.host

    # The exact statuses, task by task.
    assert [tuple(host.statuses(t.task_id)) for t in job.tasks] == list(row.statuses)
    # The launches the backend saw, in order, each under a grant.
    launches = host.recorder.launches
    assert [(x.task_id, x.where, x.outcome) for x in launches] == list(row.launches)
    assert all(x.under_grant for x in launches)
    assert not host.slot.held
    # Counts and failure reason as last reported.
    for spec_task, (recoveries, restarts) in zip(job.tasks, row.counts, strict=True):
        reports = [r.sent for r in host.reports if r.sent.task_id == spec_task.task_id]
        if reports:
            last = reports[-1]
            assert (last.recovery_count, last.restart_count) == (recoveries, restarts)
    reasons = [r.sent.failure_reason for r in host.reports if r.sent.failure_reason]
    if row.failure:
        assert reasons and row.failure in reasons[-1], reasons
    else:
        assert not reasons
    # The inventory: the job's clusters in launch order, none left live.
    inventory = await world.inventory(job_id)
    launched = [x.outcome for x in launches if x.outcome in REGIONS]
    assert [c.region for c in inventory] == prelaunched + launched
    live = [c for c in inventory if not c.HasField("terminate_time")]
    assert len(live) == row.leaked, live
    for cluster in live:
        await world.sim.terminate(world.sim.handle_for(cluster.name))
    assert await world.live(job_id) == []
    _assert_common_order(host, job)
    for text in row.notes:
        assert any(text in note for note in host.notes), (text, host.notes)
    if row.check is not None:
        row.check(host)


async def _finished(world: World, handle: ClusterHandle) -> bool:
    status = await world.sim.task_status(handle)
    return status is not None and status.finished


def _condition_set_then_cleared(host: Host) -> None:
    (task, set_to), (_, cleared) = host.conditions
    assert task == 0 and "mj-1-0 unreachable since" in set_to and cleared == ""


def _assert_common_order(host: Host, job: job_pb2.Job) -> None:
    """What every row must show, whatever its path."""
    for sent in (r.sent for r in host.reports):
        if sent.status == STARTING:
            assert sent.message == f"resources {job.tasks[sent.task_id].resources}"
    timeline = host.timeline
    for task in job.tasks:
        t = str(task.task_id)
        name = cluster_name(job.job_id, task.task_id)
        statuses = host.statuses(task.task_id)
        fetches = [f for f in host.fetched if f[0] == task.task_id]
        if task.spec.run and SUCCEEDED in statuses:
            # Marked SUCCEEDED first, then logs fetched, then the cluster torn down.
            done = timeline.index(("report", t, "SUCCEEDED"))
            fetched = timeline.index(("fetch", t), done)
            timeline.index(("terminate", name), fetched)
        if statuses and statuses[-1] in (SUCCEEDED, FAILED, S.FAILED_SETUP) and task.spec.run:
            # The final attempt's logs were copied while its cluster still existed.
            assert fetches and fetches[-1][3], fetches
    # Every launch that came up is in the lifecycle log with its attempt and region.
    for launch in host.recorder.launches:
        if launch.outcome in REGIONS:
            assert any(
                f"task {launch.task_id}: launch attempt" in n and launch.outcome in n
                for n in host.notes
            ), host.notes
    # Every transition is in the lifecycle log too, in order.
    moves = [n for n in host.notes if n.endswith("]") and " [was " in n]
    assert len(moves) == len(host.reports)
    for move, report in zip(moves, host.reports, strict=True):
        assert move.startswith(f"task {report.sent.task_id}: {report.sent.status.name}")


async def test_logs_of_a_success_are_fetched_before_teardown(world: World) -> None:
    job = make_job("name: ok\nrun: train\nsim: {log_lines: [hello, bye]}\n", 1)
    running = await start_job(world, job)
    await running.finished()
    [(task_id, name, data, existed)] = running.host.fetched
    assert (task_id, name, data, existed) == (0, "mj-1-0", b"hello\nbye\n", True)


async def test_transition_refuses_what_the_table_forbids(world: World) -> None:
    job = make_job("name: two\n---\nname: a\nrun: a\n---\nname: b\nrun: b\n", 1, prior=(SUCCEEDED,))
    host, lifecycle = await build(world, job)
    try:
        done, pending = lifecycle.tasks
        with pytest.raises(IllegalTransition, match="SUCCEEDED -> RUNNING"):
            await done.transition(RUNNING)
        with pytest.raises(IllegalTransition, match="PENDING -> PENDING"):
            await pending.transition(S.PENDING)
        with pytest.raises(IllegalTransition, match="PENDING -> RUNNING"):
            await pending.transition(RUNNING)
        assert host.reports == [] and (done.status, pending.status) == (SUCCEEDED, S.PENDING)
        # A terminal status only ever moves to FAILED_CONTROLLER (a cleanup that failed).
        await done.transition(S.FAILED_CONTROLLER, "leak")
        assert host.statuses(0) == [S.FAILED_CONTROLLER]
    finally:
        await host.hub.close()


async def test_launches_refused_while_unreachable_do_not_count_as_retries(world: World) -> None:
    async def outage(world: World) -> None:
        await world.inject(unreachable_seconds=100)  # 0.1 s

    job = make_job("name: outage\nrun: train\n", 1)
    # One counted failure would end the task FAILED_NO_RESOURCE.
    config = fast_config(max_launch_retries=1, poll_interval=0.02)
    running = await start_job(world, job, config=config, wrap=NoPush, before=outage)
    await running.finished()
    host = running.host
    assert host.statuses(0) == list(RAN)
    *refused, last = [x.outcome for x in host.recorder.launches]
    assert refused and set(refused) == {"unreachable"} and last == EAST
    assert all(r.startswith("backing off") for r in host.slot.releases[:-1])
    assert await world.live(1) == []


def test_backoff_doubles_up_to_the_maximum_with_jitter() -> None:
    backoff = Backoff(1.0, 5.0, random.Random(3))
    delays = [backoff.next() for _ in range(6)]
    steps = [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert all(step / 2 <= delay < step for delay, step in zip(delays, steps, strict=True))
    assert len(set(delays)) == len(delays)


@pytest.mark.parametrize(
    ("job_recovery", "strategy", "restarts"),
    [
        ("", EagerNextRegion, 0),
        ("FAILOVER", Failover, 0),
        ("EAGER_NEXT_REGION", EagerNextRegion, 0),
        ("{strategy: FAILOVER, max_restarts_on_errors: 4}", Failover, 4),
    ],
)
def test_strategy_is_chosen_from_the_spec(
    job_recovery: str, strategy: type[Failover | EagerNextRegion], restarts: int
) -> None:
    text = "run: x\n" + (f"resources:\n  job_recovery: {job_recovery}\n" if job_recovery else "")
    spec = parse_job_spec(text).tasks[0]

    async def never(reason: str = "") -> None:
        raise AssertionError("unused")

    slot = type("Slot", (), {"acquire": never, "release": never})()
    chosen = strategy_for(spec, None, slot, LifecycleConfig(), print)  # type: ignore[arg-type]
    assert type(chosen) is strategy and chosen.max_restarts == restarts


def test_defaults_are_skypilots_and_tests_inject_their_own() -> None:
    defaults = LifecycleConfig()
    assert (defaults.poll_interval, defaults.grace_seconds) == (15.0, 5.0)
    assert defaults.backoff_initial == 60.0 and defaults.max_launch_retries == 0
    fast = fast_config()
    assert fast.grace_seconds < 0.1 and fast.backoff_initial < 0.1


# --- races that once lost or doubled work ---------------------------------------------------------


async def test_a_succeeded_task_whose_cluster_vanished_is_not_run_again(world: World) -> None:
    """The task's end is read first: a cluster gone right after success is not a preemption."""
    job = make_job("name: once\nrun: train\n", 1)
    running = await start_job(world, job, wrap=VanishesAfterItsTask)
    await running.finished()
    host = running.host
    assert host.statuses(0) == list(RAN)
    assert [x.outcome for x in host.recorder.launches] == [EAST]
    assert await world.live(1) == []


async def test_a_refused_report_ends_the_job_failed_controller_after_cleanup(world: World) -> None:
    """Only a stale epoch means "moved away"; any other refusal must not strand the job."""
    job = make_job("name: refused\nrun: train\nsim: {runtime_seconds: 1000}\n", 1)
    running = await start_job(world, job)
    running.host.refuse[RUNNING] = Refused("job 1 task 0: rule broken")
    await running.finished()
    host = running.host
    assert host.statuses(0) == [STARTING, S.FAILED_CONTROLLER]
    assert "rule broken" in host.last(0).failure_reason
    assert running.reason is not None and "refused a report" in running.reason
    assert not host.slot.held
    assert await world.live(1) == []  # the cluster was torn down


async def test_a_stale_epoch_stops_the_job_at_once_without_cleanup(world: World) -> None:
    job = make_job("name: moved\nrun: train\nsim: {runtime_seconds: 1000}\n", 1)
    running = await start_job(world, job)
    running.host.refuse[RUNNING] = MovedAway("job 1: epoch 1 is not current")
    with pytest.raises(MovedAway):
        await running.finished()
    # The new holder owns the cluster: this replica did not touch it.
    assert len(await world.live(1)) == 1
    await world.sim.terminate(world.sim.handle_for("mj-1-0"))


async def test_the_logs_of_a_preempted_attempt_are_fetched_before_its_teardown(
    world: World,
) -> None:
    job = make_job(f"name: spot\nrun: train\n{SPOT}sim: {{log_lines: [working]}}\n", 1)
    running = await start_job(
        world, job, hooks=Hooks(at_running=preempt_first_task), wrap=LongFirstRun
    )
    await running.finished()
    host = running.host
    assert [attempt for _, attempt in host.attempts] == [1, 2]
    first, last = host.fetched
    assert first[3], "the preempted cluster was still there when its logs were copied"
    assert last[2] == b"working\n"
    # Fetched, then torn down, for each attempt.
    timeline = [step for step in host.timeline if step[0] in ("fetch", "terminate")]
    assert timeline[:2] == [("fetch", "0"), ("terminate", "mj-1-0")]


async def test_a_teardown_the_backend_never_answers_ends_failed_controller_in_bounded_time(
    world: World,
) -> None:
    job = make_job("name: stuck\nrun: train\n", 1)
    config = fast_config(unreachable_timeout=0.2)
    running = await start_job(world, job, config=config, wrap=UnreachableTerminate)
    await running.finished(timeout=5)
    host = running.host
    assert host.statuses(0) == [*RAN, S.FAILED_CONTROLLER]
    assert "stayed unreachable" in host.last(0).failure_reason
    assert any("retrying until it answers" in note for note in host.notes)
    await world.sim.terminate(world.sim.handle_for("mj-1-0"))


@pytest.mark.parametrize(
    ("recovery", "plain_first", "waited"),
    [
        # The backend's timeout (an SSH pool's), carried by its error.
        ("", 0, "0.05s"),
        # Carried only from the second error of the episode on: taken then.
        ("", 1, "0.05s"),
        # The task's own unreachable_timeout wins over the backend's.
        ("  job_recovery:\n    unreachable_timeout: 300ms\n", 0, "0.3s"),
    ],
    ids=["backend-timeout", "timeout-from-a-later-error", "the-task-timeout-wins"],
)
async def test_a_cluster_silent_past_its_timeout_is_relaunched_without_waiting_for_it_again(
    world: World, recovery: str, plain_first: int, waited: str
) -> None:
    job = make_job(f"name: island\nrun: train\nresources:\n{recovery}", 1)

    async def cut(world: World, host: Host) -> None:
        layer(host.recorder, Islanded).cut = True

    running = await start_job(
        world,
        job,
        # The replica's own timeout is far longer than the test may take.
        config=fast_config(poll_interval=0.01, unreachable_timeout=3600),
        wrap=_wrap((NoPush, functools.partial(Islanded, plain_first=plain_first), LongFirstRun)),
        hooks=Hooks(at_running=cut),
    )
    await running.finished()
    host = running.host

    assert host.statuses(0) == [STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED]
    assert any(f"stayed unreachable for {waited}" in note for note in host.notes), host.notes
    assert any("relaunching without waiting again" in note for note in host.notes)
    # The relaunch of the name replaced the silent cluster: nothing is left.
    assert len(await world.inventory(1)) == 2
    assert await world.live(1) == []


async def test_a_succeeded_cluster_is_torn_down_once(world: World) -> None:
    job = make_job("name: once\nrun: train\n", 1)
    running = await start_job(world, job)
    await running.finished()
    terminations = [s for s in running.host.timeline if s[0] == "terminate"]
    assert terminations == [("terminate", "mj-1-0")]


@pytest.mark.parametrize("confirms", [True, False], ids=["terminate-confirms", "unconfirmed"])
async def test_a_teardown_asks_whether_the_cluster_exists_only_when_terminate_cannot_say(
    world: World, confirms: bool
) -> None:
    metered: list[MeteredBackend] = []

    def meter(backend: Backend) -> Backend:
        metered.append(MeteredBackend(backend if confirms else UnconfirmedTerminate(backend)))
        return metered[0]

    job = make_job("name: once\nrun: train\n", 1)
    running = await start_job(world, job, wrap=meter)
    await running.finished()
    assert running.host.statuses(0) == list(RAN)
    calls = metered[0].calls
    assert calls["terminate"] == 1
    # The sim cloud's Terminate answers once the cluster is gone: nothing to ask after it.
    assert calls.get("cluster_exists", 0) == (0 if confirms else 1), calls
    assert await world.live(1) == []


async def test_a_running_job_on_a_pushing_backend_makes_no_backend_calls_while_quiet(
    world: World,
) -> None:
    metered: list[MeteredBackend] = []

    def meter(backend: Backend) -> Backend:
        metered.append(MeteredBackend(backend))
        return metered[0]

    job = make_job("name: quiet\nrun: train\nsim: {runtime_seconds: 1000000}\n", 1)
    # A short poll interval: a backend that pushes must not be polled at all.
    running = await start_job(world, job, wrap=meter, config=fast_config(poll_interval=0.1))
    await asyncio.wait_for(running.host.watching.wait(), 5)
    before = dict(metered[0].calls)
    # The task was seen started in the launch's answer: no look at the cluster of its own.
    assert before["launch"] == 1 and "observe" not in before, before
    await asyncio.sleep(1.0)  # a quiet interval: nothing happens to the cluster
    assert metered[0].calls == before, (before, metered[0].calls)
    assert running.host.hub.observe_calls <= 1  # the first look only
    running.request_cancel()
    await running.finished()


async def test_a_preemption_notice_reaches_the_task_before_its_cluster_goes(
    world: World,
) -> None:
    async def reclaim_with_notice(world: World, host: Host) -> None:
        name = cluster_name(host.job_id, 0)
        # 200 simulated seconds ahead: 0.2 s here.
        await world.operator.PreemptCluster(
            spb.PreemptClusterRequest(cluster_name=name, notice_seconds=200)
        )

    job = make_job(f"name: notice\nrun: train\n{SPOT}", 1)
    hooks = Hooks(at_running=reclaim_with_notice)
    running = await start_job(world, job, hooks=hooks, wrap=LongFirstRun)
    await running.finished()
    host = running.host
    assert host.statuses(0) == [STARTING, RUNNING, RECOVERING, RUNNING, SUCCEEDED]
    first = (await world.inventory(1))[0]
    assert first.HasField("notice_delivered_time") and first.HasField("preempt_time")
    assert first.notice_delivered_time.ToNanoseconds() < first.preempt_time.ToNanoseconds()
    # The preempted attempt's logs were copied, the notice in them.
    assert b"received SIGTERM: preemption notice" in host.fetched[0][2]
    assert any("will be reclaimed at" in note for note in host.notes)
