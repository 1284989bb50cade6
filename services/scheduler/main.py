"""`mj-scheduler`: the single source of truth (SPEC §2).

Opens the database (migrating it), rebuilds the admission counters from it,
gives replicas named in it one lease to come back, and serves JobService and
SchedulerService.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from managedjobs.v1 import job_service_pb2_grpc, scheduler_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common import logs, settings
from services.common.edge import ServerSecurity, server_security
from services.common.errors import register_translator
from services.common.server import Server, run_until_signal
from services.common.settings import Setting
from services.scheduler.admission import Admission, Limits
from services.scheduler.api import JobApi
from services.scheduler.db import Database, default_url
from services.scheduler.events import EventBus
from services.scheduler.health import DbHealth, unavailable
from services.scheduler.replicas import Replicas
from services.scheduler.store import Store

log = logging.getLogger(__name__)
register_translator(unavailable)

SETTINGS = (
    settings.HOST,
    Setting("port", "MJ_SCHEDULER_PORT", 50051, "port to listen on", int),
    settings.DATA_DIR,
    Setting(
        "database_url",
        "MJ_DATABASE_URL",
        "",
        "SQLAlchemy URL (postgresql://... for several hosts); empty means a SQLite file "
        "in the data dir",
    ),
    Setting("lease_ttl", "MJ_LEASE_TTL", 10.0, "seconds a replica's lease lasts", float),
    Setting(
        "heartbeat_interval",
        "MJ_HEARTBEAT_INTERVAL",
        2.0,
        "seconds between a replica's heartbeats",
        float,
    ),
    Setting("max_launches", "MJ_MAX_LAUNCHES", 0, "global cap on launching jobs (0: none)", int),
    Setting("max_jobs", "MJ_MAX_JOBS", 0, "global cap on alive jobs (0: none)", int),
    Setting(
        "replica_max_launches",
        "MJ_REPLICA_MAX_LAUNCHES",
        0,
        "per-replica launch limit overriding the replica's own (0: the replica's)",
        int,
    ),
    Setting(
        "replica_max_jobs",
        "MJ_REPLICA_MAX_JOBS",
        0,
        "per-replica job limit overriding the replica's own (0: the replica's)",
        int,
    ),
    Setting(
        "db_probe_interval",
        "MJ_DB_PROBE_INTERVAL",
        2.0,
        "seconds between database health probes",
        float,
    ),
    *settings.SERVER_SECURITY,
    settings.LOG_LEVEL,
    settings.SHUTDOWN_GRACE,
)


class SchedulerApp:
    """The scheduler's parts wired together: database, store, admission, replicas, server."""

    def __init__(
        self,
        database_url: str,
        limits: Limits,
        *,
        security: ServerSecurity,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_ttl: float = 10.0,
        heartbeat_interval: float = 2.0,
        db_probe_interval: float = 2.0,
    ) -> None:
        self.db = Database.open(database_url)
        self.bus = EventBus()
        self.store = Store(self.db, self.bus)
        self.admission = Admission(self.store, limits, self._send)
        self.health = DbHealth(self.db, self._database_changed, interval=db_probe_interval)
        self.replicas = Replicas(
            self.store,
            self.admission,
            self.health,
            lease_ttl=lease_ttl,
            heartbeat_interval=heartbeat_interval,
        )
        self.server = Server(host, port, security=security)
        self.server.add(
            job_service_pb2_grpc.add_JobServiceServicer_to_server,
            JobApi(self.store, self.bus, self.admission, self.replicas),
            "managedjobs.v1.JobService",
        )
        self.server.add(
            scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server,
            self.replicas,
            "managedjobs.v1.SchedulerService",
        )

    def _send(self, controller_id: str, message: pb.ConnectControllerResponse) -> bool:
        return self.replicas.send(controller_id, message)

    async def _database_changed(self, reachable: bool) -> None:
        await self.server.set_serving(reachable)
        if reachable:
            self.replicas.restart_leases()
            self.admission.kick()

    async def start(self) -> int:
        """Migrates (waiting for the database to answer), rebuilds the counters and serves."""
        await self.health.retry(self.db.migrate, limit=120)
        await self.admission.rebuild()
        await self.replicas.adopt_unknown()
        self.admission.start()
        self.health.start()
        return await self.server.start()

    async def close(self, grace: float = 0.0) -> None:
        await self.health.stop()
        await self.server.stop(grace)
        await self.replicas.close()
        await self.admission.stop()
        await self.db.close()


async def serve(a: argparse.Namespace, security: ServerSecurity) -> None:
    app = SchedulerApp(
        a.database_url or default_url(a.data_dir),
        Limits(
            global_launches=a.max_launches,
            global_jobs=a.max_jobs,
            replica_launches=a.replica_max_launches,
            replica_jobs=a.replica_max_jobs,
        ),
        security=security,
        host=a.host,
        port=a.port,
        lease_ttl=a.lease_ttl,
        heartbeat_interval=a.heartbeat_interval,
        db_probe_interval=a.db_probe_interval,
    )
    port = await app.start()
    log.info("scheduler serving", extra={"port": port, "database": app.db.url.split("@")[-1]})
    try:
        await run_until_signal(app.server, a.shutdown_grace)
    finally:
        await app.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = settings.parse("mj-scheduler", __doc__ or "", SETTINGS, argv)
    logs.setup("scheduler", args.log_level)
    security = server_security("mj-scheduler", vars(args))
    asyncio.run(serve(args, security))


if __name__ == "__main__":
    main()
