"""The reliability harness: the whole system on PostgreSQL and the sim cloud, chaos, and proof.

Used by `tests/system/test_reliability.py` (in CI) and `bench/chaos.py` (1,000 jobs). It
starts the topology of contract §13 as real processes (`services.launcher.stack.Stack`) on a
fresh PostgreSQL database and a seeded three-region sim cloud, drives it only
through its public APIs (JobService, SchedulerService, ControllerService,
grpc.health.v1 and the sim cloud's operator API), and judges it by what contract §9
and §16 promise, from the durable record alone: `collect_history` reads the
database's whole event log (with epochs) once the system is quiet, the sim cloud's
inventory (who launched each cluster, with which epoch, when it was preempted
and terminated, and every terminate, stop and notice it let through, with its
epoch) and its fencing counters, the scheduler's counter corrections, and the
client's own record of its cancels; `history.check` judges them (one terminal
status per job, no finished task redone, no two live clusters of a task, no
stale epoch accepted or used, no cluster left, every answered cancel in the log,
counters equal to a recount and never corrected).

The workloads and fault schedules live in `workload.py` and `faults.py`; the chaos
soak in `soak.py` and the randomized fault run in `history_run.py`. Randomness
comes from one seed: the workload, the fault times, the victims and the cloud's
preemptions.

Outcomes are never decided by a bare sleep: waits are on events (WatchJobs),
health or process state, each with a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import asyncpg  # type: ignore[import-untyped]
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.history import (
    CallRecord,
    ClientCancels,
    CloudCounters,
    ClusterRecord,
    CounterSnapshot,
    EventRecord,
    History,
    Kind,
    Violation,
    check,
    counter_drift,
    describe,
)
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import controller_service_pb2 as cpb
from managedjobs.v1 import (
    controller_service_pb2_grpc,
    job_pb2,
    job_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from managedjobs.v1 import job_service_pb2 as pb
from services.common.channels import ClientSecurity, open_sync_channel
from services.common.statuses import TERMINAL, JobStatus, ScheduleState
from services.launcher.service import Service
from services.launcher.stack import Stack

T = TypeVar("T")

ADMIN_URL = os.environ.get("MJ_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
USER = "reliability"
REGIONS = ("us-east-1", "us-west-2", "eu-west-1")
ACTIVE_STATUSES = tuple(s for s in JobStatus if s not in TERMINAL)
# Clients reconnect within a fraction of a second of a restarted server.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# A submission carries its idempotency key, so any failure that is not a verdict on the
# request may be retried; CANCELLED comes from a server that began shutting down as the
# call arrived (grpc.aio cancels calls not yet handed to a handler).
SUBMIT_RETRYABLE = RETRYABLE | {grpc.StatusCode.CANCELLED}

Log = Callable[[str], None]


def quiet(_: str) -> None:
    pass


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine to completion in its own thread (a caller's loop may be running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# --- PostgreSQL ---------------------------------------------------------------------------


def _admin(admin_url: str, sql: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(admin_url, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    _run(run())


@contextlib.contextmanager
def fresh_database(admin_url: str = ADMIN_URL) -> Iterator[str]:
    """A new, empty PostgreSQL database on the server of `admin_url`, dropped afterwards."""
    name = f"mj_rel_{uuid.uuid4().hex[:10]}"
    _admin(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
    finally:
        with contextlib.suppress(Exception):
            _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


E = TypeVar("E", JobStatus, ScheduleState)


def _enum(kind: type[E], value: object) -> E:
    """A status stored by name (or by number) as its enum member."""
    if isinstance(value, str):
        return kind[value]
    return kind(int(value))  # type: ignore[call-overload]


class Database:
    """Reads the scheduler's tables directly: the recount and the complete event log.

    The API's JobEvent has no epoch, and a live WatchJobs stream is not a proof
    of completeness; the database is the only truth (contract §2). `url` is a
    PostgreSQL URL or the scheduler's SQLite one (`sqlite:///PATH`, read-only here);
    queries are written with PostgreSQL's `$1` parameters, which SQLite reads as `?1`.
    """

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        if self.url.startswith("sqlite"):
            path = self.url.split(":///", 1)[1]
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
                return [tuple(r) for r in conn.execute(re.sub(r"\$(\d+)", r"?\1", sql), args)]

        async def run() -> list[tuple[Any, ...]]:
            conn = await asyncpg.connect(self.url, timeout=10)
            try:
                return [tuple(r) for r in await conn.fetch(sql, *args)]
            finally:
                await conn.close()

        return _run(run())

    def recount(self) -> collections.Counter[tuple[str | None, ScheduleState]]:
        """Jobs per (controller id, schedule state), in one statement."""
        rows = self.query("SELECT controller_id, schedule_state, count(*) FROM jobs GROUP BY 1, 2")
        return collections.Counter({(c, _enum(ScheduleState, s)): int(n) for c, s, n in rows})

    def statuses(self) -> collections.Counter[JobStatus]:
        """Jobs per status, in one statement."""
        rows = self.query("SELECT status, count(*) FROM jobs GROUP BY 1")
        return collections.Counter({_enum(JobStatus, s): int(n) for s, n in rows})

    def events(self, after_id: int = 0) -> list[EventRecord]:
        rows = self.query(
            "SELECT id, job_id, task_id, status, schedule_state, time, message, epoch "
            "FROM events WHERE id > $1 ORDER BY id",
            after_id,
        )
        return [
            EventRecord(
                event_id=int(i),
                job_id=int(j),
                task_id=int(t),
                status=_enum(JobStatus, s),
                schedule_state=_enum(ScheduleState, st),
                time=_seconds(when),
                message=str(m or ""),
                epoch=int(e or 0),
            )
            for i, j, t, s, st, when, m, e in rows
        ]

    def assignments(self, job_ids: Iterable[int]) -> dict[int, tuple[str | None, int]]:
        """job id -> (controller id, epoch) of its current assignment."""
        rows = self.query(
            "SELECT id, controller_id, epoch FROM jobs WHERE id = ANY($1::bigint[])",
            list(job_ids),
        )
        return {int(i): (c, int(e)) for i, c, e in rows}

    def idempotency(self, user: str) -> tuple[int, int]:
        """(rows, distinct idempotency keys) of a user's jobs."""
        rows = self.query(
            'SELECT count(*), count(DISTINCT idempotency_key) FROM jobs WHERE "user" = $1', user
        )
        return int(rows[0][0]), int(rows[0][1])


def _seconds(value: object) -> float:
    if isinstance(value, str):  # SQLite keeps a time as its ISO text
        value = dt.datetime.fromisoformat(value)
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.timestamp()
    return float(value)  # type: ignore[arg-type]


class PostgresServer:
    """The local PostgreSQL server, stopped and started with pg_ctlcluster (needs root)."""

    def __init__(self, cluster: str = "main") -> None:
        versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
        self.version = versions[0] if versions else ""
        self.cluster = cluster

    def why_unavailable(self) -> str:
        """Empty when this process can stop and start the server, else the reason."""
        if not shutil.which("pg_ctlcluster") or not self.version:
            return "pg_ctlcluster or /etc/postgresql is missing"
        if os.geteuid() != 0:
            return "stopping PostgreSQL needs root"
        if not ADMIN_URL.startswith("postgresql://postgres@127.0.0.1:5432/"):
            return f"MJ_TEST_POSTGRES_URL={ADMIN_URL} is not the local server"
        return ""

    def _ctl(self, action: str) -> None:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.cluster, action],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def ready(self) -> bool:
        done = subprocess.run(
            ["pg_isready", "-h", "127.0.0.1", "-p", "5432", "-q"], check=False, timeout=10
        )
        return done.returncode == 0

    def stop(self) -> None:
        self._ctl("stop")

    def start(self, timeout: float = 60.0) -> None:
        """Starts the server if it is down and waits until it accepts connections."""
        if not self.ready():
            with contextlib.suppress(subprocess.CalledProcessError):
                self._ctl("start")
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"PostgreSQL did not come back in {timeout:.0f}s")
            time.sleep(0.2)


# --- the system under test ----------------------------------------------------------------


def cloud_config(
    seed: int,
    time_scale: float,
    preemptions_per_hour: float = 0.0,
    nodes: int = 5000,
    launch_latency: float = 2.0,
) -> str:
    """Three regions with ample spot and on-demand capacity, seeded preemptions."""
    regions = "\n".join(
        f"  - {{name: {r}, zones: [{r}a, {r}b], spot_nodes: {nodes}, on_demand_nodes: {nodes}}}"
        for r in REGIONS
    )
    return (
        f"seed: {seed}\ntime_scale: {time_scale}\nlaunch_latency_seconds: {launch_latency}\n"
        f"preemptions_per_hour: {preemptions_per_hour}\nregions:\n{regions}\n"
    )


def controller_args(poll_interval: float = 30.0) -> list[str]:
    """Fast backoff; rare polls, since the sim cloud pushes every cluster change; a
    cancelled task of `job_spec` (which traps SIGTERM) is killed 5 simulated seconds on."""
    return [
        "--poll-interval", str(poll_interval),
        "--grace-seconds", "0.2",
        "--grace-period", "5",
        "--backoff-initial", "0.2",
        "--backoff-max", "1",
        "--start-check-interval", "0.1",
    ]  # fmt: skip


def start_stack(
    data_dir: Path,
    database_url: str,
    cloud_yaml: str,
    replicas: int = 3,
    lease_ttl: float = 3.0,
    heartbeat_interval: float = 0.5,
    scheduler_extra: Sequence[str] = (),
    controller_extra: Sequence[str] = (),
) -> Stack:
    """Starts scheduler (on `database_url`), replicas, logs and the sim cloud; all serving,
    secured as docker-compose runs them: tokens, TLS and mTLS between every process."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "simcloud.yaml"
    config.write_text(cloud_yaml)
    stack = Stack(
        data_dir,
        replicas=replicas,
        database_url=database_url,
        scheduler_args=[
            "--lease-ttl", str(lease_ttl),
            "--heartbeat-interval", str(heartbeat_interval),
            *scheduler_extra,
        ],
        controller_args=[*controller_args(), *controller_extra],
        simcloud_args=["--config", str(config)],
        tls=True,
    )  # fmt: skip
    try:
        stack.start(timeout=60)
    except BaseException:
        stack.stop()
        raise
    return stack


def job_spec(name: str, runtimes: Sequence[float], spot: bool = True) -> str:
    """A sim job: one task per runtime (simulated seconds), a chain when there are several.

    Its tasks trap SIGTERM, so a cancel's teardown lasts the grace period: a window in
    which faults can hit a job that is CANCELLING.
    """
    spot_line = "true" if spot else "false"

    def task(task_name: str, runtime: float) -> str:
        return (
            f"name: {task_name}\nresources:\n  use_spot: {spot_line}\nrun: train\n"
            f"sim: {{runtime_seconds: {runtime:.1f}, sigterm_exit_seconds: never}}\n"
        )

    if len(runtimes) == 1:
        return task(name, runtimes[0])
    steps = [task(f"step-{i}", r) for i, r in enumerate(runtimes)]
    return "---\n".join([f"name: {name}\n", *steps])


def service_log_lines(stack: Stack, service: str) -> list[dict[str, Any]]:
    """The JSON lines of one service's log (others, such as tracebacks, as {"msg": line})."""
    path = stack.data_dir / "service-logs" / f"{service}.log"
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = {"msg": line}
        out.append(record if isinstance(record, dict) else {"msg": line})
    return out


def stale_reports_refused(stack: Stack, controller_id: str | None = None) -> int:
    """How many reports the scheduler refused as stale (its "stale report" warnings)."""
    return sum(
        1
        for r in service_log_lines(stack, "scheduler")
        if r.get("msg") == "stale report"
        and (controller_id is None or r.get("controller_id") == controller_id)
    )


class Client:
    """Blocking clients of every API the harness uses, with fast reconnects."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self.jobs = job_service_pb2_grpc.JobServiceStub(self.channel(stack.scheduler_address))
        self.scheduler = scheduler_service_pb2_grpc.SchedulerServiceStub(
            self.channel(stack.scheduler_address)
        )
        self.cloud = spb_grpc.SimOperatorServiceStub(self.channel(stack.simcloud_address))
        # Submission retries by status code name.
        self.retried: collections.Counter[str] = collections.Counter()
        # The client's own record of its cancels, for the history checker: the jobs it
        # asked to cancel, those the answers named, and whether it cancelled all of them.
        self.cancels_sent: set[int] = set()
        self.cancels_answered: set[int] = set()
        self.cancelled_everything = False
        # Counter corrections the scheduler's earlier lives had made (`restart_scheduler`).
        self.earlier_corrections = 0

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = open_sync_channel(
                    address, self.stack.credentials.client_security, CHANNEL_OPTIONS
                )
            return self._channels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def submit(self, spec: str, key: str, user: str = USER, deadline: float = 120.0) -> int:
        """Submits with an idempotency key, retrying UNAVAILABLE (and the like) with the same key.

        Returns:
            The job id (the first one's, for a key seen before).
        """
        request = pb.SubmitJobRequest(spec_yaml=spec, user=user, idempotency_key=key)
        give_up = time.monotonic() + deadline
        delay = 0.05
        while True:
            try:
                return int(self.jobs.SubmitJob(request, timeout=10).job_id)
            except grpc.RpcError as error:
                if error.code() not in SUBMIT_RETRYABLE or time.monotonic() > give_up:
                    raise
                with self._lock:
                    self.retried[error.code().name] += 1
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def retrying(self, call: Callable[[], T], deadline: float = 60.0) -> T:
        """Calls until it answers anything but UNAVAILABLE or DEADLINE_EXCEEDED, or the deadline."""
        give_up = time.monotonic() + deadline
        while True:
            try:
                return call()
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE or time.monotonic() > give_up:
                    raise
            time.sleep(0.2)

    def list_jobs(self, user: str = USER, statuses: Sequence[JobStatus] = ()) -> list[job_pb2.Job]:
        """Every job of `user` (all pages), newest first."""
        out: list[job_pb2.Job] = []
        token = ""
        while True:
            request = pb.ListJobsRequest(user=user, page_size=1000, page_token=token)
            request.statuses.extend(int(s) for s in statuses)  # type: ignore[misc]
            reply = self._list(request)
            out.extend(reply.jobs)
            token = reply.next_page_token
            if not token:
                return out

    def _list(self, request: pb.ListJobsRequest) -> pb.ListJobsResponse:
        return self.retrying(lambda: self.jobs.ListJobs(request, timeout=30))

    def get_job(self, job_id: int) -> job_pb2.Job:
        request = pb.GetJobRequest(job_id=job_id)
        return self.retrying(lambda: self.jobs.GetJob(request, timeout=10).job)

    def held_by(self, controller_id: str, user: str = USER) -> list[int]:
        """Unfinished jobs assigned to a replica right now."""
        jobs = self.list_jobs(user, ACTIVE_STATUSES)
        return sorted(j.job_id for j in jobs if j.controller_id == controller_id)

    def cancel(self, job_ids: Sequence[int]) -> None:
        request = pb.CancelJobsRequest(job_ids=list(job_ids))
        with self._lock:
            self.cancels_sent.update(job_ids)
        reply = self.retrying(lambda: self.jobs.CancelJobs(request, timeout=30))
        with self._lock:
            self.cancels_answered.update(reply.cancelled_job_ids)

    def cancel_all(self, user: str = USER) -> None:
        request = pb.CancelJobsRequest(all=True, user=user)
        with self._lock:
            self.cancelled_everything = True
        reply = self.retrying(lambda: self.jobs.CancelJobs(request, timeout=120), deadline=180)
        with self._lock:
            self.cancels_answered.update(reply.cancelled_job_ids)

    def cancels(self) -> ClientCancels:
        """The record of the cancels this client sent and had answered."""
        with self._lock:
            return ClientCancels(
                frozenset(self.cancels_sent),
                frozenset(self.cancels_answered),
                self.cancelled_everything,
            )

    def restart_scheduler(self, kill: bool = False, timeout: float = 60.0) -> None:
        """Restarts the scheduler (SIGKILL with `kill`, else SIGTERM), keeping the counter
        corrections its life made: the count starts again at 0 with the next one."""
        self.earlier_corrections += int(self.scheduler_state().counter_corrections)
        self.stack.scheduler.restart(timeout=timeout, kill=kill)

    def counter_corrections(self) -> int:
        """Counter differences the scheduler's reconcile found and fixed, over every life of
        it this client restarted."""
        return self.earlier_corrections + int(self.scheduler_state().counter_corrections)

    def scheduler_state(self) -> scheduler_service_pb2.GetSchedulerStateResponse:
        request = scheduler_service_pb2.GetSchedulerStateRequest()
        return self.retrying(lambda: self.scheduler.GetSchedulerState(request, timeout=10))

    def controller_state(self, service: Service) -> cpb.GetControllerStateResponse:
        stub = controller_service_pb2_grpc.ControllerServiceStub(self.channel(service.address))
        request = cpb.GetControllerStateRequest()
        return self.retrying(lambda: stub.GetControllerState(request, timeout=10))

    def inventory(self) -> list[spb.Cluster]:
        """Every cluster the sim cloud ever launched, in launch order."""
        out: list[spb.Cluster] = []
        token = ""
        while True:
            request = spb.ListInventoryRequest(page_size=10000, page_token=token)
            # The sim cloud is the world, not the system under test: a busy machine's
            # slow connect is retried.
            reply = self.retrying(functools.partial(self.cloud.ListInventory, request, timeout=30))
            out.extend(reply.clusters)
            token = reply.next_page_token
            if not token:
                return out

    def cloud_state(self) -> spb.GetCloudStateResponse:
        request = spb.GetCloudStateRequest()
        return self.retrying(lambda: self.cloud.GetCloudState(request, timeout=10))

    def health(self, address: str, timeout: float = 1.0) -> int | None:
        """The server's overall grpc.health.v1 status, or None when it does not answer."""
        stub = health_pb2_grpc.HealthStub(self.channel(address))
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return int(reply.status)


SERVING = int(health_pb2.HealthCheckResponse.SERVING)
NOT_SERVING = int(health_pb2.HealthCheckResponse.NOT_SERVING)


class EventLog:
    """Follows WatchJobs for every job from event 0, across scheduler restarts.

    It is how the harness waits (for a status, for DONE) without polling. It is
    not the proof: the complete log is read from the database at the end.
    """

    def __init__(self, address: str, security: ClientSecurity) -> None:
        self._channel = open_sync_channel(address, security, CHANNEL_OPTIONS)
        self._stub = job_service_pb2_grpc.JobServiceStub(self._channel)
        self._changed = threading.Condition()
        self.by_job: dict[int, list[job_pb2.JobEvent]] = collections.defaultdict(list)
        self.done: set[int] = set()
        self.last_id = 0
        self.reconnects = 0
        self._stop = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="event-log", daemon=True)
        self._triggers: dict[
            int, list[tuple[Callable[[job_pb2.JobEvent], bool], Callable[[], None]]]
        ]
        self._triggers = collections.defaultdict(list)

    def start(self) -> EventLog:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(10)
        self._channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._call = self._stub.WatchJobs(pb.WatchJobsRequest(after_event_id=self.last_id))
                for response in self._call:
                    self._add(response.event)
            except grpc.RpcError:
                pass
            if self._stop.wait(0.2):
                return
            self.reconnects += 1

    def _add(self, event: job_pb2.JobEvent) -> None:
        with self._changed:
            self.last_id = max(self.last_id, event.event_id)
            self.by_job[event.job_id].append(event)
            if event.schedule_state == ScheduleState.DONE:
                self.done.add(event.job_id)
            fired = self._fire(event.job_id, [event])
            self._changed.notify_all()
        for action in fired:
            action()

    def when(
        self,
        job_id: int,
        predicate: Callable[[job_pb2.JobEvent], bool],
        action: Callable[[], None],
    ) -> None:
        """Calls `action` once, at the first event of the job for which `predicate` holds
        (at once if one was seen already). `action` runs on the log's thread: keep it short."""
        with self._changed:
            self._triggers[job_id].append((predicate, action))
            fired = self._fire(job_id, self.by_job.get(job_id, []))
        for run in fired:
            run()

    def _fire(self, job_id: int, events: Sequence[job_pb2.JobEvent]) -> list[Callable[[], None]]:
        triggers = self._triggers.get(job_id)
        if not triggers:
            return []
        fired = [a for p, a in triggers if any(p(e) for e in events)]
        triggers[:] = [(p, a) for p, a in triggers if a not in fired]
        return fired

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Waits until `predicate()` (called under the log's lock) holds, or the timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 1.0))
            return True

    def wait_done(
        self,
        job_ids: Iterable[int],
        timeout: float,
        client: Client | None = None,
        progress: Log = quiet,
    ) -> set[int]:
        """Waits until every job is DONE; returns those that are not by the deadline.

        A live stream can miss an event (a reconnect lands between two commits);
        with `client`, jobs not seen DONE are checked with ListJobs every few seconds.
        """
        wanted = set(job_ids)
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 5.0
        while True:
            with self._changed:
                left = wanted - self.done
            if not left:
                return set()
            now = time.monotonic()
            if now > deadline:
                return left
            if client is not None and now >= next_check:
                finished = {
                    j.job_id for j in client.list_jobs() if j.schedule_state == ScheduleState.DONE
                }
                with self._changed:
                    self.done |= finished & left
                progress(f"{len(wanted) - len(left - finished)}/{len(wanted)} jobs done")
                next_check = now + 5.0
                continue
            self.wait_for(lambda: not (wanted - self.done), min(deadline, next_check) - now)


@dataclasses.dataclass
class System:
    """The system under test with its clients: what a reliability test drives and reads."""

    stack: Stack
    client: Client
    events: EventLog
    db: Database


@contextlib.contextmanager
def system(
    data_dir: Path,
    admin_url: str,
    cloud_yaml: str,
    replicas: int = 3,
    scheduler_extra: Sequence[str] = (),
    lease_ttl: float = 3.0,
    heartbeat_interval: float | None = None,
    log: Log = print,
) -> Iterator[System]:
    """The whole system on a fresh database, with clients and a live event log; stopped after."""
    with fresh_database(admin_url) as url:
        stack = start_stack(
            data_dir,
            url,
            cloud_yaml,
            replicas=replicas,
            lease_ttl=lease_ttl,
            heartbeat_interval=heartbeat_interval or min(0.5, lease_ttl / 5),
            scheduler_extra=scheduler_extra,
        )
        log(f"service logs in {data_dir / 'service-logs'}")
        client = Client(stack)
        events = EventLog(stack.scheduler_address, stack.credentials.client_security).start()
        try:
            yield System(stack, client, events, Database(url))
        finally:
            events.close()
            client.close()
            stack.stop()


# --- figures and invariants ---------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _ts(stamp: Any) -> float | None:
    return stamp.ToNanoseconds() / 1e9 if stamp.ToNanoseconds() else None


def describe_cluster(cluster: spb.Cluster) -> str:
    """One inventory record, with its times as wall-clock seconds, for failure messages."""
    times = {
        field: _ts(getattr(cluster, f"{field}_time"))
        for field in ("launch", "up", "task_end", "preempt", "terminate")
    }
    when = " ".join(f"{k}={v:.3f}" for k, v in times.items() if v is not None)
    status = spb.ClusterStatus.Name(cluster.status)
    calls = " ".join(
        f"{spb.ClusterCallKind.Name(c.kind).removeprefix('CLUSTER_CALL_KIND_').lower()}"
        f"@{c.epoch}={_ts(c.call_time) or 0.0:.3f}"
        for c in cluster.calls
    )
    return f"{cluster.name}#{cluster.cluster_id} epoch {cluster.epoch} {status} {when} {calls}"


def describe_job(client: Client, db: Database | None, job_id: int) -> str:
    """A job's clusters (inventory), events (database, with epochs) and lifecycle log."""
    clusters = client.cloud.ListInventory(
        spb.ListInventoryRequest(page_size=100, job_id=job_id), timeout=30
    ).clusters
    lines = [f"job {job_id} clusters:"] + [f"  {describe_cluster(c)}" for c in clusters]
    if db is not None:
        events = db.query(
            "SELECT id, task_id, status, schedule_state, time, message, epoch FROM events "
            "WHERE job_id = $1 ORDER BY id",
            job_id,
        )
        lines.append(f"job {job_id} events (id task status state time message epoch):")
        for event_id, task_id, status, state, when, message, epoch in events:
            lines.append(
                f"  {event_id} {task_id} {status} {state} {_seconds(when):.3f} {message!r} {epoch}"
            )
    lifecycle = client.stack.data_dir / "logs" / str(job_id) / "controller.log"
    if lifecycle.exists():
        lines.append(f"job {job_id} lifecycle log ({lifecycle}):")
        lines += [f"  {line}" for line in lifecycle.read_text(errors="replace").splitlines()]
    return "\n".join(lines)


def cluster_record(cluster: spb.Cluster) -> ClusterRecord:
    """An inventory record as the history checker reads it."""
    kinds = {
        spb.CLUSTER_CALL_KIND_TERMINATE: "terminate",
        spb.CLUSTER_CALL_KIND_STOP: "stop",
        spb.CLUSTER_CALL_KIND_NOTICE: "notice",
    }
    calls = tuple(
        CallRecord(kinds.get(c.kind, "unknown call"), int(c.epoch), _ts(c.call_time) or 0.0)
        for c in cluster.calls
    )
    return ClusterRecord(
        cluster_id=int(cluster.cluster_id),
        name=cluster.name,
        job_id=int(cluster.job_id),
        task_id=int(cluster.task_id),
        epoch=int(cluster.epoch),
        launch_time=_ts(cluster.launch_time) or 0.0,
        task_end_time=_ts(cluster.task_end_time),
        exit_code=int(cluster.exit_code),
        preempt_time=_ts(cluster.preempt_time),
        terminate_time=_ts(cluster.terminate_time),
        replaced=bool(cluster.replaced),
        calls=calls,
    )


def reported_counters(state: scheduler_service_pb2.GetSchedulerStateResponse) -> dict[str, int]:
    """The scheduler's counters, named as `history.CounterSnapshot` names them."""
    out = {
        "launching": int(state.launching),
        "alive": int(state.alive),
        "waiting": int(state.waiting),
        "alive_waiting": int(state.alive_waiting),
    }
    for replica in state.replicas:
        out[f"{replica.controller_id}.launching"] = int(replica.launching)
        out[f"{replica.controller_id}.alive"] = int(replica.alive)
    return out


def counter_snapshot(
    client: Client, db: Database, label: str, settle: float = 10.0
) -> CounterSnapshot:
    """The scheduler's counters and a recount at a quiescent point.

    Admission applies a change just after its commit, so the two may differ for a
    moment; they are read again until they agree or `settle` seconds pass, and the
    last reading is kept (the checker judges it).
    """
    deadline = time.monotonic() + settle
    while True:
        reported = reported_counters(client.scheduler_state())
        snapshot = CounterSnapshot(label, reported, db.recount())
        if not counter_drift(snapshot) or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.2)


def collect_history(
    client: Client,
    db: Database,
    job_ids: Iterable[int] | None = None,
    counters: Sequence[CounterSnapshot] = (),
    tasks: Mapping[int, int] | None = None,
) -> History:
    """The durable record of a run: the whole event log, the inventory, the cloud's
    counters, the scheduler's counter corrections, and the client's own record (its
    cancels, and `tasks`: how many tasks it submitted each job with, when it knows)."""
    state = client.cloud_state()
    return History(
        events=db.events(),
        clusters=[cluster_record(c) for c in client.inventory()],
        job_ids=None if job_ids is None else sorted(set(job_ids)),
        cloud=CloudCounters(
            stale_launches_rejected=int(state.stale_launches_rejected),
            stale_terminates_rejected=int(state.stale_terminates_rejected),
            stale_notices_rejected=int(state.stale_notices_rejected),
            unterminated_clusters=int(state.unterminated_clusters),
        ),
        counters=list(counters),
        tasks=tasks,
        counter_corrections=client.counter_corrections(),
        cancels=client.cancels(),
    )


def cloud_figures(client: Client) -> dict[str, int]:
    """The sim cloud's counters a report prints."""
    state = client.cloud_state()
    return {
        "launches": int(state.launched_total),
        "preemptions": int(state.preempted_total),
        "duplicate_launches": int(state.violations) + int(state.replaced_total),
        "unterminated_clusters": int(state.unterminated_clusters),
        "stale_launches_rejected": int(state.stale_launches_rejected),
        "stale_terminates_rejected": int(state.stale_terminates_rejected),
        "stale_notices_rejected": int(state.stale_notices_rejected),
    }


def lifecycle_lines(stack: Stack, needle: str, limit: int = 20) -> list[str]:
    """Lines of the jobs' lifecycle logs that contain `needle`, as "job N: line"."""
    found: list[str] = []
    for path in sorted((stack.data_dir / "logs").glob("*/controller.log")):
        for line in path.read_text(errors="replace").splitlines():
            if needle in line and len(found) < limit:
                found.append(f"job {path.parent.name}: {line}")
    return found


def explain(
    client: Client, db: Database | None, violations: Sequence[Violation], jobs: int = 3
) -> str:
    """The violations, then the clusters, events and lifecycle log of the first few jobs
    they name (those of the log's own contract last: they are everywhere when they are)."""
    lines = [describe(violations)]
    named = sorted(
        {(v.kind == Kind.LOG_CONTRACT, v.job_id) for v in violations if v.job_id is not None}
    )
    chosen: list[int] = []
    for _, job_id in named:
        if job_id is not None and job_id not in chosen and len(chosen) < jobs:
            chosen.append(job_id)
    lines.extend(describe_job(client, db, job_id) for job_id in chosen)
    return "\n".join(lines)


class KnownFailures(AssertionError):
    """A run that broke only what a test's xfail names as known (`judge`)."""


def judge(
    problems: Sequence[str],
    violations: Sequence[Violation],
    known: Iterable[Kind],
    details: str = "",
    also_known: Sequence[str] = (),
) -> None:
    """Fails a test by what a run broke.

    Raises:
        AssertionError: a problem of the run, or a violation of a kind not `known`.
        KnownFailures: only violations of `known` kinds (or `also_known` findings),
            for a test marked `xfail(strict=True, raises=KnownFailures)`: it fails
            outright on anything new, and passes (strictly: flips) once all are fixed.
    """
    assert not problems, "\n".join([*problems, details])
    known = set(known)
    unknown = [v for v in violations if v.kind not in known]
    assert not unknown, details or describe(violations)
    if violations or also_known:
        raise KnownFailures("\n".join([details or describe(violations), *also_known]))


def history_violations(
    client: Client,
    db: Database,
    job_ids: Iterable[int] | None = None,
    kinds: Iterable[Kind] | None = None,
    counters: Sequence[CounterSnapshot] = (),
) -> list[Violation]:
    """Collects the run's record and checks it (`history.check`)."""
    history = collect_history(client, db, job_ids, counters)
    return check(history, None if kinds is None else set(kinds))


def job_problems(
    jobs: Sequence[job_pb2.Job], cancelled: Iterable[int] = (), expect_success: bool = True
) -> list[str]:
    """Every job DONE with a terminal status, every task terminal; successes as expected."""
    cancelled = set(cancelled)
    problems: list[str] = []
    for job in jobs:
        status = JobStatus(job.status)
        where = f"job {job.job_id} ({job.name})"
        if job.schedule_state != ScheduleState.DONE:
            problems.append(f"{where}: not DONE but {ScheduleState(job.schedule_state).name}")
        if status not in TERMINAL:
            problems.append(f"{where}: ended {status.name}, not a terminal status")
        for task in job.tasks:
            if JobStatus(task.status) not in TERMINAL:
                problems.append(f"{where} task {task.task_id}: {JobStatus(task.status).name}")
        if not expect_success:
            continue
        allowed = {JobStatus.CANCELLED, JobStatus.SUCCEEDED}
        if job.job_id not in cancelled:
            allowed = {JobStatus.SUCCEEDED}
        if status in TERMINAL and status not in allowed:
            problems.append(f"{where}: ended {status.name}: {job.failure_reason!r}")
    return problems
