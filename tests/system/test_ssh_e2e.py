"""The whole system on SSH node pools, as processes: scheduler, two replicas, logs, `mj`.

Eight simulated hosts (harness/sshd.py: one real sshd per host on 127.0.1.N, each
host its own OS user) make three pools: `east` (hosts 1-2, with A100:2 each),
`west` (hosts 3-4) and `race` (hosts 5-8). The stack is shared by every test;
tests run one after the other and each leaves every host free and answering, so
the pools they share never interfere. What a host runs and holds is read from the
host itself: its user's processes (`ps -u`, their environment) and its ~/.mj.

SSH cannot push, so replicas poll (`--poll-interval 0.5`). A host is preempted by
SIGKILL of its sshd and every process of its user, and partitioned by SIGSTOP of
its sshd; `east` gives up on a silent host after 5 s, `west` after 12 s.
Outside CI these tests skip without root or openssh-server; under CI=true they
never skip.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from harness.e2e import assert_no_tracebacks, mj
from harness.local_clusters import open_folder
from harness.sshd import SshHost, SshHosts, clusters_running
from harness.waiting import wait_until
from managedjobs.v1 import controller_service_pb2 as cpb
from managedjobs.v1 import controller_service_pb2_grpc, job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.launcher.service import Service
from services.launcher.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.sshd]

S = JobStatus
# The pools' hosts (1-based indexes into the harness's hosts) and how long each pool
# waits for a silent host.
EAST, WEST, RACE = (1, 2), (3, 4), (5, 6, 7, 8)
EAST_TIMEOUT = 5.0
WEST_TIMEOUT = 12.0
CONTROLLER_ARGS = [
    "--poll-interval", "0.5",
    "--grace-seconds", "0.2",
    "--backoff-initial", "0.3",
    "--backoff-max", "1.5",
    "--start-check-interval", "0.2",
]  # fmt: skip
SCHEDULER_ARGS = ["--lease-ttl", "3", "--heartbeat-interval", "0.5"]
SSH_ENV = {
    "MJ_SSH_CONNECT_TIMEOUT": "2",
    # Generous enough that a busy machine is not taken for a partition.
    "MJ_SSH_COMMAND_TIMEOUT": "4",
    "MJ_SSH_REAP_INTERVAL": "2",
}


# --- waiting ------------------------------------------------------------------------------------


class JobEvents:
    """A job's events as they arrive (WatchJobs, read in a thread), waited on with deadlines."""

    def __init__(self, jobs: job_service_pb2_grpc.JobServiceStub, job_id: int) -> None:
        self.job_id = job_id
        self.events: list[job_pb2.JobEvent] = []
        self._changed = threading.Condition()
        self._ended = False
        self._call = jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=240)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                with self._changed:
                    self.events.append(response.event)
                    self._changed.notify_all()
        except grpc.RpcError:
            pass  # cancelled by `close`, or the deadline: `wait` reports what it saw
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def wait(
        self, done: Callable[[list[job_pb2.JobEvent]], bool], within: float, what: str
    ) -> None:
        deadline = time.monotonic() + within
        with self._changed:
            while not done(self.events):
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    raise AssertionError(
                        f"job {self.job_id}: no {what} in {within:g}s; statuses "
                        f"{[S(s).name for s in self.statuses()]}, last events "
                        f"{[e.message for e in self.events[-5:]]}"
                    )
                self._changed.wait(left)

    def status(self, status: JobStatus, within: float = 30, count: int = 1) -> None:
        """Waits until the job reached `status` `count` times."""
        self.wait(
            lambda _: self.statuses().count(status) >= count,
            within,
            f"{status.name} (x{count})",
        )

    def done(self, within: float = 60) -> None:
        self.wait(
            lambda events: any(e.schedule_state == ScheduleState.DONE for e in events),
            within,
            "DONE",
        )

    def statuses(self) -> list[JobStatus]:
        """The job's statuses in order, repeats collapsed."""
        out: list[JobStatus] = []
        for event in list(self.events):
            if event.status and (not out or out[-1] != event.status):
                out.append(S(event.status))
        return out

    def messages(self) -> list[str]:
        return [event.message for event in list(self.events)]

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(10)


# --- the stack and its hosts --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    made = SshHosts.create(8, tmp_path_factory.mktemp("sshd"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def stack(hosts: SshHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("ssh-stack")
    pools = hosts.pool_file(
        data / "ssh_node_pools.yaml",
        {
            "east": {
                "hosts": [{"index": i, "accelerators": "A100:2", "cpus": 8} for i in EAST],
                "unreachable_timeout": EAST_TIMEOUT,
            },
            "west": {"hosts": list(WEST), "unreachable_timeout": WEST_TIMEOUT},
            "race": {"hosts": list(RACE), "unreachable_timeout": EAST_TIMEOUT},
        },
    )
    with Stack(
        data,
        replicas=2,
        controller_args=CONTROLLER_ARGS,
        scheduler_args=SCHEDULER_ARGS,
        ssh_node_pools=str(pools),
        env={**os.environ, **SSH_ENV},
    ) as running:
        yield running
    assert_no_tracebacks(data)


@pytest.fixture
def clean(hosts: SshHosts, jobs: job_service_pb2_grpc.JobServiceStub) -> Iterator[SshHosts]:
    """Every host answers before the test; after it, every job is done (a failed test's
    jobs are cancelled, so they cannot spill into the next test) and no host holds or
    runs anything."""
    up(hosts)
    yield hosts
    up(hosts)
    unfinished = [j.job_id for j in all_jobs(jobs) if j.schedule_state != ScheduleState.DONE]
    if unfinished:
        jobs.CancelJobs(pb.CancelJobsRequest(job_ids=unfinished))
        wait_until(
            lambda: all(j.schedule_state == ScheduleState.DONE for j in all_jobs(jobs)),
            within=60,
            what="every job to be done",
        )
    assert_nothing_left(hosts.hosts)


def up(hosts: SshHosts) -> None:
    for host in hosts.hosts:
        host.resume()
        if host.process is None:
            host.start()


def all_jobs(jobs: job_service_pb2_grpc.JobServiceStub) -> list[job_pb2.Job]:
    return list(jobs.ListJobs(pb.ListJobsRequest(page_size=1000)).jobs)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder the code of every host's user can write (markers between attempts)."""
    with open_folder(0o1777) as path:
        yield path


def assert_nothing_left(hosts: Sequence[SshHost], within: float = 20) -> None:
    """No host holds a reservation or a cluster folder, or runs a process of a task: read
    from the hosts (a host given up while silent is cleaned by the reaper once it answers)."""

    def leftovers() -> dict[str, object]:
        found: dict[str, object] = {}
        for host in hosts:
            what = {
                "reservation": host.reservation(),
                "folders": host.cluster_folders(),
                "processes": host.task_processes(),
            }
            if any(what.values()):
                found[host.user] = what
        return found

    try:
        wait_until(lambda: not leftovers(), within=within, what="every host to be empty")
    except AssertionError:
        raise AssertionError(f"left on the hosts: {leftovers()}") from None


def submit(jobs: job_service_pb2_grpc.JobServiceStub, spec: str) -> int:
    return int(jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id)


def get(jobs: job_service_pb2_grpc.JobServiceStub, job_id: int) -> job_pb2.Job:
    return jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job


def job_id_from(output: str) -> int:
    match = re.search(r"^Job (\d+) submitted", output, re.MULTILINE)
    assert match, f"no job id in {output!r}"
    return int(match.group(1))


def running_on(hosts: Sequence[SshHost], cluster: str) -> list[SshHost]:
    """The hosts where processes of the cluster run, from the hosts' process lists."""
    return [host for host in hosts if cluster in host.clusters_running()]


def launches_recorded(hosts: Sequence[SshHost], cluster: str) -> dict[str, str]:
    """Host user -> the newest launch of `cluster` the host ever reserved (its fence
    record, kept after the cluster is gone)."""
    found = {}
    for host in hosts:
        fence = host.home / ".mj" / "fence" / f"cluster-{cluster}"
        if fence.exists():
            found[host.user] = fence.read_text().split()[2]
    return found


def restart(stack: Stack, replica: Service) -> None:
    """Starts a killed replica again; returns once the scheduler acknowledged its lease."""
    replica.start()
    replica.wait_serving()

    def leased() -> bool:
        with stack.channel(replica.address) as channel:
            state = controller_service_pb2_grpc.ControllerServiceStub(channel).GetControllerState(
                cpb.GetControllerStateRequest(), timeout=5
            )
        return state.connected and state.lease_renew_time.seconds > 0

    wait_until(leased, within=30, what=f"{replica.name} to hold a lease again")


def reaped(stack: Stack, cluster: str) -> list[str]:
    """The services whose ssh backend reaper released a host of `cluster` (their logs)."""
    found = []
    for path in sorted((stack.data_dir / "service-logs").glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"reaper released a host"' in line and json.loads(line).get("cluster") == cluster:
                found.append(path.stem)
    return found


def pool(hosts: SshHosts, indexes: Sequence[int]) -> list[SshHost]:
    return [hosts.hosts[i - 1] for i in indexes]


def launch_held(host: SshHost) -> str:
    """The launch id of the cluster the host is reserved for."""
    held = host.reservation()
    assert held is not None, f"{host.user} holds nothing"
    return held["launch"]


# --- tests --------------------------------------------------------------------------------------


def test_two_node_job_gets_both_ranks_and_its_logs_are_readable(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts, tmp_path: Path
) -> None:
    spec = tmp_path / "two.yaml"
    spec.write_text(
        "name: two-nodes\n"
        "num_nodes: 2\n"
        "resources:\n  region: east\n"
        "setup: echo setup on $(whoami)\n"
        "run: |\n"
        '  echo "rank=$MJ_NODE_RANK of=$MJ_NUM_NODES job=$MJ_JOB_ID '
        "sky=$SKYPILOT_NODE_RANK/$SKYPILOT_NUM_NODES/$SKYPILOT_TASK_ID "
        'ips=$(echo $SKYPILOT_NODE_IPS | tr " " ,) user=$(whoami)"\n'
    )

    launched = mj(stack, "launch", str(spec))

    assert launched.returncode == 0, launched.stdout + launched.stderr
    job_id = job_id_from(launched.stdout)
    job = get(jobs, job_id)
    assert job.status == S.SUCCEEDED
    assert job.tasks[0].region == "east"
    logs = mj(stack, "logs", str(job_id), "--no-follow")
    assert logs.returncode == 0, logs.stderr
    east = {host.user: host.address for host in pool(clean, EAST)}
    lines = re.findall(r"^\(rank=(\d)\) rank=(\d) of=2 job=(\d+) sky=(.*) ips=(.*) user=(.*)$",
                       logs.stdout, re.MULTILINE)  # fmt: skip
    assert sorted(line[0] for line in lines) == ["0", "1"], logs.stdout
    users = set()
    for prefix, rank, job_no, sky, ips, user in lines:
        assert prefix == rank and job_no == str(job_id)
        assert sky == f"{rank}/2/mj-{job_id}-task-0"
        assert sorted(ips.split(",")) == sorted(east.values())
        assert ips.split(",")[int(rank)] == east[user]
        users.add(user)
    assert users == set(east)
    assert logs.stdout.count("setup on") == 2
    # `mj launch` followed the same log.
    assert "rank=1 of=2" in launched.stdout


def test_chain_runs_on_the_pool(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts
) -> None:
    launched = mj(stack, "launch", "examples/chain.yaml", "--detach")
    assert launched.returncode == 0, launched.stderr
    job_id = job_id_from(launched.stdout)
    events = JobEvents(jobs, job_id)
    try:
        events.done(within=60)
    finally:
        events.close()
    job = get(jobs, job_id)
    assert job.status == S.SUCCEEDED, job.failure_reason
    assert [t.status for t in job.tasks] == [S.SUCCEEDED] * 3
    assert [t.region for t in job.tasks] == ["east"] * 3
    ends = [t.end_time.ToNanoseconds() for t in job.tasks]
    assert ends == sorted(ends)
    for task_id, text in {0: "prepare done", 1: "epoch 3", 2: "evaluate done"}.items():
        out = mj(stack, "logs", str(job_id), "--task", str(task_id), "--no-follow")
        assert out.returncode == 0, out.stderr
        assert text in out.stdout
    # Each task had a cluster of its own on the pool's hosts.
    for task_id in range(3):
        assert len(launches_recorded(pool(clean, EAST), f"mj-{job_id}-{task_id}")) == 1


def test_more_accelerators_than_any_host_has_fails_prechecks(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts, tmp_path: Path
) -> None:
    spec = tmp_path / "big.yaml"
    spec.write_text("name: too-big\nresources:\n  accelerators: A100:4\nrun: echo never\n")

    launched = mj(stack, "launch", str(spec))

    assert launched.returncode != 0
    job = get(jobs, job_id_from(launched.stdout))
    assert job.status == S.FAILED_PRECHECKS
    assert "A100:4" in job.failure_reason
    # No host was ever reserved for it.
    assert launches_recorded(clean.hosts, f"mj-{job.job_id}-0") == {}


@pytest.mark.parametrize(
    ("strategy", "pool_after"), [("FAILOVER", "east"), ("EAGER_NEXT_REGION", "west")]
)
def test_preempted_host_is_recovered_on_another_host(
    stack: Stack,
    jobs: job_service_pb2_grpc.JobServiceStub,
    clean: SshHosts,
    shared: Path,
    strategy: str,
    pool_after: str,
) -> None:
    marker = shared / "first-attempt"
    job_id = submit(
        jobs,
        f"name: preempted-{strategy.lower().replace('_', '-')}\n"
        f"resources:\n  job_recovery: {strategy}\n"
        "run: |\n"
        f"  if [ -e {marker} ]; then echo second attempt on $(whoami); exit 0; fi\n"
        f"  touch {marker}; echo first attempt; sleep 300\n",
    )
    cluster = f"mj-{job_id}-0"
    events = JobEvents(jobs, job_id)
    try:
        events.status(S.RUNNING)
        wait_until(marker.exists, within=20, what="the first attempt to start")
        (first,) = running_on(clean.hosts, cluster)
        assert first.index in EAST

        first.kill()
        events.status(S.RECOVERING, within=30)
        events.status(S.RUNNING, within=30, count=2)
        running = get(jobs, job_id)
        assert running.tasks[0].region == pool_after
        # The job went on while the killed host was down: its files still name the
        # first attempt, which nothing could reach to remove.
        assert (first.reservation() or {}).get("cluster") == cluster
        first.start()
        events.done()
    finally:
        events.close()

    job = get(jobs, job_id)
    assert job.status == S.SUCCEEDED, job.failure_reason
    assert job.recovery_count == 1
    assert events.statuses()[events.statuses().index(S.RUNNING) :] == [
        S.RUNNING,
        S.RECOVERING,
        S.RUNNING,
        S.SUCCEEDED,
    ]
    recorded = launches_recorded(clean.hosts, cluster)
    assert len(recorded) == 2 and first.user in recorded
    (second_user,) = set(recorded) - {first.user}
    second = next(host for host in clean.hosts if host.user == second_user)
    assert second.index in (EAST if pool_after == "east" else WEST)
    logs = mj(stack, "logs", str(job_id), "--no-follow")
    assert f"second attempt on {second.user}" in logs.stdout
    assert_nothing_left(clean.hosts)


def test_short_partition_leaves_the_job_running_and_it_succeeds(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts, shared: Path
) -> None:
    go = shared / "go"
    job_id = submit(
        jobs,
        "name: partitioned\nresources:\n  region: west\n  job_recovery: FAILOVER\n"
        f"run: |\n  while [ ! -e {go} ]; do sleep 0.1; done; echo finished on $(whoami)\n",
    )
    cluster = f"mj-{job_id}-0"
    events = JobEvents(jobs, job_id)
    try:
        events.status(S.RUNNING)
        (host,) = wait_until(
            lambda: running_on(clean.hosts, cluster), within=20, what="the task to run"
        )
        launch = launch_held(host)

        host.pause()
        try:
            wait_until(
                lambda: "unreachable since" in get(jobs, job_id).tasks[0].condition,
                within=20,
                what="the unreachable condition",
            )
            status = mj(stack, "status", str(job_id))
        finally:
            host.resume()
        assert status.returncode == 0, status.stderr
        assert re.search(r"Condition:\s+.*unreachable since", status.stdout), status.stdout
        assert "RUNNING" in status.stdout

        events.wait(
            lambda evs: any("answers again" in e.message for e in evs), 20, "the condition cleared"
        )
        assert get(jobs, job_id).tasks[0].condition == ""
        go.touch()
        events.done()
    finally:
        events.close()

    job = get(jobs, job_id)
    assert job.status == S.SUCCEEDED, job.failure_reason
    assert job.recovery_count == 0
    assert S.RECOVERING not in events.statuses()
    # Never relaunched: the one launch, on the host that was partitioned.
    assert launches_recorded(clean.hosts, cluster) == {host.user: launch}
    logs = mj(stack, "logs", str(job_id), "--no-follow")
    assert logs.stdout.strip() == f"finished on {host.user}"


def test_long_partition_is_recovered_elsewhere_and_the_old_processes_reaped(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts, shared: Path
) -> None:
    marker = shared / "first-attempt"
    go = shared / "go"
    job_id = submit(
        jobs,
        "name: islanded\nresources:\n  region: east\n  job_recovery: FAILOVER\n"
        "run: |\n"
        f"  if [ -e {marker} ]; then\n"
        f"    while [ ! -e {go} ]; do sleep 0.1; done; echo second attempt; exit 0\n"
        "  fi\n"
        f"  touch {marker}; echo first attempt; sleep 300\n",
    )
    cluster = f"mj-{job_id}-0"
    events = JobEvents(jobs, job_id)
    try:
        events.status(S.RUNNING)
        wait_until(marker.exists, within=20, what="the first attempt to start")
        (island,) = running_on(clean.hosts, cluster)
        island.pause()
        try:
            events.status(S.RECOVERING, within=40)
            events.status(S.RUNNING, within=40, count=2)
            (second,) = wait_until(
                lambda: [h for h in running_on(clean.hosts, cluster) if h is not island],
                within=20,
                what="the second attempt to run",
            )
            assert second.index in EAST
            # The island still runs the first attempt: nothing could reach it.
            assert cluster in island.clusters_running()
        finally:
            island.resume()
        # Once it answers, a reaper kills what it runs of the cluster and frees it (the
        # job still runs, so nothing else would touch the island).
        wait_until(
            lambda: cluster not in island.clusters_running() and island.reservation() is None,
            within=20,
            what="the island's old processes to be reaped",
        )
        # The reaper logs once the host is free: its line may come a moment later.
        wait_until(lambda: reaped(stack, cluster), within=10, what="the reaper's log line")
        assert cluster in second.clusters_running()
        go.touch()
        events.done()
    finally:
        events.close()

    job = get(jobs, job_id)
    assert job.status == S.SUCCEEDED, job.failure_reason
    assert job.recovery_count == 1
    assert any(f"{cluster} unreachable since" in m for m in events.messages())
    lifecycle = mj(stack, "logs", str(job_id), "--controller", "--no-follow").stdout
    assert f"stayed unreachable for {EAST_TIMEOUT:g}s" in lifecycle
    assert "relaunching without waiting again" in lifecycle
    assert_nothing_left(clean.hosts)


def test_cancel_a_running_job_leaves_nothing_on_the_hosts(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts
) -> None:
    job_id = submit(
        jobs,
        "name: to-cancel\nnum_nodes: 2\nresources:\n  region: west\nrun: sleep 300 & sleep 301\n",
    )
    cluster = f"mj-{job_id}-0"
    events = JobEvents(jobs, job_id)
    try:
        events.status(S.RUNNING)
        used = wait_until(
            lambda: running_on(clean.hosts, cluster), within=20, what="both ranks to run"
        )
        wait_until(lambda: len(running_on(clean.hosts, cluster)) == 2, within=20, what="both ranks")
        assert {host.index for host in used} <= set(WEST)

        out = mj(stack, "cancel", str(job_id))
        assert out.returncode == 0, out.stderr
        events.done(within=40)
    finally:
        events.close()
    job = get(jobs, job_id)
    assert job.status == S.CANCELLED
    assert events.statuses()[-2:] == [S.CANCELLING, S.CANCELLED]
    # The cleanup verified the cluster gone before the job was DONE.
    assert all(h.reservation() is None and not h.cluster_folders() for h in clean.hosts)
    assert not any(clusters_running(clean.hosts).values())
    assert_nothing_left(clean.hosts)


def test_a_killed_replica_is_resumed_elsewhere_without_a_relaunch(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts, shared: Path
) -> None:
    go = shared / "go"
    job_id = submit(
        jobs,
        "name: orphan\nresources:\n  region: west\n"
        f"run: |\n  while [ ! -e {go} ]; do sleep 0.1; done; echo finished\n",
    )
    cluster = f"mj-{job_id}-0"
    events = JobEvents(jobs, job_id)
    try:
        events.status(S.RUNNING)
        (host,) = wait_until(
            lambda: running_on(clean.hosts, cluster), within=20, what="the task to run"
        )
        launch = launch_held(host)
        holder = get(jobs, job_id).controller_id
        replica = stack.service(holder)

        replica.kill()
        try:
            events.wait(
                lambda evs: any(e.message.startswith("resumed on ") for e in evs),
                30,
                "another replica to take the job",
            )
            (other,) = [
                m.removeprefix("resumed on ") for m in events.messages() if "resumed on " in m
            ]
            # The new holder watches the same processes: nothing was relaunched.
            go.touch()
            events.done()
        finally:
            restart(stack, replica)
    finally:
        events.close()

    job = get(jobs, job_id)
    assert job.status == S.SUCCEEDED, job.failure_reason
    assert job.recovery_count == 0
    assert events.statuses() == [S.PENDING, S.STARTING, S.RUNNING, S.SUCCEEDED]
    # One cluster launched in total: the hosts recorded that one launch only...
    assert launches_recorded(clean.hosts, cluster) == {host.user: launch}
    assert sum("launched on" in m for m in events.messages()) == 1
    # ...and the new holder watched it where it ran. (The killed replica's last
    # lifecycle lines may not have been shipped before it died.)
    lifecycle = mj(stack, "logs", str(job_id), "--controller", "--no-follow").stdout
    assert f"assigned to {other} (epoch 2)" in lifecycle
    assert f"resumed; watching {cluster}" in lifecycle
    assert other != holder


def test_two_replicas_launching_twenty_jobs_never_double_book_a_host(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, clean: SshHosts
) -> None:
    race = pool(clean, RACE)
    # Long enough that the pool is seen full between launches even on a slow machine (with
    # 1 s, a sampler that reads every process table sometimes never caught four at once).
    spec = "name: racer\nresources:\n  region: race\nrun: sleep 3\n"
    seen: list[dict[str, set[str]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(clusters_running(race))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(20) as threads:
            job_ids = list(threads.map(lambda _: submit(jobs, spec), range(20)))
        watchers = [JobEvents(jobs, job_id) for job_id in job_ids]
        try:
            for watcher in watchers:
                watcher.done(within=90)
        finally:
            for watcher in watchers:
                watcher.close()
    finally:
        stop.set()
        sampler.join(10)

    finished = [get(jobs, job_id) for job_id in job_ids]
    assert [j.status for j in finished] == [S.SUCCEEDED] * 20, [j.failure_reason for j in finished]
    assert all(j.recovery_count == 0 for j in finished)
    # Never two clusters on one host at once, from the hosts' own process lists.
    doubled = [(user, names) for snap in seen for user, names in snap.items() if len(names) > 1]
    assert doubled == []
    # The pool was full at times, so launches did contend for hosts.
    assert max(sum(1 for names in snap.values() if names) for snap in seen) == 4
    # Every cluster ran on one host only, and each was launched once.
    where: dict[str, set[str]] = {}
    for snap in seen:
        for user, names in snap.items():
            for name in names:
                where.setdefault(name, set()).add(user)
    assert all(len(users) == 1 for users in where.values()), where
    for job_id in job_ids:
        assert len(launches_recorded(race, f"mj-{job_id}-0")) == 1
    # Both replicas launched some of them.
    admitted = {
        message.removeprefix("admitted on ")
        for watcher in watchers
        for message in watcher.messages()
        if message.startswith("admitted on ")
    }
    assert admitted == {"controller-1", "controller-2"}
