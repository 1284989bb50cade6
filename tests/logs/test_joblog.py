"""Lifecycle lines leave a replica in shared batches, and a finishing job waits a bounded time.

A fake logs service (a real gRPC server in this process) counts the calls it gets
and can hang, so the test sees how many shipments many finishing jobs share and
that none of them waits longer than its bound when the service does not answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from managedjobs.v1 import log_service_pb2 as pb
from managedjobs.v1 import log_service_pb2_grpc
from services.backends import ClusterHandle
from services.common.channels import ClientSecurity
from services.controller.joblog import LogsClient


class FakeLogs(log_service_pb2_grpc.LogServiceServicer):
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.hang = False
        self.fetch_calls: list[list[int]] = []
        self.refuse: set[int] = set()

    async def AppendControllerLogs(
        self, request: pb.AppendControllerLogsRequest, context: Any
    ) -> pb.AppendControllerLogsResponse:
        if self.hang:
            await asyncio.Event().wait()
        self.calls.append(len(request.lines))
        return pb.AppendControllerLogsResponse()

    async def BatchFetchTaskLogs(
        self, request: pb.BatchFetchTaskLogsRequest, context: Any
    ) -> pb.BatchFetchTaskLogsResponse:
        self.fetch_calls.append([f.job_id for f in request.fetches])
        return pb.BatchFetchTaskLogsResponse(
            results=[
                pb.FetchTaskLogsResult(code="PERMISSION_DENIED", message="not held")
                if f.job_id in self.refuse
                else pb.FetchTaskLogsResult(bytes_stored=1)
                for f in request.fetches
            ]
        )


@pytest.fixture
async def logs() -> AsyncIterator[tuple[FakeLogs, LogsClient]]:
    fake = FakeLogs()
    server = grpc.aio.server()
    log_service_pb2_grpc.add_LogServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = LogsClient(f"127.0.0.1:{port}", ClientSecurity(), flush_interval=0.05)
    client.start()
    try:
        yield fake, client
    finally:
        await client.close()
        await server.stop(None)


async def test_many_finishing_jobs_share_shipments(logs: tuple[FakeLogs, LogsClient]) -> None:
    fake, client = logs
    for job_id in range(1, 201):
        client.note(job_id, 1, f"job {job_id}: SUCCEEDED")
    results = await asyncio.gather(*(client.shipped(job_id) for job_id in range(1, 201)))
    assert all(results)
    assert sum(fake.calls) == 200
    assert len(fake.calls) <= 2  # 200 lines fit one batch: not one call per job


async def test_a_logs_service_that_never_answers_holds_no_job_past_its_bound(
    logs: tuple[FakeLogs, LogsClient],
) -> None:
    fake, client = logs
    fake.hang = True
    for job_id in range(1, 101):
        client.note(job_id, 1, "finishing")
    waits = asyncio.gather(*(client.shipped(job_id, timeout=0.3) for job_id in range(1, 101)))
    # Waited on together, not in turn: the 100 jobs take one bound (0.3 s), where 100 in
    # turn would take 30 s.
    results = await asyncio.wait_for(waits, 10)
    assert results == [False] * 100


async def test_fetches_asked_for_at_once_share_one_call_and_a_refusal_is_not_retried(
    logs: tuple[FakeLogs, LogsClient],
) -> None:
    fake, client = logs
    fake.refuse = {2}
    results = await asyncio.gather(
        *(client.fetch(job, 0, 1, ClusterHandle(f"mj-{job}-0", "sim"), 1) for job in (1, 2, 3))
    )
    assert results == [True, False, True]
    # One call for the three; the refused one (a final answer) is not asked again.
    assert fake.fetch_calls == [[1, 2, 3]]
