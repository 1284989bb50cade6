"""A replica whose lease ran out changes nothing at the backend (the controller's own fencing).

The sim cloud and the local backend fence by epoch as well; these tests prove
the replica's layer on its own: its view of the lease never outlives the
scheduler's, and without it no launch, terminate or notice reaches the backend.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.backends import LaunchPlan
from services.backends.local.backend import LocalBackend
from services.controller.fencing import LeaseGuard
from services.controller.lease import Lease
from services.controller.messages import LeaseLost, MovedAway


async def test_no_launch_or_terminate_without_a_lease(tmp_path: Path) -> None:
    lease = {"valid": False}

    async def wait_lease() -> bool:
        return lease["valid"]

    backend = LocalBackend(tmp_path)
    guard = LeaseGuard(backend, wait_lease)
    request = LaunchPlan(job_id=1, task_id=0, epoch=3, cluster_name="mj-1-0", run="sleep 30")
    with pytest.raises(LeaseLost):
        await guard.launch(request)
    assert not await backend.cluster_exists("mj-1-0")

    lease["valid"] = True
    handle = await guard.launch(request)
    try:
        lease["valid"] = False
        with pytest.raises(LeaseLost):
            await guard.terminate(handle, 3)
        with pytest.raises(LeaseLost):
            await guard.notify_preemption(handle, 3, 0.0)
        assert await backend.cluster_exists("mj-1-0")
        # Reads still pass: a replica may look, it may not act.
        assert guard.handle_for("mj-1-0").cluster_name == "mj-1-0"
    finally:
        await backend.terminate(handle, 3)
    assert not await backend.cluster_exists("mj-1-0")


async def test_a_draining_replica_changes_nothing_even_with_its_lease(tmp_path: Path) -> None:
    """Once the replica drains its jobs are the scheduler's again: with the lease still
    valid, no launch, stop, terminate or notice reaches the backend. (The drain sends
    the jobs back while the runners are still unwinding; this is what makes it safe.)"""
    draining = {"yes": False}

    async def wait_lease() -> bool:
        return True

    backend = LocalBackend(tmp_path)
    guard = LeaseGuard(backend, wait_lease, lambda: draining["yes"])
    request = LaunchPlan(job_id=1, task_id=0, epoch=3, cluster_name="mj-1-0", run="sleep 30")
    handle = await guard.launch(request)
    try:
        draining["yes"] = True
        with pytest.raises(MovedAway):
            await guard.launch(
                LaunchPlan(job_id=2, task_id=0, epoch=1, cluster_name="mj-2-0", run="true")
            )
        assert not await backend.cluster_exists("mj-2-0")
        for call in (
            guard.terminate(handle, 3),
            guard.stop(handle, 3, 0.0),
            guard.notify_preemption(handle, 3, 0.0),
        ):
            with pytest.raises(MovedAway):
                await call
        assert await backend.cluster_exists("mj-1-0")
        assert (await guard.observe(handle)).cluster.name == "UP"
    finally:
        await backend.terminate(handle, 3)


def test_lease_lost_stops_a_job_like_a_move_away() -> None:
    assert issubclass(LeaseLost, MovedAway)


async def _nothing() -> None:
    return None


def _lease(now: list[float]) -> tuple[Lease, asyncio.Event]:
    """A lease on the clock `now[0]`, and the event its link sets while a stream is up."""
    connected = asyncio.Event()
    lease = Lease(connected, _nothing, clock=lambda: now[0], sleep=asyncio.sleep)
    lease.ttl = 10.0
    lease.heartbeat_interval = 1.0
    return lease, connected


def _heartbeat(lease: Lease, now: list[float], seq: int, sent: float, answered: float) -> None:
    """Heartbeat `seq` leaves at `sent` and its ack is read at `answered`."""
    now[0] = sent
    lease.sent(seq)
    now[0] = answered
    lease.answered(seq)


def test_lease_view_runs_out_a_margin_before_the_ttl() -> None:
    now = [100.0]
    lease, connected = _lease(now)
    assert not lease.valid()  # never renewed
    connected.set()
    lease.renewed(100.0)
    now[0] = 108.9
    assert lease.valid()
    # The scheduler's lease lasts until 110 at the earliest; ours ends a margin before.
    now[0] = 109.1
    assert not lease.valid()


def test_lease_needs_a_live_stream() -> None:
    now = [100.0]
    lease, connected = _lease(now)
    lease.renewed(100.0)
    assert not lease.valid()
    connected.set()
    assert lease.valid()


def test_an_ack_buffered_through_a_stall_does_not_renew_the_lease() -> None:
    """SIGSTOP right after a heartbeat left; on SIGCONT its ack is read: the lease is
    renewed from when the heartbeat was sent, so it has run out."""
    now = [100.0]
    lease, connected = _lease(now)
    connected.set()
    lease.renewed(100.0)
    # Heartbeat 7 sent; paused for 30 s, past the scheduler's lease, before its ack.
    _heartbeat(lease, now, 7, sent=100.5, answered=130.0)
    assert not lease.valid()
    # A heartbeat sent now and acked renews it.
    _heartbeat(lease, now, 8, sent=130.0, answered=130.2)
    assert lease.valid()


def test_only_a_heartbeats_answer_renews_the_lease() -> None:
    now = [100.0]
    lease, connected = _lease(now)
    connected.set()
    lease.renewed(100.0)
    now[0] = 109.5
    lease.answered(12)  # the ack of a report, not of a heartbeat
    assert not lease.valid()


async def test_a_backend_call_waits_for_the_stream_within_the_lease() -> None:
    now = [100.0]
    lease, connected = _lease(now)
    lease.renewed(100.0)
    waiting = asyncio.create_task(lease.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    connected.set()
    assert await asyncio.wait_for(waiting, 1)
    # Past the lease, it does not wait at all.
    connected.clear()
    now[0] = 200.0
    assert not await asyncio.wait_for(lease.wait(), 1)


async def test_a_late_answer_on_a_live_stream_is_waited_for_not_taken_as_a_lost_lease() -> None:
    """Under load the acknowledgements come late and the lease view runs out while the
    stream is up: the scheduler still counts the lease (it renews on receipt), so a
    backend call waits for the next acknowledgement instead of dropping the job."""
    now = [100.0]
    lease, connected = _lease(now)
    connected.set()
    lease.renewed(100.0)
    now[0] = 120.0  # the view ran out at 109; no answer since
    waiting = asyncio.create_task(lease.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    # An answer to a heartbeat sent long ago renews nothing: still waiting.
    _heartbeat(lease, now, 7, sent=101.0, answered=120.0)
    await asyncio.sleep(0.01)
    assert not waiting.done()
    # The answer to a fresh heartbeat, on the same stream: the call goes ahead.
    _heartbeat(lease, now, 8, sent=119.5, answered=120.0)
    assert await asyncio.wait_for(waiting, 1)


async def test_a_new_streams_lease_counts_once_its_first_heartbeat_is_answered() -> None:
    """The scheduler may have released this replica's jobs when its last stream closed;
    the revokes for them come on the new stream before the answer to its first heartbeat.
    Until that answer no call goes ahead, however fresh the last renewal; a call waiting
    for it goes ahead after it."""
    now = [100.0]
    lease, connected = _lease(now)
    connected.set()
    lease.renewed(100.0)
    assert lease.valid()
    # The stream breaks; a new one is welcomed a second later.
    connected.clear()
    lease.ended()
    now[0] = 101.0
    lease.welcomed(pb.ControllerWelcome(lease_ttl_seconds=10.0))
    connected.set()
    assert not lease.valid()
    waiting = asyncio.create_task(lease.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    # The answer to the new stream's first heartbeat.
    _heartbeat(lease, now, 9, sent=101.0, answered=101.0)
    assert await asyncio.wait_for(waiting, 1)
    assert lease.valid()
