"""Every server of the system in this process, secured as in production, on free ports.

The scheduler (SQLite), one controller replica (local backend; its link to the
scheduler is not started, so it only serves ControllerService), the logs service
(reading jobs from the scheduler with the service token) and the sim cloud, each
behind the edge with the tokens file of `identities`, over TLS + mTLS or plaintext.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from harness.identities import Identities
from managedjobs.v1 import controller_service_pb2_grpc, log_service_pb2_grpc, scheduler_service_pb2
from services.backends.local.backend import LocalBackend
from services.common.server import Server
from services.controller.config import LifecycleConfig
from services.controller.joblog import LogsClient
from services.controller.replica import Replica
from services.logs import JobDirectory, LogServicer, LogStore
from services.scheduler.admission import Limits
from services.scheduler.main import SchedulerApp
from services.simcloud import start
from services.simcloud.config import DEFAULT_CONFIG


@dataclasses.dataclass
class System:
    """The addresses of the running servers, by the service names of the auth matrix."""

    scheduler: str
    controller: str
    logs: str
    simcloud: str

    def address(self, service: str) -> str:
        """The address serving a full service name (e.g. managedjobs.v1.LogService)."""
        short = service.rsplit(".", 1)[-1]
        if short in ("JobService", "SchedulerService"):
            return self.scheduler
        if short == "ControllerService":
            return self.controller
        if short == "LogService":
            return self.logs
        return self.simcloud


@contextlib.asynccontextmanager
async def running_system(
    ids: Identities, tls: bool, folder: Path, database_url: str = ""
) -> AsyncIterator[System]:
    """Starts the four servers, keeping their files in the existing `folder`; stops them on exit.

    The scheduler's database is `database_url`, by default a SQLite file in `folder`.
    """
    scheduler = SchedulerApp(
        database_url or f"sqlite:///{folder / 'scheduler.db'}",
        Limits(),
        security=ids.server("scheduler", tls),
    )
    scheduler_address = f"127.0.0.1:{await scheduler.start()}"
    stack = contextlib.AsyncExitStack()
    stack.push_async_callback(scheduler.close)
    try:
        # The logs service, reading jobs from the scheduler as a service.
        logs_backend = LocalBackend(folder / "clusters")
        directory = JobDirectory(scheduler_address, ids.client("service", tls))
        logs = Server("127.0.0.1", 0, security=ids.server("logs", tls))
        log_store = LogStore(folder / "logs")
        stack.callback(log_store.close)
        logs.add(
            log_service_pb2_grpc.add_LogServiceServicer_to_server,
            LogServicer(log_store, directory, logs_backend),
            "managedjobs.v1.LogService",
        )
        logs_address = f"127.0.0.1:{await logs.start()}"
        stack.push_async_callback(logs_backend.close)
        stack.push_async_callback(directory.close)
        stack.push_async_callback(logs.stop, 0)
        # One controller replica, serving its state only.
        replica = Replica(
            controller_id="controller-1",
            address="",
            capacity=scheduler_service_pb2.Capacity(max_launches=4, max_jobs=4),
            backend=LocalBackend(folder / "replica-clusters"),
            logs=LogsClient(logs_address, ids.client("controller", tls)),
            config=LifecycleConfig(),
            scheduler_address=scheduler_address,
            security=ids.client("controller", tls),
        )
        controller = Server("127.0.0.1", 0, security=ids.server("controller-1", tls))
        controller.add(
            controller_service_pb2_grpc.add_ControllerServiceServicer_to_server,
            replica,
            "managedjobs.v1.ControllerService",
        )
        controller_address = f"127.0.0.1:{await controller.start()}"
        stack.push_async_callback(replica.close)
        stack.push_async_callback(controller.stop, 0)
        config = dataclasses.replace(DEFAULT_CONFIG, launch_latency_seconds=0.0)
        cloud = await start(config, security=ids.server("simcloud", tls))
        stack.push_async_callback(cloud.stop)
        async with stack:
            yield System(
                scheduler_address, controller_address, logs_address, f"127.0.0.1:{cloud.port}"
            )
    except BaseException:
        await stack.aclose()
        raise
