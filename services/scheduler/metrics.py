"""The scheduler's Prometheus metrics (served on `--metrics-port`).

Counts follow the committed moves (`moved`, fed by the store's hook, like the
admission counters), the reports replicas send and the cancels users ask for.
Latencies are measured from moments the scheduler sees: a job's submission to
its launch grant, the grant to its task RUNNING, a cancel to the job CANCELLED.
The in-flight moments are kept in bounded maps (the oldest forgotten first), so
memory stays flat whatever the load. Gauges of jobs per schedule state and per
replica read the admission counters when scraped; jobs per status are recounted
from the database by the reconcile loop.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from managedjobs.v1 import job_pb2
from services.common.metrics import SECONDS, child
from services.common.statuses import ALIVE_STATES, JobStatus, ScheduleState
from services.scheduler.counters import Counters
from services.scheduler.txn import Move

St = ScheduleState
IN_FLIGHT = 100_000

SUBMISSIONS = Counter("mj_submissions_total", "Jobs accepted")
ADMISSIONS = Counter("mj_admissions_total", "Jobs admitted to a replica with a launch slot")
GRANTS = Counter(
    "mj_launch_grants_total", "Launch slots granted to admitted jobs (later tasks, recoveries)"
)
RESUMES = Counter(
    "mj_resumes_total", "Jobs moved to another replica after their replica's lease ended"
)
LAUNCHES = Counter("mj_launches_total", "Tasks that reached RUNNING on a new cluster")
RECOVERIES = Counter("mj_recoveries_total", "Preemption recoveries reported")
RESTARTS = Counter("mj_restarts_total", "Restarts after user code failed, reported")
CANCELS = Counter("mj_cancels_total", "Jobs whose cancel was accepted")
REPORTS = Counter("mj_reports_total", "Reports from replicas, by kind", ["kind"])
REFUSED = Counter("mj_reports_refused_total", "Reports refused, by reason", ["reason"])
CORRECTIONS = Counter(
    "mj_counter_corrections_total", "Admission counter differences found by a recount, and fixed"
)
LEASES_EXPIRED = Counter("mj_leases_expired_total", "Replica leases that ran out")
STREAMS_LOST = Counter(
    "mj_replica_streams_lost_total",
    "Replica streams the replica's side closed, their jobs released at once",
)
OUT_OF_SEQUENCE = Counter(
    "mj_replica_streams_out_of_sequence_total",
    "Replica streams ended because a request's number was not the next one",
)
REPLAYED = Counter(
    "mj_reports_replayed_total",
    "Reports received again after they were applied: acknowledged, not applied twice",
    ["kind"],
)
HELLOS_REFUSED = Counter(
    "mj_hellos_refused_total",
    "Replica hellos refused (wrong controller id, second stream)",
    ["reason"],
)
SUBMIT_TO_GRANT = Histogram(
    "mj_submit_to_grant_seconds", "From submission to the launch grant", buckets=SECONDS
)
GRANT_TO_RUNNING = Histogram(
    "mj_grant_to_running_seconds", "From a launch grant to the task RUNNING", buckets=SECONDS
)
CANCEL_TO_CANCELLED = Histogram(
    "mj_cancel_to_cancelled_seconds", "From a cancel request to the job CANCELLED", buckets=SECONDS
)
JOBS_BY_STATUS = Gauge("mj_jobs_by_status", "Jobs by status (recounted periodically)", ["status"])

_granted: collections.OrderedDict[int, float] = collections.OrderedDict()
_cancelled: collections.OrderedDict[int, float] = collections.OrderedDict()


def _remember(moments: collections.OrderedDict[int, float], job_id: int) -> None:
    moments[job_id] = time.monotonic()
    moments.move_to_end(job_id)
    while len(moments) > IN_FLIGHT:
        moments.popitem(last=False)


def moved(moves: Sequence[Move]) -> None:
    """Follows committed moves, as the admission counters do."""
    for move in moves:
        if move.old == St.INACTIVE and move.new == St.WAITING:
            SUBMISSIONS.inc()
        elif move.new == St.LAUNCHING and move.old != St.LAUNCHING:
            (ADMISSIONS if move.old == St.WAITING else GRANTS).inc()
            _remember(_granted, move.job_id)
        elif move.old == move.new and move.old_controller is None and move.new_controller:
            RESUMES.inc()
        if move.new == St.DONE:
            _granted.pop(move.job_id, None)


def admitted(jobs: Iterable[job_pb2.Job]) -> None:
    now = time.time()
    for job in jobs:
        if job.HasField("submit_time"):
            SUBMIT_TO_GRANT.observe(max(0.0, now - job.submit_time.ToNanoseconds() / 1e9))


def reported(kind: str, refusal: str = "") -> None:
    child(REPORTS, kind).inc()
    if refusal:
        REFUSED.labels(refusal).inc()


def task_changed(job_id: int, status: JobStatus, recoveries: int, restarts: int) -> None:
    """A task report was applied: its new status and how many recoveries/restarts it added."""
    if recoveries > 0:
        RECOVERIES.inc(recoveries)
    if restarts > 0:
        RESTARTS.inc(restarts)
    if status == JobStatus.RUNNING:
        LAUNCHES.inc()
        granted = _granted.pop(job_id, None)
        if granted is not None:
            GRANT_TO_RUNNING.observe(time.monotonic() - granted)
    elif status == JobStatus.CANCELLED:
        asked = _cancelled.pop(job_id, None)
        if asked is not None:
            CANCEL_TO_CANCELLED.observe(time.monotonic() - asked)


def cancel_requested(job_ids: Iterable[int], done_at_once: Iterable[int]) -> None:
    done = set(done_at_once)
    for job_id in job_ids:
        CANCELS.inc()
        if job_id in done:
            CANCEL_TO_CANCELLED.observe(0.0)
        elif job_id not in _cancelled:
            _remember(_cancelled, job_id)


def corrected(count: int) -> None:
    CORRECTIONS.inc(count)


def lease_expired() -> None:
    LEASES_EXPIRED.inc()


def stream_lost() -> None:
    STREAMS_LOST.inc()


def stream_out_of_sequence() -> None:
    OUT_OF_SEQUENCE.inc()


def replayed(kind: str) -> None:
    child(REPLAYED, kind).inc()


def hello_refused(reason: str) -> None:
    HELLOS_REFUSED.labels(reason).inc()


def statuses(counts: dict[JobStatus, int]) -> None:
    for status in JobStatus:
        JOBS_BY_STATUS.labels(status.name).set(counts.get(status, 0))


class CountersCollector(Collector):
    """Jobs per schedule state, and alive / launching per replica, read when scraped."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self.counters.counts
        states = GaugeMetricFamily("mj_jobs", "Unfinished jobs by schedule state", labels=["state"])
        for state in (St.WAITING, St.LAUNCHING, St.ALIVE, St.ALIVE_WAITING):
            states.add_metric([state.name], sum(n for (_, s), n in counts.items() if s == state))
        yield states
        alive = GaugeMetricFamily("mj_replica_jobs", "Jobs each replica holds", labels=["replica"])
        launching = GaugeMetricFamily(
            "mj_replica_launch_slots", "Launch slots each replica holds", labels=["replica"]
        )
        replicas = sorted({c for c, _ in counts if c is not None})
        for cid in replicas:
            alive.add_metric([cid], sum(counts[(cid, s)] for s in ALIVE_STATES))
            launching.add_metric([cid], counts[(cid, St.LAUNCHING)])
        yield alive
        yield launching


_collector: CountersCollector | None = None


def watch_counters(counters: Counters) -> None:
    """Registers the gauges of `counters` (the latest app's, in a process that makes several)."""
    global _collector
    if _collector is not None:
        REGISTRY.unregister(_collector)
    _collector = CountersCollector(counters)
    REGISTRY.register(_collector)


def unwatch_counters(counters: Counters) -> None:
    """Unregisters the gauges of `counters`, if they are the ones registered (an app that
    closed leaves nothing of itself reachable from the registry)."""
    global _collector
    if _collector is not None and _collector.counters is counters:
        REGISTRY.unregister(_collector)
        _collector = None
