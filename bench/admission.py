"""Admission throughput and latency through gRPC, on SQLite and on PostgreSQL.

Starts `mj-scheduler` as a process, once per security mode: `none` (no
authentication, plaintext), `tokens` (bearer tokens on every call: a controller
token for the replica, an admin's for the submitters, as `make up` runs) and
`tls` (tokens, TLS and mTLS, as docker-compose runs); connects one benchmark
replica over ConnectController (a real stream client with ample capacity that
records when each assignment arrives), then measures:
- sustained submissions per second over N jobs from concurrent clients, each
  job its own `SubmitJob` call, or `--batch` jobs per `SubmitJobs` call;
- submit -> launch-granted latency (the assignment reaching the replica) p50/p99,
  submitting one job at a time with spare capacity.
Records one JSON line per database and mode (`results.py`), the secured modes with
their throughput relative to `none` (`cost_vs_none`, contract §14). Targets: the
"submissions" and "submit -> launch granted" rows of contract §15. With single
calls each line also gives the floor gRPC itself sets on this machine
(`empty_handler_floor`): the same callers against a server whose `SubmitJob`
answers at once, with no authentication and no database, and that server's CPU
per call.

    .venv/bin/python bench/admission.py [--jobs 5000] [--latency-jobs 300] [--postgres URL]
        [--only sqlite|postgres] [--modes none,tokens,tls] [--batch 1]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from harness.bench.machine import probe_filesystem
from harness.bench.results import record
from harness.bench.system import cpu_seconds, empty_server, postgres_database
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import (
    job_service_pb2_grpc,
    scheduler_service_pb2_grpc,
)
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.channels import ClientSecurity, open_channel
from services.common.security.auth import Role, add_token
from services.common.security.certs import make_certificates
from services.common.security.tls import ClientTls
from services.controller.messages import unbatched
from services.launcher.ports import free_port
from services.launcher.service import wait_serving

SPEC = "name: bench\nrun: echo hi\n"


class BenchReplica:
    """A replica that only records when assignments arrive."""

    def __init__(self, address: str, security: ClientSecurity) -> None:
        self.address = address
        self.security = security
        self.assigned: dict[int, float] = {}
        self.waiters: dict[int, asyncio.Future[float]] = {}
        self.ready = asyncio.Event()
        self.target = 0
        self.reached = asyncio.Event()

    async def run(self) -> None:
        async with open_channel(self.address, self.security) as channel:
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)

            async def requests():  # type: ignore[no-untyped-def]
                yield pb.ConnectControllerRequest(
                    seq=1,
                    hello=pb.ControllerHello(
                        controller_id="bench-replica",
                        capacity=pb.Capacity(max_launches=1_000_000, max_jobs=1_000_000),
                    ),
                )
                for seq in itertools.count(2):
                    await asyncio.sleep(1)
                    yield pb.ConnectControllerRequest(seq=seq, heartbeat=pb.ControllerHeartbeat())

            async for response in stub.ConnectController(requests()):
                now = time.perf_counter()
                for message in unbatched(response):
                    kind = message.WhichOneof("message")
                    if kind == "welcome":
                        self.ready.set()
                    elif kind == "assignment":
                        job_id = message.assignment.job.job_id
                        self.assigned[job_id] = now
                        waiter = self.waiters.pop(job_id, None)
                        if waiter is not None and not waiter.done():
                            waiter.set_result(now)
                        if self.target and len(self.assigned) >= self.target:
                            self.reached.set()


def request(i: int) -> jpb.SubmitJobRequest:
    return jpb.SubmitJobRequest(spec_yaml=SPEC, user="bench", idempotency_key=f"k{i}")


async def submit_all(
    stub: job_service_pb2_grpc.JobServiceStub, jobs: int, concurrency: int, batch: int
) -> float:
    """Submits `jobs` jobs from `concurrency` callers, one per SubmitJob (`batch` 1) or
    `batch` per SubmitJobs; the seconds it took."""
    counter = iter(range(0, jobs, batch))

    async def submitter() -> None:
        for first in counter:
            if batch == 1:
                await stub.SubmitJob(request(first))
            else:
                last = min(first + batch, jobs)
                await stub.SubmitJobs(
                    jpb.SubmitJobsRequest(jobs=[request(i) for i in range(first, last)])
                )

    start = time.perf_counter()
    await asyncio.gather(*(submitter() for _ in range(concurrency)))
    return time.perf_counter() - start


def empty_handler_floor(jobs: int, concurrency: int) -> dict[str, float]:
    """Single SubmitJob calls per second from the benchmark's callers against
    `EmptyJobService` in its own process, and that process's CPU per call."""
    with empty_server() as (address, server):

        async def run() -> tuple[float, float]:
            async with open_channel(address, ClientSecurity()) as channel:
                await asyncio.wait_for(channel.channel_ready(), 30)
                stub = job_service_pb2_grpc.JobServiceStub(channel)
                cpu_before = cpu_seconds(server)
                seconds = await submit_all(stub, jobs, concurrency, 1)
                return seconds, cpu_seconds(server) - cpu_before

        seconds, cpu = asyncio.run(run())
    return {
        "calls_per_s": round(jobs / seconds, 1),
        "server_cpu_ms_per_call": round(cpu / jobs * 1000, 3),
    }


async def measure(
    address: str,
    tokens: dict[str, ClientSecurity],
    jobs: int,
    latency_jobs: int,
    concurrency: int,
    batch: int = 1,
    cpu_seconds: Callable[[], float] = lambda: 0.0,
) -> dict[str, float]:
    """The figures; `cpu_seconds` reads the scheduler's CPU time so far."""
    replica = BenchReplica(address, tokens["controller"])
    replica_task = asyncio.create_task(replica.run())
    await asyncio.wait_for(replica.ready.wait(), 10)
    async with open_channel(address, tokens["admin"]) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        # Latency: one job at a time, spare capacity.
        latencies = []
        loop = asyncio.get_running_loop()
        for _ in range(latency_jobs):
            start = time.perf_counter()
            reply = await stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=SPEC, user="bench"))
            if reply.job_id in replica.assigned:
                granted = replica.assigned[reply.job_id]
            else:
                future: asyncio.Future[float] = loop.create_future()
                replica.waiters[reply.job_id] = future
                granted = await asyncio.wait_for(future, 10)
            latencies.append((granted - start) * 1000)
        # Throughput: concurrent submitters, one job per SubmitJob or `batch` per SubmitJobs.
        before = len(replica.assigned)
        replica.target = before + jobs
        cpu_before = cpu_seconds()
        start = time.perf_counter()
        submit_seconds = await submit_all(stub, jobs, concurrency, batch)
        await asyncio.wait_for(replica.reached.wait(), 120)
        all_seconds = time.perf_counter() - start
        cpu = cpu_seconds() - cpu_before
    replica_task.cancel()
    latencies.sort()
    return {
        "submissions_per_s": round(jobs / submit_seconds, 1),
        "admitted_per_s": round((len(replica.assigned) - before) / all_seconds, 1),
        "grant_latency_p50_ms": round(statistics.median(latencies), 2),
        "grant_latency_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1], 2),
        # From the first submission until every job was granted.
        "scheduler_cpu_ms_per_job": round(cpu / jobs * 1000, 3),
    }


def bench_security(data_dir: str, mode: str) -> tuple[dict[str, ClientSecurity], list[str]]:
    """The callers' security in `mode` (an admin and the bench replica's controller), and
    the scheduler's flags for it."""
    if mode == "none":
        return {"admin": ClientSecurity(), "controller": ClientSecurity()}, ["--auth", "none"]
    path = Path(data_dir) / "tokens.yaml"
    admin = add_token(path, "bench", Role.ADMIN)
    controller = add_token(path, "bench-replica", Role.CONTROLLER, "bench-replica")
    flags = ["--tokens-file", str(path)]
    if mode == "tokens":
        return {
            "admin": ClientSecurity.of(admin),
            "controller": ClientSecurity.of(controller),
        }, flags
    tls = Path(data_dir) / "tls"
    ca = make_certificates(
        tls, hosts=["scheduler"], controllers=["bench-replica"], clients=["admin"],
        extra_names=["localhost", "127.0.0.1"],
    )  # fmt: skip

    def client(name: str) -> ClientTls | None:
        return ClientTls.from_files(str(ca), str(tls / f"{name}.pem"), str(tls / f"{name}.key"))

    flags += ["--tls-cert", str(tls / "scheduler.pem"), "--tls-key", str(tls / "scheduler.key"),
              "--tls-client-ca", str(ca)]  # fmt: skip
    return {
        "admin": ClientSecurity.of(admin, client("admin")),
        "controller": ClientSecurity.of(controller, client("bench-replica")),
    }, flags


def run_scheduler(
    database_url: str, data_dir: str, flags: list[str], probe: ClientSecurity
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with (Path(data_dir) / "scheduler.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler.main", "--port", str(port),
             "--data-dir", data_dir, "--database-url", database_url, "--log-level", "WARNING",
             *flags],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    wait_serving(address, 60, security=probe)
    return process, address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--latency-jobs", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--batch", type=int, default=1, help="jobs per call: 1 uses SubmitJob, more SubmitJobs"
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--only", choices=["sqlite", "postgres"])
    parser.add_argument("--modes", default="none,tokens,tls", help="security modes, in order")
    args = parser.parse_args()
    floor = {}
    if args.batch == 1:
        floor = {"empty_handler_floor": empty_handler_floor(args.jobs, args.concurrency)}
    for kind in ["sqlite", "postgres"]:
        if args.only and kind != args.only:
            continue
        baseline = 0.0
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as data_dir:
                probe_filesystem(Path(data_dir))
                if kind == "sqlite":
                    url = f"sqlite:///{data_dir}/bench.db"
                else:
                    url = postgres_database(args.postgres)
                callers, flags = bench_security(data_dir, mode)
                probe = ClientSecurity(None, callers["admin"].tls)
                process, address = run_scheduler(url, data_dir, flags, probe)
                try:
                    figures: dict[str, object] = dict(
                        asyncio.run(
                            measure(
                                address,
                                callers,
                                args.jobs,
                                args.latency_jobs,
                                args.concurrency,
                                args.batch,
                                functools.partial(cpu_seconds, psutil.Process(process.pid)),
                            )
                        )
                    )
                finally:
                    process.terminate()
                    process.wait(30)
            rate = float(figures["submissions_per_s"])  # type: ignore[arg-type]
            if mode == "none":
                baseline = rate
            elif baseline:
                figures["cost_vs_none"] = round(1 - rate / baseline, 3)
            record("admission", {"database": kind, "security": mode, "jobs": args.jobs,
                                 "batch": args.batch, **figures, **floor})  # fmt: skip


if __name__ == "__main__":
    main()
