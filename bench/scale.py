"""N jobs submitted at once on the sim cloud (launch latency 0): how fast they all run, and cost.

Starts the whole system as processes (harness/bench/system.py), measures every process
before, submits N long jobs as fast as the API takes them, and reports:
- seconds until every job is RUNNING, and submissions per second;
- submit -> first launch (the job's STARTING event) p50/p99;
- RSS and PSS of every process before and loaded, and per job for the replicas;
- CPU seconds per job of the scheduler and the replicas while loading, and of every
  process of the system (`cpu_ms_per_job`), counted until every process is quiet
  again (`settled_after_s` after all run: what the loading left behind is its cost);
- idle CPU (percent of a core) of each process with every job running and
  nothing happening;
- with --drain, SIGTERM to one replica: how long until its process was gone, how
  long until the other replicas held its jobs, still RUNNING (needs --replicas 2
  or more), and the CPU seconds each process spent meanwhile.
Targets: the "jobs all RUNNING", "live jobs across replicas" and "controller memory
per live job" rows of contract §15. Records one JSON line (`results.py`).

    .venv/bin/python bench/scale.py [--jobs 2000] [--replicas 1] [--postgres URL] [--drain]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from harness.bench.results import record
from harness.bench.system import (
    LONG_SPEC,
    channel,
    cpu_seconds,
    memory,
    postgres_database,
    processes,
    running_system,
    summary,
)
from managedjobs.v1 import job_pb2, job_service_pb2_grpc, scheduler_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import scheduler_service_pb2 as spb
from services.launcher.stack import Stack


async def submit_all(stack: Stack, jobs: int, concurrency: int, batch: int) -> float:
    """Submits `jobs` jobs from `concurrency` callers, `batch` per call; returns the seconds."""
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        counter = iter(range(0, jobs, batch))

        async def submitter() -> None:
            for first in counter:
                requests = [
                    jpb.SubmitJobRequest(spec_yaml=LONG_SPEC, idempotency_key=f"s{i}")
                    for i in range(first, min(jobs, first + batch))
                ]
                if batch == 1:
                    await stub.SubmitJob(requests[0])
                else:
                    await stub.SubmitJobs(jpb.SubmitJobsRequest(jobs=requests))

        start = time.perf_counter()
        await asyncio.gather(*(submitter() for _ in range(concurrency)))
        return time.perf_counter() - start


async def watch_until_running(
    stack: Stack, jobs: int, timeout: float, after: int = 0
) -> dict[int, dict[str, Any]]:
    """Event times per job (submitted, starting, running) until `jobs` jobs are RUNNING.

    A watch that falls too far behind is cut off (RESOURCE_EXHAUSTED); it resumes
    after the last event it saw, as any client should.
    """
    times: dict[int, dict[str, Any]] = {}
    running = 0
    started = time.time()
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        while running < jobs:
            stream = stub.WatchJobs(jpb.WatchJobsRequest(after_event_id=after), timeout=timeout)
            try:
                async for response in stream:
                    event = response.event
                    after = max(after, event.event_id)
                    seen = times.setdefault(event.job_id, {})
                    at = event.time.ToNanoseconds() / 1e9
                    if event.message == "submitted":
                        seen.setdefault("submitted", at)
                    elif event.message.startswith("admitted on "):
                        seen.setdefault("admitted", at)
                        seen.setdefault("replica", event.message.removeprefix("admitted on "))
                    elif event.status == job_pb2.JOB_STATUS_STARTING:
                        seen.setdefault("starting", at)
                    elif event.status == job_pb2.JOB_STATUS_RECOVERING:
                        seen["recoveries"] = seen.get("recoveries", 0) + 1
                    elif event.status == job_pb2.JOB_STATUS_RUNNING and "running" not in seen:
                        seen["running"] = at
                        running += 1
                        if running % 10_000 == 0:  # a long run can be followed on stderr
                            progress = {"running": running, "s": round(time.time() - started, 1)}
                            print(json.dumps(progress), file=sys.stderr, flush=True)
                        if running >= jobs:
                            stream.cancel()
                            break
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
    return times


def settle(procs: dict[str, psutil.Process], quiet: float = 5.0, limit: float = 60.0) -> float:
    """Seconds until every process spent under `quiet` percent of a core in one second:
    work the jobs' loading left behind (lifecycle log lines shipped and stored) is part
    of their cost, not of the idle system's."""
    start = time.time()
    while time.time() - start < limit:
        if max(idle_cpu(procs, 1.0).values()) < quiet:
            break
    return round(time.time() - start, 1)


def idle_cpu(procs: dict[str, psutil.Process], seconds: float) -> dict[str, float]:
    before = {name: cpu_seconds(p) for name, p in procs.items()}
    time.sleep(seconds)
    return {
        name: round(100 * (cpu_seconds(p) - before[name]) / seconds, 2) for name, p in procs.items()
    }


def run(args: argparse.Namespace, data_dir: Path, database_url: str) -> dict[str, object]:
    figures: dict[str, object] = {}
    with running_system(data_dir, args.replicas, database_url) as stack:
        procs = processes(stack)
        time.sleep(1.0)
        before_memory = {name: memory(p) for name, p in procs.items()}
        before_cpu = {name: cpu_seconds(p) for name, p in procs.items()}
        loop = asyncio.new_event_loop()
        start = time.time()
        watch = loop.create_task(watch_until_running(stack, args.jobs, args.timeout))
        submit_seconds = loop.run_until_complete(
            submit_all(stack, args.jobs, args.concurrency, args.batch)
        )
        times = loop.run_until_complete(watch)
        all_running = max(t["running"] for t in times.values()) - start
        figures["settled_after_s"] = settle(procs)
        loaded_cpu = {name: cpu_seconds(p) - before_cpu[name] for name, p in procs.items()}
        loaded_memory = {name: memory(p) for name, p in procs.items()}
        figures["idle_cpu_percent"] = idle_cpu(procs, args.idle_seconds)
        if args.drain:
            figures["drain"] = drain(stack, procs, loop, args.jobs, args.timeout)
        loop.close()
    to_launch = [
        (t["starting"] - t["submitted"]) * 1000
        for t in times.values()
        if "starting" in t and "submitted" in t
    ]
    stages = {
        "submit_to_admit": ("submitted", "admitted"),
        "admit_to_starting": ("admitted", "starting"),
        "starting_to_running": ("starting", "running"),
    }
    breakdown = {
        name: summary([(t[b] - t[a]) * 1000 for t in times.values() if a in t and b in t], "ms")
        for name, (a, b) in stages.items()
    }
    replicas = [n for n in procs if n.startswith("controller")]
    admitted_on = collections.Counter(str(t["replica"]) for t in times.values() if "replica" in t)
    per_job_kb = [
        (loaded_memory[n]["rss_mb"] - before_memory[n]["rss_mb"]) * 1024 * args.replicas / args.jobs
        for n in replicas
    ]
    return {
        "jobs": args.jobs,
        "replicas": args.replicas,
        "database": "postgres" if database_url else "sqlite",
        "all_running_s": round(all_running, 2),
        "submissions_per_s": round(args.jobs / submit_seconds, 1),
        "submit_to_launch": summary(to_launch, "ms"),
        "stages": breakdown,
        "admitted_per_replica": dict(sorted(admitted_on.items())),
        # Nothing is preempted here (spot, but no preemption rate): a recovery is a bug.
        "recoveries": sum(int(t.get("recoveries", 0)) for t in times.values()),
        "scheduler_cpu_ms_per_job": round(1000 * loaded_cpu["scheduler"] / args.jobs, 2),
        "replica_cpu_ms_per_job": round(1000 * sum(loaded_cpu[n] for n in replicas) / args.jobs, 2),
        "cpu_ms_per_job": {
            name: round(1000 * seconds / args.jobs, 2) for name, seconds in loaded_cpu.items()
        },
        "replica_kb_per_job": round(statistics.mean(per_job_kb), 1),
        "memory_before": before_memory,
        "memory_loaded": loaded_memory,
        **figures,
    }


async def held_by(stack: Stack, controller_id: str) -> set[int]:
    """Ids of the jobs the replica holds, read page by page."""
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        ids: set[int] = set()
        request = jpb.ListJobsRequest(page_size=1000)
        while True:
            reply = await stub.ListJobs(request)
            ids |= {j.job_id for j in reply.jobs if j.controller_id == controller_id}
            if not reply.next_page_token:
                return ids
            request.page_token = reply.next_page_token


async def held_elsewhere(stack: Stack, victim: str, jobs: int, timeout: float) -> float:
    """When the other replicas held all `jobs` jobs again (Unix seconds): the scheduler
    gave each job the victim held, still RUNNING, to a new holder (its "resumed on"
    event). Read from the scheduler's counters every 10 ms: watching the jobs' events
    would cost this process and the scheduler more CPU than the move itself."""
    deadline = time.time() + timeout
    async with channel(stack, stack.scheduler_address) as chan:
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(chan)
        while time.time() < deadline:
            state = await stub.GetSchedulerState(spb.GetSchedulerStateRequest())
            if sum(r.alive for r in state.replicas if r.controller_id != victim) >= jobs:
                return time.time()
            await asyncio.sleep(0.01)
    raise TimeoutError(f"the jobs were not all held elsewhere after {timeout} s")


async def exited(process: subprocess.Popen[bytes], timeout: float) -> float:
    """When the process exited (Unix seconds), the event loop serving meanwhile."""
    deadline = time.time() + timeout
    while process.poll() is None:
        if time.time() > deadline:
            raise TimeoutError(f"pid {process.pid} still running after {timeout} s")
        await asyncio.sleep(0.005)
    return time.time()


def drain(
    stack: Stack,
    procs: dict[str, psutil.Process],
    loop: asyncio.AbstractEventLoop,
    jobs: int,
    timeout: float,
) -> dict[str, object]:
    """SIGTERM to the first replica: seconds to drain, and until its jobs run elsewhere,
    with the CPU seconds every other process (and this one, watching) spent meanwhile."""
    victim = stack.controllers[0]
    ids = loop.run_until_complete(held_by(stack, victim.name))
    others = {name: p for name, p in procs.items() if name != victim.name}
    others["bench"] = psutil.Process()
    before = {name: cpu_seconds(p) for name, p in others.items()}
    start = time.time()
    victim.signal(signal.SIGTERM)
    again = loop.create_task(held_elsewhere(stack, victim.name, jobs, timeout))
    assert victim.process is not None
    drained = loop.run_until_complete(exited(victim.process, 120)) - start
    resumed = loop.run_until_complete(again) - start
    cpu = {name: round(cpu_seconds(p) - before[name], 2) for name, p in others.items()}
    return {
        "jobs": len(ids),
        "drain_s": round(drained, 2),
        "running_elsewhere_s": round(resumed, 2),
        "cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=100, help="jobs per SubmitJobs call")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--drain", action="store_true")
    parser.add_argument("--postgres", default="", help="admin URL: run on a fresh PostgreSQL db")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        database_url = postgres_database(args.postgres) if args.postgres else ""
        record("scale", run(args, Path(tmp), database_url))


if __name__ == "__main__":
    main()
