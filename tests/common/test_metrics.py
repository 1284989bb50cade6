"""Prometheus metrics: what the scheduler counts, and a service serving them on its port."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from managedjobs.v1 import job_service_pb2 as pb
from managedjobs.v1 import job_service_pb2_grpc
from services.common.security.edge import ServerSecurity
from services.launcher.ports import free_port
from services.launcher.service import wait_serving
from services.scheduler.admission import Limits
from services.scheduler.main import SchedulerApp


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[job_service_pb2_grpc.JobServiceStub]:
    app = SchedulerApp(
        f"sqlite:///{tmp_path / 's.db'}", Limits(), security=ServerSecurity.without_auth()
    )
    port = await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield job_service_pb2_grpc.JobServiceStub(channel)
    await app.close()


async def test_submissions_cancels_and_rpcs_are_counted(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    submitted = value("mj_submissions_total")
    cancels = value("mj_cancels_total")
    calls = value("mj_rpc_seconds_count", method="/managedjobs.v1.JobService/SubmitJob", code="OK")
    refused = value(
        "mj_rpc_seconds_count",
        method="/managedjobs.v1.JobService/SubmitJob",
        code="INVALID_ARGUMENT",
    )
    ids = [
        (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n"))).job_id for _ in range(3)
    ]
    with pytest.raises(grpc.aio.AioRpcError):
        await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: [\n"))
    await client.CancelJobs(pb.CancelJobsRequest(job_ids=ids[:2]))
    assert value("mj_submissions_total") - submitted == 3
    assert value("mj_cancels_total") - cancels == 2
    method = "/managedjobs.v1.JobService/SubmitJob"
    assert value("mj_rpc_seconds_count", method=method, code="OK") - calls == 3
    assert value("mj_rpc_seconds_count", method=method, code="INVALID_ARGUMENT") - refused == 1
    # Jobs by schedule state, read from the counters when scraped.
    assert value("mj_jobs", state="WAITING") == 1


def test_a_service_serves_its_metrics_on_its_metrics_port(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "MJ_DATA_DIR": str(tmp_path), "MJ_AUTH": "none"}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.scheduler.main", "--port", str(port),
         "--metrics-port", str(metrics_port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}", 30)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        process.terminate()
        process.wait(30)
    for name in ("mj_submissions_total", "mj_jobs", "mj_rpc_seconds", "mj_counter_corrections"):
        assert name in text, name
