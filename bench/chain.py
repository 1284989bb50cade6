"""The cost of a status change against the length of the chain: flat, not quadratic.

Starts the whole system (harness/bench/system.py) and runs one chain of N tasks for each
N (10, 100, 1,000 by default). Its tasks have no `run`, so each goes STARTING then
SUCCEEDED at once and the whole chain is a stream of status changes through the
scheduler. Reports, per N, the wall time and the scheduler's CPU time per status
change, from the job's admission to DONE. The cost per change must not grow with N.

    .venv/bin/python bench/chain.py [--lengths 10,100,1000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from harness.bench.results import record
from harness.bench.system import channel, cpu_seconds, processes, running_system
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.launcher.stack import Stack


def chain(length: int) -> str:
    return "name: chain\n" + "".join(f"---\nname: t{i}\n" for i in range(length))


async def run_chain(stack: Stack, length: int) -> tuple[float, int]:
    """Submits the chain and waits for it to be DONE: (seconds, status changes)."""
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        job_id = (await stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=chain(length)))).job_id
        start = time.perf_counter()
        changes = 0
        request = jpb.WatchJobsRequest(job_ids=[job_id])
        async for response in stub.WatchJobs(request, timeout=600):
            event = response.event
            if event.schedule_state == job_pb2.SCHEDULE_STATE_DONE:
                break
            if event.status in (job_pb2.JOB_STATUS_STARTING, job_pb2.JOB_STATUS_SUCCEEDED):
                changes += 1
        return time.perf_counter() - start, changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="10,100,1000")
    args = parser.parse_args()
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, running_system(Path(tmp)) as stack:
        scheduler = processes(stack)["scheduler"]
        for length in (int(n) for n in args.lengths.split(",")):
            before = cpu_seconds(scheduler)
            seconds, changes = asyncio.run(run_chain(stack, length))
            cpu = cpu_seconds(scheduler) - before
            assert changes == 2 * length, (changes, length)
            figures[f"tasks_{length}"] = {
                "status_changes": changes,
                "ms_per_change": round(1000 * seconds / changes, 3),
                "scheduler_cpu_ms_per_change": round(1000 * cpu / changes, 3),
            }
    record("chain", figures)


if __name__ == "__main__":
    main()
