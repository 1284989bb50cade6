"""`mj-scheduler`: the single source of truth (SPEC §2).

Opens the database (migrating it), rebuilds the admission counters from it,
gives replicas named in it one lease to come back, and serves JobService and
SchedulerService.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from managedjobs.v1 import job_service_pb2_grpc, scheduler_service_pb2_grpc
from services.common import logs, settings
from services.common.server import Server, run_until_signal
from services.common.settings import Setting
from services.scheduler.admission import Admission, Limits
from services.scheduler.api import JobApi
from services.scheduler.db import Database, default_url
from services.scheduler.events import EventBus
from services.scheduler.replicas import Replicas
from services.scheduler.store import Store

log = logging.getLogger(__name__)

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
    settings.LOG_LEVEL,
    settings.SHUTDOWN_GRACE,
)


async def serve(args: object) -> None:
    a = args
    db = Database.open(getattr(a, "database_url") or default_url(getattr(a, "data_dir")))
    await db.migrate()
    bus = EventBus()
    store = Store(db, bus)
    limits = Limits(
        global_launches=getattr(a, "max_launches"),
        global_jobs=getattr(a, "max_jobs"),
        replica_launches=getattr(a, "replica_max_launches"),
        replica_jobs=getattr(a, "replica_max_jobs"),
    )
    replicas: Replicas
    admission = Admission(store, limits, lambda cid, msg: replicas.send(cid, msg))
    replicas = Replicas(
        store,
        admission,
        lease_ttl=getattr(a, "lease_ttl"),
        heartbeat_interval=getattr(a, "heartbeat_interval"),
    )
    await admission.rebuild()
    await replicas.adopt_unknown()
    admission.start()
    server = Server(getattr(a, "host"), getattr(a, "port"))
    server.add(
        job_service_pb2_grpc.add_JobServiceServicer_to_server,
        JobApi(store, bus, admission, replicas),
        "managedjobs.v1.JobService",
    )
    server.add(
        scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server,
        replicas,
        "managedjobs.v1.SchedulerService",
    )
    port = await server.start()
    log.info("scheduler serving", extra={"port": port, "database": db.url.split("@")[-1]})
    try:
        await run_until_signal(server, getattr(a, "shutdown_grace"))
    finally:
        await replicas.close()
        await admission.stop()
        await db.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = settings.parse("mj-scheduler", __doc__ or "", SETTINGS, argv)
    logs.setup("scheduler", args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
