"""Cancels on running jobs: one by one, and all at once.

Starts the whole system (bench/system.py), runs N long jobs until they are all
RUNNING, then cancels them one at a time (each after the previous answer), and
another N all at once (one CancelJobs for the user's jobs). Reports the
CancelJobs round trip and cancel -> CANCELLED (the job's CANCELLED event) p50/p99,
how long cancelling all at once took to the last CANCELLED, and the CPU each
process spent per job meanwhile (`cpu_ms_per_cancel`; "bench" is this process,
watching every event with a batched WatchJobs, as the CLI does: a CANCELLED event
counts from when its response arrives).
Target (contract §15): cancel takes effect p99 <= 1 s.

The jobs set `grace_period: 0.01`: a sim task never exits on SIGTERM by itself, so
with the default grace every cancel would wait the whole grace (30 s) before
the SIGKILL; what is measured is the system's own path from CancelJobs to
CANCELLED (stop, logs kept, teardown, report).

    .venv/bin/python bench/cancel.py [--jobs 1000]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from system import LONG_SPEC, CpuMeter, JobEvents, channel, run_jobs_bench, summary

from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.stack import Stack

# Killed 10 ms after the SIGTERM (see above).
SPEC = LONG_SPEC + "grace_period: 0.01\n"
RUNNING, CANCELLED = job_pb2.JOB_STATUS_RUNNING, job_pb2.JOB_STATUS_CANCELLED


class Events(JobEvents):
    """Every job's first RUNNING and CANCELLED times."""

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[int, float] = {}
        self.cancelled: dict[int, float] = {}

    def record(self, event: job_pb2.JobEvent, at: float) -> None:
        if event.status == RUNNING:
            self.running.setdefault(event.job_id, at)
        elif event.status == CANCELLED:
            self.cancelled.setdefault(event.job_id, at)


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
            await events.until(lambda: set(ids) <= events.running.keys(), 300)
            return ids

        one_by_one = await start(jobs)
        rpc, effect = [], []
        for job_id in one_by_one:
            sent = time.time()
            await stub.CancelJobs(jpb.CancelJobsRequest(job_ids=[job_id]))
            rpc.append((time.time() - sent) * 1000)
            await events.until(lambda j=job_id: j in events.cancelled, 60)
            effect.append((events.cancelled[job_id] - sent) * 1000)
        figures["one_by_one"] = {
            "cancel_rpc": summary(rpc, "ms"),
            "to_cancelled": summary(effect, "ms"),
        }

        all_at_once = await start(jobs)
        owner = (await stub.GetJob(jpb.GetJobRequest(job_id=all_at_once[0]))).job.user
        meter = CpuMeter(stack, bench=True)
        sent = time.time()
        reply = await stub.CancelJobs(jpb.CancelJobsRequest(all=True, user=owner))
        rpc_ms = (time.time() - sent) * 1000
        await events.until(lambda: set(all_at_once) <= events.cancelled.keys(), 300)
        effect = [(events.cancelled[j] - sent) * 1000 for j in all_at_once]
        figures["all_at_once"] = {
            "cancelled": len(reply.cancelled_job_ids),
            "cancel_rpc_ms": round(rpc_ms, 1),
            "to_cancelled": summary(effect, "ms"),
            "cpu_ms_per_cancel": meter.ms_per(len(all_at_once)),
        }
        watcher.cancel()
    return figures


def main() -> None:
    run_jobs_bench("cancel", __doc__, measure, jobs=1000)


if __name__ == "__main__":
    main()
