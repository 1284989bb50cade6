"""N jobs submitted at once on the sim cloud (launch latency 0): how fast they all run, and cost.

Starts the whole system as processes (`services.stack.Stack`: sim cloud,
scheduler, logs, replicas), measures every process before, submits N long
jobs as fast as the API takes them, and reports:
- seconds until every job is RUNNING, and submissions per second;
- submit -> first launch (the job's STARTING event) p50/p99;
- RSS and PSS of every process before and loaded, and per job for the replicas;
- CPU seconds per job of the scheduler and the replicas while loading;
- idle CPU (percent of a core) of each replica and of the sim cloud with every
  job running and nothing happening.
Targets (SPEC §15, issue): 2,000 jobs all RUNNING in <= 5 s with one replica;
20,000 in <= 60 s with the replica <= 1 GiB and <= 5% of a core idle; scheduler
<= 3 ms CPU per job.

    .venv/bin/python bench/scale.py [--jobs 2000] [--replicas 1] [--postgres URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import machine

from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.stack import Service, Stack

SPEC = "name: scale\nrun: train\nsim: {runtime_seconds: 1000000}\n"
CLOUD = """
seed: 1
time_scale: 1
launch_latency_seconds: 0
max_cpus: 64
regions:
  - {name: us-east-1, zones: [us-east-1a], spot_nodes: 1000000, on_demand_nodes: 1000000}
"""

# A pushing backend: the replica never polls; launches are checked quickly.
CONTROLLER_ARGS = ["--poll-interval", "3600", "--start-check-interval", "0.05"]
CONTROLLER_ARGS += ["--log-level", "WARNING"]


def memory(process: psutil.Process) -> dict[str, float]:
    info = process.memory_full_info()
    return {"rss_mb": round(info.rss / 2**20, 1), "pss_mb": round(info.pss / 2**20, 1)}


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


async def submit_all(address: str, jobs: int, concurrency: int) -> float:
    """Submits `jobs` jobs from `concurrency` concurrent callers; returns the seconds it took."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        counter = iter(range(jobs))

        async def submitter() -> None:
            for i in counter:
                await stub.SubmitJob(
                    jpb.SubmitJobRequest(spec_yaml=SPEC, user="bench", idempotency_key=f"s{i}")
                )

        start = time.perf_counter()
        await asyncio.gather(*(submitter() for _ in range(concurrency)))
        return time.perf_counter() - start


async def watch_until_running(
    address: str, jobs: int, timeout: float
) -> dict[int, dict[str, float]]:
    """Event times per job (submitted, starting, running) until every job is RUNNING."""
    times: dict[int, dict[str, float]] = {}
    running = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        stream = stub.WatchJobs(jpb.WatchJobsRequest(), timeout=timeout)
        async for response in stream:
            event = response.event
            seen = times.setdefault(event.job_id, {})
            at = event.time.ToNanoseconds() / 1e9
            if event.message == "submitted":
                seen.setdefault("submitted", at)
            elif event.status == job_pb2.JOB_STATUS_STARTING:
                seen.setdefault("starting", at)
            elif event.status == job_pb2.JOB_STATUS_RUNNING and "running" not in seen:
                seen["running"] = at
                running += 1
                if running >= jobs:
                    stream.cancel()
                    break
    return times


def processes(stack: Stack) -> dict[str, psutil.Process]:
    out: dict[str, psutil.Process] = {}
    for service in stack.services:
        assert isinstance(service, Service) and service.process is not None
        out[service.name] = psutil.Process(service.process.pid)
    return out


def idle_cpu(procs: dict[str, psutil.Process], seconds: float) -> dict[str, float]:
    before = {name: cpu_seconds(p) for name, p in procs.items()}
    time.sleep(seconds)
    return {
        name: round(100 * (cpu_seconds(p) - before[name]) / seconds, 2) for name, p in procs.items()
    }


def run(args: argparse.Namespace, data_dir: Path, database_url: str) -> dict[str, object]:
    config = data_dir / "simcloud.yaml"
    config.write_text(CLOUD)
    stack = Stack(
        data_dir,
        replicas=args.replicas,
        database_url=database_url,
        scheduler_args=["--log-level", "WARNING"],
        controller_args=CONTROLLER_ARGS,
        simcloud_args=["--config", str(config), "--log-level", "WARNING"],
    )
    stack.start(timeout=60)
    try:
        procs = processes(stack)
        time.sleep(1.0)
        before_memory = {name: memory(p) for name, p in procs.items()}
        before_cpu = {name: cpu_seconds(p) for name, p in procs.items()}
        start = time.time()
        watcher = asyncio.new_event_loop()
        watch = watcher.create_task(
            watch_until_running(stack.scheduler_address, args.jobs, args.timeout)
        )
        submit_seconds = watcher.run_until_complete(
            submit_all(stack.scheduler_address, args.jobs, args.concurrency)
        )
        times = watcher.run_until_complete(watch)
        all_running = max(t["running"] for t in times.values()) - start
        loaded_cpu = {name: cpu_seconds(p) - before_cpu[name] for name, p in procs.items()}
        loaded_memory = {name: memory(p) for name, p in procs.items()}
        idle = idle_cpu(procs, args.idle_seconds)
        watcher.close()
    finally:
        stack.stop()
    to_launch = [
        (t["starting"] - t["submitted"]) * 1000
        for t in times.values()
        if "starting" in t and "submitted" in t
    ]
    replicas = [n for n in procs if n.startswith("controller")]
    per_job_kb = [
        (loaded_memory[n]["rss_mb"] - before_memory[n]["rss_mb"]) * 1024 * args.replicas / args.jobs
        for n in replicas
    ]
    return {
        "bench": "scale",
        "jobs": args.jobs,
        "replicas": args.replicas,
        "database": "postgres" if database_url else "sqlite",
        "all_running_s": round(all_running, 2),
        "submissions_per_s": round(args.jobs / submit_seconds, 1),
        "submit_to_launch_p50_ms": round(statistics.median(to_launch), 1),
        "submit_to_launch_p99_ms": round(percentile(to_launch, 0.99), 1),
        "scheduler_cpu_ms_per_job": round(1000 * loaded_cpu["scheduler"] / args.jobs, 2),
        "replica_cpu_ms_per_job": round(1000 * sum(loaded_cpu[n] for n in replicas) / args.jobs, 2),
        "replica_kb_per_job": round(statistics.mean(per_job_kb), 1),
        "memory_before": before_memory,
        "memory_loaded": loaded_memory,
        "idle_cpu_percent": idle,
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--postgres", default="", help="admin URL: run on a fresh PostgreSQL db")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        database_url = ""
        if args.postgres:
            import asyncpg

            name = f"mj_scale_{uuid.uuid4().hex[:8]}"

            async def create() -> None:
                conn = await asyncpg.connect(args.postgres)
                await conn.execute(f'CREATE DATABASE "{name}"')
                await conn.close()

            asyncio.run(create())
            database_url = args.postgres.rsplit("/", 1)[0] + "/" + name
        print(json.dumps(run(args, Path(tmp), database_url)), flush=True)


if __name__ == "__main__":
    main()
