"""`mj-scheduler`: the single source of truth (contract §2).

Opens the database (migrating it), rebuilds the admission counters from it,
gives replicas named in it one lease to come back, and serves JobService and
SchedulerService.

How the parts connect: every write goes through the store's transactions; their
committed moves feed the counters and kick admission (`Store.on_moves`); messages
to replicas go through the outbox; reports come back through `Reports`; a
reconcile loop checks the counters against a recount and the replicas against
their assignments, periodically and whenever a commit was in doubt.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from collections.abc import Sequence as Seq

from managedjobs.v1 import job_service_pb2_grpc, scheduler_service_pb2_grpc
from services.common import logs, settings, test_switches
from services.common.background import Background
from services.common.errors import register_translator
from services.common.metrics import METRICS_PORT, serve_metrics
from services.common.security.edge import ServerSecurity, server_security
from services.common.server import Server, run_until_signal
from services.common.settings import Setting
from services.scheduler import metrics, queries
from services.scheduler.admission import Admission, Limits
from services.scheduler.api import JobApi
from services.scheduler.cancels import Cancels
from services.scheduler.counters import Counters
from services.scheduler.db import SYNCHRONOUS, Database, default_url
from services.scheduler.deadlines import PendingDeadlines
from services.scheduler.events import QUEUE_LIMIT, EventBus
from services.scheduler.health import DbHealth, is_unreachable, unavailable
from services.scheduler.leases import Leases
from services.scheduler.outbox import Outbox
from services.scheduler.replicas import Replicas
from services.scheduler.reports import Reports
from services.scheduler.store import Store
from services.scheduler.txn import Move

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
    Setting(
        "db_writers",
        "MJ_DB_WRITERS",
        1,
        "write transactions at once on PostgreSQL (0: no limit); one writer gathers "
        "concurrent work into bigger batches. SQLite always has one",
        settings.count,
    ),
    Setting(
        "sqlite_synchronous",
        "MJ_SQLITE_SYNCHRONOUS",
        "full",
        "SQLite: when a commit reaches the disk. full: before its answer (an OK survives an "
        "OS crash or power loss); normal: at checkpoints (an OK survives a crash of the "
        "scheduler, not always an OS crash)",
        settings.one_of(*SYNCHRONOUS),
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
    Setting(
        "reconcile_interval",
        "MJ_RECONCILE_INTERVAL",
        30.0,
        "seconds between checks of the admission counters against a recount",
        float,
    ),
    Setting(
        "watch_queue_limit",
        "MJ_WATCH_QUEUE_LIMIT",
        QUEUE_LIMIT,
        "events a WatchJobs stream may fall behind before it is cut off (RESOURCE_EXHAUSTED, "
        "with the event id to resume after)",
        int,
    ),
    *settings.SERVER_SECURITY,
    METRICS_PORT,
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
        reconcile_interval: float = 30.0,
        watch_queue_limit: int = QUEUE_LIMIT,
        db_writers: int = 1,
        sqlite_synchronous: str = "full",
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = Database.open(
            database_url, writers=db_writers, sqlite_synchronous=sqlite_synchronous
        )
        self.db.on_doubt = self.reconcile_soon
        self.bus = EventBus(watch_queue_limit)
        self.store = Store(self.db, self.bus)
        self.counters = Counters(self.store)
        self.outbox = Outbox()
        self.admission = Admission(self.store, self.counters, self.outbox, limits)
        self.store.on_moves = self._moved
        metrics.watch_counters(self.counters)
        self.reports = Reports(self.store)
        self.deadlines = PendingDeadlines(self.store, self.admission.waiting_reason)
        self.health = DbHealth(self.db, self._database_changed, interval=db_probe_interval)
        self.leases = Leases(
            self.store,
            self.admission,
            self.outbox,
            self.health,
            ttl=lease_ttl,
            clock=clock,
            sleep=sleep,
        )
        self.replicas = Replicas(
            self.store,
            self.reports,
            self.admission,
            self.outbox,
            self.health,
            self.leases,
            heartbeat_interval=heartbeat_interval,
        )
        self.reconcile_interval = reconcile_interval
        self._sleep = sleep
        self._reconcile_now = asyncio.Event()
        self._reconciler = Background("reconcile", self._reconcile_loop)
        self._ticker = Background("reconcile-ticker", self._tick)
        self._closed = False
        self.server = Server(host, port, security=security)
        self.job_api = JobApi(
            self.store,
            self.bus,
            self.admission,
            Cancels(self.store, self.outbox),
            on_pending_deadline=self.deadlines.soon,
        )
        self.server.add(
            job_service_pb2_grpc.add_JobServiceServicer_to_server,
            self.job_api,
            "managedjobs.v1.JobService",
        )
        self.server.add(
            scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server,
            self.replicas,
            "managedjobs.v1.SchedulerService",
        )

    def _moved(self, moves: Seq[Move]) -> None:
        self.counters.apply(moves)
        metrics.moved(moves)
        self.admission.moved(moves)
        self.leases.moved(moves)

    def reconcile_soon(self) -> None:
        self._reconcile_now.set()

    async def reconcile(self) -> None:
        """Checks counters against a recount and replicas against their assignments."""
        diff = await self.counters.reconcile()
        if diff:
            metrics.corrected(sum(abs(n) for n in diff.values()))
            self.admission.kick()
        await self.replicas.sync_assignments()
        metrics.statuses(await self.store.read(queries.status_counts))

    async def _reconcile_loop(self) -> None:
        """Reconciles whenever asked to: every `reconcile_interval` seconds (`_tick`), and at
        once after a write whose outcome was unknown."""
        while True:
            await self._reconcile_now.wait()
            self._reconcile_now.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_unreachable(exc):
                    log.exception("reconcile failed")

    async def _tick(self) -> None:
        while True:
            await self._sleep(self.reconcile_interval)
            self._reconcile_now.set()

    async def _database_changed(self, reachable: bool) -> None:
        await self.server.set_serving(reachable)
        if reachable:
            self.leases.restart()
            self.admission.kick()
            self.reconcile_soon()

    async def start(self) -> int:
        """Migrates (waiting for the database to answer), rebuilds the counters and serves."""
        await self.health.retry(self.db.migrate, limit=120)
        await self.counters.rebuild()
        await self.leases.adopt_unknown()
        self.admission.start()
        self.deadlines.start()
        self.health.start()
        self._reconciler.start()
        self._ticker.start()
        return await self.server.start()

    async def close(self, grace: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        await self._ticker.stop()
        await self._reconciler.stop()
        await self.health.stop()
        # The replicas' streams end first, as the scheduler's doing: they keep their jobs.
        await self.replicas.close()
        await self.server.stop(grace)
        await self.deadlines.stop()
        await self.admission.stop()
        await self.store.statistics.stop()
        await self.db.close()
        metrics.unwatch_counters(self.counters)


async def serve(a: argparse.Namespace, security: ServerSecurity) -> None:
    # First: a taken metrics port stops the service before it opened anything.
    serve_metrics(a.metrics_port, a.host)
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
        reconcile_interval=a.reconcile_interval,
        watch_queue_limit=a.watch_queue_limit,
        db_writers=a.db_writers,
        sqlite_synchronous=a.sqlite_synchronous,
    )
    try:
        port = await app.start()
        log.info("scheduler serving", extra={"port": port, "database": app.db.url.split("@")[-1]})
        # The replicas' streams end before the server stops: as the scheduler's doing,
        # which ends no lease (the replicas keep their jobs for the next scheduler).
        await run_until_signal(app.server, a.shutdown_grace, drain=app.replicas.close)
    finally:
        await app.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = settings.parse("mj-scheduler", __doc__ or "", SETTINGS, argv)
    logs.setup("scheduler", args.log_level)
    test_switches.load("mj-scheduler")
    security = server_security("mj-scheduler", vars(args))
    asyncio.run(serve(args, security))


if __name__ == "__main__":
    main()
