"""The logs service over real gRPC (`logs_harness`): storing and serving task logs,
following them live, controller logs, and the bounds of every request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness.local_clusters import open_folder
from harness.logs_harness import (
    DONE,
    RECOVERING,
    RUNNING,
    SUCCEEDED,
    Follow,
    MemoryBackend,
    System,
    running_system,
)
from managedjobs.v1 import job_pb2, job_service_pb2_grpc, log_service_pb2
from services.backends.base import ClusterHandle, LaunchPlan
from services.backends.local.backend import LocalBackend
from services.common.security.edge import ServerSecurity
from services.common.server import Server
from services.logs import RECOVERED_MARKER, LogStore
from services.logs.main import SETTINGS
from services.logs.reading import CHUNK_BYTES, tail_offset
from services.logs.store import OPEN_APPENDERS


@pytest.fixture
async def system(tmp_path: Path) -> AsyncIterator[System]:
    async with running_system(tmp_path, MemoryBackend()) as running:
        yield running


async def test_controller_log_append_then_read(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.add(2)
    await system.append(1, "launching", "running\n")
    await system.append(2, "other job")
    await system.append(1, "succeeded")

    assert await system.read(job_id=1, controller=True) == b"launching\nrunning\nsucceeded\n"
    assert await system.read(job_id=1, controller=True, tail_lines=2) == b"running\nsucceeded\n"
    assert await system.read(job_id=2, controller=True) == b"other job\n"
    assert (system.data_dir / "logs" / "1" / "controller.log").is_file()


async def test_controller_log_follow_wakes_on_append_and_ends_when_job_done(
    system: System,
) -> None:
    system.scheduler.add(1)
    await system.append(1, "first")
    follow = Follow(system, job_id=1, controller=True)
    await follow.until(b"first\n")

    await system.append(1, "second")
    await follow.until(b"second\n")
    system.scheduler.update(1, status=SUCCEEDED)
    await system.append(1, "cleaning up")
    await follow.until(b"cleaning up\n")
    assert not follow.ended
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"first\nsecond\ncleaning up\n"


INVALID = grpc.StatusCode.INVALID_ARGUMENT
C = "mj-1-0"  # the cluster of job 1's task 0, for each of its attempts


async def test_fetch_task_logs_stores_and_read_logs_serves_them(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=SUCCEEDED, cluster_name=C)
    system.backend.write(C, b"l1\nl2\nl3\n")

    assert await system.fetch(1, 0) == 9
    system.backend.vanish(C)

    assert (system.data_dir / "logs" / "1" / "task-0.log").read_bytes() == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1, task_id=0) == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1) == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1, tail_lines=2) == b"l2\nl3\n"
    assert await system.read(job_id=1, tail_lines=5) == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1, attempt=1, tail_lines=1) == b"l3\n"
    # A finished task's stored copy is complete: following it ends at once.
    assert await Follow(system, job_id=1, tail_lines=1).to_end() == b"l3\n"


async def test_fetch_by_cluster_name_and_refetch_replaces_not_duplicates(system: System) -> None:
    system.scheduler.add(1)
    system.backend.write(C, b"partial\n")
    request = log_service_pb2.FetchTaskLogsRequest(job_id=1, task_id=0, cluster_name=C, attempt=1)
    await system.stub.FetchTaskLogs(request)
    system.backend.write(C, b"rest\n")

    assert (await system.stub.FetchTaskLogs(request)).bytes_stored == 13
    assert await system.read(job_id=1, task_id=0) == b"partial\nrest\n"


async def test_read_without_follow_reads_a_live_cluster_once(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"x\ny\n")

    assert await system.read(job_id=1) == b"x\ny\n"
    assert await system.read(job_id=1, tail_lines=1) == b"y\n"
    assert await system.read(job_id=1, attempt=1) == b"x\ny\n"


async def test_follow_of_a_running_task_sends_every_byte_once_and_ends_with_the_task(
    system: System,
) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"one\n")
    follow = Follow(system, job_id=1)
    await follow.until(b"one\n")

    system.backend.write(C, b"two\n")
    await follow.until(b"two\n")
    system.backend.write(C, b"three\n")
    system.backend.finish(C)
    # What a controller does: SUCCEEDED first, fetch before teardown, then DONE.
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0)
    system.backend.vanish(C)
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"one\ntwo\nthree\n"


async def test_follow_finishes_from_the_stored_copy_after_the_tail_breaks(
    system: System,
) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"one\n")
    follow = Follow(system, job_id=1, task_id=0)
    await follow.until(b"one\n")

    system.backend.break_tails(C)
    system.backend.write(C, b"two\n")  # never reaches the live tail
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0)

    # Ends without DONE: the task is over and its stored copy is complete.
    assert await follow.to_end() == b"one\ntwo\n"


async def test_follow_continues_on_the_recovered_cluster_after_a_marker(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"a\n")
    follow = Follow(system, job_id=1)
    await follow.until(b"a\n")

    system.backend.vanish(C)  # preempted, its logs lost with it
    system.scheduler.update(1, status=RECOVERING)
    system.backend.relaunch(C)
    system.backend.write(C, b"b\n")
    system.scheduler.update(1, status=RUNNING, recovery_count=1)
    await follow.until(RECOVERED_MARKER + b"b\n")
    system.backend.finish(C)
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0, attempt=2)
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"a\n" + RECOVERED_MARKER + b"b\n"
    # The first attempt's logs could not be kept: asking for them says so.
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.read(job_id=1, attempt=1)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "attempt 1" in (raised.value.details() or "")
    assert await system.read(job_id=1, attempt=2) == b"b\n"


async def test_follow_waits_for_a_pending_task_and_goes_through_the_chain(
    system: System,
) -> None:
    system.scheduler.add(1, tasks=2)
    follow = Follow(system, job_id=1)
    for task_id in range(2):
        cluster = f"mj-1-{task_id}"
        system.backend.write(cluster, f"task {task_id}\n".encode())
        system.scheduler.update(1, task_id, status=RUNNING, cluster_name=cluster)
        await follow.until(f"task {task_id}\n".encode())
        system.backend.finish(cluster)
        system.scheduler.update(1, task_id, status=SUCCEEDED)
        await system.fetch(1, task_id)
    system.scheduler.update(1, 1, schedule_state=DONE)

    assert await follow.to_end() == b"task 0\ntask 1\n"
    assert sorted(set(follow.task_ids)) == [0, 1]
    assert follow.task_ids == sorted(follow.task_ids)


async def test_follow_of_a_task_that_never_ran_ends_when_the_job_is_done(system: System) -> None:
    system.scheduler.add(1)
    follow = Follow(system, job_id=1)
    system.scheduler.update(1, status=job_pb2.JOB_STATUS_CANCELLED, schedule_state=DONE)

    assert await follow.to_end() == b""


async def test_follow_of_a_real_local_cluster_sends_its_output_once(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "clusters", poll_interval=0.02)
    # The task runs as a uid of its own: it sees only folders open to everyone.
    with open_folder(0o755) as shared:
        go = shared / "go"
        run = f"echo one; while [ ! -e {go} ]; do sleep 0.01; done; echo two"
        request = LaunchPlan(job_id=1, task_id=0, epoch=1, cluster_name="mj-1-0", run=run)
        async with running_system(tmp_path, backend) as system:
            system.scheduler.add(1)
            system.scheduler.update(1, status=job_pb2.JOB_STATUS_STARTING, cluster_name="mj-1-0")
            handle = await backend.launch(request)
            try:
                system.scheduler.update(1, status=RUNNING)
                follow = Follow(system, job_id=1)
                await follow.until(b"one\n")
                go.touch()
                await follow.until(b"two\n")
                system.scheduler.update(1, status=SUCCEEDED)
                assert await system.fetch(1, 0, handle=handle) == len(b"one\ntwo\n")
            finally:
                await backend.terminate(handle)
            system.scheduler.update(1, schedule_state=DONE)

            assert await follow.to_end() == b"one\ntwo\n"
            assert await system.read(job_id=1) == b"one\ntwo\n"


async def test_follow_survives_a_scheduler_restart(system: System) -> None:
    system.scheduler.add(1)
    await system.append(1, "before")
    follow = Follow(system, job_id=1, controller=True)
    await follow.until(b"before\n")
    port = system.scheduler_server.port
    await system.scheduler_server.stop(0)

    restarted = Server("127.0.0.1", port, security=ServerSecurity.without_auth())
    restarted.add(
        job_service_pb2_grpc.add_JobServiceServicer_to_server,
        system.scheduler,
        "managedjobs.v1.JobService",
    )
    await restarted.start()
    system.scheduler_server = restarted
    await system.append(1, "after")
    await follow.until(b"after\n")
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"before\nafter\n"


async def test_drain_ends_follow_streams_with_unavailable(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name=C)
    system.backend.write(C, b"live\n")
    task_follow = Follow(system, job_id=1)
    controller_follow = Follow(system, job_id=1, controller=True)
    await task_follow.until(b"live\n")

    await system.servicer.drain()

    for follow in (task_follow, controller_follow):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await follow.to_end()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"job_id": 99}, grpc.StatusCode.NOT_FOUND, "99"),
        ({"job_id": 99, "follow": True}, grpc.StatusCode.NOT_FOUND, "99"),
        ({"job_id": 0}, grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
        ({"job_id": 1, "tail_lines": -1}, grpc.StatusCode.INVALID_ARGUMENT, "tail_lines"),
        ({"job_id": 1, "tail_lines": 100_001}, grpc.StatusCode.INVALID_ARGUMENT, "tail_lines"),
        ({"job_id": 1, "task_id": 1}, grpc.StatusCode.INVALID_ARGUMENT, "task_id"),
        ({"job_id": 1, "task_id": -1, "follow": True}, grpc.StatusCode.INVALID_ARGUMENT, "task_id"),
        ({"job_id": 1, "attempt": 0}, grpc.StatusCode.INVALID_ARGUMENT, "attempt"),
        ({"job_id": 1, "attempt": 1, "controller": True}, INVALID, "attempt"),
        ({"job_id": 1, "attempt": 2}, grpc.StatusCode.NOT_FOUND, "attempt 2"),
        ({"job_id": 1, "attempt": 2, "follow": True}, grpc.StatusCode.NOT_FOUND, "attempt 2"),
    ],
)  # fmt: skip
async def test_read_logs_rejects_bad_requests(
    system: System, fields: dict[str, Any], code: grpc.StatusCode, field: str
) -> None:
    system.scheduler.add(1)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.read(**fields)
    assert raised.value.code() == code
    assert field in (raised.value.details() or "")


def fetch_request(**fields: Any) -> log_service_pb2.FetchTaskLogsRequest:
    """A fetch of job 1's task 0, attempt 1, with `fields` changed."""
    values: dict[str, Any] = {"job_id": 1, "task_id": 0, "attempt": 1, "cluster_name": C}
    return log_service_pb2.FetchTaskLogsRequest(**{**values, **fields})


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (fetch_request(cluster_name=""), "cluster_name"),
        (fetch_request(job_id=0), "job_id"),
        (fetch_request(task_id=-1), "task_id"),
        (fetch_request(attempt=0), "attempt"),
        (fetch_request(attempt=-3), "attempt"),
        (fetch_request(handle_json="{"), "handle_json"),
        (fetch_request(handle_json="[]"), "handle_json"),
        (fetch_request(handle_json='{"cluster_name": 7}'), "handle_json"),
        (fetch_request(handle_json=ClusterHandle(C, backend="sim").to_json()), "handle_json"),
        (fetch_request(handle_json=ClusterHandle("mj-1-00", "memory").to_json()), "handle_json"),
        (fetch_request(cluster_name="mj-2-0"), "cluster_name"),
        (fetch_request(cluster_name="mj-1-1"), "cluster_name"),
        (fetch_request(cluster_name="x" * 5000), "cluster_name"),
        (fetch_request(handle_json=" " * (16 * 1024 + 1)), "handle_json"),
    ],
)
async def test_fetch_rejects_bad_requests_and_stores_nothing(
    system: System, request_: log_service_pb2.FetchTaskLogsRequest, field: str
) -> None:
    system.scheduler.add(1)
    system.scheduler.add(2)
    system.backend.write(C, b"x\n")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.stub.FetchTaskLogs(request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = raised.value.details() or ""
    assert field in details and len(details) < 600
    assert not (system.data_dir / "logs").exists()


async def test_deeply_nested_handle_json_is_invalid_and_the_service_goes_on(
    system: System,
) -> None:
    system.scheduler.add(1)
    system.backend.write(C, b"kept\n")
    for depth in (17, 5000):
        nested = "[" * depth + "]" * depth
        handle_json = f'{{"cluster_name": "{C}", "backend": "memory", "data": {nested}}}'
        assert len(handle_json) <= 16 * 1024
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await system.stub.FetchTaskLogs(fetch_request(handle_json=handle_json))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "nests deeper" in (raised.value.details() or "")
    # Brackets inside strings are not nesting, and a shallow handle is taken.
    shallow = ClusterHandle(C, "memory", data={"note": "[" * 100, "deep": [[1]]}).to_json()
    assert (await system.stub.FetchTaskLogs(fetch_request(handle_json=shallow))).bytes_stored == 5
    assert await system.read(job_id=1, attempt=1) == b"kept\n"


async def test_append_rejects_bad_batches_and_stores_nothing(system: System) -> None:
    system.scheduler.add(1)
    line = log_service_pb2.ControllerLogLine
    for lines, field in [
        ([line(job_id=1, line="fine"), line(job_id=0, line="x")], "lines[1].job_id"),
        ([line(job_id=1, line="x" * (16 * 1024 + 1))], "lines[0].line"),
        ([line(job_id=1, line="x")] * 1001, "lines"),
    ]:
        request = log_service_pb2.AppendControllerLogsRequest(lines=lines)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await system.stub.AppendControllerLogs(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (raised.value.details() or "")
    assert not (system.data_dir / "logs").exists()
    # The bounds themselves are fine.
    request = log_service_pb2.AppendControllerLogsRequest(
        lines=[line(job_id=1, line="y" * (16 * 1024))] + [line(job_id=1, line="z")] * 999
    )
    assert (await system.stub.AppendControllerLogs(request)).lines_stored == 1000


def test_controller_logs_stay_whole_past_the_open_files_kept(tmp_path: Path) -> None:
    store = LogStore(tmp_path)
    jobs = range(1, OPEN_APPENDERS + 40)
    for round_ in range(3):  # interleaved, so every job's file is closed and reopened
        for job_id in jobs:
            assert store.append_controller_lines(job_id, [f"{job_id} {round_}"]) > 0
    assert len(store._appenders) == OPEN_APPENDERS
    for job_id in jobs:  # readable before close: nothing waits in a buffer
        expected = "".join(f"{job_id} {round_}\n" for round_ in range(3))
        assert store.controller_path(job_id).read_text() == expected
    store.close()
    assert not store._appenders
    store.append_controller_lines(1, ["again"])
    assert store.controller_path(1).read_text().endswith("1 2\nagain\n")


def test_tail_offset_within_a_range(tmp_path: Path) -> None:
    path = tmp_path / "sections.log"
    path.write_bytes(b"a1\na2\n" + b"b1\nb2\nb3\n" + b"c1\n")
    start, end = 6, 15  # the b lines
    assert path.read_bytes()[tail_offset(path, 2, start, end) : end] == b"b2\nb3\n"
    assert tail_offset(path, 10, start, end) == start
    assert tail_offset(path, 0, start, end) == start
    assert tail_offset(tmp_path / "missing", 3, start, end) == start


def test_tail_offset_spans_chunks(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    lines = [f"{i:07d}\n".encode() for i in range(3 * CHUNK_BYTES // 8)]
    path.write_bytes(b"".join(lines))
    for count in (1, 2, CHUNK_BYTES // 8 + 3, len(lines), len(lines) + 1):
        start = tail_offset(path, count)
        assert path.read_bytes()[start:] == b"".join(lines[-count:])
    path.write_bytes(b"no newline\nat the end")
    assert path.read_bytes()[tail_offset(path, 1) :] == b"at the end"


def test_settings_have_unique_flags_and_env_vars() -> None:
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)
    assert {s.name: s.default for s in SETTINGS}["port"] == 50052
    assert all(s.env.startswith("MJ_") for s in SETTINGS)
