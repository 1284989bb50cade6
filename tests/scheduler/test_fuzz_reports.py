"""A replica's reports, fuzzed against a real scheduler: a refused report writes nothing.

The generic fuzz test (test_fuzz.py) cannot reach past the epoch check of a report:
it never holds a job. Here a raw ConnectController stream plays a replica that
holds a real job (a two-task chain), and hypothesis sends it every kind of report
built from the proto descriptors (`fuzzing.messages`), most of them aimed at the
job it holds at its epoch, with random and extreme values everywhere else: unknown
statuses, negative counts, times beyond year 9999, huge texts, handbacks of many
jobs. For each report:

- the scheduler acknowledges it (accepted, or refused STALE or INVALID) and the
  stream stays up;
- a refused report leaves the job exactly as it was;
- at the end no log line is an error, and the admission counters equal a recount.

The hello is checked too: what the scheduler keeps of it (capacity, address,
regions, held jobs) must be in range, or the stream is refused INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from harness.fuzzing import SEED_VARIABLE, explore, fuzz_seed
from harness.replica_stream import (
    BUDGET,
    EXAMPLES,
    REPLICA,
    REPORTS,
    Fuzzer,
    Replica,
    hello,
    holding_a_job,
)
from managedjobs.v1 import job_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus
from services.scheduler.main import SchedulerApp

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


async def test_refused_reports_write_nothing_and_every_report_is_answered(
    app: SchedulerApp, caplog: pytest.LogCaptureFixture
) -> None:
    seed = fuzz_seed()
    print(f"{SEED_VARIABLE}={seed}")  # shown with any failure
    caplog.set_level(logging.WARNING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel:
        replica = Replica(channel)
        await replica.start(hello())
        fuzzer = Fuzzer(replica, job_service_pb2_grpc.JobServiceStub(channel))
        loop = asyncio.get_running_loop()
        ran = await asyncio.to_thread(
            explore, REPORTS, fuzzer.check, loop, examples=EXAMPLES, seed=seed, budget=BUDGET
        )
        replica.close()
    assert ran >= 10
    # Reports of every kind of answer were sent: the job's rules were really reached.
    assert {"REPORT_REFUSAL_UNSPECIFIED", "REPORT_REFUSAL_INVALID"} <= set(fuzzer.outcomes)
    assert await app.counters.reconcile() == {}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == []


async def test_a_refused_report_with_a_time_out_of_range_writes_nothing(app: SchedulerApp) -> None:
    async with holding_a_job(app) as (replica, fuzzer, held):
        before = await fuzzer.job(held.job_id)
        starting = pb.TaskTransition(
            job_id=held.job_id, epoch=held.epoch, task_id=0, status=2, cluster_name="mj-x"
        )
        starting.start_time.seconds = 2**62
        ack = await replica.report(pb.ConnectControllerRequest(transition=starting))
        assert ack.refusal == pb.REPORT_REFUSAL_INVALID
        assert "transition.start_time" in ack.reason
        assert await fuzzer.job(held.job_id) == before
        # The same report with a real time is applied.
        starting.start_time.seconds = 1_800_000_000
        ack = await replica.report(pb.ConnectControllerRequest(transition=starting))
        assert ack.accepted
        assert (await fuzzer.job(held.job_id)).tasks[0].cluster_name == "mj-x"


async def test_a_report_on_the_last_possible_task_id_is_refused_and_the_stream_stays(
    app: SchedulerApp,
) -> None:
    """The report of task 2**31 - 1 (a proto int32's largest) is about no task: refused
    INVALID, not a failed batch (on PostgreSQL, reading task_id + 1 overflowed its column
    and closed the stream)."""
    async with holding_a_job(app) as (replica, fuzzer, held):
        before = await fuzzer.job(held.job_id)
        last = pb.TaskTransition(
            job_id=held.job_id, epoch=held.epoch, task_id=2**31 - 1, status=2, attempt=1
        )
        ack = await replica.report(pb.ConnectControllerRequest(transition=last))
        assert ack.refusal == pb.REPORT_REFUSAL_INVALID
        assert await fuzzer.job(held.job_id) == before


async def test_texts_are_stored_as_they_can_be_and_names_too_long_are_refused(
    app: SchedulerApp,
) -> None:
    """PostgreSQL stores no NUL character and keeps a region to 64 characters: a report
    carrying either is made storable (never a failed batch that closes the stream)."""
    async with holding_a_job(app) as (replica, fuzzer, held):
        starting = pb.TaskTransition(
            job_id=held.job_id, epoch=held.epoch, task_id=0, status=int(JobStatus.STARTING)
        )
        starting.cluster_name = "c" * 129
        ack = await replica.report(pb.ConnectControllerRequest(transition=starting))
        assert ack.refusal == pb.REPORT_REFUSAL_INVALID and "cluster_name" in ack.reason
        starting.cluster_name = "mj-1-0"
        starting.region = "r" * 100
        starting.message = "exit\x00code"
        starting.failure_reason = "x" * 100_000
        ack = await replica.report(pb.ConnectControllerRequest(transition=starting))
        assert ack.accepted
        task = (await fuzzer.job(held.job_id)).tasks[0]
        assert task.region == "r" * 64 and len(task.failure_reason.encode()) <= 16 * 1024


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"capacity": pb.Capacity(max_launches=-1, max_jobs=1)}, "hello.capacity.max_launches"),
        ({"capacity": pb.Capacity(max_launches=1, max_jobs=-(2**31))}, "hello.capacity.max_jobs"),
        ({"address": "h" * 300}, "hello.address"),
        ({"regions": ["us-east-1", ""]}, "hello.regions[1]"),
        ({"regions": ["r"] * 1001}, "hello.regions"),
        ({"held_jobs": [pb.HeldJob(job_id=-5, epoch=1)]}, "hello.held_jobs[0]"),
    ],
)
async def test_a_hello_out_of_range_is_refused_naming_the_field(
    app: SchedulerApp, changes: dict[str, Any], field: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel:
        replica = Replica(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await replica.start(hello(**changes))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (caught.value.details() or "")
    assert app.replicas.refused_hellos == 1 and REPLICA not in app.admission.replicas
