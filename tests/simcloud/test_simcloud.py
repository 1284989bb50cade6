"""The sim cloud: the model on a manual clock, and the service in-process through the sim backend.

Model tests move simulated time by hand (`ManualClock`), so every timing is exact.
Service tests run a real server on port 0 with a large time_scale and talk to it
the way the control plane does, through `SimBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.backends import (
    BackendUnreachableError,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
    TaskEnd,
    TaskStatus,
    make_backend,
)
from services.backends.sim.backend import SimBackend
from services.common.security.edge import ServerSecurity
from services.controller.fencing import LeaseGuard
from services.controller.messages import LeaseLost
from services.simcloud import Cloud, CloudConfig, ManualClock, RunningCloud, list_inventory, start
from services.simcloud.clusters import CallKind, ClusterState, TaskPlan, TaskState
from services.simcloud.config import DEFAULT_CONFIG, ConfigError, RegionConfig, parse_config
from services.simcloud.errors import NoCapacity, PrecheckFailed, PrecheckInvalid, StaleEpoch
from services.simcloud.events import EventKind
from services.simcloud.fence import MAX_CALLS
from services.simcloud.regions import LaunchSpec

ROOT = Path(__file__).resolve().parents[2]
EAST, WEST, EU = "us-east-1", "us-west-2", "eu-west-1"


def small_cloud(**changes: Any) -> CloudConfig:
    """Three regions with room for one spot node each, except eu-west-1 with none."""
    regions = (
        RegionConfig(EAST, ("us-east-1a", "us-east-1b"), 1, 4, ("A100",)),
        RegionConfig(WEST, ("us-west-2a",), 1, 4, ("A100",)),
        RegionConfig(EU, ("eu-west-1a",), 0, 4, ("V100",)),
    )
    return dataclasses.replace(CloudConfig(regions=regions, launch_latency_seconds=5.0), **changes)


def spec(name: str = "c", job: int = 1, task: int = 0, epoch: int = 1, **kw: Any) -> LaunchSpec:
    fields: dict[str, Any] = {"use_spot": True, **kw}
    return LaunchSpec(cluster_name=name, job_id=job, task_id=task, epoch=epoch, **fields)


def launch_up(cloud: Cloud, s: LaunchSpec) -> tuple[str, list[str]]:
    """Launches on a manual clock and lets the launch latency pass."""
    cluster, tried = cloud.begin_launch(s)
    cloud.advance(cloud.regions[cluster.region].launch_latency)
    assert cluster.status == ClusterState.UP
    return cluster.region, tried


# --- config -------------------------------------------------------------------------------


def test_example_and_default_configs_describe_three_regions() -> None:
    example = parse_config((ROOT / "examples/simcloud.yaml").read_text())
    assert [r.name for r in example.regions] == [EAST, WEST, EU]
    assert [r.name for r in DEFAULT_CONFIG.regions] == [EAST, WEST, EU]


def test_notice_seconds_is_set_per_cloud_and_per_region() -> None:
    config = parse_config(
        "notice_seconds: 30\nregions: [{name: a, notice_seconds: 120}, {name: b}]"
    )
    cloud = Cloud(config, ManualClock())
    assert [r.notice_seconds for r in cloud.regions.values()] == [120.0, 30.0]


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("notice_seconds: -1\nregions: [{name: a}]", "notice_seconds"),
        ("regions: [{name: a, launch_latency_seconds: 1e300}]", "launch_latency_seconds"),
        ("regions: [{name: 'a b'}]", "regions[0]"),
        ("regions: [{name: a, zones: [a1], gpus: 1}]", "regions[0].gpus"),
        ("time_scale: 0\nregions: [{name: a}]", "time_scale"),
        ("regions: [{name: a, zones: [x]}, {name: b, zones: [x]}]", "regions[1]"),
        ("regions: []", "regions"),
    ],
)
def test_bad_config_names_the_field(text: str, path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace("[", r"\[").replace("]", r"\]")):
        parse_config(text)


@pytest.mark.parametrize(
    ("model", "proto", "prefix"),
    [
        (ClusterState, pb.ClusterStatus, "CLUSTER_STATUS_"),
        (TaskState, pb.TaskStatus, "TASK_STATUS_"),
        (EventKind, pb.EventKind, "EVENT_KIND_"),
        (CallKind, pb.ClusterCallKind, "CLUSTER_CALL_KIND_"),
    ],
)
def test_model_enums_mirror_the_proto_enums(model: Any, proto: Any, prefix: str) -> None:
    declared = {name.removeprefix(prefix): number for name, number in proto.items()}
    declared.pop("UNSPECIFIED")
    assert {member.name: int(member) for member in model} == declared


def test_every_backend_takes_the_same_settings(tmp_path: Path) -> None:
    settings = {"data_dir": tmp_path, "simcloud_address": "127.0.0.1:1"}
    assert make_backend("local", settings).name == "local"
    sim = make_backend("sim", settings)
    assert isinstance(sim, SimBackend) and sim.address == "127.0.0.1:1"
    with pytest.raises(ValueError, match="simcloud_address"):
        make_backend("sim", {"data_dir": tmp_path})


# --- the model ----------------------------------------------------------------------------


def test_full_region_fails_over_in_order_and_records_every_region_tried() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    assert launch_up(cloud, spec("a", job=1)) == (EAST, [EAST])
    assert launch_up(cloud, spec("b", job=2)) == (WEST, [EAST, WEST])
    with pytest.raises(NoCapacity) as caught:
        cloud.begin_launch(spec("c", job=3, accelerators="A100:1"))
    assert caught.value.regions_tried == [EAST, WEST]
    assert caught.value.metadata["regions_tried"] == f"{EAST},{WEST}"
    # Terminating frees the node: the next launch gets us-east-1 again.
    assert cloud.terminate("a") is True
    assert cloud.terminate("a") is False
    assert launch_up(cloud, spec("c", job=3)) == (EAST, [EAST])
    # On-demand is its own pool.
    assert launch_up(cloud, dataclasses.replace(spec("d", job=4), use_spot=False))[0] == EAST


@pytest.mark.parametrize(
    ("changes", "error", "text"),
    [
        ({"region": "mars-1"}, PrecheckFailed, "unknown region"),
        ({"zone": "mars-1a"}, PrecheckFailed, "unknown zone"),
        ({"region": WEST, "zone": "us-east-1a"}, PrecheckFailed, "is in us-east-1"),
        ({"accelerators": "TPU:8"}, PrecheckFailed, "not offered"),
        ({"cpus": "512+"}, PrecheckFailed, "more than"),
        ({"cpus": "lots"}, PrecheckInvalid, "cpus"),
        ({"accelerators": "A100:zero"}, PrecheckInvalid, "count"),
        ({"cloud": "aws"}, PrecheckFailed, "unknown cloud"),
        ({"num_nodes": 0}, PrecheckInvalid, "num_nodes"),
        ({"cluster_name": "bad name!"}, PrecheckInvalid, "cluster_name"),
        ({"region": EAST, "blocked_regions": (EAST,)}, PrecheckFailed, "no region"),
        ({"accelerators": "V100", "blocked_regions": (EU,)}, PrecheckFailed, "no region"),
    ],
)
def test_requests_that_can_never_launch_fail_the_precheck(
    changes: dict[str, Any], error: type[Exception], text: str
) -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    with pytest.raises(error, match=text):
        cloud.begin_launch(dataclasses.replace(spec(), **changes))
    assert cloud.inventory == []
    assert cloud.state().launches_rejected_precheck == 1


def test_candidates_blocked_regions_and_accelerators_shape_the_order() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    s = spec(candidate_regions=(WEST, EAST))
    assert launch_up(cloud, s) == (WEST, [WEST])
    assert launch_up(cloud, spec("b", job=2, blocked_regions=(WEST,))) == (EAST, [EAST])
    with pytest.raises(NoCapacity) as caught:
        cloud.begin_launch(spec("c", job=3, accelerators="V100"))
    assert caught.value.regions_tried == [EU]


def test_task_runs_setup_then_run_and_every_change_is_an_event() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    plan = TaskPlan(runtime=10, setup_seconds=3, exit_code=2, log_lines=("x", "y"))
    cluster, _ = cloud.begin_launch(spec(plan=plan))
    assert (cluster.status, cluster.task_status) == (ClusterState.INIT, TaskState.PENDING)
    cloud.advance(5)
    assert (cluster.status, cluster.task_status) == (ClusterState.UP, TaskState.SETTING_UP)
    cloud.advance(3)
    assert cluster.task_status == TaskState.RUNNING
    cloud.advance(10)
    assert (cluster.task_status, cluster.exit_code, cluster.task_end_time) == (
        TaskState.FAILED,
        2,
        18.0,
    )
    messages = [(e.cluster_status.name, e.task_status, e.message) for e in cloud.events.all()]
    assert messages == [
        ("INIT", None, "launching in us-east-1a"),
        ("UP", TaskState.SETTING_UP, "up"),
        ("UP", TaskState.RUNNING, "setup done"),
        ("UP", TaskState.FAILED, "run exited with 2"),
    ]
    failing = TaskPlan(setup_exit_code=7)
    other, _ = cloud.begin_launch(spec("s", job=2, plan=failing))
    cloud.advance(5)
    assert (other.task_status, other.exit_code) == (TaskState.FAILED_SETUP, 7)


def test_exit_code_runs_fails_only_the_first_runs_of_a_task() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    plan = TaskPlan(runtime=1, exit_code=75, exit_code_runs=2)
    codes = []
    for _ in range(3):
        cluster, _ = cloud.begin_launch(spec(plan=plan))
        cloud.advance(10)
        codes.append((cluster.task_status, cluster.exit_code))
        cloud.terminate(cluster.name)
    other, _ = cloud.begin_launch(spec("other", job=2, plan=plan))
    cloud.advance(10)
    assert codes == [(TaskState.FAILED, 75), (TaskState.FAILED, 75), (TaskState.SUCCEEDED, 0)]
    assert (other.task_status, other.exit_code) == (TaskState.FAILED, 75)


def test_log_lines_are_spread_over_the_runtime_and_cut_by_preemption() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    plan = TaskPlan(runtime=10, log_lines=("a", "b", "c", "d", "e"), preempt_after=5)
    cluster, _ = cloud.begin_launch(spec(plan=plan))
    cloud.advance(5)  # UP: line 0 at once, then one every 2 s
    assert cluster.render(0, cluster.lines_emitted(cloud.clock.now())) == b"a\n"
    cloud.advance(2)
    assert cluster.lines_emitted(cloud.clock.now()) == 2
    cloud.advance(3)  # preempted at UP + 5: lines at 0, 2 and 4 were written
    assert cluster.status == ClusterState.DOWN
    assert cluster.lines_emitted(cloud.clock.now() + 100) == 3 and cluster.log_final()
    multi, _ = cloud.begin_launch(spec("m", job=2, num_nodes=1, plan=TaskPlan(runtime=0)))
    assert multi.render(0, 1) == b"m: running\n"


def test_scripted_preemption_hits_only_the_first_spot_cluster_of_a_task() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    plan = TaskPlan(runtime=100, preempt_after=10)
    first, _ = cloud.begin_launch(spec(plan=plan))
    cloud.advance(15)
    assert first.status == ClusterState.DOWN and first.preempted
    assert cloud.regions[EAST].spot_used == 0
    second, _ = cloud.begin_launch(spec(plan=plan))
    assert first.status == ClusterState.TERMINATED and not first.replaced
    cloud.advance(200)
    assert second.status == ClusterState.UP and second.task_status == TaskState.SUCCEEDED
    on_demand, _ = cloud.begin_launch(spec("od", job=9, plan=plan, use_spot=False))
    cloud.advance(200)
    assert on_demand.status == ClusterState.UP


def run_random_scenario(seed: int) -> list[tuple[object, ...]]:
    config = small_cloud(seed=seed, preemptions_per_hour=3600.0)
    config = dataclasses.replace(
        config, regions=tuple(dataclasses.replace(r, spot_nodes=50) for r in config.regions)
    )
    cloud = Cloud(config, ManualClock())
    for job in range(1, 21):
        cloud.begin_launch(spec(f"c{job}", job=job, plan=TaskPlan(runtime=job % 4 + 0.5)))
        cloud.advance(0.7)
        if job % 5 == 0:
            cloud.terminate(f"c{job - 1}")
    cloud.advance(50)
    return [event.key() for event in cloud.events.all()]


def test_the_same_seed_gives_the_same_events() -> None:
    first = run_random_scenario(seed=7)
    assert first == run_random_scenario(seed=7)
    assert any("preempted" in str(key) for key in first)
    assert first != run_random_scenario(seed=8)


def test_random_reclaims_are_announced_and_happen_at_the_deadline() -> None:
    config = small_cloud(seed=3, preemptions_per_hour=3600.0, notice_seconds=30.0)
    cloud = Cloud(config, ManualClock())
    plan = TaskPlan(runtime=1e6)
    for job in (1, 2):
        cloud.begin_launch(spec(f"c{job}", job=job, plan=plan))
    cloud.advance(1000)
    by_cluster: dict[str, list[tuple[str, float]]] = {}
    for event in cloud.events.all():
        by_cluster.setdefault(event.cluster_name, []).append((event.kind.name, event.sim_time))
    for name in ("c1", "c2"):
        kinds = [kind for kind, _ in by_cluster[name]]
        assert kinds == [
            "CLUSTER_STATUS_CHANGED",  # INIT
            "CLUSTER_STATUS_CHANGED",  # UP
            "PREEMPTION_NOTICE",
            "CLUSTER_STATUS_CHANGED",  # DOWN
        ]
        (_, noticed), (_, down) = by_cluster[name][2:]
        cluster = cloud.get(name)
        assert down - noticed == pytest.approx(30.0)
        assert cluster.preempt_time == cluster.notice_deadline == down
    assert cloud.state().preempted_total == 2


def test_an_earlier_reclaim_overtakes_a_notice_and_a_later_one_never_delays_it() -> None:
    cloud = Cloud(small_cloud(notice_seconds=100.0), ManualClock())
    cluster, _ = cloud.begin_launch(spec(plan=TaskPlan(runtime=1e6)))
    cloud.advance(5)
    assert cloud.preempt_cluster("c", notice=50) == (True, 55.0)
    assert cloud.preempt_cluster("c", notice=80) == (True, 55.0)
    cloud.advance(10)
    assert cloud.preempt_cluster("c", notice=0) == (True, None)
    assert cluster.status == ClusterState.DOWN and cluster.preempt_time == 15.0
    cloud.advance(100)
    assert cloud.state().preempted_total == 1


def test_signal_notes_sit_among_the_log_lines_of_every_node() -> None:
    cloud = Cloud(small_cloud(), ManualClock(start_wall=0.0))
    plan = TaskPlan(runtime=10, log_lines=("a", "b", "c", "d", "e"))
    cluster, _ = cloud.begin_launch(spec(plan=plan, num_nodes=2, use_spot=False))
    cloud.advance(5 + 3)  # UP at 5; lines at 0 and 2 of the run are out
    before = cluster.render(0, cluster.entries_emitted(cloud.clock.now()))
    assert cloud.notify("c", epoch=1, deadline=60.0) == 8.0
    assert cloud.notify("c", epoch=1, deadline=60.0) == 8.0  # a repeat: one note
    cloud.advance(20)
    log = cluster.render(0, cluster.entries_emitted(cloud.clock.now()))
    note = "received SIGTERM: preemption notice, reclaim at 1970-01-01T00:01:00Z"
    ranks = [f"(rank={r}) " for r in (0, 1)]
    expected = [f"{rank}{line}" for line in ("a", "b", note, "c", "d", "e") for rank in ranks]
    assert log.decode().splitlines() == expected
    assert log.startswith(before) and b"".join(cluster.render_chunks(0, 6, 10)) == log


def test_a_launch_with_a_stale_epoch_is_refused_and_counted() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    launch_up(cloud, spec(epoch=2))
    with pytest.raises(StaleEpoch, match="stale epoch"):
        cloud.begin_launch(spec(epoch=1))
    assert cloud.state().stale_launches_rejected == 1
    assert cloud.get("c").status == ClusterState.UP
    launch_up(cloud, spec(epoch=3))
    assert cloud.state().replaced_total == 1


def test_a_terminate_with_a_stale_epoch_is_refused_and_counted() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    launch_up(cloud, spec(epoch=1))
    launch_up(cloud, spec(epoch=2))  # the job moved; its new holder relaunched
    with pytest.raises(StaleEpoch, match="stale epoch 1"):
        cloud.terminate("c", epoch=1)
    assert cloud.state().stale_terminates_rejected == 1
    assert cloud.get("c").status == ClusterState.UP
    assert cloud.terminate("c", epoch=2) is True


def test_calls_the_fence_lets_through_are_kept_with_their_epochs() -> None:
    """The fence knows only the highest epoch launched: once the job moved to a holder
    that adopted the cluster without launching, the old holder's calls pass it. The
    record keeps every call with its epoch and time, so they show."""
    clock = ManualClock()
    cloud = Cloud(small_cloud(preemptions_per_hour=0.0), clock)
    launch_up(cloud, spec(epoch=1, plan=TaskPlan(runtime=1000.0)))
    cloud.notify("c", epoch=2, deadline=clock.wall(500.0))  # the new holder, adopting
    cloud.advance(1.0)
    cloud.notify("c", epoch=1, deadline=clock.wall(500.0))  # the old one: not refused
    cloud.begin_stop("c", epoch=2, grace=0.0)
    cloud.advance(1.0)
    cloud.begin_terminate("c", epoch=1)
    cluster = cloud.get("c")
    assert cluster.status == ClusterState.TERMINATED
    assert cluster.calls == [
        (CallKind.NOTICE, 2, 5.0),
        (CallKind.NOTICE, 1, 6.0),
        (CallKind.STOP, 2, 6.0),
        (CallKind.TERMINATE, 1, 7.0),
    ]
    # A call the fence refuses is counted, not kept.
    launch_up(cloud, spec(epoch=3, plan=TaskPlan(runtime=1000.0)))
    with pytest.raises(StaleEpoch):
        cloud.notify("c", epoch=2, deadline=clock.wall(500.0))
    relaunched = cloud.get("c")
    assert relaunched.calls is None and cloud.state().stale_notices_rejected == 1
    for _ in range(MAX_CALLS + 3):
        cloud.notify("c", epoch=0, deadline=clock.wall(600.0))  # an operator's
    assert relaunched.calls is not None and len(relaunched.calls) == MAX_CALLS
    assert relaunched.calls_dropped == 3


def test_inventory_counts_replacements_and_overlapping_clusters_of_a_task() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    launch_up(cloud, spec("a", job=1))
    launch_up(cloud, spec("a", job=1))  # same name: the live one is replaced, no overlap
    assert [c.replaced for c in cloud.inventory] == [True, False]
    assert cloud.state().violations == 0
    cloud.terminate("a")
    launch_up(cloud, spec("x", job=5))
    launch_up(cloud, spec("y", job=5))  # another name for the same task while x is live
    state = cloud.state()
    assert state.violations == 1
    assert (state.launched_total, state.live_clusters, state.unterminated_clusters) == (4, 2, 2)


def test_operator_preempts_regions_sets_capacity_and_fails_launches() -> None:
    cloud = Cloud(small_cloud(), ManualClock())
    launch_up(cloud, spec("a", job=1))
    launch_up(cloud, dataclasses.replace(spec("b", job=2), use_spot=False))
    assert cloud.preempt_region(EAST) == (["a"], None)
    assert cloud.get("b").status == ClusterState.UP
    cloud.set_capacity(EAST, spot=0, on_demand=None)
    cloud.inject_faults(WEST, fail_next_launches=1)
    with pytest.raises(NoCapacity):
        cloud.begin_launch(spec("c", job=3, accelerators="A100"))
    assert cloud.regions[WEST].failing_launches == 0
    assert launch_up(cloud, spec("c", job=3, accelerators="A100")) == (WEST, [EAST, WEST])


# --- the service, through the sim backend ----------------------------------------------------


@pytest.fixture
async def running() -> AsyncIterator[RunningCloud]:
    config = small_cloud(time_scale=1000.0, launch_latency_seconds=2.0)
    cloud = await start(config, port=0, security=ServerSecurity.without_auth())
    try:
        yield cloud
    finally:
        await cloud.stop()


@pytest.fixture
async def backend(running: RunningCloud) -> AsyncIterator[SimBackend]:
    sim = make_backend("sim", {"simcloud_address": f"127.0.0.1:{running.port}"})
    assert isinstance(sim, SimBackend)
    try:
        yield sim
    finally:
        await sim.close()


@pytest.fixture
async def operator(running: RunningCloud) -> AsyncIterator[pb_grpc.SimOperatorServiceAsyncStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield pb_grpc.SimOperatorServiceStub(channel)


def task(
    job: int = 1, task_id: int = 0, epoch: int = 1, sim: Mapping[str, Any] | None = None, **kw: Any
) -> LaunchPlan:
    fields: dict[str, Any] = {"use_spot": True, **kw}
    if sim is not None:
        fields["extensions"] = {"sim": sim}
    return LaunchPlan(
        job_id=job, task_id=task_id, epoch=epoch, cluster_name=f"mj-{job}-{task_id}", **fields
    )


async def test_backend_maps_no_capacity_and_prechecks(backend: SimBackend) -> None:
    first = await backend.launch(task(1))
    assert (first.region, first.backend) == (EAST, "sim")
    await backend.launch(task(2))
    with pytest.raises(ResourcesUnavailableError) as caught:
        await backend.launch(task(3))
    assert caught.value.regions_tried == [EAST, WEST, EU]
    with pytest.raises(PrecheckError, match="unknown region"):
        await backend.launch(task(4, region="mars-1"))
    with pytest.raises(PrecheckError, match="cpus"):
        await backend.launch(task(4, cpus="many"))
    with pytest.raises(StaleEpochError, match="stale epoch"):
        await backend.launch(task(1, epoch=0))


async def test_backend_sees_a_task_through_to_its_end(backend: SimBackend) -> None:
    sim = {"runtime_seconds": 300, "log_lines": ["one", "two"], "exit_code": 3}
    handle = await backend.launch(task(sim=sim))
    assert await backend.cluster_status(handle) == ClusterStatus.UP
    assert await backend.task_status(handle) == TaskStatus.RUNNING
    assert await backend.task_end(handle) is None
    chunks = [chunk async for chunk in backend.tail_logs(handle)]
    assert b"".join(chunks) == b"one\ntwo\n"
    assert await backend.task_status(handle) == TaskStatus.FAILED
    assert await backend.task_end(handle) is not None
    assert await backend.read_logs(handle) == b"one\ntwo\n"
    assert await backend.cluster_exists(handle.cluster_name)
    await backend.terminate(handle)
    await backend.terminate(handle)
    assert not await backend.cluster_exists(handle.cluster_name)
    assert await backend.cluster_status(handle) == ClusterStatus.DOWN
    assert await backend.task_status(handle) is None
    assert await backend.read_logs(backend.handle_for("never-launched")) == b""


async def test_teardowns_asked_for_at_once_go_as_one_call_each_answered_on_its_own(
    backend: SimBackend, running: RunningCloud
) -> None:
    one = await backend.launch(task(1, sim={"runtime_seconds": 1e6}))
    two = await backend.launch(task(2, sim={"runtime_seconds": 1e6}, epoch=3))
    never = backend.handle_for("mj-9-0")
    before = backend.batched.terminations.batches
    outcomes = await asyncio.gather(
        backend.terminate(one, epoch=1),
        backend.terminate(two, epoch=2),  # below epoch 3, which launched it: fenced
        backend.terminate(never, epoch=1),
        backend.terminate(backend.handle_for("../etc"), epoch=1),
        return_exceptions=True,
    )
    assert outcomes[0] is True and outcomes[2] is True
    assert isinstance(outcomes[1], StaleEpochError) and "stale epoch 2" in str(outcomes[1])
    # A name the cloud would refuse is refused here, alone, not in the batch.
    assert isinstance(outcomes[3], PrecheckError)
    assert backend.batched.terminations.batches == before + 1
    assert not await backend.cluster_exists(one.cluster_name)
    assert await backend.cluster_exists(two.cluster_name)
    assert running.cloud.state().stale_terminates_rejected == 1
    # A stop (keep the cluster, a grace) never waits in a teardown's batch, nor one with
    # another grace: three keys, three calls.
    await asyncio.gather(
        backend.stop(two, epoch=3, grace=5.0),
        backend.stop(two, epoch=3, grace=0.0),
        backend.terminate(backend.handle_for("mj-8-0"), epoch=1),
    )
    assert backend.batched.terminations.batches == before + 4
    assert await backend.task_status(two) == TaskStatus.FAILED
    assert await backend.cluster_exists(two.cluster_name)


async def test_launches_asked_for_at_once_go_as_one_call_each_answered_on_its_own(
    backend: SimBackend, running: RunningCloud
) -> None:
    before = backend.batched.launches.batches
    outcomes = await asyncio.gather(
        backend.launch(task(1)),
        backend.launch(task(2)),
        backend.launch(task(3)),  # east and west are full by now: no capacity anywhere
        backend.launch(task(4, region="mars-1")),
        backend.launch(task(1, epoch=0)),  # below epoch 1, launched just before it
        return_exceptions=True,
    )
    assert backend.batched.launches.batches == before + 1
    first, second, full, nowhere, stale = outcomes
    assert isinstance(first, ClusterHandle) and isinstance(second, ClusterHandle)
    assert (first.region, second.region) == (EAST, WEST)
    assert isinstance(full, ResourcesUnavailableError)
    assert full.regions_tried == [EAST, WEST, EU]
    assert isinstance(nowhere, PrecheckError) and "unknown region" in str(nowhere)
    assert isinstance(stale, StaleEpochError)
    state = running.cloud.state()
    assert (state.launched_total, state.stale_launches_rejected) == (2, 1)
    # A request too big to share a batch's 4 MiB goes alone, as a Launch of its own.
    big = {"runtime_seconds": 1e6, "log_lines": ["x" * 1000] * 20}
    handle = await backend.launch(task(5, use_spot=False, sim=big))
    assert backend.batched.launches.batches == before + 1
    assert await backend.cluster_exists(handle.cluster_name)


async def test_launch_batches_keep_within_their_bounds(running: RunningCloud) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        cloud = pb_grpc.SimCloudServiceStub(channel)
        operator = pb_grpc.SimOperatorServiceStub(channel)
        one = pb.LaunchRequest(cluster_name="c", job_id=1, epoch=1)
        for calls in ([], [one] * 1001):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await cloud.LaunchClusters(pb.LaunchClustersRequest(calls=calls))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "calls: 1 to 1000 calls" in (caught.value.details() or "")
        # A bad item is answered alone, named as in a Launch of its own.
        bad = pb.LaunchRequest(cluster_name="../etc", job_id=2, epoch=1)
        reply = await cloud.LaunchClusters(pb.LaunchClustersRequest(calls=[one, bad]))
        assert reply.results[0].response.cluster.name == "c"
        error = reply.results[1].error
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "cluster_name" in error.message
        assert running.cloud.state().launched_total == 1
        # An outage fails the whole call, launching nothing.
        await operator.InjectFaults(pb.InjectFaultsRequest(unreachable_seconds=1e6))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cloud.LaunchClusters(
                pb.LaunchClustersRequest(calls=[pb.LaunchRequest(cluster_name="d", job_id=3)])
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        await operator.ResetFaults(pb.ResetFaultsRequest())
        assert running.cloud.state().launched_total == 1


async def test_log_reads_asked_for_at_once_share_one_call_and_a_big_log_is_read_alone(
    backend: SimBackend, running: RunningCloud
) -> None:
    line = "x" * 999
    handles = []
    for job in range(1, 5):
        # About 1 MB of log each: three fit in one answer (3 MiB), the fourth is left out.
        sim = {"runtime_seconds": 1, "log_lines": [f"{job}{line}"] * 1000}
        handles.append(await backend.launch(task(job, use_spot=False, sim=sim)))
    for handle in handles:
        async for _ in backend.tail_logs(handle):
            pass  # to the end of the task: its whole log is written
    before = backend.batched.log_reads.batches
    logs = await asyncio.gather(
        *(backend.read_logs(handle) for handle in handles),
        backend.read_logs(backend.handle_for("never-launched")),
    )
    assert backend.batched.log_reads.batches == before + 1
    assert [log == f"{job}{line}\n".encode() * 1000 for job, log in enumerate(logs[:4], 1)] == [
        True
    ] * 4
    assert logs[4] == b""
    with pytest.raises(PrecheckError):
        await backend.read_logs(backend.handle_for("../etc"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        request = pb.GetLogsRequest(cluster_names=[h.cluster_name for h in handles])
        reply = await pb_grpc.SimCloudServiceStub(channel).GetLogs(request)
    assert [(log.omitted, len(log.data)) for log in reply.logs] == [(False, 1_001_000)] * 3 + [
        (True, 0)
    ]


async def test_preemption_is_pushed_on_the_event_stream(
    backend: SimBackend, operator: pb_grpc.SimOperatorServiceAsyncStub
) -> None:
    stream = backend.events()
    assert stream is not None
    handle = await backend.launch(task(sim={"runtime_seconds": 1e6}))
    seen: list[tuple[str, ClusterStatus | None]] = []
    opened = asyncio.Event()
    down = ClusterStatus.DOWN

    async def until_down() -> None:
        async for event in stream:
            opened.set()
            status = event.observation.cluster if event.observation else None
            seen.append((event.cluster_name, status))
            if (event.cluster_name, status) == (handle.cluster_name, down):
                return

    watcher = asyncio.create_task(until_down())
    # The stream starts "from now": probe launches until one of their events comes through.
    for probe in range(100, 110):
        await backend.terminate(await backend.launch(task(probe, use_spot=False)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(opened.wait(), 0.5)
        if opened.is_set():
            break
    reply = await operator.PreemptCluster(pb.PreemptClusterRequest(cluster_name="mj-1-0"))
    assert reply.preempted
    await asyncio.wait_for(watcher, 5)
    assert seen[-1] == (handle.cluster_name, ClusterStatus.DOWN)
    assert await backend.task_status(handle) is None
    state = await operator.GetCloudState(pb.GetCloudStateRequest())
    assert (state.preempted_total, state.live_clusters, state.unterminated_clusters) == (1, 0, 1)


async def test_watch_resumes_after_a_sequence_number(running: RunningCloud) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.SimCloudServiceStub(channel)
        request = pb.LaunchRequest(cluster_name="r", job_id=1, epoch=1)
        await stub.Launch(request)
        call = stub.WatchEvents(pb.WatchEventsRequest(after_seq=1))
        hello = await call.read()
        assert not hello.events
        events: list[pb.ClusterEvent] = []
        while len(events) < 2:
            events += (await call.read()).events
        call.cancel()
        assert [e.seq for e in events] == [2, 3]
        assert events[0].cluster_status == pb.CLUSTER_STATUS_UP
        # A read says which event it is as new as: the events numbered below are older.
        cluster = (await stub.GetCluster(pb.GetClusterRequest(cluster_name="r"))).cluster
        assert cluster.event_seq == 3
        # Watched again from 1, both events are ready at once: they come in one message.
        call = stub.WatchEvents(pb.WatchEventsRequest(after_seq=1))
        assert not (await call.read()).events
        assert [e.seq for e in (await call.read()).events] == [2, 3]
        call.cancel()


async def test_an_unreachable_cloud_is_reported_and_recovers(
    backend: SimBackend, operator: pb_grpc.SimOperatorServiceAsyncStub
) -> None:
    assert await backend.reachable()
    await operator.InjectFaults(pb.InjectFaultsRequest(unreachable_seconds=300))  # 0.3 s real
    assert not await backend.reachable()
    with pytest.raises(BackendUnreachableError):
        await backend.cluster_status(backend.handle_for("x"))
    deadline = asyncio.get_running_loop().time() + 5
    while not await backend.reachable():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_inventory_lists_every_cluster_with_who_launched_it(
    backend: SimBackend, operator: pb_grpc.SimOperatorServiceAsyncStub
) -> None:
    for job in (1, 2):
        handle = await backend.launch(task(job, epoch=job + 10))
        await backend.terminate(handle, epoch=job + 10)
    await backend.launch(task(1, epoch=11))
    records = await list_inventory(operator, page_size=1)
    assert [(c.job_id, c.epoch, c.HasField("terminate_time")) for c in records] == [
        (1, 11, True),
        (2, 12, True),
        (1, 11, False),
    ]
    # Who asked for each end, with which epoch, and when (not before the launch).
    calls = [[(call.kind, call.epoch) for call in c.calls] for c in records]
    assert calls == [
        [(pb.CLUSTER_CALL_KIND_TERMINATE, 11)],
        [(pb.CLUSTER_CALL_KIND_TERMINATE, 12)],
        [],
    ]
    first = records[0]
    assert first.calls[0].call_time.ToNanoseconds() >= first.launch_time.ToNanoseconds()
    assert [c.cluster_id for c in await list_inventory(operator, job_id=2)] == [2]
    state = await operator.GetCloudState(pb.GetCloudStateRequest())
    assert (state.launched_total, state.terminated_total, state.violations) == (3, 2, 0)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await operator.ListInventory(pb.ListInventoryRequest(page_token="nope"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_launch_its_caller_abandons_is_rolled_back() -> None:
    """A cancelled Launch leaves no cluster behind, even one still provisioning."""
    cloud = await start(
        small_cloud(time_scale=1.0, launch_latency_seconds=30.0),
        port=0,
        security=ServerSecurity.without_auth(),
    )
    sim = make_backend("sim", {"simcloud_address": f"127.0.0.1:{cloud.port}"})
    try:
        launching = asyncio.create_task(sim.launch(task(7)))
        await eventually(lambda: sim.cluster_exists("mj-7-0"), True)
        launching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await launching
        await eventually(lambda: sim.cluster_exists("mj-7-0"), False)
    finally:
        await sim.close()
        await cloud.stop()


async def test_a_launch_never_waits_for_a_batch_in_flight() -> None:
    """Launches take minutes on a real cloud: one asked for while others provision goes
    at once in a batch of its own, and callers that give up leave nothing behind."""
    cloud = await start(
        small_cloud(time_scale=1.0, launch_latency_seconds=30.0),
        port=0,
        security=ServerSecurity.without_auth(),
    )
    sim = SimBackend(f"127.0.0.1:{cloud.port}")
    try:
        launching = []
        for job in (1, 2, 3, 4, 5, 6):
            launching.append(asyncio.create_task(sim.launch(task(job, use_spot=False))))
            await eventually(lambda job=job: sim.cluster_exists(f"mj-{job}-0"), True)
        assert sim.batched.launches.batches == 6
        for call in launching:
            call.cancel()
        await asyncio.gather(*launching, return_exceptions=True)
        for job in (1, 2, 3, 4, 5, 6):
            await eventually(lambda job=job: sim.cluster_exists(f"mj-{job}-0"), False)
    finally:
        await sim.close()
        await cloud.stop()


async def test_a_replica_that_lost_its_lease_leaves_a_launch_it_gave_up_standing() -> None:
    """The teardown of a launch whose runner gave up is the backend's own call: the
    replica's lease guard checks it as any other, and a replica without its lease
    leaves the cluster to the job's next holder rather than send a stale terminate."""
    cloud = await start(
        small_cloud(time_scale=1.0, launch_latency_seconds=30.0),
        port=0,
        security=ServerSecurity.without_auth(),
    )
    sim = SimBackend(f"127.0.0.1:{cloud.port}")
    lease = {"valid": True}

    async def wait_lease() -> bool:
        return lease["valid"]

    guarded = LeaseGuard(sim, wait_lease)
    try:
        kept = asyncio.create_task(guarded.launch(task(1, use_spot=False)))
        await eventually(lambda: sim.cluster_exists("mj-1-0"), True)
        kept.cancel()
        await asyncio.gather(kept, return_exceptions=True)
        # With its lease, the replica tears down what it gave up.
        await eventually(lambda: sim.cluster_exists("mj-1-0"), False)

        left = asyncio.create_task(guarded.launch(task(2, use_spot=False)))
        await eventually(lambda: sim.cluster_exists("mj-2-0"), True)
        lease["valid"] = False
        left.cancel()
        await asyncio.gather(left, return_exceptions=True)
        await asyncio.sleep(0.3)
        assert await sim.cluster_exists("mj-2-0")
        state = cloud.cloud.state()
        assert (state.terminated_total, state.stale_terminates_rejected) == (1, 0)
        with pytest.raises(LeaseLost, match="lease lost; not calling teardown of mj-2-0"):
            assert sim.own_call_fence is not None
            await sim.own_call_fence("teardown of mj-2-0")
    finally:
        await sim.close()
        await cloud.stop()


async def eventually(check: Any, want: object, timeout: float = 5.0) -> None:
    """Waits (bounded) until `await check()` equals `want`."""
    async with asyncio.timeout(timeout):
        while True:
            if await check() == want:
                return
            await asyncio.sleep(0.01)


# --- task ends, notices and signals: a real server on a manual clock -----------------------
#
# The cloud's clock moves only when a test calls `advance`, so every simulated instant
# below is exact; launches need no advance (launch latency 0), and wall-clock times are
# START + simulated seconds.

START = 1_700_000_000.0
NOTICE = 120.0
# The `sim` setting of a task that traps SIGTERM: only SIGKILL ends it.
TRAPS = {"sigterm_exit_seconds": "never"}


@dataclasses.dataclass
class Manual:
    """A sim cloud on a manual clock, served on port 0, and its clients."""

    running: RunningCloud
    backend: SimBackend
    cloud: pb_grpc.SimCloudServiceAsyncStub
    operator: pb_grpc.SimOperatorServiceAsyncStub

    def advance(self, seconds: float) -> None:
        self.running.cloud.advance(seconds)

    async def cluster(self, name: str) -> pb.Cluster:
        return (await self.cloud.GetCluster(pb.GetClusterRequest(cluster_name=name))).cluster


@pytest.fixture
async def manual() -> AsyncIterator[Manual]:
    """us-east-1 announces spot reclaims NOTICE simulated seconds ahead; other regions do not."""
    config = small_cloud(launch_latency_seconds=0.0)
    east = dataclasses.replace(config.regions[0], notice_seconds=NOTICE)
    config = dataclasses.replace(config, regions=(east, *config.regions[1:]))
    running = await start(
        config, port=0, clock=ManualClock(START), security=ServerSecurity.without_auth()
    )
    backend = SimBackend(f"127.0.0.1:{running.port}")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield Manual(
            running,
            backend,
            pb_grpc.SimCloudServiceStub(channel),
            pb_grpc.SimOperatorServiceStub(channel),
        )
    finally:
        await channel.close()
        await backend.close()
        await running.stop()


async def open_stream(m: Manual) -> AsyncIterator[ClusterEvent]:
    """The backend's event stream, once open: it starts "from now", so probe until one shows."""
    stream = m.backend.events()
    assert stream is not None
    first = asyncio.ensure_future(anext(stream))
    for probe in range(900, 1000):
        await m.backend.launch(task(probe, use_spot=False))
        done, _ = await asyncio.wait({first}, timeout=0.2)
        if done:
            break
    assert first.done(), "the event stream never opened"
    return stream


async def next_event_of(
    stream: AsyncIterator[ClusterEvent], name: str, timeout: float = 5.0
) -> ClusterEvent:
    """The next event about cluster `name` (others skipped), within `timeout` real seconds."""
    async with asyncio.timeout(timeout):
        async for event in stream:
            if event.cluster_name == name:
                return event
    raise AssertionError("the event stream ended")


async def test_a_finished_task_stays_readable_after_its_cluster_is_preempted(
    manual: Manual,
) -> None:
    m = manual
    done = await m.backend.launch(task(1, sim={"runtime_seconds": 5, "exit_code": 3}))
    running = await m.backend.launch(task(2, sim={"runtime_seconds": 1e6}))
    m.advance(5)
    end = TaskEnd(TaskStatus.FAILED, 3, START + 5)
    assert await m.backend.observe(done) == Observation(ClusterStatus.UP, TaskStatus.FAILED, end)
    for name in (done.cluster_name, running.cluster_name):
        await m.operator.PreemptCluster(pb.PreemptClusterRequest(cluster_name=name))
    # The end survives the preemption; a task that had not ended is unreadable.
    assert await m.backend.observe(done) == Observation(ClusterStatus.DOWN, TaskStatus.FAILED, end)
    record = await m.cluster(done.cluster_name)
    assert (record.status, record.task_status, record.exit_code) == (
        pb.CLUSTER_STATUS_DOWN,
        pb.TASK_STATUS_FAILED,
        3,
    )
    assert await m.backend.observe(running) == Observation(ClusterStatus.DOWN)
    # Many clusters, one call: every name answered, one never launched among them.
    never = m.backend.handle_for("never-launched")
    bad = m.backend.handle_for("no such name!")
    seen = await m.backend.observe_many([done, running, never, done, bad])
    assert isinstance(seen.pop(bad.cluster_name), PrecheckError)
    assert seen == {
        done.cluster_name: Observation(ClusterStatus.DOWN, TaskStatus.FAILED, end),
        running.cluster_name: Observation(ClusterStatus.DOWN),
        "never-launched": Observation(ClusterStatus.DOWN),
    }
    reply = await m.cloud.GetClusters(
        pb.GetClustersRequest(cluster_names=[done.cluster_name, "never-launched"])
    )
    assert [c.name for c in reply.clusters] == [done.cluster_name]
    assert list(reply.unknown_cluster_names) == ["never-launched"]
    # Terminated: the end is history (in the inventory), no longer an observation.
    await m.backend.terminate(done)
    assert await m.backend.observe(done) == Observation(ClusterStatus.DOWN)
    record = await m.cluster(done.cluster_name)
    assert record.task_status == pb.TASK_STATUS_UNSPECIFIED and record.HasField("task_end_time")


async def test_pushed_events_carry_the_whole_observation(manual: Manual) -> None:
    m = manual
    stream = await open_stream(m)
    handle = await m.backend.launch(task(1, sim={"runtime_seconds": 5, "exit_code": 3}))
    up = await next_event_of(stream, handle.cluster_name)
    assert up.observation == Observation(ClusterStatus.INIT)
    up = await next_event_of(stream, handle.cluster_name)
    assert up.observation == Observation(ClusterStatus.UP, TaskStatus.RUNNING)
    m.advance(5)
    end = TaskEnd(TaskStatus.FAILED, 3, START + 5)
    ended = await next_event_of(stream, handle.cluster_name)
    assert ended.observation == Observation(ClusterStatus.UP, TaskStatus.FAILED, end)
    assert ended.notice_deadline is None
    await m.operator.PreemptCluster(pb.PreemptClusterRequest(cluster_name=handle.cluster_name))
    down = await next_event_of(stream, handle.cluster_name)
    assert down.observation == Observation(ClusterStatus.DOWN, TaskStatus.FAILED, end)


async def test_a_spot_reclaim_is_announced_notice_seconds_ahead(manual: Manual) -> None:
    m = manual
    stream = await open_stream(m)
    sim = {"runtime_seconds": 1e6, "preempt_after_seconds": 10}
    handle = await m.backend.launch(task(1, sim=sim))
    assert handle.region == EAST
    for _ in range(2):  # INIT, UP
        await next_event_of(stream, handle.cluster_name)
    m.advance(10)  # the reclaim is decided, and announced NOTICE seconds ahead
    notice = await next_event_of(stream, handle.cluster_name)
    deadline = START + 10 + NOTICE
    assert notice.notice_deadline == deadline
    # The observation carries the pending reclaim too, for whoever looks without the event.
    assert notice.observation == Observation(
        ClusterStatus.UP, TaskStatus.RUNNING, notice_deadline=deadline
    )
    m.advance(NOTICE - 0.5)
    assert (await m.backend.observe(handle)).cluster == ClusterStatus.UP
    m.advance(0.5)
    down = await next_event_of(stream, handle.cluster_name)
    assert down.observation == Observation(ClusterStatus.DOWN)
    assert down.notice_deadline is None
    record = await m.cluster(handle.cluster_name)
    assert record.preempt_time.ToNanoseconds() / 1e9 == deadline
    assert record.notice_deadline.ToNanoseconds() / 1e9 == deadline
    # An operator's notice: announced with its own lead time, then the reclaim.
    other = await m.backend.launch(task(2, sim={"runtime_seconds": 1e6}))
    reply = await m.operator.PreemptCluster(
        pb.PreemptClusterRequest(cluster_name=other.cluster_name, notice_seconds=30)
    )
    later = START + 10 + NOTICE + 30
    assert reply.preempted and reply.deadline.ToNanoseconds() / 1e9 == later
    for _ in range(2):  # INIT, UP
        await next_event_of(stream, other.cluster_name)
    assert (await next_event_of(stream, other.cluster_name)).notice_deadline == later
    m.advance(30)
    assert (await next_event_of(stream, other.cluster_name)).observation == Observation(
        ClusterStatus.DOWN
    )
    state = await m.operator.GetCloudState(pb.GetCloudStateRequest())
    assert (state.preemption_notices_total, state.preempted_total) == (2, 2)


async def test_a_notice_is_passed_on_to_the_task_and_fenced_by_epoch(manual: Manual) -> None:
    m = manual
    sim = {"runtime_seconds": 100, "log_lines": ["a", "b", "c", "d"]}
    handle = await m.backend.launch(task(1, epoch=2, sim=sim))
    m.advance(30)  # lines at 0 and 25 are out
    tail = m.backend.tail_logs(handle)
    assert isinstance(tail, AsyncGenerator)
    followed = await read_until(tail, b"a\nb\n")
    deadline = START + 150
    await m.backend.notify_preemption(handle, 2, deadline)
    # A follower reads the note at once, not at the next line.
    followed += await read_until(tail, b"reclaim at")
    await tail.aclose()
    record = await m.cluster(handle.cluster_name)
    assert record.notice_delivered_time.ToNanoseconds() / 1e9 == START + 30
    assert record.notice_delivered_deadline.ToNanoseconds() / 1e9 == deadline
    note = b"received SIGTERM: preemption notice, reclaim at 2023-11-14T22:15:50Z\n"
    assert await m.backend.read_logs(handle) == b"a\nb\n" + note == followed
    m.advance(70)
    assert await m.backend.read_logs(handle) == b"a\nb\n" + note + b"c\nd\n"
    [listed] = await list_inventory(m.operator, job_id=1)
    assert listed.notice_delivered_time == record.notice_delivered_time
    # A replica that lost the job may not signal the new holder's task.
    with pytest.raises(StaleEpochError, match="stale epoch 1"):
        await m.backend.notify_preemption(handle, 1, deadline + 1)
    assert (await m.cluster(handle.cluster_name)).notice_delivered_deadline == (
        record.notice_delivered_deadline
    )
    state = await m.operator.GetCloudState(pb.GetCloudStateRequest())
    assert (state.notices_delivered_total, state.stale_notices_rejected) == (1, 1)
    # Nothing to tell once the task ended, or for a cluster never launched.
    reply = await m.cloud.NotifyPreemption(
        pb.NotifyPreemptionRequest(
            cluster_name=handle.cluster_name, epoch=2, deadline=record.notice_delivered_deadline
        )
    )
    assert not reply.delivered
    await m.backend.notify_preemption(m.backend.handle_for("never-launched"), 2, deadline)


async def test_a_graceful_terminate_signals_the_task_and_ends_after_the_grace(
    manual: Manual,
) -> None:
    m = manual
    handle = await m.backend.launch(task(1, sim={"runtime_seconds": 1e6, **TRAPS}))
    m.advance(7)
    terminating = asyncio.create_task(m.backend.terminate(handle, epoch=1, grace=30))
    await eventually(lambda: signalled(m, handle.cluster_name), True)
    record = await m.cluster(handle.cluster_name)
    assert record.status == pb.CLUSTER_STATUS_UP
    assert record.sigterm_time.ToNanoseconds() / 1e9 == START + 7
    assert b"received SIGTERM: terminating, SIGKILL in 30s\n" in await m.backend.read_logs(handle)
    m.advance(29.5)
    assert (await m.cluster(handle.cluster_name)).status == pb.CLUSTER_STATUS_UP
    assert not terminating.done()
    m.advance(0.5)
    await asyncio.wait_for(terminating, 5)
    record = await m.cluster(handle.cluster_name)
    assert record.status == pb.CLUSTER_STATUS_TERMINATED
    assert record.terminate_time.ToNanoseconds() / 1e9 == START + 37
    [listed] = await list_inventory(m.operator, job_id=1)
    assert listed.sigterm_time == record.sigterm_time
    # A task that ends within its grace ends the terminate with it.
    short = await m.backend.launch(task(2, sim={"runtime_seconds": 10, **TRAPS}))
    terminating = asyncio.create_task(m.backend.terminate(short, grace=300))
    await eventually(lambda: signalled(m, short.cluster_name), True)
    m.advance(10)
    await asyncio.wait_for(terminating, 5)
    assert (await m.cluster(short.cluster_name)).terminate_time.ToNanoseconds() / 1e9 == (
        START + 47
    )
    # A task already ended gets no signal, and its cluster goes at once.
    m.advance(1)
    ended = await m.backend.launch(task(3, sim={"runtime_seconds": 0}))
    await m.backend.terminate(ended, grace=300)
    record = await m.cluster(ended.cluster_name)
    assert record.status == pb.CLUSTER_STATUS_TERMINATED and not record.HasField("sigterm_time")


async def test_a_stop_kills_the_task_after_the_grace_and_keeps_the_cluster_and_its_log(
    manual: Manual,
) -> None:
    m = manual
    handle = await m.backend.launch(
        task(1, epoch=2, sim={"runtime_seconds": 1e6, "log_lines": ["x"], **TRAPS})
    )
    m.advance(7)
    with pytest.raises(StaleEpochError):
        await m.backend.stop(handle, epoch=1, grace=0)
    await m.backend.stop(m.backend.handle_for("never-launched"), 2, 0)  # nothing to stop
    stopping = asyncio.create_task(m.backend.stop(handle, epoch=2, grace=30))
    await eventually(lambda: signalled(m, handle.cluster_name), True)
    m.advance(29.5)
    assert not stopping.done()
    m.advance(0.5)
    await asyncio.wait_for(stopping, 5)
    record = await m.cluster(handle.cluster_name)
    assert record.status == pb.CLUSTER_STATUS_UP
    assert (record.task_status, record.exit_code) == (pb.TASK_STATUS_FAILED, 137)
    assert record.task_end_time.ToNanoseconds() / 1e9 == START + 37
    assert await m.backend.read_logs(handle) == (
        b"x\nreceived SIGTERM: stopping, SIGKILL in 30s\nkilled (SIGKILL)\n"
    )
    # Stopping again has nothing to stop; the terminate that follows is at once.
    await m.backend.stop(handle, epoch=2, grace=30)
    await m.backend.terminate(handle, epoch=2, grace=30)
    assert (await m.cluster(handle.cluster_name)).status == pb.CLUSTER_STATUS_TERMINATED


async def test_a_task_exits_at_sigterm_unless_it_traps_it(manual: Manual) -> None:
    """As a process with the default handler, a task ends at its stop's SIGTERM (143),
    with no simulated time passing; one that traps it exits N seconds later, or is
    killed at the end of the grace when N is longer."""
    m = manual
    # The second line is due long after the stop: a task that ended never writes it.
    sim = {"runtime_seconds": 1e6, "log_lines": ["x", "later"]}
    default = await m.backend.launch(task(1, sim=sim, use_spot=False))
    m.advance(7)
    await asyncio.wait_for(m.backend.stop(default, epoch=1, grace=30), 5)
    record = await m.cluster(default.cluster_name)
    assert (record.status, record.task_status, record.exit_code) == (
        pb.CLUSTER_STATUS_UP,
        pb.TASK_STATUS_FAILED,
        143,
    )
    assert record.task_end_time == record.sigterm_time
    assert record.task_end_time.ToNanoseconds() / 1e9 == START + 7
    assert await m.backend.read_logs(default) == (
        b"x\nreceived SIGTERM: stopping, SIGKILL in 30s\nexited (SIGTERM)\n"
    )
    # A graceful terminate of such a task ends the cluster at once too.
    other = await m.backend.launch(task(2, sim=sim, use_spot=False))
    await asyncio.wait_for(m.backend.terminate(other, epoch=1, grace=30), 5)
    record = await m.cluster(other.cluster_name)
    assert record.status == pb.CLUSTER_STATUS_TERMINATED
    assert record.terminate_time == record.sigterm_time == record.task_end_time
    assert record.exit_code == 143

    trapping = await m.backend.launch(
        task(3, sim={**sim, "sigterm_exit_seconds": 10}, use_spot=False)
    )
    stopping = asyncio.create_task(m.backend.stop(trapping, epoch=1, grace=30))
    await eventually(lambda: signalled(m, trapping.cluster_name), True)
    m.advance(9.5)
    assert (await m.cluster(trapping.cluster_name)).task_status == pb.TASK_STATUS_RUNNING
    assert not stopping.done()
    m.advance(0.5)
    await asyncio.wait_for(stopping, 5)
    record = await m.cluster(trapping.cluster_name)
    assert (record.task_status, record.exit_code) == (pb.TASK_STATUS_FAILED, 143)
    assert record.task_end_time.ToNanoseconds() / 1e9 == START + 17
    # A terminate ends the cluster once its trapping task exits, before the grace is out.
    slow = await m.backend.launch(task(4, sim={**sim, "sigterm_exit_seconds": 10}, use_spot=False))
    terminating = asyncio.create_task(m.backend.terminate(slow, epoch=1, grace=30))
    await eventually(lambda: signalled(m, slow.cluster_name), True)
    m.advance(10)
    await asyncio.wait_for(terminating, 5)
    record = await m.cluster(slow.cluster_name)
    assert record.terminate_time.ToNanoseconds() / 1e9 == START + 27
    # Exiting later than the grace: SIGKILL at the end of the grace comes first.
    late = await m.backend.launch(task(5, sim={**sim, "sigterm_exit_seconds": 60}, use_spot=False))
    stopping = asyncio.create_task(m.backend.stop(late, epoch=1, grace=30))
    await eventually(lambda: signalled(m, late.cluster_name), True)
    m.advance(30)
    await asyncio.wait_for(stopping, 5)
    record = await m.cluster(late.cluster_name)
    assert (record.exit_code, record.task_end_time.ToNanoseconds() / 1e9) == (137, START + 57)
    m.advance(60)  # the trap's exit, due after the kill, changes nothing
    assert (await m.cluster(late.cluster_name)).exit_code == 137


async def test_a_stop_never_waits_for_an_earlier_stops_grace(manual: Manual) -> None:
    """Cancels made one after another each get their SIGTERM at once, though every
    earlier stop is still waiting out its grace for a task that traps SIGTERM: the
    stops' batches are never queued behind each other's answers."""
    m = manual
    handles = [
        await m.backend.launch(task(job, sim={"runtime_seconds": 1e6, **TRAPS}, use_spot=False))
        for job in range(1, 9)
    ]
    stops = []
    for handle in handles:
        stops.append(asyncio.create_task(m.backend.stop(handle, epoch=1, grace=30)))
        await eventually(lambda h=handle: signalled(m, h.cluster_name), True)
    assert m.backend.batched.terminations.batches == len(handles)
    assert not any(stop.done() for stop in stops)
    m.advance(30)
    await asyncio.wait_for(asyncio.gather(*stops), 5)
    for handle in handles:
        record = await m.cluster(handle.cluster_name)
        assert record.sigterm_time.ToNanoseconds() / 1e9 == START
        assert (record.exit_code, record.task_end_time.ToNanoseconds() / 1e9) == (137, START + 30)


async def read_until(stream: AsyncIterator[bytes], marker: bytes) -> bytes:
    """Chunks of a log stream until `marker` shows (5 real seconds at most)."""
    got = b""
    async with asyncio.timeout(5):
        while marker not in got:
            got += await anext(stream)
    return got


async def signalled(m: Manual, name: str) -> bool:
    return (await m.cluster(name)).HasField("sigterm_time")


async def test_watching_past_the_head_is_out_of_range(manual: Manual) -> None:
    m = manual
    await m.backend.launch(task(1))
    head = (await m.operator.GetCloudState(pb.GetCloudStateRequest())).head_seq
    call = m.cloud.WatchEvents(pb.WatchEventsRequest(after_seq=head + 5))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "after_seq" in (caught.value.details() or "")


async def test_the_backend_knows_the_clouds_regions_once_loaded(manual: Manual) -> None:
    m = manual
    assert m.backend.launch_concurrency == 256
    await m.backend.load()
    assert m.backend.regions() == (EAST, WEST, EU)
