"""Reading a big queue: ListJobs pages, `mj queue --all`, and WatchJobs with many watchers.

Starts the scheduler (and the rest of the system, with no replica, so jobs stay
queued: harness/bench/system.py), fills it with N jobs through SubmitJobs, and measures:
- the time of each ListJobs page of 1,000 over the whole queue, at each size
  (10,000 and 100,000 jobs by default): p50/p99 per page;
- `mj queue --all` over the first size: the wall time until it has printed every job;
- WatchJobs with W watchers (1,000 by default) of every job: from a submission to
  the last watcher receiving its event.
Target: the "list a 100,000-job queue" row of contract §15. Records one JSON line
(`results.py`).
(The script is not named `queue.py`: `bench/` comes first on every benchmark's
path, and a `queue` there would stand in for the standard library's module.)

    .venv/bin/python bench/listing.py [--sizes 10000,100000] [--mj-jobs 20000] [--watchers 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.bench.results import record
from harness.bench.system import LONG_SPEC, channel, running_system, summary
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import job_service_pb2_grpc
from services.launcher.stack import Stack

ROOT = Path(__file__).resolve().parent.parent


async def fill(stack: Stack, total: int, have: int) -> int:
    """Submits jobs until the queue holds `total`; returns how many it holds."""
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        batch = [jpb.SubmitJobRequest(spec_yaml=LONG_SPEC) for _ in range(1000)]

        async def submitter(count: int) -> None:
            for _ in range(count):
                await stub.SubmitJobs(jpb.SubmitJobsRequest(jobs=batch))

        missing = (total - have) // 1000
        await asyncio.gather(*(submitter(missing // 4 + (i < missing % 4)) for i in range(4)))
    return have + missing * 1000


async def pages(stack: Stack) -> dict[str, float]:
    times = []
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        request = jpb.ListJobsRequest(page_size=1000)
        while True:
            start = time.perf_counter()
            reply = await stub.ListJobs(request)
            times.append((time.perf_counter() - start) * 1000)
            if not reply.next_page_token:
                break
            request.page_token = reply.next_page_token
    return {"pages": len(times), **summary(times, "ms")}


def mj_queue_all(stack: Stack) -> float:
    env = {**os.environ, **stack.client_env()}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "queue", "--all"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert done.stdout.count("\n") > 1000, done.stdout[-500:]
    return round(seconds, 2)


async def fan_out(stack: Stack, watchers: int) -> dict[str, float]:
    """W watchers of one job; the job is cancelled; when each watcher got the event."""
    async with channel(stack, stack.scheduler_address) as chan:
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        job_id = (await stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=LONG_SPEC))).job_id
        got: list[float] = []
        backlogs = 0
        ready = asyncio.Event()

        async def watch() -> None:
            nonlocal backlogs
            stream = stub.WatchJobs(jpb.WatchJobsRequest(job_ids=[job_id]))
            async for response in stream:
                if response.event.message == "submitted":
                    backlogs += 1
                    if backlogs == watchers:
                        ready.set()
                    continue
                got.append(time.perf_counter())
                stream.cancel()
                return

        tasks = [asyncio.create_task(watch()) for _ in range(watchers)]
        await asyncio.wait_for(ready.wait(), 120)
        start = time.perf_counter()
        await stub.CancelJobs(jpb.CancelJobsRequest(job_ids=[job_id]))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return {"watchers": watchers, **summary([(t - start) * 1000 for t in got], "ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--mj-jobs", type=int, default=20000)
    parser.add_argument("--watchers", type=int, default=1000)
    args = parser.parse_args()
    figures: dict[str, object] = {}
    sizes = sorted(int(n) for n in args.sizes.split(","))
    with tempfile.TemporaryDirectory() as tmp, running_system(Path(tmp), replicas=0) as stack:
        have = 0
        for size in sorted({*sizes, args.mj_jobs}):
            have = asyncio.run(fill(stack, size, have))
            if size in sizes:
                figures[f"list_pages_{size}_jobs"] = asyncio.run(pages(stack))
            if size == args.mj_jobs:
                figures[f"mj_queue_all_{size}_jobs_s"] = mj_queue_all(stack)
        figures["watch_fan_out"] = asyncio.run(fan_out(stack, args.watchers))
    record("listing", figures)


if __name__ == "__main__":
    main()
