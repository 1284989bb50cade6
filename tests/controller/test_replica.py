"""A controller replica's own bookkeeping: cancels, assignments and watchers.

These run the `Replica` class in this process without a scheduler: messages are
handed to it as its stream would, and what it does with them is checked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from harness.waiting import reached
from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.backends import (
    BackendError,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    Observation,
    TaskStatus,
)
from services.backends.local.backend import LocalBackend
from services.backends.wrapper import BackendWrapper
from services.common.channels import ClientSecurity
from services.controller.config import LifecycleConfig
from services.controller.joblog import LogsClient
from services.controller.messages import MovedAway, Report
from services.controller.replica import Replica
from services.controller.watch import ClusterWatch
from services.scheduler.spec.parse import parse_job_spec


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Replica]:
    made = Replica(
        controller_id="c1",
        address="",
        capacity=pb.Capacity(max_launches=4, max_jobs=10),
        backend=LocalBackend(tmp_path / "clusters"),
        logs=LogsClient("127.0.0.1:1", ClientSecurity()),
        config=LifecycleConfig(),
        scheduler_address="127.0.0.1:1",
    )
    yield made
    await made.close()


def assignment(
    job_id: int, epoch: int, cancel_requested: bool = False
) -> pb.ConnectControllerResponse:
    spec = parse_job_spec("name: j\nrun: sleep 100\n")
    task = job_pb2.Task(task_id=0, name="j", status=job_pb2.JOB_STATUS_PENDING, spec=spec.tasks[0])
    job = job_pb2.Job(job_id=job_id, name="j", tasks=[task], cancel_requested=cancel_requested)
    return pb.ConnectControllerResponse(assignment=pb.JobAssignment(job=job, epoch=epoch))


def cancel(job_id: int, epoch: int) -> pb.ConnectControllerResponse:
    return pb.ConnectControllerResponse(cancel=pb.JobCancel(job_id=job_id, epoch=epoch))


async def test_a_cancel_that_arrives_before_its_assignment_is_kept(replica: Replica) -> None:
    """The scheduler sends a cancel as soon as it commits; the assignment it races may
    come after it. The replica keeps the cancel for that (job, epoch)."""
    replica.link.dispatch(cancel(7, 3))
    replica.link.dispatch(assignment(7, 3))
    assert replica.runners[7].cancel.is_set()


async def test_an_early_cancel_for_another_epoch_does_not_cancel(replica: Replica) -> None:
    replica.link.dispatch(cancel(8, 2))
    replica.link.dispatch(assignment(8, 3))
    assert not replica.runners[8].cancel.is_set()


async def test_a_cancel_reaches_a_running_job_of_its_epoch(replica: Replica) -> None:
    replica.link.dispatch(assignment(9, 1))
    runner = replica.runners[9]
    replica.link.dispatch(cancel(9, 1))
    assert runner.cancel.is_set()


async def test_an_older_assignment_never_replaces_a_newer_one(replica: Replica) -> None:
    replica.link.dispatch(assignment(10, 5))
    first = replica.runners[10]
    replica.link.dispatch(assignment(10, 4))
    assert replica.runners[10] is first and first.epoch == 5


class Pushing(BackendWrapper):
    """A backend that pushes the events a test puts in `pushed`."""

    def __init__(self, inner: LocalBackend) -> None:
        super().__init__(inner)
        self.pushed: asyncio.Queue[ClusterEvent] = asyncio.Queue()
        # What a look sees, when set (else the local backend's answer).
        self.now: Observation | None = None

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        return self._events()

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        if self.now is None:
            return await super().observe_many(handles)
        return {handle.cluster_name: self.now for handle in handles}

    async def _events(self) -> AsyncIterator[ClusterEvent]:
        while True:
            yield await self.pushed.get()
            # Asked for the next event: the watch has handed this one to its watchers.
            self.pushed.task_done()

    async def delivered(self) -> None:
        """Waits until the watch has handed every pushed event to its watchers."""
        await reached(self.pushed.join(), what="the pushed events to be delivered")


@pytest.fixture
async def pushing(tmp_path: Path) -> AsyncIterator[tuple[Pushing, ClusterWatch]]:
    backend = Pushing(LocalBackend(tmp_path))
    hub = ClusterWatch(backend, poll_interval=3600)
    hub.start()
    yield backend, hub
    await hub.close()


async def test_closing_one_watcher_leaves_the_others_of_a_cluster_listening(
    pushing: tuple[Pushing, ClusterWatch],
) -> None:
    """A job's old and new runner may watch one cluster name for a moment."""
    backend, hub = pushing
    handle = ClusterHandle("mj-1-0", "local")
    old, new = hub.watch(handle), hub.watch(handle)
    old.close()
    news = Observation(ClusterStatus.DOWN)
    await backend.pushed.put(ClusterEvent("mj-1-0", news))
    assert await asyncio.wait_for(new.next(1), 2) == news
    new.close()
    assert hub.watched == 0 and hub.observe_calls == 0


UP = Observation(ClusterStatus.UP, TaskStatus.RUNNING, seq=5)


async def test_pushed_news_older_than_the_launchs_own_look_is_not_taken_as_current(
    pushing: tuple[Pushing, ClusterWatch],
) -> None:
    """The launch answered with the cluster UP (its look numbered 5); the event of the
    cluster's INIT (numbered 3) arrives after it, as a lagging stream delivers it: it is
    not news (taken as current, it looked like a preemption). Newer news is."""
    backend, hub = pushing
    watcher = hub.watch(ClusterHandle("mj-1-0", "local", seen=UP))
    await backend.pushed.put(ClusterEvent("mj-1-0", Observation(ClusterStatus.INIT, seq=3)))
    await backend.delivered()
    assert await watcher.next(0) is None
    down = Observation(ClusterStatus.DOWN, seq=7)
    await backend.pushed.put(ClusterEvent("mj-1-0", down))
    assert await asyncio.wait_for(watcher.next(1), 2) == down
    watcher.close()


async def test_pushed_news_older_than_a_look_made_meanwhile_is_not_taken_as_current(
    pushing: tuple[Pushing, ClusterWatch],
) -> None:
    """A lifecycle looks at its cluster (numbered 5) while an older event (3) waits
    for it: after the look, that event is no news."""
    backend, hub = pushing
    handle = ClusterHandle("mj-1-0", "local")
    watcher = hub.watch(handle)
    await backend.pushed.put(ClusterEvent("mj-1-0", Observation(ClusterStatus.INIT, seq=3)))
    await backend.delivered()  # not yet read
    backend.now = UP
    assert await hub.look(handle) == UP
    assert await watcher.next(0) is None
    # With a preemption notice, stale news gives way to a fresh look.
    watcher.notice(1_900_000_000.0)
    await backend.pushed.put(ClusterEvent("mj-1-0", Observation(ClusterStatus.INIT, seq=4)))
    await backend.delivered()
    assert await asyncio.wait_for(watcher.next(1), 2) == UP
    watcher.close()


class Journal:
    """What a drain did, in order: lines noted and shipped, requests posted and
    written, runners stopped and unwound (the replica's link and logs client stubbed)."""

    def __init__(self, replica: Replica, monkeypatch: pytest.MonkeyPatch, answered: bool) -> None:
        self.steps: list[tuple[object, ...]] = []
        self.posted: list[pb.JobHandback] = []
        self.answered = answered
        loop = asyncio.get_running_loop()
        self.never: asyncio.Future[pb.ReportAck] = loop.create_future()
        monkeypatch.setattr(replica.link.outbox, "post", self.post)
        monkeypatch.setattr(replica.link.outbox, "notify", self.notify)
        monkeypatch.setattr(replica.link.outbox, "written", self.written)
        monkeypatch.setattr(replica.logs, "note", self.note)
        monkeypatch.setattr(replica.logs, "shipped", self.shipped)

    def post(self, report: Report) -> asyncio.Future[pb.ReportAck]:
        answer: asyncio.Future[pb.ReportAck] = asyncio.get_running_loop().create_future()
        if not isinstance(report, pb.JobHandback):  # the runners' own requests: never answered
            return answer
        self.posted.append(report)
        self.steps.append(("posted",))
        if self.answered:
            answer.set_result(pb.ReportAck(accepted=True))
        return answer

    def notify(self, report: Report) -> None:
        if isinstance(report, pb.JobHandback):
            self.posted.append(report)
            self.steps.append(("notified",))

    async def written(self) -> None:
        self.steps.append(("written",))

    def note(self, job_id: int, epoch: int, message: str) -> None:
        self.steps.append(("note", job_id, message))

    async def shipped(self, job_id: int | None = None, timeout: float = 0) -> bool:
        self.steps.append(("shipped",))
        return True

    def kinds(self) -> list[object]:
        """The steps' kinds, repeats of one kind in a row shown once."""
        kinds = [step[0] for step in self.steps]
        return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


@pytest.mark.parametrize("answered", [True, False], ids=["acked", "never-answered"])
async def test_drain_hands_every_job_back_in_one_message_and_is_bounded(
    replica: Replica, monkeypatch: pytest.MonkeyPatch, answered: bool
) -> None:
    for job_id in range(1, 51):
        replica.link.dispatch(assignment(job_id, epoch=job_id % 3 + 1))
    journal = Journal(replica, monkeypatch, answered)
    monkeypatch.setattr("services.controller.replica.HANDBACK_TIMEOUT", 0.2)
    runners = list(replica.runners.values())

    await asyncio.wait_for(replica.drain(), 5)

    [handback] = journal.posted
    assert sorted((j.job_id, j.epoch) for j in handback.jobs) == [
        (job_id, job_id % 3 + 1) for job_id in range(1, 51)
    ]
    assert all(r.task is not None and r.task.done() for r in runners)
    assert replica.draining


class SlowToUnwind:
    """A runner whose stop takes a while to finish (tens of thousands together do)."""

    def __init__(self, job_id: int, epoch: int, journal: Journal) -> None:
        self.job_id, self.epoch = job_id, epoch
        self.journal = journal
        self.unwound = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)
            self.unwound.set()
            self.journal.steps.append(("unwound", self.job_id))

    def note(self, message: str) -> None:
        self.journal.note(self.job_id, self.epoch, message)

    def stop(self) -> None:
        self.journal.steps.append(("stopped", self.job_id))
        self.task.cancel()


async def test_drain_ships_the_lines_then_sends_the_jobs_back_then_stops_the_runners(
    replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each job's lifecycle log says it was handed back, shipped before the handback
    (after it the logs service takes no line of these jobs from this replica); the
    runners stop once the handback is written (stopping thousands fills the event loop,
    which would hold it back), and the drain ends once they have all unwound."""
    journal = Journal(replica, monkeypatch, answered=True)
    slow = [SlowToUnwind(job_id, 4, journal) for job_id in (21, 22)]
    for runner in slow:
        replica.runners[runner.job_id] = runner  # type: ignore[assignment]

    await asyncio.wait_for(replica.drain(), 5)

    assert journal.kinds() == ["note", "shipped", "posted", "written", "stopped", "unwound"]
    assert [s[1:] for s in journal.steps if s[0] == "note"] == [
        (21, "handed back: c1 is draining"),
        (22, "handed back: c1 is draining"),
    ]
    assert all(r.unwound.is_set() and r.task.done() for r in slow)
    # With a valid lease, the guard still refuses: the replica is draining.
    replica.link.connected.set()
    replica.link.lease.last_renewal = time.monotonic()
    with pytest.raises(MovedAway, match="draining"):
        await replica.backend.terminate(ClusterHandle("mj-21-0", "local"), 4)


async def test_a_job_assigned_while_draining_goes_straight_back_unstarted(
    replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assignment the scheduler sent before it knew of the drain is handed back at
    once: no runner would stop it, nor hand it back, before this replica exits."""
    journal = Journal(replica, monkeypatch, answered=True)
    await replica.drain()
    replica.link.dispatch(assignment(31, epoch=2))
    assert 31 not in replica.runners
    [handback] = journal.posted
    assert [(j.job_id, j.epoch) for j in handback.jobs] == [(31, 2)]
    assert journal.steps == [("note", 31, "handed back: c1 is draining"), ("notified",)]


async def test_a_job_dropped_for_a_lapsed_lease_is_handed_back(
    replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream is up but no heartbeat was answered in time (a loaded scheduler): the
    launch is not made, and the job goes back to the scheduler, which may still count
    this replica's lease: it must not stay assigned to a replica that dropped it."""
    notified: list[Report] = []
    monkeypatch.setattr(replica.link.outbox, "notify", notified.append)
    replica.link.lease.ttl = 0.2  # how long a launch waits for a fresh answer
    replica.link.connected.set()
    message = assignment(11, 2)
    message.assignment.launch_granted = True
    replica.link.dispatch(message)
    runner = replica.runners[11]
    assert runner.task is not None
    await asyncio.wait_for(runner.task, 5)
    handbacks = [m for m in notified if isinstance(m, pb.JobHandback)]
    assert [[(j.job_id, j.epoch) for j in h.jobs] for h in handbacks] == [[(11, 2)]]
