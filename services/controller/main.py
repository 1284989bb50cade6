"""`mj-controller`: one controller replica (contract §2, §9).

Connects to the scheduler (its stream is the replica's lease), runs the jobs it
is assigned, and serves ControllerService. SIGTERM drains: the replica stops
taking jobs and hands its jobs back without failing them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import re
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from managedjobs.v1 import controller_service_pb2_grpc
from services.backends import BACKEND, backend_settings, make_backend
from services.common import logs, settings, test_switches
from services.common.channels import ClientSecurity
from services.common.metrics import METRICS_PORT, serve_metrics
from services.common.security.edge import ServerSecurity, server_security
from services.common.security.tls import TlsConfigError
from services.common.server import Server, run_until_signal
from services.common.settings import Setting, SettingError
from services.controller.capacity import DEFAULT_MEMORY_PER_JOB_KB, replica_capacity
from services.controller.config import LifecycleConfig
from services.controller.joblog import LogsClient
from services.controller.replica import Replica

log = logging.getLogger(__name__)

SETTINGS = (
    settings.HOST,
    Setting("port", "MJ_CONTROLLER_PORT", 50061, "port to listen on (0 picks a free one)", int),
    Setting(
        "controller_id",
        "MJ_CONTROLLER_ID",
        "",
        "this replica's id (default: host name, port and a random suffix)",
    ),
    settings.SCHEDULER_ADDRESS,
    settings.LOGS_ADDRESS,
    BACKEND,
    *backend_settings(),
    settings.DATA_DIR,
    Setting(
        "max_launches",
        "MJ_CONTROLLER_MAX_LAUNCHES",
        0,
        "launch capacity (0: what the backend runs well at once; 4 x CPUs for local)",
        int,
    ),
    Setting("max_jobs", "MJ_CONTROLLER_MAX_JOBS", 0, "job capacity (0: from memory)", int),
    Setting(
        "memory_per_job_kb",
        "MJ_MEMORY_PER_JOB_KB",
        DEFAULT_MEMORY_PER_JOB_KB,
        "controller memory per live job, for the job capacity",
        int,
    ),
    Setting(
        "poll_interval",
        "MJ_POLL_INTERVAL",
        15.0,
        "seconds between cluster checks when the backend cannot push",
        float,
    ),
    Setting(
        "grace_seconds",
        "MJ_GRACE_SECONDS",
        5.0,
        "seconds to wait after user code failed before checking the cluster's health",
        float,
    ),
    Setting("backoff_initial", "MJ_BACKOFF_INITIAL", 60.0, "first launch retry delay", float),
    Setting("backoff_max", "MJ_BACKOFF_MAX", 600.0, "largest launch retry delay", float),
    Setting(
        "max_launch_retries",
        "MJ_MAX_LAUNCH_RETRIES",
        0,
        "launch attempts before FAILED_NO_RESOURCE (0: forever)",
        int,
    ),
    Setting(
        "start_check_interval",
        "MJ_START_CHECK_INTERVAL",
        1.0,
        "seconds between checks that a launched task started",
        float,
    ),
    Setting("start_checks", "MJ_START_CHECKS", 60, "checks before a launch is retried", int),
    Setting(
        "grace_period",
        "MJ_GRACE_PERIOD",
        30.0,
        "seconds between SIGTERM and SIGKILL when a task is stopped (a task's grace_period wins)",
        float,
    ),
    Setting(
        "unreachable_timeout",
        "MJ_UNREACHABLE_TIMEOUT",
        120.0,
        "seconds a cluster may stay unreachable before it is recovered (the task's or the "
        "backend's own timeout wins)",
        float,
    ),
    *settings.SERVER_SECURITY,
    *settings.CLIENT_SECURITY,
    METRICS_PORT,
    settings.LOG_LEVEL,
    settings.SHUTDOWN_GRACE,
)


def default_controller_id(port: int) -> str:
    """Host name, port and a random suffix, in the characters a controller id allows."""
    host = re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip("-.")[:40]
    return f"{host or 'controller'}-{port}-{uuid.uuid4().hex[:6]}"


async def serve(a: argparse.Namespace, security: ServerSecurity, client: ClientSecurity) -> None:
    # First: a taken metrics port stops the service before it opened anything.
    serve_metrics(a.metrics_port, a.host)
    try:
        backend = make_backend(a.backend, vars(a))
    except ValueError as exc:  # a backend setting it cannot run with, named
        raise SettingError(str(exc)) from None
    await backend.prepare()
    config = LifecycleConfig(
        poll_interval=a.poll_interval,
        grace_seconds=a.grace_seconds,
        backoff_initial=a.backoff_initial,
        backoff_max=a.backoff_max,
        max_launch_retries=a.max_launch_retries,
        start_checks=a.start_checks,
        start_check_interval=a.start_check_interval,
        grace_period=a.grace_period,
        unreachable_timeout=a.unreachable_timeout,
    )
    server = Server(a.host, a.port, security=security)
    capacity = replica_capacity(
        a.max_launches or backend.launch_concurrency, a.max_jobs, a.memory_per_job_kb
    )
    replica = Replica(
        controller_id=a.controller_id,
        address="",
        capacity=capacity,
        backend=backend,
        logs=LogsClient(a.logs_address, client),
        config=config,
        scheduler_address=a.scheduler_address,
        security=client,
    )
    server.add(
        controller_service_pb2_grpc.add_ControllerServiceServicer_to_server,
        replica,
        "managedjobs.v1.ControllerService",
    )
    port = await server.start()
    # The id and address are known only once the port is bound; the link starts after.
    replica.address = f"{a.host}:{port}"
    replica.controller_id = replica.controller_id or default_controller_id(port)
    replica.start()
    log.info(
        "controller serving",
        extra={"port": port, "controller_id": replica.controller_id, "pid": os.getpid()},
    )
    try:
        await run_until_signal(server, a.shutdown_grace, drain=functools.partial(drain, replica))
    finally:
        await replica.close()


async def drain(replica: Replica) -> None:
    """The replica's drain, after which this process ends (`exit_now`). Stopping tens
    of thousands of jobs leaves as many tracebacks in reference cycles; the cyclic
    collector would scan the whole heap again and again to free what the exit frees
    at once, and the drain would wait for it."""
    gc.disable()
    await replica.drain()


def main(argv: Sequence[str] | None = None) -> None:
    args = settings.parse("mj-controller", __doc__ or "", SETTINGS, argv)
    args.data_dir = str(Path(args.data_dir).resolve())
    logs.setup("controller", args.log_level)
    test_switches.load("mj-controller")
    security = server_security("mj-controller", vars(args))
    try:
        client = ClientSecurity.from_settings(vars(args))
    except (TlsConfigError, OSError) as exc:
        raise SystemExit(f"mj-controller: {exc}") from None
    asyncio.run(serve(args, security, client))
    exit_now()


def exit_now() -> None:
    """Ends the process once `serve` returned: every job was handed back and every log
    line shipped, so nothing is left to do but free memory. The interpreter's own
    teardown of tens of thousands of jobs' objects takes seconds, and a drain should
    end when its work does, so the process exits without it (logs flushed first)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
