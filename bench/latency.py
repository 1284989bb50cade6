"""Submit -> first launch under Poisson arrivals, and a single sequential client's submit time.

Starts the whole system (harness/bench/system.py: sim cloud with launch latency 0, one
replica), then:
- for each mean gap (0.5 s and 0.05 s by default), submits jobs at Poisson
  arrival times from one client and measures submit -> first launch (the job's
  STARTING event) p50/p99, and the SubmitJob round trip of that paced client;
- one client submitting one job at a time, each after the previous answer:
  the SubmitJob round trip p50/p99, each process's CPU per job meanwhile, and
  the scheduler's own handling time of those calls, from its `mj_rpc_seconds`
  histogram (`handling`: the "one SubmitJob, inside the scheduler" row);
  once through an asyncio channel (as the services call each other), once
  through the blocking channel `mj` uses (`sequential_submit_mj_client`, with
  this process's own CPU as "bench");
- the same sequential client against a server whose SubmitJob answers at once,
  in a process of its own, plaintext and without authentication
  (`sequential_floor`, as many calls): what gRPC's round trip alone costs on this
  machine, the floor under `sequential_submit`.
Target: the "submit -> launch granted" row of contract §15. Records one JSON line
(`results.py`).

    .venv/bin/python bench/latency.py [--jobs 200] [--gaps 0.5,0.05] [--sequential 300]
    (`--gaps ''`: the sequential client alone)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from harness.bench.results import record
from harness.bench.system import (
    LONG_SPEC,
    CpuMeter,
    channel,
    empty_server,
    handling_time,
    rpc_buckets,
    running_system,
    summary,
)
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.common.channels import ClientSecurity, open_channel, open_sync_channel
from services.launcher.ports import free_port
from services.launcher.stack import Stack


async def poisson(stack: Stack, jobs: int, gap: float, seed: int) -> dict[str, object]:
    """Submits `jobs` jobs at Poisson times (mean `gap` s): submit -> STARTING per job, and
    each SubmitJob's round trip (one client, one call at a time, as a paced user's)."""
    rng = random.Random(seed)
    sent: dict[int, float] = {}
    round_trips: list[float] = []
    started: dict[int, float] = {}
    done = asyncio.Event()
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)

        async def watch() -> None:
            async for response in stub.WatchJobs(jpb.WatchJobsRequest()):
                event = response.event
                if event.status == job_pb2.JOB_STATUS_STARTING and event.job_id not in started:
                    started[event.job_id] = time.time()
                    if len(started) >= jobs and len(sent) >= jobs:
                        done.set()
                        return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.5)  # the watch is open before the first submission
        for _ in range(jobs):
            await asyncio.sleep(rng.expovariate(1.0 / gap))
            at, start = time.time(), time.perf_counter()
            reply = await stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=LONG_SPEC))
            round_trips.append((time.perf_counter() - start) * 1000)
            sent[reply.job_id] = at
        await asyncio.wait_for(done.wait(), 120)
        watcher.cancel()
    return {
        **summary([(started[j] - sent[j]) * 1000 for j in sent if j in started], "ms"),
        "submit": summary(round_trips, "ms"),
    }


async def sequential(stack: Stack, jobs: int, metrics_port: int) -> dict[str, object]:
    """One job at a time, each after the previous answer: the SubmitJob round trip, the
    CPU each process spent per job meanwhile (every job is admitted, launched and
    reported RUNNING while the next ones are submitted), and the scheduler's handling
    time of the calls."""
    meter = CpuMeter(stack, bench=True)
    before = rpc_buckets(metrics_port, "SubmitJob")
    async with channel(stack, stack.scheduler_address) as chan:
        times = await one_by_one(job_service_pb2_grpc.JobServiceStub(chan), jobs)
    handling = handling_time(before, rpc_buckets(metrics_port, "SubmitJob"))
    return {**summary(times, "ms"), "cpu_ms_per_job": meter.ms_per(jobs), "handling": handling}


async def sequential_floor(jobs: int) -> dict[str, object]:
    """As `sequential`, against `EmptyJobService` (no work, no authentication, no TLS)."""
    with empty_server() as (address, _):
        async with open_channel(address, ClientSecurity()) as chan:
            await asyncio.wait_for(chan.channel_ready(), 30)
            times = await one_by_one(job_service_pb2_grpc.JobServiceStub(chan), jobs)
    return summary(times, "ms")


async def one_by_one(stub: job_service_pb2_grpc.JobServiceStub, jobs: int) -> list[float]:
    """`jobs` SubmitJob calls, each after the previous answer: each round trip in ms."""
    times = []
    for _ in range(jobs):
        start = time.perf_counter()
        await stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=LONG_SPEC))
        times.append((time.perf_counter() - start) * 1000)
    return times


def sequential_blocking(stack: Stack, jobs: int) -> dict[str, object]:
    """As `sequential`, through the blocking client `mj` uses (`open_sync_channel`)."""
    times = []
    meter = CpuMeter(stack, bench=True)
    with open_sync_channel(stack.scheduler_address, stack.credentials.client_security) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        for _ in range(jobs):
            start = time.perf_counter()
            stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=LONG_SPEC))
            times.append((time.perf_counter() - start) * 1000)
    return {**summary(times, "ms"), "cpu_ms_per_job": meter.ms_per(jobs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200, help="jobs per arrival rate")
    parser.add_argument("--gaps", default="0.5,0.05", help="mean gaps between arrivals (s)")
    parser.add_argument("--sequential", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    figures: dict[str, object] = {}
    metrics_port = free_port()
    scheduler_args = ["--metrics-port", str(metrics_port)]
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_system(Path(tmp), scheduler_args=scheduler_args) as stack,
    ):
        for gap in (float(g) for g in args.gaps.split(",") if g):
            figures[f"submit_to_launch_gap_{gap:g}s"] = asyncio.run(
                poisson(stack, args.jobs, gap, args.seed)
            )
        figures["sequential_submit"] = asyncio.run(sequential(stack, args.sequential, metrics_port))
        figures["sequential_submit_mj_client"] = sequential_blocking(stack, args.sequential)
    figures["sequential_floor"] = asyncio.run(sequential_floor(args.sequential))
    record("latency", {"jobs": args.jobs, **figures})


if __name__ == "__main__":
    main()
