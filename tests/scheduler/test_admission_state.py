"""A hypothesis state machine over admission (contract §5), on the real store and counters.

Random submits with priorities, replicas joining, draining and leaving, launch
slot requests, launch completions, backoffs, job completions and cancels; after
every step a scheduling pass runs and the invariants are checked:
- never launching over a launch limit, never alive over a job limit, per replica
  and globally;
- ALIVE_WAITING is served first: none is left waiting while its replica has a
  free launch slot, unless the global launch cap is reached, and then every slot
  the pass granted went to a job ranked ahead of it (priority, then submission),
  whichever replica holds either;
- WAITING is admitted by priority, then submission order, and none is left
  while some replica could take it;
- the in-memory counters equal a recount from the database. Nothing here
  updates a counter by hand: they follow the store's committed moves, as in
  the scheduler.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.store import move_job
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import ScheduleState
from services.scheduler import queries
from services.scheduler.admission import Admission, Limits
from services.scheduler.cancels import Cancels, Targets
from services.scheduler.counters import Counters, live_counts
from services.scheduler.db import Database
from services.scheduler.endings import finish
from services.scheduler.events import EventBus
from services.scheduler.outbox import Outbox
from services.scheduler.releases import release_replica
from services.scheduler.reports import Reports
from services.scheduler.spec.parse import parse_job_spec
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob

St = ScheduleState
SPEC = parse_job_spec("name: j\nrun: echo\n")
GLOBAL_JOBS = 9


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        self.db = Database.open(f"sqlite:///{Path(self.tmp.name) / 'a.db'}")
        self.store = Store(self.db, EventBus())
        self.counters = Counters(self.store)
        self.outbox = Outbox()
        self.admission = Admission(
            self.store,
            self.counters,
            self.outbox,
            Limits(global_jobs=GLOBAL_JOBS),
        )
        self.store.on_moves = self.counters.apply
        self.reports = Reports(self.store)
        self.cancels = Cancels(self.store, self.outbox)
        self.run(self.db.migrate())
        self.next_replica = 0
        self.waiting_before: list[tuple[int, int]] = []
        # The ALIVE_WAITING jobs before the last pass, by id: their rank.
        self.alive_waiting_before: dict[int, tuple[int, int]] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.db.close())
        self.loop.close()
        self.tmp.cleanup()

    # --- helpers -----------------------------------------------------------------------

    def jobs(self, state: ScheduleState) -> list[Any]:
        return self.run(self.store.read(queries.queued_jobs, state, None, 10_000))

    def rank(self, state: ScheduleState = St.WAITING) -> dict[int, tuple[int, int]]:
        return {j.id: (-j.priority, j.id) for j in self.jobs(state)}

    def schedule(self) -> None:
        self.waiting_before = sorted(self.rank().values())
        self.alive_waiting_before = self.rank(St.ALIVE_WAITING)
        self.run(self.admission.schedule())

    # --- rules -------------------------------------------------------------------------

    # A low cap binds before the replicas' own limits do, so ALIVE_WAITING jobs of
    # several replicas wait for the same global slot; a high one binds less often.
    # Replicas and jobs may be there from the start: the states where replicas compete
    # for the same slots come sooner.
    @initialize(
        global_launches=st.integers(1, 4),
        replicas=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), max_size=3),
        priorities=st.lists(st.integers(-3, 3), max_size=8),
    )
    def start(
        self, global_launches: int, replicas: list[tuple[int, int]], priorities: list[int]
    ) -> None:
        self.admission.limits.global_launches = global_launches
        self.run(self.counters.rebuild())
        for launches, jobs in replicas:
            self.replica_joins(launches, jobs)
        for priority in priorities:
            self.submit(priority, 1)

    @rule(priority=st.integers(-3, 3), count=st.integers(1, 3))
    def submit(self, priority: int, count: int) -> None:
        jobs = [NewJob("j", "u", priority, "", "", SPEC.tasks) for _ in range(count)]
        self.run(self.store.submit_many(jobs))
        self.schedule()

    @rule(launches=st.integers(1, 4), jobs=st.integers(1, 5))
    def replica_joins(self, launches: int, jobs: int) -> None:
        self.next_replica += 1
        cid = f"r{self.next_replica}"
        self.outbox.attach(cid)
        self.admission.connected(
            pb.ControllerHello(
                controller_id=cid, capacity=pb.Capacity(max_launches=launches, max_jobs=jobs)
            )
        )
        self.schedule()

    @precondition(lambda self: self.admission.replicas)
    @rule(data=st.data())
    def replica_drains(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.admission.replicas)))
        self.admission.draining(cid)
        self.schedule()

    @precondition(lambda self: self.admission.replicas)
    @rule(data=st.data())
    def replica_leaves(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.admission.replicas)))
        self.admission.gone(cid)
        self.run(release_replica(self.store, cid))
        self.schedule()

    def _pick(self, data: st.DataObject, state: ScheduleState) -> Any | None:
        rows = [j for j in self.jobs(state) if j.controller_id is not None]
        return data.draw(st.sampled_from(rows)) if rows else None

    def _some(self, data: st.DataObject, state: ScheduleState, each: Any) -> list[Any]:
        """Up to 3 held jobs in `state`, each with a value drawn from `each`."""
        rows = [j for j in self.jobs(state) if j.controller_id is not None]
        if not rows:
            return []
        picked = st.lists(st.sampled_from(rows), max_size=3, unique_by=lambda j: j.id)
        return [(job, data.draw(each)) for job in data.draw(picked)]

    @rule(data=st.data())
    def replicas_report(self, data: st.DataObject) -> None:
        """Before the next pass, as a batch of reports: held jobs (of one replica or
        several) ask for a launch slot for their next task, and launches finish or back
        off (giving their slot back and asking again). Slots freed and slots asked for
        meet in one pass."""
        asking = self._some(data, St.ALIVE, st.none())
        for job, backoff in self._some(data, St.LAUNCHING, st.booleans()):
            reason = "backing off after no capacity in r" if backoff else ""
            self.run(
                move_job(self.store, job.id, St.LAUNCHING, St.ALIVE, epoch=job.epoch,
                                cid=job.controller_id, wait_reason=reason)
            )  # fmt: skip
            if backoff:
                self._request(job)
        for job, _ in asking:
            self._request(job)
        self.schedule()

    def _request(self, job: Any) -> None:
        self.run(
            move_job(self.store, job.id, St.ALIVE, St.ALIVE_WAITING, epoch=job.epoch,
                            cid=job.controller_id)
        )  # fmt: skip

    @rule(data=st.data(), state=st.sampled_from([St.LAUNCHING, St.ALIVE, St.ALIVE_WAITING]))
    def job_finishes(self, data: st.DataObject, state: ScheduleState) -> None:
        job = self._pick(data, state)
        if job is not None:
            self.run(self._finish(job))
            self.schedule()

    async def _finish(self, job: Any) -> None:
        await self.store.transaction(lambda txn: finish(txn, job.controller_id, job.id, job.epoch))

    @rule(data=st.data())
    def cancel_waiting(self, data: st.DataObject) -> None:
        waiting = self.jobs(St.WAITING)
        if waiting:
            job = data.draw(st.sampled_from(waiting))
            assert self.run(self.cancels.cancel(Targets(job_ids=[job.id]))) == [job.id]
            self.schedule()

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def within_limits(self) -> None:
        totals = self.counters.totals()
        assert totals.launching <= self.admission.limits.global_launches
        assert totals.alive <= GLOBAL_JOBS
        for cid, replica in self.admission.replicas.items():
            slots = self.counters.slots(cid)
            assert slots.launching <= replica.capacity.max_launches, cid
            assert slots.alive <= replica.capacity.max_jobs, cid

    @invariant()
    def counters_equal_a_recount(self) -> None:
        recount = live_counts(self.run(self.store.read(queries.recount)))
        assert live_counts(self.counters.counts) == recount

    @invariant()
    def alive_waiting_served_first(self) -> None:
        global_room = self.admission.limits.global_launches - self.counters.totals().launching
        launching = {j.id for j in self.jobs(St.LAUNCHING)}
        granted = [r for i, r in self.alive_waiting_before.items() if i in launching]
        for job in self.jobs(St.ALIVE_WAITING):
            replica = self.admission.replicas.get(job.controller_id)
            if replica is None:
                continue
            if self.counters.slots(job.controller_id).launching >= replica.capacity.max_launches:
                continue
            # Its replica had a free slot all through the pass (a pass only takes them).
            assert global_room <= 0, "left waiting with a free launch slot"
            rank = (-job.priority, job.id)
            assert all(r < rank for r in granted), "a lower-ranked job was granted a slot first"

    @invariant()
    def waiting_admitted_in_order_and_only_when_full(self) -> None:
        still = sorted(self.rank().values())
        admitted = [r for r in self.waiting_before if r not in still]
        if still and admitted:
            assert max(admitted) < still[0], "a lower-ranked job was admitted first"
        if still:
            totals = self.counters.totals()
            room = any(
                not r.draining
                and self.counters.slots(cid).launching < r.capacity.max_launches
                and self.counters.slots(cid).alive < r.capacity.max_jobs
                for cid, r in self.admission.replicas.items()
            )
            assert (
                not room
                or totals.launching >= self.admission.limits.global_launches
                or totals.alive >= GLOBAL_JOBS
            )


AdmissionMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdmission = AdmissionMachine.TestCase
