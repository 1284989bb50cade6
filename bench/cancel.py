"""Cancels on running jobs: spaced out, all at once, and of tasks that trap SIGTERM.

Starts the whole system (harness/bench/system.py) and runs long jobs until they are all
RUNNING, three times over:

- `spaced`: 20 jobs, cancelled one at a time 1.5 s apart (each cancel its own
  CancelJobs, not waiting for the previous to take effect);
- `all_at_once`: `--jobs` jobs (1,000 by default), cancelled by one CancelJobs for
  the user's jobs, with the CPU each process spent per job meanwhile
  (`cpu_ms_per_cancel`; "bench" is this process);
- `traps_sigterm`: 20 jobs as in `spaced`, whose task traps SIGTERM
  (`sim.sigterm_exit_seconds: never`), so only the SIGKILL at the end of the default
  grace period ends it; `over_grace` is how long past the grace each one took.

The other tasks are the sim cloud's default: they exit at SIGTERM, as a process
with the default handler does, so a cancel never waits for the grace. Reports the
CancelJobs round trip and cancel -> CANCELLED (the job's CANCELLED event, watched
with one batched WatchJobs as the CLI does: it counts from when its response
arrives) p50/p99/max.
Targets (contract §15): cancel -> CANCELLED p99 <= 500 ms, 1,000 at once; a task
that traps SIGTERM CANCELLED within grace + 1 s.

    .venv/bin/python bench/cancel.py [--jobs 1000]
"""

from __future__ import annotations

import asyncio
import time

from harness.bench.system import LONG_SPEC, CpuMeter, JobEvents, channel, run_jobs_bench, summary
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.controller.config import LifecycleConfig
from services.launcher.stack import Stack

# The long task, and the same task trapping SIGTERM.
TRAPS_SPEC = LONG_SPEC.replace("sim: {", "sim: {sigterm_exit_seconds: never, ")
SPACED_JOBS, APART_SECONDS = 20, 1.5
GRACE_SECONDS = LifecycleConfig().grace_period
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

        async def start(count: int, spec: str) -> list[int]:
            ids: list[int] = []
            for first in range(0, count, 500):
                batch = [jpb.SubmitJobRequest(spec_yaml=spec)] * min(500, count - first)
                ids += (await stub.SubmitJobs(jpb.SubmitJobsRequest(jobs=batch))).job_ids
            await events.until(lambda: set(ids) <= events.running.keys(), 300)
            return ids

        async def spaced(spec: str) -> tuple[list[float], list[float]]:
            """Cancels SPACED_JOBS running jobs APART_SECONDS apart: the CancelJobs round
            trips and cancel -> CANCELLED, in ms."""
            ids = await start(SPACED_JOBS, spec)
            sent: dict[int, float] = {}
            rpc = []
            for job_id in ids:
                sent[job_id] = time.time()
                await stub.CancelJobs(jpb.CancelJobsRequest(job_ids=[job_id]))
                rpc.append((time.time() - sent[job_id]) * 1000)
                await asyncio.sleep(APART_SECONDS)
            await events.until(lambda: set(ids) <= events.cancelled.keys(), GRACE_SECONDS + 60)
            return rpc, [(events.cancelled[j] - sent[j]) * 1000 for j in ids]

        figures: dict[str, object] = {}
        rpc, effect = await spaced(LONG_SPEC)
        figures["spaced"] = {
            "jobs": SPACED_JOBS,
            "apart_s": APART_SECONDS,
            "cancel_rpc": summary(rpc, "ms"),
            "to_cancelled": summary(effect, "ms"),
        }

        all_at_once = await start(jobs, LONG_SPEC)
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

        rpc, effect = await spaced(TRAPS_SPEC)
        figures["traps_sigterm"] = {
            "jobs": SPACED_JOBS,
            "apart_s": APART_SECONDS,
            "grace_s": GRACE_SECONDS,
            "cancel_rpc": summary(rpc, "ms"),
            "to_cancelled": summary(effect, "ms"),
            "over_grace": summary([ms - GRACE_SECONDS * 1000 for ms in effect], "ms"),
        }
        watcher.cancel()
    return figures


def main() -> None:
    run_jobs_bench("cancel", __doc__, measure, jobs=1000)


if __name__ == "__main__":
    main()
