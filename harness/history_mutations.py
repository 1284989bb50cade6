"""Mutation runs: the real system with one protection turned off must break its history.

The history checker's own tests (`tests/system/test_history_checker.py`) feed it hand-written
histories. These runs make the real system write a bad one: the whole system as
processes (scheduler on a fresh PostgreSQL database, controller replicas, logs, a
sim cloud without random preemptions; tokens, TLS and mTLS), started with one
protection turned off through a test-only switch (`MJ_TEST_DISABLE`,
`services/common/test_switches.py`), driven into the one situation that
protection exists for, and judged by `history.check`. Each must report the
violation that protection prevents; the same scenario with every protection on
(`protected=True`) must report none.

Nothing is left to a race: each situation is arranged, and each step awaits what
it makes happen. Controller-1 holds the one long job J (it alone is up when J is
submitted); controller-2 starts once it does, and takes J over when
controller-1's lease runs out.

- `lease-guard` (`stale_call`): controller-1 talks to the scheduler through a TCP
  proxy (`harness/tcp_proxy.py`) that holds: its heartbeats stop arriving, the scheduler
  lets its lease run out and resumes J on controller-2 (epoch 2), which adopts J's
  cluster C (a RUNNING task is watched, not relaunched), while controller-1 still
  sees its stream up and keeps J. A preemption notice for C is announced; both
  replicas pass it on to the task. Controller-1's guard, finding no valid lease,
  refuses; without the guard its notice goes out at epoch 1, and the cloud cannot
  refuse it (no epoch above 1 was ever launched: controller-2 adopted C).
- `cancel-on-assignment` (`cancel_not_honoured`): the same cut, and J is cancelled
  at once, while controller-1 still holds it: the cancel goes to a replica that
  will never get it, and the assignment to controller-2 carries the cancel flag.
  Controller-2 cancels J; ignoring the flag, it runs J to its end.
- `epoch-check-at-report` (`stale_report`): a real replica cannot be made to send
  a report at an epoch it lost: once its lease is gone it stops its jobs and drops
  what it had not sent, and the scheduler reads nothing more from the stream it
  gave the jobs away from. The report that check exists for is a late one, so the
  test plays controller-1 itself (a raw stream with its token and certificate):
  it takes J, reports it STARTING, falls silent until J has moved and runs on
  controller-2, then comes back and reports J RUNNING at epoch 1. Refused as stale
  when protected; written without the check.

Once the scenario is over, J ends (cancelled where it did not end by itself) and
the record is judged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc

from harness.history import Kind, Violation, check, describe
from harness.reliability import (
    ADMIN_URL,
    Client,
    Database,
    EventLog,
    Log,
    cloud_config,
    collect_history,
    controller_args,
    counter_snapshot,
    describe_job,
    fresh_database,
    job_spec,
    quiet,
)
from harness.tcp_proxy import TcpProxy
from harness.waiting import wait_until
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.common import test_switches
from services.common.channels import ClientSecurity, TokenSource, open_sync_channel
from services.common.event_messages import CANCEL_REQUESTED, RESUMED_ON
from services.common.security.auth import Secrets
from services.common.security.tls import ClientTls
from services.common.statuses import JobStatus, ScheduleState
from services.controller.messages import unbatched
from services.launcher.service import Service
from services.launcher.stack import Stack

LEASE_TTL = 3.0
HEARTBEAT = 0.5
TIME_SCALE = 10.0
# Simulated seconds: J outlives every scenario, except where it must end by itself.
FOREVER = 1e6
# Real seconds any one step may take on a loaded machine (only a bound on a wait).
WITHIN = 90.0
HOLDER, TAKER = "controller-1", "controller-2"


@dataclasses.dataclass
class System:
    """The system of a mutation run: controller-1 behind a proxy, neither replica started."""

    stack: Stack
    proxy: TcpProxy
    client: Client
    events: EventLog
    db: Database
    log: Log

    @property
    def holder(self) -> Service:
        return self.stack.service(HOLDER)

    @property
    def taker(self) -> Service:
        return self.stack.service(TAKER)

    def start(self, service: Service) -> None:
        """Starts a replica and waits until the scheduler has its stream."""
        service.start()
        service.wait_serving(60)
        self.wait(lambda: self.connected(service.name), f"{service.name} connected")

    def connected(self, controller_id: str) -> bool:
        state = self.client.scheduler_state()
        return any(r.controller_id == controller_id and r.connected for r in state.replicas)

    def runs(self, service: Service, job_id: int) -> JobStatus | None:
        """The task status of the replica's runner of the job; None without one."""
        jobs = self.client.controller_state(service).jobs
        return next((JobStatus(j.status) for j in jobs if j.job_id == job_id), None)

    def latest(self, job_id: int) -> tuple[JobStatus, ScheduleState] | None:
        events = self.events.by_job.get(job_id)
        if not events:
            return None
        return JobStatus(events[-1].status), ScheduleState(events[-1].schedule_state)

    def running(self, job_id: int) -> bool:
        """The job's latest event: its task RUNNING, its launch slot given back."""
        return self.latest(job_id) == (JobStatus.RUNNING, ScheduleState.ALIVE)

    def event_id(self, job_id: int, message: str) -> int | None:
        """The first event of the job with this message, if any."""
        events = self.events.by_job.get(job_id, [])
        return next((e.event_id for e in events if e.message == message), None)

    def moved(self, job_id: int) -> int:
        """Awaits the scheduler giving the job to controller-2; returns that event's id."""
        message = f"{RESUMED_ON}{TAKER}"
        self.wait(lambda: self.event_id(job_id, message), f"job {job_id} resumed on {TAKER}")
        found = self.event_id(job_id, message)
        assert found is not None
        return found

    def cluster(self, job_id: int) -> spb.Cluster:
        """The job's first cluster."""
        return next(c for c in self.client.inventory() if c.job_id == job_id)

    def done(self, job_id: int) -> None:
        self.wait(lambda: job_id in self.events.done, f"job {job_id} DONE")

    def wait(self, probe: Callable[[], object], what: str) -> None:
        self.log(f"waiting for {what}")
        wait_until(probe, what=what, within=WITHIN, every=0.1)


@contextlib.contextmanager
def system(data_dir: Path, admin_url: str, disabled: str, log: Log) -> Iterator[System]:
    """The sim cloud, the scheduler and logs started (with the protection `disabled`
    turned off in the scheduler and the replicas, unless empty); controller-1 behind
    a proxy; the replicas left for the scenario to start."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "simcloud.yaml"
    config.write_text(cloud_config(1, TIME_SCALE, preemptions_per_hour=0.0))
    with fresh_database(admin_url) as url:
        stack = Stack(
            data_dir,
            replicas=2,
            database_url=url,
            scheduler_args=[
                "--lease-ttl", str(LEASE_TTL), "--heartbeat-interval", str(HEARTBEAT),
            ],
            controller_args=controller_args(),
            simcloud_args=["--config", str(config)],
            tls=True,
        )  # fmt: skip
        proxy = TcpProxy(stack.scheduler_address)
        stack.service(HOLDER).env["MJ_SCHEDULER_ADDRESS"] = proxy.address
        for service in (stack.scheduler, *stack.controllers):
            service.env[test_switches.ENV] = disabled
        client: Client | None = None
        events: EventLog | None = None
        try:
            assert stack.simcloud is not None
            for service in (stack.simcloud, stack.scheduler, stack.logs):
                service.start()
                service.wait_serving(60)
            log(f"service logs in {data_dir / 'service-logs'}")
            client = Client(stack)
            events = EventLog(stack.scheduler_address, stack.credentials.client_security).start()
            yield System(stack, proxy, client, events, Database(url), log)
        finally:
            proxy.release()
            if events is not None:
                events.close()
            if client is not None:
                client.close()
            stack.stop()
            proxy.close()


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A protection, the violation its absence must show, and the scenario that shows it
    (it returns the job, DONE)."""

    switch: str
    kind: Kind
    scenario: Callable[[System], int]


@dataclasses.dataclass
class MutationReport:
    switch: str
    protected: bool
    expected: Kind
    violations: list[Violation]
    details: str = ""

    @property
    def kinds(self) -> set[Kind]:
        return {v.kind for v in self.violations}

    @property
    def caught(self) -> bool:
        """The matching violation was reported."""
        return self.expected in self.kinds


def run_mutation(
    mutation: Mutation,
    data_dir: Path,
    admin_url: str = ADMIN_URL,
    protected: bool = False,
    log: Log = quiet,
) -> MutationReport:
    """Runs a mutation's scenario (with every protection on, when `protected`) and judges
    the record."""
    disabled = "" if protected else mutation.switch
    with system(data_dir, admin_url, disabled, log) as s:
        job_id = mutation.scenario(s)
        snapshot = counter_snapshot(s.client, s.db, "the job done")
        history = collect_history(s.client, s.db, [job_id], [snapshot], {job_id: 1})
        violations = check(history)
        details = "\n".join([describe(violations), describe_job(s.client, s.db, job_id)])
    return MutationReport(mutation.switch, protected, mutation.kind, violations, details)


# --- controller-1 cut off by the proxy --------------------------------------------------------


def _holding(s: System, runtime: float) -> int:
    """J RUNNING on controller-1 (the only replica up); returns J."""
    s.start(s.holder)
    job_id = s.client.submit(job_spec("mutation", (runtime,), spot=False), "mutation")
    s.wait(lambda: s.running(job_id), f"job {job_id} RUNNING on {HOLDER}")
    return job_id


def _back(s: System, job_id: int) -> None:
    """The proxy releases: controller-1 reconnects, is told J moved; J ends."""
    s.proxy.release()
    s.wait(
        lambda: s.connected(HOLDER) and s.runs(s.holder, job_id) is None,
        f"{HOLDER} back, no longer running job {job_id}",
    )
    if job_id not in s.events.done:
        s.client.cancel([job_id])
    s.done(job_id)


def notice_from_a_replica_cut_off(s: System) -> int:
    job_id = _holding(s, FOREVER)
    s.start(s.taker)
    s.proxy.hold()
    s.log(f"{HOLDER} cut off")
    s.moved(job_id)
    name = s.cluster(job_id).name
    request = spb.PreemptClusterRequest(cluster_name=name, notice_seconds=FOREVER)
    s.client.retrying(lambda: s.client.cloud.PreemptCluster(request))

    def acted() -> bool:
        """Controller-1's guard refused the notice (its runner stopped), or the notice
        reached the cluster at epoch 1."""
        if s.runs(s.holder, job_id) is None:
            return True
        return any(call.epoch == 1 for call in s.cluster(job_id).calls)

    s.wait(acted, f"{HOLDER}'s notice to {name} at epoch 1, or its refusal")
    _back(s, job_id)
    return job_id


def cancel_while_it_moves(s: System) -> int:
    # J would end by itself 10 real seconds after it started: long after the cancel.
    job_id = _holding(s, 100.0)
    # Controller-1 hears nothing more (the cancel included), the scheduler still hears it:
    # the cancel is accepted while controller-1 holds J, however long it takes.
    s.proxy.hold(upstream=False)
    s.client.cancel([job_id])
    s.start(s.taker)
    s.proxy.hold(upstream=True)
    s.log(f"{HOLDER} cut off")
    moved = s.moved(job_id)
    accepted = s.event_id(job_id, CANCEL_REQUESTED)
    assert accepted is not None and accepted < moved, (accepted, moved)
    s.done(job_id)
    _back(s, job_id)
    return job_id


# --- controller-1 played by the test --------------------------------------------------------


class ReplicaStream:
    """A raw ConnectController stream as a replica, with its own token and certificate:
    sends what it is told, keeps its lease with heartbeats, and collects what comes back."""

    def __init__(self, stack: Stack, controller_id: str) -> None:
        tls_dir = stack.credentials.tls_dir
        assert tls_dir is not None
        tls = ClientTls.from_files(
            str(tls_dir / "ca.pem"),
            str(tls_dir / f"{controller_id}.pem"),
            str(tls_dir / f"{controller_id}.key"),
        )
        token = TokenSource(path=Secrets.in_data_dir(stack.data_dir).controller(controller_id))
        self.controller_id = controller_id
        self._channel = open_sync_channel(stack.scheduler_address, ClientSecurity(token, tls))
        self._stub = scheduler_service_pb2_grpc.SchedulerServiceStub(self._channel)
        self._seq = 0
        self._changed = threading.Condition()
        self.assignments: list[pb.JobAssignment] = []
        self.acks: dict[int, pb.ReportAck] = {}
        self._outbox: queue.Queue[pb.ConnectControllerRequest | None] | None = None
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def connect(self, held: Sequence[pb.HeldJob] = ()) -> None:
        """Opens a stream: the hello (holding `held`), then heartbeats until `close`."""
        self._outbox = queue.Queue()
        hello = pb.ControllerHello(
            controller_id=self.controller_id,
            capacity=pb.Capacity(max_launches=4, max_jobs=100),
            held_jobs=list(held),
        )
        self._send(hello=hello)
        call = self._stub.ConnectController(iter(self._outbox.get, None))
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, args=(call,), daemon=True),
            threading.Thread(target=self._beat, args=(self._outbox, self._stopped), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Ends the stream (the scheduler then counts the lease down)."""
        self._stopped.set()
        if self._outbox is not None:
            self._outbox.put(None)
            self._outbox = None
        for thread in self._threads:
            thread.join(10)

    def report(self, **message: object) -> pb.ReportAck:
        """Sends a request and returns its ack."""
        seq = self._send(**message)
        with self._changed:
            answered = self._changed.wait_for(lambda: seq in self.acks, WITHIN)
            assert answered, f"no ack for {message}"
            return self.acks[seq]

    def assignment(self) -> pb.JobAssignment:
        with self._changed:
            assert self._changed.wait_for(lambda: self.assignments, WITHIN), "no assignment"
            return self.assignments[0]

    def _send(self, **message: object) -> int:
        """Numbers the request (once for all the replica's streams) and sends it, in order."""
        assert self._outbox is not None
        return self._numbered(self._outbox, **message)

    def _numbered(
        self, outbox: queue.Queue[pb.ConnectControllerRequest | None], **message: object
    ) -> int:
        with self._changed:
            self._seq += 1
            outbox.put(pb.ConnectControllerRequest(seq=self._seq, **message))  # type: ignore[arg-type]
            return self._seq

    def _beat(
        self, outbox: queue.Queue[pb.ConnectControllerRequest | None], stopped: threading.Event
    ) -> None:
        while not stopped.wait(HEARTBEAT):
            self._numbered(outbox, heartbeat=pb.ControllerHeartbeat())

    def _read(self, call: Iterator[pb.ConnectControllerResponse]) -> None:
        try:
            for response in call:
                for message in unbatched(response):
                    kind = message.WhichOneof("message")
                    with self._changed:
                        if kind == "assignment":
                            self.assignments.append(message.assignment)
                        elif kind == "ack":
                            self.acks[message.ack.ack_seq] = message.ack
                        self._changed.notify_all()
        except grpc.RpcError:
            pass  # closed

    def shut(self) -> None:
        self.close()
        self._channel.close()


def late_report(s: System) -> int:
    replica = ReplicaStream(s.stack, HOLDER)
    try:
        replica.connect()
        s.wait(lambda: s.connected(HOLDER), f"{HOLDER} (played) connected")
        job_id = s.client.submit(job_spec("mutation", (FOREVER,), spot=False), "mutation")
        given = replica.assignment()
        assert given.job.job_id == job_id and given.epoch == 1, given
        starting = pb.TaskTransition(
            job_id=job_id, epoch=1, task_id=0, status=int(JobStatus.STARTING), message="launching"
        )
        assert replica.report(transition=starting).accepted
        s.start(s.taker)
        replica.close()  # silent: its lease runs out, J moves
        s.moved(job_id)
        s.wait(lambda: s.running(job_id), f"job {job_id} RUNNING on {TAKER}")
        replica.connect(held=[pb.HeldJob(job_id=job_id, epoch=1)])
        late = pb.TaskTransition(
            job_id=job_id, epoch=1, task_id=0, status=int(JobStatus.RUNNING), message="launched"
        )
        ack = replica.report(transition=late)
        s.log(f"the late report: accepted={ack.accepted} {ack.reason!r}")
        replica.close()
    finally:
        replica.shut()
    s.client.cancel([job_id])
    s.done(job_id)
    return job_id


MUTATIONS: Sequence[Mutation] = (
    Mutation(test_switches.EPOCH_CHECK_AT_REPORT, Kind.STALE_REPORT, late_report),
    Mutation(test_switches.LEASE_GUARD, Kind.STALE_CALL, notice_from_a_replica_cut_off),
    Mutation(test_switches.CANCEL_ON_ASSIGNMENT, Kind.CANCEL_NOT_HONOURED, cancel_while_it_moves),
)


def mutation(switch: str) -> Mutation:
    return next(m for m in MUTATIONS if m.switch == switch)
