"""A replica reconnecting to a restarted scheduler as its lease runs out (contract §9).

The hello of a new stream announces the jobs the replica holds. If the replica's
lease runs out after that hello left and before the welcome came back, the
replica stops those jobs, while the scheduler, which read the hello, keeps them
assigned to it: run by no one, for good. The replica hands them back on the new
stream, once they have unwound (a launch given up is rolled back first), so they
are resumed, and nothing the old attempt did lands after the scheduler took them
back: the history checker finds nothing once they have run to their end.

The whole system runs in this process (`harness.lifecycle_world.World`), with auth on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from harness.history import check, describe
from harness.lifecycle_world import LAUNCH, RUN, World
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.controller.replica import Replica

S = JobStatus
SPEC = f"name: j\nrun: train\nsim: {{runtime_seconds: {RUN:g}}}\n"


class LeaseRunsOutAfterTheHello(Replica):
    """Once `armed`, its lease runs out just after a hello to a serving scheduler left:
    the replica stops its jobs, as its lease timer would (`on_lease_lost`), before the
    welcome can come back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.serving: Callable[[], bool] = lambda: False
        self.lost: asyncio.Task[None] | None = None

    def hello(self) -> pb.ControllerHello:
        message = super().hello()
        if self.armed and self.serving():
            self.armed = False
            self.lost = asyncio.get_running_loop().create_task(self.on_lease_lost())
        return message


@pytest.mark.parametrize(
    ("launched", "resumed"),
    [(True, S.RUNNING), (False, S.RECOVERING)],
    ids=["running", "launching"],
)
def test_jobs_stopped_while_the_hello_was_on_its_way_are_handed_back(
    launched: bool, resumed: JobStatus
) -> None:
    # Leases far longer than the reconnect: only the armed replica's own loss happens.
    world = World.open(replicas=0, spare=1, lease_ttl=10.0)
    try:
        cid = world.start_replica(LeaseRunsOutAfterTheHello)
        replica = world.replicas[cid].replica
        assert isinstance(replica, LeaseRunsOutAfterTheHello)
        replica.serving = lambda: world.scheduler is not None
        job_id = world.submit(SPEC)
        world.settle()
        if launched:
            world.advance(LAUNCH)
        before = world.settle()
        assert before.jobs[job_id].epoch == 1

        replica.armed = True
        world.restart_scheduler()
        after = world.settle(within=15)

        assert replica.lost is not None and replica.lost.done(), "the lease never ran out"
        row = after.jobs[job_id]
        assert (row.status, row.controller_id, row.epoch) == (resumed, cid, 2), world.describe(
            after, job_id
        )
        messages = [e.message for e in after.events if e.job_id == job_id]
        assert f"handed back by {cid}" in messages, messages
        # Still run: it ends once, and its record holds nothing stale.
        world.advance(LAUNCH + RUN)
        done = world.settle()
        assert done.jobs[job_id].schedule_state == ScheduleState.DONE
        assert done.jobs[job_id].status == S.SUCCEEDED, world.describe(done, job_id)
        found = check(done.history({job_id: 1}))
        assert not found, describe(found) + "\n" + world.describe(done, job_id)
    finally:
        world.close()
