"""The system under benchmark: the whole stack as processes on a sim cloud, and its clients.

Every benchmark that measures the running system starts it here, so they all
run the same topology (sim cloud, scheduler, logs, replicas) with the same
settings, and reach it the same way. As under `make up`, every process runs
wherever the OS puts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil

from harness.bench.machine import probe_filesystem
from harness.bench.results import record
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.common.channels import open_channel
from services.launcher.ports import free_port
from services.launcher.stack import Stack

# One big region, no launch latency, tasks that run until cancelled.
CLOUD = """
seed: 1
time_scale: 1
launch_latency_seconds: 0
max_cpus: 64
regions:
  - {name: us-east-1, zones: [us-east-1a], spot_nodes: 10000000, on_demand_nodes: 10000000}
"""
LONG_SPEC = "name: bench\nrun: train\nsim: {runtime_seconds: 30000000}\n"
# A pushing backend: replicas never poll; launches are checked quickly.
CONTROLLER_ARGS = ["--poll-interval", "3600", "--start-check-interval", "0.05"]
CONTROLLER_ARGS += ["--log-level", "WARNING"]


@contextlib.contextmanager
def running_system(
    data_dir: Path,
    replicas: int = 1,
    database_url: str = "",
    scheduler_args: Sequence[str] = (),
    controller_args: Sequence[str] = (),
    tls: bool = False,
) -> Iterator[Stack]:
    probe_filesystem(data_dir)
    config = data_dir / "simcloud.yaml"
    config.write_text(CLOUD)
    stack = Stack(
        data_dir,
        replicas=replicas,
        database_url=database_url,
        scheduler_args=["--log-level", "WARNING", *scheduler_args],
        controller_args=[*CONTROLLER_ARGS, *controller_args],
        simcloud_args=["--config", str(config), "--log-level", "WARNING"],
        tls=tls,
    )
    stack.start(timeout=60)
    try:
        yield stack
    finally:
        stack.stop()


def run_jobs_bench(
    bench: str,
    description: str | None,
    measure: Callable[[Stack, int], Awaitable[dict[str, object]]],
    jobs: int,
) -> None:
    """A benchmark's `main`: `measure` over `--jobs` jobs (default `jobs`) on a system of
    its own, then one JSON line of its figures and the machine."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--jobs", type=int, default=jobs)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_system(Path(tmp)) as stack:
        figures = asyncio.run(measure(stack, args.jobs))
    record(bench, {"jobs": args.jobs, **figures})


class JobEvents:
    """One batched watch of every job, as the CLI watches; `record` (a subclass's) keeps
    what it needs of each event, with the time its response arrived."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()

    def record(self, event: job_pb2.JobEvent, at: float) -> None:
        raise NotImplementedError

    async def follow(self, stub: job_service_pb2_grpc.JobServiceStub) -> None:
        async for response in stub.WatchJobs(jpb.WatchJobsRequest(batched=True)):
            now = time.time()
            for event in response.events:
                self.record(event, now)
            self.changed.set()

    async def until(self, done: Callable[[], bool], timeout: float) -> None:
        """Returns once `done()` holds; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())


class EmptyJobService(job_service_pb2_grpc.JobServiceServicer):
    """Answers every SubmitJob at once: what a call costs before any work."""

    async def SubmitJob(
        self, request: jpb.SubmitJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> jpb.SubmitJobResponse:
        return jpb.SubmitJobResponse(job_id=1)


def serve_empty(port: int) -> None:
    async def serve() -> None:
        server = grpc.aio.server()
        job_service_pb2_grpc.add_JobServiceServicer_to_server(EmptyJobService(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


@contextlib.contextmanager
def empty_server() -> Iterator[tuple[str, psutil.Process]]:
    """`EmptyJobService` in a process of its own, plaintext and without authentication:
    its address and its process. gRPC's own cost of a call on this machine."""
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve_empty, args=(port,))
    server.start()
    try:
        yield f"127.0.0.1:{port}", psutil.Process(server.pid)
    finally:
        server.kill()
        server.join()


def channel(stack: Stack, address: str) -> grpc.aio.Channel:
    """An asyncio channel to a service of the system, as its admin (token, TLS if on)."""
    return open_channel(address, stack.credentials.client_security)


def processes(stack: Stack) -> dict[str, psutil.Process]:
    return {s.name: psutil.Process(s.process.pid) for s in stack.services if s.process}


def memory(process: psutil.Process) -> dict[str, float]:
    info = process.memory_full_info()
    return {"rss_mb": round(info.rss / 2**20, 1), "pss_mb": round(info.pss / 2**20, 1)}


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


class CpuMeter:
    """Counts the CPU every process of the system spends from now on (and, with
    `bench=True`, this process's too, as "bench")."""

    def __init__(self, stack: Stack, bench: bool = False) -> None:
        self.processes = processes(stack)
        if bench:
            self.processes["bench"] = psutil.Process()
        self.before = {name: cpu_seconds(p) for name, p in self.processes.items()}

    def ms_per(self, count: int) -> dict[str, float]:
        """Each process's milliseconds of CPU since the start, per one of `count` items."""
        return {
            name: round((cpu_seconds(p) - self.before[name]) * 1000 / count, 2)
            for name, p in self.processes.items()
        }


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def summary(values: Sequence[float], unit: str) -> dict[str, float]:
    """p50, p99 and max of `values`, rounded, keyed with `unit` (e.g. "ms")."""
    if not values:
        return {}
    return {
        f"p50_{unit}": round(statistics.median(values), 2),
        f"p99_{unit}": round(percentile(values, 0.99), 2),
        f"max_{unit}": round(max(values), 2),
    }


def rpc_buckets(metrics_port: int, method: str) -> dict[float, float]:
    """A service's `mj_rpc_seconds` histogram for `method` (calls answered OK), read from
    its Prometheus endpoint: cumulative count per bucket's upper bound (seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "mj_rpc_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            ours = labels.get("method", "").endswith(method) and labels.get("code") == "OK"
            if sample.name.endswith("_bucket") and ours:
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def handling_time(before: dict[float, float], after: dict[float, float]) -> dict[str, object]:
    """The server-side handling time of the calls between two readings of `rpc_buckets`:
    their count, the share answered within each bucket, and p50/p99 interpolated within
    their buckets (a histogram knows no finer)."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts.get(float("inf"), 0.0)
    if not total:
        return {"calls": 0}

    def quantile(q: float) -> float:
        target, lower, below = q * total, 0.0, 0.0
        for bound, cumulative in counts.items():
            if cumulative >= target:
                if bound == float("inf"):
                    return lower * 1000
                share = (target - below) / max(cumulative - below, 1e-9)
                return (lower + (bound - lower) * share) * 1000
            lower, below = bound, cumulative
        return lower * 1000

    return {
        "calls": int(total),
        "p50_ms": round(quantile(0.5), 2),
        "p99_ms": round(quantile(0.99), 2),
        "within_ms": {
            f"{bound * 1000:g}": round(n / total, 4)
            for bound, n in counts.items()
            if bound != float("inf") and bound <= 0.01
        },
    }


def postgres_database(admin_url: str) -> str:
    """A fresh database on the PostgreSQL server of `admin_url` (left for inspection)."""
    import asyncpg

    name = f"mj_bench_{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        conn = await asyncpg.connect(admin_url)
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()

    asyncio.run(create())
    return admin_url.rsplit("/", 1)[0] + "/" + name
