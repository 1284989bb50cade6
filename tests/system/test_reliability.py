"""Replicas die and nothing is lost (contract §9, §16), shown with real processes.

Each test starts the whole system (`reliability.start_stack`: scheduler on a fresh
PostgreSQL database, three or two controller replicas with a 3 s lease, logs,
and a seeded three-region sim cloud; tokens, TLS and mTLS between them all) and
breaks it on purpose:

- a chaos soak: SIGKILL a random replica every 5-10 s for 30 s while
  80 jobs run and get preempted; every job ends in exactly one terminal status,
  no task attempt is launched twice, no cluster is left (`bench/chaos.py` runs
  the same for 1,000 jobs, and SIGSTOPs replicas too);
- SIGSTOP a replica past its lease, let its jobs move, SIGCONT it: nothing it
  says or does with its stale epochs is accepted, and the sim cloud never had to
  refuse a stale launch or terminate (the replica's own fencing stopped them);
- SIGKILL a replica in the middle of a cancel's teardown: the job's next holder
  finishes the cleanup, then the job is CANCELLED;
- restart the scheduler five times during 600 submissions with idempotency
  keys: none lost, none duplicated, counters equal the database's recount;
- stop PostgreSQL for 15 s mid-run: health goes NOT_SERVING during the outage, a
  call meanwhile is answered UNAVAILABLE, no service exits, work resumes after its
  return and every job finishes.

Each run's durable record is then judged by the history checker (`history.py`).
Figures (resume latency after a kill, preemptions, recoveries, how soon health
and work followed the database) are printed, not asserted: timings are for the
benchmarks (contract §15).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from pathlib import Path

import grpc
import pytest

from harness.history import (
    CounterSnapshot,
    Kind,
    counter_drift,
    describe,
    expected_counters,
)
from harness.prerequisites import missing
from harness.reliability import (
    ADMIN_URL,
    NOT_SERVING,
    SERVING,
    Database,
    EventLog,
    PostgresServer,
    cloud_config,
    cloud_figures,
    history_violations,
    job_problems,
    job_spec,
    judge,
    reported_counters,
    stale_reports_refused,
    system,
)
from harness.soak import SoakConfig, run_soak
from harness.waiting import wait_until
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.v1 import job_service_pb2 as pb
from services.common.event_messages import RESUMED_ON
from services.common.statuses import JobStatus, ScheduleState

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
LEASE_TTL = 3.0
St = ScheduleState


@pytest.fixture
def admin_url(postgres_base: str) -> str:
    """The PostgreSQL server's admin URL (skipped when unreachable, failed under CI)."""
    return ADMIN_URL


# Every kind but those about the log's own accuracy (assignments carrying their
# epoch, the scheduler's events recording what it read before a report committed),
# which `test_history.py` demands: these tests judge what the system did.
KINDS = frozenset(Kind) - {Kind.LOG_CONTRACT, Kind.STALE_SCHEDULER_WRITE}


def running_and_watched(events: EventLog, job_id: int) -> bool:
    """The job's latest event: its task RUNNING, its launch slot given back (ALIVE)."""
    latest = events.by_job.get(job_id)
    if not latest:
        return False
    return latest[-1].status == JobStatus.RUNNING and latest[-1].schedule_state == St.ALIVE


def resumed_after(events: EventLog, job_id: int, event_id: int) -> bool:
    """Whether the scheduler handed the job to a replica after `event_id`."""
    return any(
        e.event_id > event_id and e.message.startswith(RESUMED_ON)
        for e in events.by_job.get(job_id, [])
    )


def recovered_after(events: EventLog, job_id: int, event_id: int) -> bool:
    """RECOVERING then RUNNING (and watched) again, after `event_id`."""
    later = [e for e in events.by_job.get(job_id, []) if e.event_id > event_id]
    return any(e.status == JobStatus.RECOVERING for e in later) and running_and_watched(
        events, job_id
    )


def last_event_id(db: Database) -> int:
    return max((e.event_id for e in db.events()), default=0)


# --- (a) the chaos soak ---------------------------------------------------------------------


@pytest.mark.timeout(480)
def test_chaos_soak_kills_replicas_and_loses_nothing(tmp_path: Path, admin_url: str) -> None:
    config = SoakConfig()
    report = run_soak(
        config, tmp_path / "soak", admin_url, log=lambda m: print(time.strftime("%X"), m)
    )
    print(json.dumps(report.figures))
    # Every planned kill happened.
    assert report.figures["kills"] == report.figures["kills_planned"] >= 3, report.figures
    assert report.figures["jobs"] == config.jobs
    # The chaos did hit: replicas died holding jobs, spot clusters were preempted.
    assert report.figures["resume_samples"] > 0 and report.figures["preemptions"] > 0
    judge(report.problems, report.violations, (), report.details)


# --- (b) a paused replica -------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_paused_replica_acts_on_nothing_with_its_stale_epochs(
    tmp_path: Path, admin_url: str
) -> None:
    with system(tmp_path / "paused", admin_url, cloud_config(seed=2, time_scale=10)) as s:
        specs = {f"paused-{i}": job_spec(f"paused-{i}", [3000.0]) for i in range(12)}
        ids = [s.client.submit(spec, key) for key, spec in specs.items()]
        assert s.events.wait_for(lambda: all(running_and_watched(s.events, j) for j in ids), 90)
        holders = collections.Counter(j.controller_id for j in s.client.list_jobs())
        victim = s.stack.service(holders.most_common(1)[0][0])
        held = {j.job_id: j.epoch for j in s.client.controller_state(victim).jobs}
        assert held, f"{victim.name} holds no job"
        assert s.db.assignments(held) == {j: (victim.name, e) for j, e in held.items()}
        others = [c for c in s.stack.controllers if c is not victim]
        paused_mark = last_event_id(s.db)
        paused_at = time.time()
        victim.pause()
        try:
            # Past its lease, the scheduler hands its jobs to the others with epoch + 1.
            assert s.events.wait_for(
                lambda: all(resumed_after(s.events, j, paused_mark) for j in held), LEASE_TTL + 20
            ), "the paused replica's jobs did not move"
            moved_seconds = time.time() - paused_at
            now = s.db.assignments(held)
            for job_id, epoch in held.items():
                controller, new_epoch = now[job_id]
                assert controller in {c.name for c in others}, (job_id, controller)
                assert new_epoch > epoch, (job_id, epoch, new_epoch)

            def new_holders_run_them() -> bool:
                running = {
                    c.name: {j.job_id: j.epoch for j in s.client.controller_state(c).jobs}
                    for c in others
                }
                return all(running.get(now[j][0] or "", {}).get(j) == now[j][1] for j in held)

            wait_until(
                new_holders_run_them,
                what="the new holders to run the jobs at the new epochs",
                within=20,
            )
            # RUNNING tasks are watched again, not relaunched.
            assert s.events.wait_for(
                lambda: all(running_and_watched(s.events, j) for j in held), 30
            )
            # Give the stale replica news to act on: preemptions (it would relaunch) and a
            # cancel (it would tear down); the new holders deal with them meanwhile.
            ordered = sorted(held)
            preempted, cancelled = ordered[::2], ordered[1]
            news_mark = s.events.last_id
            for job_id in preempted:
                request = spb.PreemptClusterRequest(cluster_name=f"mj-{job_id}-0")
                assert s.client.cloud.PreemptCluster(request, timeout=10).preempted
            s.client.cancel([cancelled])
            assert s.events.wait_for(
                lambda: (
                    all(recovered_after(s.events, j, news_mark) for j in preempted)
                    and cancelled in s.events.done
                ),
                60,
            ), "the new holders did not recover the preempted jobs and cancel the other"
        finally:
            victim.resume()
        resumed_mark = last_event_id(s.db)

        def victim_let_go() -> bool:
            state = s.client.controller_state(victim)
            return state.connected and not any(held.get(j.job_id) == j.epoch for j in state.jobs)

        wait_until(
            victim_let_go, what="the resumed replica to stop acting for its old epochs", within=30
        )
        s.client.cancel_all()
        assert not s.events.wait_done(ids, 90, s.client)

        # Nothing written or launched with a stale epoch: the checker follows each job's
        # assignment epoch through the whole log, and judges every event, those the
        # scheduler writes with epoch 0 too (a status change no replica's current epoch
        # vouches for is a stale write), and every launch in the inventory by its time.
        violations = history_violations(s.client, s.db, ids, KINDS)
        stale = [v for v in violations if v.kind in (Kind.STALE_REPORT, Kind.STALE_CALL)]
        assert not stale, describe(stale)
        # The replica's own fencing stopped its stale calls: the cloud never had to.
        figures = cloud_figures(s.client)
        assert figures["stale_launches_rejected"] == 0, figures
        assert figures["stale_terminates_rejected"] == 0, figures
        # No teardown either: a cluster the stale replica tore down would be one more recovery.
        jobs = {j.job_id: j for j in s.client.list_jobs()}
        recoveries = {j: jobs[j].recovery_count for j in held}
        assert recoveries == {j: int(j in preempted) for j in held}
        assert not violations, describe(violations)
        assert not job_problems(list(jobs.values()), cancelled=ids)
        assert not s.stack.exited()
        print(
            json.dumps(
                {
                    "held": len(held),
                    "moved_seconds": round(moved_seconds, 2),
                    "stale_reports_refused": stale_reports_refused(s.stack, victim.name),
                    "stale_launches_rejected": figures["stale_launches_rejected"],
                    "stale_terminates_rejected": figures["stale_terminates_rejected"],
                    "events_after_resume": len(s.db.events(resumed_mark)),
                }
            )
        )


@pytest.mark.timeout(180)
def test_cancelling_job_of_a_killed_replica_finishes_cleanup_then_is_cancelled(
    tmp_path: Path, admin_url: str
) -> None:
    with system(tmp_path / "cancelling", admin_url, cloud_config(seed=5, time_scale=10)) as s:
        specs = {f"cancelling-{i}": job_spec(f"cancelling-{i}", [3000.0]) for i in range(6)}
        ids = [s.client.submit(spec, key) for key, spec in specs.items()]
        assert s.events.wait_for(lambda: all(running_and_watched(s.events, j) for j in ids), 90)
        target = ids[0]
        holder = s.stack.service(s.client.get_job(target).controller_id)
        # With the cloud API away for 8 s, the holder cannot finish the teardown: the job
        # stays CANCELLING, and the holder dies in the middle of it.
        outage = spb.InjectFaultsRequest(unreachable_seconds=80.0)
        s.client.cloud.InjectFaults(outage, timeout=10)
        mark = s.events.last_id
        s.client.cancel([target])
        assert s.events.wait_for(
            lambda: any(
                e.event_id > mark and e.status == JobStatus.CANCELLING
                for e in s.events.by_job[target]
            ),
            10,
        ), "the job never went CANCELLING"
        killed_mark = s.events.last_id
        holder.kill()
        try:
            assert s.events.wait_for(
                lambda: resumed_after(s.events, target, killed_mark), LEASE_TTL + 10
            ), "the CANCELLING job did not move"
        finally:
            holder.start()
        assert s.events.wait_for(lambda: target in s.events.done, 60)
        job = s.client.get_job(target)
        assert JobStatus(job.status) == JobStatus.CANCELLED, job
        later = [JobStatus(e.status) for e in s.events.by_job[target] if e.event_id > killed_mark]
        assert JobStatus.FAILED_CONTROLLER not in later, later
        # The new holder tore the cluster down once the cloud answered again.
        clusters = [c for c in s.client.inventory() if c.job_id == target]
        assert clusters and all(c.HasField("terminate_time") for c in clusters), clusters
        s.client.cancel_all()
        assert not s.events.wait_done(ids, 90, s.client)
        violations = history_violations(s.client, s.db, ids, KINDS)
        assert not violations, describe(violations)
        jobs = [j for j in s.client.list_jobs() if j.job_id in set(ids)]
        assert not job_problems(jobs, cancelled=ids), job_problems(jobs, cancelled=ids)


# --- (c) scheduler restarts during submissions ----------------------------------------------


@pytest.mark.timeout(300)
def test_scheduler_restarts_lose_and_duplicate_no_submission(
    tmp_path: Path, admin_url: str
) -> None:
    total, restarts, cap, ttl = 600, 5, 40, 10.0
    extra = ("--max-jobs", str(cap), "--shutdown-grace", "1")
    cloud = cloud_config(seed=3, time_scale=10)
    # The default lease (10 s): replicas ride out a scheduler restart without losing it.
    with system(
        tmp_path / "restarts", admin_url, cloud, 2, scheduler_extra=extra, lease_ttl=ttl
    ) as s:
        answers: dict[int, int] = {}
        progress = threading.Condition()
        restarted_at: list[int] = []

        thresholds = [total * k // (restarts + 1) for k in range(1, restarts + 1)]

        def submit(index: int) -> None:
            # Submission `index` goes once every restart due by then has begun, so the
            # submissions never outrun the restarts however fast they are answered.
            due = sum(threshold <= index for threshold in thresholds)
            with progress:
                progress.wait_for(lambda: len(restarted_at) >= due)
            spec = job_spec(f"sub-{index}", [1e6], spot=False)
            job_id = s.client.submit(spec, f"key-{index}")
            with progress:
                answers[index] = job_id
                progress.notify_all()

        def all_connected() -> bool:
            state = s.client.scheduler_state()
            connected = sorted(r.controller_id for r in state.replicas if r.connected)
            return connected == [c.name for c in s.stack.controllers]

        def restart_scheduler() -> None:
            for k, threshold in enumerate(thresholds, start=1):
                with progress:
                    progress.wait_for(lambda: len(answers) >= threshold)  # noqa: B023
                # Restarts, not a scheduler away most of the time: each one comes once the
                # replicas are back from the last (on a slow machine a replica's reconnects
                # could otherwise all fall in the next restarts' outages, past its lease).
                # (Not an assertion here: the check after the restarts says what went wrong.)
                deadline = time.monotonic() + ttl
                while not all_connected() and time.monotonic() < deadline:
                    time.sleep(0.1)
                with progress:
                    restarted_at.append(len(answers))
                    progress.notify_all()
                # Odd restarts crash (SIGKILL), even ones stop cleanly (SIGTERM).
                s.client.restart_scheduler(kill=k % 2 == 1)

        restarter = threading.Thread(target=restart_scheduler, daemon=True)
        restarter.start()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(submit, range(total)))
        restarter.join(120)
        assert restarted_at == thresholds, restarted_at

        # None lost, none duplicated.
        assert len(answers) == total
        assert len(set(answers.values())) == total, "two keys were answered with one job"
        listed = s.client.list_jobs()
        assert len(listed) == total
        assert {j.job_id for j in listed} == set(answers.values())
        assert sorted(j.name for j in listed) == sorted(f"sub-{i}" for i in range(total))
        assert s.db.idempotency("reliability") == (total, total)

        # Replicas reconnect and re-announce their jobs: none of them moved.
        wait_until(all_connected, what="every replica to be connected again", within=ttl + 10)
        assigned = {j.job_id: (j.controller_id, j.schedule_state) for j in listed}
        epochs = s.db.assignments(j for j, (c, _) in assigned.items() if c)
        moved = {j: e for j, (_, e) in epochs.items() if e != 1}
        assert not moved, f"jobs moved by scheduler restarts (job: epoch): {moved}"

        # The counters equal a recount from the database, once nothing is in flight.
        seen: list[CounterSnapshot] = []

        def settled() -> bool:
            snapshot = CounterSnapshot(
                "after the restarts",
                reported_counters(s.client.scheduler_state()),
                s.db.recount(),
            )
            seen.append(snapshot)
            expected = expected_counters(snapshot.recount, ())
            return (
                not counter_drift(snapshot)
                and expected["launching"] == 0
                and expected["alive"] == cap
            )

        try:
            wait_until(settled, what="the counters to equal the recount", within=60)
        except AssertionError as error:
            drift = describe(counter_drift(seen[-1])) or "no drift"
            raise AssertionError(f"{error}: {drift}; recount {dict(seen[-1].recount)}") from None
        assert not s.stack.exited()
        print(
            json.dumps(
                {
                    "submissions": total,
                    "restarts_at": restarted_at,
                    "submit_retries": dict(s.client.retried),
                    "counters": dict(seen[-1].reported),
                }
            )
        )
        s.client.cancel_all()
        assert not s.events.wait_done(answers.values(), 180, s.client)
        violations = history_violations(s.client, s.db, answers.values(), KINDS)
        assert not violations, describe(violations)


# --- (d) the database goes away for 15 s ----------------------------------------------------


@pytest.mark.timeout(300)
def test_database_outage_is_ridden_out(tmp_path: Path, admin_url: str) -> None:
    server = PostgresServer()
    reason = server.why_unavailable()
    if reason:
        missing(f"the outage stops PostgreSQL, which it cannot here: {reason}")
    outage = 15.0
    with system(tmp_path / "outage", admin_url, cloud_config(seed=4, time_scale=10)) as s:
        # 7.5 to 22.5 real seconds each: some end during the outage, some after.
        runtimes = [75.0 + 150.0 * i / 23 for i in range(24)]
        ids = [
            s.client.submit(job_spec(f"outage-{i}", [r]), f"outage-{i}")
            for i, r in enumerate(runtimes)
        ]
        assert s.events.wait_for(lambda: all(running_and_watched(s.events, j) for j in ids), 90)
        scheduler = s.stack.scheduler_address
        not_serving_after: float | None = None
        health_seen: set[int | None] = set()
        exited: set[str] = set()
        submit_code: grpc.StatusCode | None = None
        try:
            stopped = time.monotonic()
            server.stop()
            while (elapsed := time.monotonic() - stopped) < outage:
                status = s.client.health(scheduler)
                health_seen.add(status)
                if status == NOT_SERVING and not_serving_after is None:
                    not_serving_after = elapsed
                    try:
                        request = pb.SubmitJobRequest(
                            spec_yaml=job_spec("during-outage", [10.0]), user="outage-probe"
                        )
                        s.client.jobs.SubmitJob(request, timeout=5)
                    except grpc.RpcError as error:
                        submit_code = error.code()
                exited |= {x.name for x in s.stack.exited()}
                time.sleep(0.1)  # sampling health during a fixed outage
        finally:
            server.start()
        returned = time.time()
        returned_mono = time.monotonic()
        wait_until(
            lambda: s.client.health(scheduler) == SERVING,
            what="the scheduler to be SERVING again",
            within=30,
        )
        serving_again = time.monotonic() - returned_mono
        resumed = s.events.wait_for(
            lambda: any(
                e.time.ToNanoseconds() / 1e9 >= returned for j in ids for e in s.events.by_job[j]
            ),
            60,
        )
        resumed_after = time.monotonic() - returned_mono
        not_done = s.events.wait_done(ids, 120, s.client)
        figures = {
            "not_serving_after_seconds": not_serving_after,
            "serving_again_seconds": round(serving_again, 2),
            "work_resumed_after_seconds": round(resumed_after, 2),
            "health_seen": sorted(str(x) for x in health_seen),
            "submit_during_outage": str(submit_code),
            "exited": sorted(exited),
        }
        print(json.dumps(figures))
        assert not_serving_after is not None, f"health never said NOT_SERVING: {figures}"
        # A client call during the cut is told to come back later, not failed for good.
        assert submit_code == grpc.StatusCode.UNAVAILABLE, figures
        assert not exited and not s.stack.exited(), figures
        assert resumed, "no event was written after the database's return"
        assert not not_done, f"jobs not done after the outage: {sorted(not_done)}"
        jobs = [j for j in s.client.list_jobs() if j.job_id in set(ids)]
        assert not job_problems(jobs), job_problems(jobs)
        violations = history_violations(s.client, s.db, ids, KINDS)
        assert not violations, describe(violations)
