"""Cancels on running jobs: one by one, and all at once.

Starts the whole system (bench/system.py), runs N long jobs until they are all
RUNNING, then cancels them one at a time (each after the previous answer), and
another N all at once (one CancelJobs for the user's jobs). Reports the
CancelJobs round trip and cancel -> CANCELLED (the job's CANCELLED event) p50/p99,
how long cancelling all at once took to the last CANCELLED, and the CPU each
process spent per job meanwhile (`cpu_ms_per_cancel`; "bench" is this process,
watching every event with a batched WatchJobs, as the CLI does: a CANCELLED event
counts from when its response arrives).
Target (SPEC §15): cancel takes effect p99 <= 1 s.

The jobs set `grace_period: 0.01`: a sim task never exits on SIGTERM by itself, so
with the default grace every cancel would wait the whole grace (30 s) before
the SIGKILL; what is measured is the system's own path from CancelJobs to
CANCELLED (stop, logs kept, teardown, report).

    .venv/bin/python bench/cancel.py [--jobs 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from machine import machine
from system import LONG_SPEC, channel, cpu_seconds, processes, running_system, summary

from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.stack import Stack

# Killed 10 ms after the SIGTERM (see above).
SPEC = LONG_SPEC + "grace_period: 0.01\n"
RUNNING, CANCELLED = job_pb2.JOB_STATUS_RUNNING, job_pb2.JOB_STATUS_CANCELLED


class Events:
    """Every job's RUNNING and CANCELLED times, from one watch of the whole system."""

    def __init__(self) -> None:
        self.running: dict[int, float] = {}
        self.cancelled: dict[int, float] = {}
        self.changed = asyncio.Event()

    async def follow(self, stub: job_service_pb2_grpc.JobServiceStub) -> None:
        async for response in stub.WatchJobs(jpb.WatchJobsRequest(batched=True)):
            now = time.time()
            for event in response.events:
                if event.status == RUNNING:
                    self.running.setdefault(event.job_id, now)
                elif event.status == CANCELLED:
                    self.cancelled.setdefault(event.job_id, now)
            self.changed.set()

    async def until(self, done: dict[int, float], ids: set[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ids <= done.keys():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())


async def measure(stack: Stack, jobs: int) -> dict[str, object]:
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        events = Events()
        watcher = asyncio.create_task(events.follow(stub))
        figures: dict[str, object] = {}

        async def start(count: int) -> list[int]:
            request = jpb.SubmitJobsRequest(
                jobs=[jpb.SubmitJobRequest(spec_yaml=SPEC) for _ in range(count)]
            )
            ids: list[int] = []
            for first in range(0, count, 500):
                batch = jpb.SubmitJobsRequest(jobs=request.jobs[first : first + 500])
                ids += list((await stub.SubmitJobs(batch)).job_ids)
            await events.until(events.running, set(ids), 300)
            return ids

        one_by_one = await start(jobs)
        rpc, effect = [], []
        for job_id in one_by_one:
            sent = time.time()
            await stub.CancelJobs(jpb.CancelJobsRequest(job_ids=[job_id]))
            rpc.append((time.time() - sent) * 1000)
            await events.until(events.cancelled, {job_id}, 60)
            effect.append((events.cancelled[job_id] - sent) * 1000)
        figures["one_by_one"] = {
            "cancel_rpc": summary(rpc, "ms"),
            "to_cancelled": summary(effect, "ms"),
        }

        all_at_once = await start(jobs)
        owner = (await stub.GetJob(jpb.GetJobRequest(job_id=all_at_once[0]))).job.user
        procs = {**processes(stack), "bench": psutil.Process()}
        before = {name: cpu_seconds(p) for name, p in procs.items()}
        sent = time.time()
        reply = await stub.CancelJobs(jpb.CancelJobsRequest(all=True, user=owner))
        rpc_ms = (time.time() - sent) * 1000
        await events.until(events.cancelled, set(all_at_once), 300)
        cpu = {
            name: round((cpu_seconds(p) - before[name]) * 1000 / len(all_at_once), 2)
            for name, p in procs.items()
        }
        effect = [(events.cancelled[j] - sent) * 1000 for j in all_at_once]
        figures["all_at_once"] = {
            "cancelled": len(reply.cancelled_job_ids),
            "cancel_rpc_ms": round(rpc_ms, 1),
            "to_cancelled": summary(effect, "ms"),
            "cpu_ms_per_cancel": cpu,
        }
        watcher.cancel()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_system(Path(tmp)) as stack:
        figures = asyncio.run(measure(stack, args.jobs))
    print(json.dumps({"bench": "cancel", "jobs": args.jobs, **figures, "machine": machine()}))


if __name__ == "__main__":
    main()
