"""The logs RPCs replicas call refuse what is not theirs (contract §14, §19): a job that does
not exist, another job's cluster, a job the calling replica does not hold at the epoch it
gives. Real gRPC with tokens (`identities`), a scripted scheduler (`logs_harness`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from harness.identities import Identities, make_identities
from harness.logs_harness import RUNNING, MemoryBackend, System, running_system
from managedjobs.v1 import log_service_pb2

C1 = "mj-1-0"
Line = log_service_pb2.ControllerLogLine


class Clock:
    """The holders cache's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    return make_identities(tmp_path_factory.mktemp("identities"))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def system(tmp_path: Path, ids: Identities, clock: Clock) -> AsyncIterator[System]:
    """The logs service with tokens; the stub calls as controller-1."""
    async with running_system(tmp_path, MemoryBackend(), ids, "controller", clock) as running:
        running.scheduler.add(1, controller_id="controller-1", epoch=3)
        running.scheduler.add(2, controller_id="controller-2", epoch=1)
        running.scheduler.add(3)  # waiting: held by nobody
        running.scheduler.update(1, status=RUNNING, cluster_name=C1)
        running.backend.write(C1, b"out\n")
        yield running


def reason(error: grpc.aio.AioRpcError) -> str:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)  # type: ignore[arg-type]
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    raise AssertionError("no ErrorInfo")


async def fetch(system: System, job_id: int, epoch: int, task_id: int = 0) -> int:
    request = log_service_pb2.FetchTaskLogsRequest(
        job_id=job_id,
        task_id=task_id,
        cluster_name=f"mj-{job_id}-{task_id}",
        attempt=1,
        epoch=epoch,
    )
    return (await system.stub.FetchTaskLogs(request)).bytes_stored


async def append(system: System, *lines: Line) -> log_service_pb2.AppendControllerLogsResponse:
    request = log_service_pb2.AppendControllerLogsRequest(lines=lines)
    return await system.stub.AppendControllerLogs(request)


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return raised.value


def job_folder(system: System, job_id: int) -> Path:
    return system.data_dir / "logs" / str(job_id)


async def test_the_holder_at_its_epoch_fetches_and_appends(system: System) -> None:
    assert await fetch(system, 1, epoch=3) == 4
    reply = await append(system, Line(job_id=1, epoch=3, line="launched"))
    assert (reply.lines_stored, list(reply.refused)) == (1, [])
    assert (job_folder(system, 1) / "controller.log").read_text() == "launched\n"


async def test_a_job_that_does_not_exist_is_not_found_and_gets_no_folder(system: System) -> None:
    error = await refused(fetch(system, 99, epoch=1))
    assert (error.code(), reason(error)) == (grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")
    error = await refused(append(system, Line(job_id=99, epoch=1, line="x")))
    assert (error.code(), reason(error)) == (grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")
    assert not job_folder(system, 99).exists()


async def test_another_jobs_cluster_is_invalid(system: System) -> None:
    request = log_service_pb2.FetchTaskLogsRequest(
        job_id=1, task_id=0, cluster_name="mj-2-0", attempt=1, epoch=3
    )
    error = await refused(system.stub.FetchTaskLogs(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mj-2-0" in (error.details() or "") and "mj-1-0" in (error.details() or "")
    # A task the job does not have: its cluster name is right, the task is not.
    error = await refused(fetch(system, 1, epoch=3, task_id=1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "task_id" in (error.details() or "")
    assert not job_folder(system, 1).exists()


@pytest.mark.parametrize(
    ("job_id", "epoch"),
    [(1, 2), (1, 4), (1, 0), (2, 1), (3, 0)],
    ids=["older epoch", "newer epoch", "no epoch", "another replica's job", "unassigned job"],
)
async def test_a_job_not_held_at_that_epoch_is_permission_denied(
    system: System, job_id: int, epoch: int
) -> None:
    error = await refused(fetch(system, job_id, epoch))
    assert (error.code(), reason(error)) == (grpc.StatusCode.PERMISSION_DENIED, "JOB_NOT_HELD")
    error = await refused(append(system, Line(job_id=job_id, epoch=epoch, line="x")))
    assert (error.code(), reason(error)) == (grpc.StatusCode.PERMISSION_DENIED, "JOB_NOT_HELD")
    assert not job_folder(system, job_id).exists()


async def test_a_batch_stores_the_lines_of_held_jobs_and_names_the_others(
    system: System,
) -> None:
    reply = await append(
        system,
        Line(job_id=1, epoch=3, line="one"),
        Line(job_id=2, epoch=1, line="not mine"),
        Line(job_id=99, epoch=1, line="no such job"),
        Line(job_id=1, epoch=3, line="two"),
    )
    assert reply.lines_stored == 2
    assert sorted((r.job_id, r.code) for r in reply.refused) == [
        (2, "PERMISSION_DENIED"),
        (99, "NOT_FOUND"),
    ]
    assert (job_folder(system, 1) / "controller.log").read_text() == "one\ntwo\n"
    assert not job_folder(system, 2).exists() and not job_folder(system, 99).exists()


async def test_a_batch_of_fetches_stores_the_held_jobs_and_answers_each_other_on_its_own(
    system: System,
) -> None:
    def item(job_id: int, epoch: int, cluster: str = "") -> log_service_pb2.FetchTaskLogsRequest:
        return log_service_pb2.FetchTaskLogsRequest(
            job_id=job_id,
            task_id=0,
            cluster_name=cluster or f"mj-{job_id}-0",
            attempt=1,
            epoch=epoch,
        )

    reply = await system.stub.BatchFetchTaskLogs(
        log_service_pb2.BatchFetchTaskLogsRequest(
            fetches=[item(1, 3), item(2, 1), item(99, 1), item(1, 3, cluster="mj-2-0")]
        )
    )
    assert [(r.bytes_stored, r.code, r.reason) for r in reply.results] == [
        (4, "", ""),
        (0, "PERMISSION_DENIED", "JOB_NOT_HELD"),
        (0, "NOT_FOUND", "JOB_NOT_FOUND"),
        (0, "INVALID_ARGUMENT", "ARGUMENT_INVALID"),
    ]
    assert "mj-2-0" in reply.results[3].message
    assert (job_folder(system, 1) / "task-0.log").read_bytes() == b"out\n"
    assert not job_folder(system, 2).exists() and not job_folder(system, 99).exists()
    for count in (0, 501):
        request = log_service_pb2.BatchFetchTaskLogsRequest(fetches=[item(1, 3)] * count)
        error = await refused(system.stub.BatchFetchTaskLogs(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "fetches: 1 to 500" in (error.details() or "")


async def test_a_log_the_disk_cannot_take_is_unavailable_not_internal(system: System) -> None:
    (system.data_dir / "logs").mkdir(parents=True, exist_ok=True)
    job_folder(system, 1).write_text("a file where job 1's folder should be")
    error = await refused(fetch(system, 1, epoch=3))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot store the logs of cluster mj-1-0" in (error.details() or "")


async def test_holds_are_cached_briefly_and_a_move_is_seen(system: System, clock: Clock) -> None:
    jobs = system.scheduler
    await append(system, *(Line(job_id=1, epoch=3, line=f"{i}") for i in range(50)))
    asked = jobs.questions
    for i in range(5):
        await append(system, Line(job_id=1, epoch=3, line=f"again {i}"))
    assert jobs.questions == asked  # one question for many lines and calls

    # The job's lease ran out and it came back to this replica at epoch 4.
    jobs.jobs[1].epoch = 4
    assert (await append(system, Line(job_id=1, epoch=4, line="resumed"))).lines_stored == 1
    assert jobs.questions == asked + 1  # a newer epoch is checked at once
    error = await refused(append(system, Line(job_id=1, epoch=3, line="stale")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert jobs.questions == asked + 1  # an older epoch than known needs no question

    # Moved to another replica: the cached hold lasts at most the cache's life.
    jobs.jobs[1].controller_id = "controller-2"
    jobs.jobs[1].epoch = 5
    clock.now += 5.0
    error = await refused(append(system, Line(job_id=1, epoch=4, line="too late")))
    assert (error.code(), reason(error)) == (grpc.StatusCode.PERMISSION_DENIED, "JOB_NOT_HELD")
    assert "controller-2" in (error.details() or "")
    log = (job_folder(system, 1) / "controller.log").read_text()
    assert "resumed" in log and "stale" not in log and "too late" not in log


async def test_a_batch_over_many_jobs_asks_the_scheduler_once(system: System) -> None:
    jobs = system.scheduler
    for job_id in range(10, 310):
        jobs.add(job_id, controller_id="controller-1", epoch=1)
    asked = jobs.questions
    reply = await append(system, *(Line(job_id=j, epoch=1, line="up") for j in range(10, 310)))
    assert reply.lines_stored == 300 and not reply.refused
    assert jobs.questions == asked + 1  # one ListJobs for the 300 jobs, no GetJob each


async def test_a_batch_of_fetches_over_many_jobs_asks_the_scheduler_once(system: System) -> None:
    jobs = system.scheduler
    for job_id in range(10, 110):
        jobs.add(job_id, controller_id="controller-1", epoch=1)
    asked = jobs.questions
    fetches = [
        log_service_pb2.FetchTaskLogsRequest(
            job_id=j, task_id=0, cluster_name=f"mj-{j}-0", attempt=1, epoch=1
        )
        for j in range(10, 110)
    ]
    reply = await system.stub.BatchFetchTaskLogs(
        log_service_pb2.BatchFetchTaskLogsRequest(fetches=fetches)
    )
    assert [r.code for r in reply.results] == [""] * 100
    assert jobs.questions == asked + 1  # one ListJobs for the 100 jobs, no GetJob each


async def test_a_user_cannot_call_the_replicas_rpcs(tmp_path: Path, ids: Identities) -> None:
    async with running_system(tmp_path, MemoryBackend(), ids, "user") as running:
        running.scheduler.add(1, controller_id="controller-1", epoch=3)
        error = await refused(fetch(running, 1, epoch=3))
        assert (error.code(), reason(error)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
        )
        assert not job_folder(running, 1).exists()
