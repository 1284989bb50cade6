"""The ssh backend against real sshd servers, one per simulated host (contract §17, §18).

Every host is its own OS user on its own loopback address (harness/sshd.py), so
"the host's processes" are the processes of its user and "the host's files" are
its home. Preemption is killing a host's sshd and every process of its user;
a partition is SIGSTOP of its sshd. Outside CI these tests skip when root or
openssh-server is missing; under CI=true they never skip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from harness.sshd import SshHost, SshHosts
from harness.waiting import wait_for
from services.backends import (
    BackendUnreachableError,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
    TaskStatus,
    make_backend,
)
from services.backends.ssh.backend import SSHBackend
from services.backends.ssh.config import load_node_pools

pytestmark = pytest.mark.sshd

UNREACHABLE_TIMEOUT = 7.0
# How long the tests that partition a host wait for a command.
SHORT = {"connect_timeout": 1.5, "command_timeout": 3.0}
Factory = Callable[..., SSHBackend]


def request(name: str, **fields: Any) -> LaunchPlan:
    return LaunchPlan(
        job_id=fields.pop("job_id", 1),
        task_id=fields.pop("task_id", 0),
        epoch=fields.pop("epoch", 1),
        cluster_name=name,
        **fields,
    )


async def observed(backend: SSHBackend, handle: ClusterHandle, task: TaskStatus) -> Observation:
    """Waits until the task reaches `task`; that observation."""

    async def probe() -> Observation | None:
        seen = await backend.observe(handle)
        return seen if seen.task is task else None

    return await wait_for(probe, what=f"task {task.value} on {handle.cluster_name}")


def host_of(hosts: SshHosts, host_id: str) -> SshHost:
    return next(h for h in hosts.hosts if host_id.startswith(f"{h.user}@"))


def reservation_of(host: SshHost) -> str | None:
    """The cluster the host's own reservation names, read from its files."""
    held = host.reservation()
    return held["cluster"] if held else None


async def no_task_processes(host: SshHost) -> bool:
    return not host.task_processes()


async def no_processes(host: SshHost) -> bool:
    """Not even an sshd session: `ps -u USER` shows nothing."""
    return not host.ps()


@pytest.fixture(scope="module")
def sshd_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    made = SshHosts.create(4, tmp_path_factory.mktemp("sshd"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def hosts(sshd_hosts: SshHosts) -> Iterator[SshHosts]:
    """The module's four hosts, each up and with nothing of an earlier test left."""

    def reset() -> None:
        for host in sshd_hosts.hosts:
            host.resume()
            if host.process is None:
                host.start()
            host.wipe()

    reset()
    yield sshd_hosts
    reset()


@pytest.fixture
async def backends(hosts: SshHosts, tmp_path: Path) -> AsyncIterator[Factory]:
    """Makes backend instances on a pools file of the given hosts (1-based indexes)."""
    made: list[SSHBackend] = []

    def make(*indexes: int, **options: Any) -> SSHBackend:
        pools = options.pop("pools", None) or {
            "pool": {
                "hosts": list(indexes or (1, 2, 3, 4)),
                "unreachable_timeout": UNREACHABLE_TIMEOUT,
            }
        }
        path = hosts.pool_file(tmp_path / f"pools-{len(made)}.yaml", pools)
        backend = SSHBackend(
            load_node_pools(path),
            **{
                "connect_timeout": 2.0,
                # Generous, so a busy machine never looks like a partition; the tests
                # that partition a host shorten it.
                "command_timeout": 15.0,
                "reap_interval": 0,
                "poll_interval": 0.05,
                **options,
            },
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


@pytest.fixture
def chatty_shell(hosts: SshHosts) -> Iterator[None]:
    """Host 1's user has shell startup files that print (a greeting, as many do)."""
    bashrc = hosts.hosts[0].home / ".bashrc"
    saved = bashrc.read_bytes() if bashrc.exists() else None
    bashrc.write_text("echo 'Welcome to host 1!'\n" + (saved or b"").decode())
    yield
    if saved is None:
        bashrc.unlink()
    else:
        bashrc.write_bytes(saved)


async def test_two_node_task_gets_both_ranks_and_succeeds(
    backends: Factory, hosts: SshHosts, tmp_path: Path, chatty_shell: None
) -> None:
    backend = backends(1, 2)
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "greeting.txt").write_text("hello from the workdir\n")
    run = (
        'echo "rank=$MJ_NODE_RANK nodes=$MJ_NUM_NODES job=$MJ_JOB_ID task=$MJ_TASK_ID '
        "sky=$SKYPILOT_NODE_RANK/$SKYPILOT_NUM_NODES/$SKYPILOT_TASK_ID "
        'user=$(whoami) greeting=$GREETING"; cat greeting.txt'
    )
    handle = await backend.launch(
        request(
            "two",
            job_id=7,
            task_id=2,
            num_nodes=2,
            setup="echo setting up",
            run=run,
            workdir=str(workdir),
            envs={"GREETING": "it's a test"},
        )
    )

    assert handle.backend == "ssh" and handle.region == "pool"
    seen = await observed(backend, handle, TaskStatus.SUCCEEDED)
    assert seen.cluster is ClusterStatus.UP
    assert seen.end is not None and seen.end.exit_code == 0
    users = [host_of(hosts, hid).user for hid in handle.data["hosts"]]
    assert len(set(users)) == 2
    expected = b"".join(
        f"(rank={rank}) setting up\n"
        f"(rank={rank}) rank={rank} nodes=2 job=7 task=2 sky={rank}/2/mj-7-task-2 "
        f"user={users[rank]} greeting=it's a test\n"
        f"(rank={rank}) hello from the workdir\n".encode()
        for rank in range(2)
    )
    assert await backend.read_logs(handle) == expected
    tailed = b"".join([chunk async for chunk in backend.tail_logs(handle)])
    assert sorted(tailed.splitlines()) == sorted(expected.splitlines())


async def test_end_state_stays_readable_after_the_processes_were_killed(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1)
    handle = await backend.launch(request("fails", run="echo before; exit 3"))
    ended = await observed(backend, handle, TaskStatus.FAILED)
    assert ended.end is not None and ended.end.exit_code == 3
    assert abs(ended.end.end_time - time.time()) < 60

    hosts.hosts[0].kill()
    hosts.hosts[0].start()

    again = await backend.observe(handle)
    assert again.end == ended.end
    assert await backend.read_logs(handle) == b"before\n"


async def test_failed_setup_never_starts_run(backends: Factory) -> None:
    backend = backends(1)
    handle = await backend.launch(request("setup", setup="exit 5", run="echo ran"))
    seen = await observed(backend, handle, TaskStatus.FAILED_SETUP)
    assert seen.end is not None and seen.end.exit_code == 5
    assert b"ran" not in await backend.read_logs(handle)


async def test_impossible_or_busy_requests(backends: Factory, hosts: SshHosts) -> None:
    pools = {
        "gpus": {"hosts": [{"index": 1, "accelerators": "A100:8", "cpus": 8, "memory": 32}]},
        "cpus": {"hosts": [{"index": 2, "cpus": 4, "memory": 16}]},
    }
    backend = backends(pools=pools)
    assert backend.regions() == ["gpus", "cpus"]

    with pytest.raises(PrecheckError, match="A100:16"):
        await backend.launch(request("big", accelerators="A100:16"))
    with pytest.raises(PrecheckError, match="memory>=64GB"):
        await backend.launch(request("fat", memory="64+"))
    with pytest.raises(PrecheckError, match="cpus>=16"):
        await backend.launch(request("wide", cpus="16"))
    with pytest.raises(PrecheckError, match="unknown region"):
        await backend.launch(request("nowhere", region="mars"))
    assert all(reservation_of(host) is None for host in hosts.hosts)

    first = await backend.launch(request("first", accelerators="A100:4", run="sleep 100"))
    assert first.region == "gpus"
    with pytest.raises(ResourcesUnavailableError) as busy:
        await backend.launch(request("second", job_id=2, accelerators="A100:1"))
    assert busy.value.regions_tried == ["gpus"]
    # A pinned pool only; the other pool is free and fits.
    cpu = await backend.launch(request("third", job_id=3, cpus="2+", region="cpus"))
    assert cpu.region == "cpus"
    with pytest.raises(PrecheckError, match="blocked"):
        await backend.launch(request("fourth", job_id=4, region="cpus", blocked_regions=("cpus",)))


async def test_terminate_leaves_no_process_and_no_folder(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, 2)
    # Children, a background job and a process that left the group with setsid.
    run = "setsid sleep 1001 & sleep 1002 & bash -c 'sleep 1003'"
    handle = await backend.launch(request("doomed", num_nodes=2, run=run))
    used = [host_of(hosts, hid) for hid in handle.data["hosts"]]

    async def all_sleeping() -> bool:
        return all(sum("sleep 100" in p for p in h.task_processes()) == 3 for h in used)

    await wait_for(all_sleeping, what="every rank's sleeps")

    await backend.terminate(handle, epoch=1, grace=0.5)

    assert not await backend.cluster_exists("doomed")
    await backend.terminate(handle, epoch=1)  # idempotent
    for host in used:
        assert list((host.home / ".mj" / "clusters").iterdir()) == []
        assert reservation_of(host) is None
    await backend.close()
    for host in used:
        await wait_for(lambda h=host: no_processes(h), what=f"no process of {host.user}")


async def test_graceful_terminate_sends_sigterm_before_sigkill(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, 2)
    polite = "trap 'echo TERM >$HOME/marker; exit 0' TERM; while true; do sleep 0.1; done"
    stubborn = "trap 'echo TERM >$HOME/marker' TERM; while true; do sleep 0.1; done"
    one = await backend.launch(request("polite", run=polite))
    two = await backend.launch(request("stubborn", job_id=2, run=stubborn))
    h1, h2 = (host_of(hosts, h.data["hosts"][0]) for h in (one, two))
    await observed(backend, one, TaskStatus.RUNNING)
    await observed(backend, two, TaskStatus.RUNNING)

    await asyncio.gather(
        backend.terminate(one, epoch=1, grace=5), backend.terminate(two, epoch=1, grace=0.5)
    )

    assert (h1.home / "marker").read_text() == "TERM\n"
    # The stubborn task got SIGTERM too, then SIGKILL after its grace.
    assert (h2.home / "marker").read_text().startswith("TERM\n")
    assert not h1.task_processes() and not h2.task_processes()


async def test_stop_ends_the_task_and_keeps_its_last_words_until_terminate(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, 2, 3)
    polite = "trap 'echo checkpointed; exit 0' TERM; echo ready; while true; do sleep 0.1; done"
    stubborn = "trap 'echo ignored' TERM; echo ready; while true; do sleep 0.1; done"
    one = await backend.launch(request("polite", num_nodes=2, run=polite))
    two = await backend.launch(request("stubborn", job_id=2, epoch=3, run=stubborn))
    await observed(backend, one, TaskStatus.RUNNING)
    await observed(backend, two, TaskStatus.RUNNING)
    with pytest.raises(StaleEpochError):
        await backend.stop(two, epoch=2, grace=0)  # launched by epoch 3

    await asyncio.gather(backend.stop(one, epoch=1, grace=5), backend.stop(two, epoch=3, grace=0.5))

    used = [host_of(hosts, hid) for h in (one, two) for hid in h.data["hosts"]]
    assert all(not host.task_processes() for host in used)
    assert (await backend.read_logs(one)).count(b"checkpointed\n") == 2
    assert (await backend.read_logs(two)).startswith(b"ready\n")
    assert b"ignored\n" in await backend.read_logs(two)
    assert await backend.cluster_exists("polite") and await backend.cluster_exists("stubborn")
    await asyncio.gather(backend.terminate(one, epoch=1), backend.terminate(two, epoch=3))
    assert not await backend.cluster_exists("polite")
    assert not await backend.cluster_exists("stubborn")


async def test_a_host_whose_key_is_not_known_is_refused(
    backends: Factory, hosts: SshHosts, tmp_path: Path
) -> None:
    host = hosts.hosts[0]
    impostor = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[{host.address}]:{host.port} {impostor}")
    backend = backends(pools={"pool": {"hosts": [1], "known_hosts": str(known_hosts)}})

    with pytest.raises(BackendUnreachableError, match=r"[Hh]ost key"):
        await backend.launch(request("spoofed", run="true"))

    # Nothing ran there: not even the node script made its folder.
    assert not (host.home / ".mj").exists()


async def test_two_instances_launching_at_once_never_share_a_host(
    backends: Factory, hosts: SshHosts
) -> None:
    first, second = backends(), backends()
    launches = [
        (first if i % 2 else second).launch(request(f"race-{i}", job_id=100 + i, run="sleep 100"))
        for i in range(20)
    ]

    results = await asyncio.gather(*launches, return_exceptions=True)

    handles = [r for r in results if isinstance(r, ClusterHandle)]
    failures = [r for r in results if not isinstance(r, ClusterHandle)]
    assert all(isinstance(f, ResourcesUnavailableError) for f in failures), failures
    assert len(handles) == 4
    owners = {h.data["hosts"][0]: h.cluster_name for h in handles}
    assert len(owners) == 4
    for host_id, name in owners.items():
        host = host_of(hosts, host_id)
        # The host's own view: one reservation, one cluster's processes.
        assert reservation_of(host) == name
        assert host.clusters_running() == {name}


async def test_killed_host_is_unreachable_then_down_once_it_answers(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, **SHORT)
    handle = await backend.launch(request("victim", run="sleep 1000"))
    await observed(backend, handle, TaskStatus.RUNNING)

    hosts.hosts[0].kill()
    with pytest.raises(BackendUnreachableError) as silent:
        await backend.observe(handle)
    assert silent.value.timeout == UNREACHABLE_TIMEOUT

    hosts.hosts[0].start()
    seen = await backend.observe(handle)
    assert seen == Observation(ClusterStatus.DOWN, None, None)


async def test_host_killed_during_a_command_is_unreachable_not_an_error(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, **SHORT)
    # The task notes SIGTERM and runs on, so terminate waits out its grace on the host.
    run = "trap 'touch $HOME/termed' TERM; while true; do sleep 0.1; done"
    handle = await backend.launch(request("dying", run=run))
    await observed(backend, handle, TaskStatus.RUNNING)
    terminating = asyncio.create_task(backend.terminate(handle, epoch=1, grace=60))
    termed = hosts.hosts[0].home / "termed"

    async def in_grace() -> bool:
        return termed.exists()

    await wait_for(in_grace, what="terminate to be waiting out the grace")

    hosts.hosts[0].kill()

    # The connection died under the command: the host did not answer; that is no failure.
    with pytest.raises(BackendUnreachableError) as silent:
        await terminating
    assert silent.value.timeout == UNREACHABLE_TIMEOUT


async def test_partitioned_host_is_unreachable_with_the_pools_timeout(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, **SHORT)
    handle = await backend.launch(request("island", run="sleep 1000"))
    await observed(backend, handle, TaskStatus.RUNNING)

    hosts.hosts[0].pause()
    try:
        for _ in range(2):  # on the open connection, then on a new one
            with pytest.raises(BackendUnreachableError) as silent:
                await backend.observe(handle)
            assert silent.value.timeout == UNREACHABLE_TIMEOUT
        with pytest.raises(BackendUnreachableError):
            await backend.terminate(handle, epoch=1)
    finally:
        hosts.hosts[0].resume()

    # Nothing died: the partition healed and the task runs on.
    assert (await backend.observe(handle)).task is TaskStatus.RUNNING


async def test_stale_epochs_are_refused_by_every_instance(backends: Factory) -> None:
    holder, old = backends(), backends()
    handle = await holder.launch(request("fenced", job_id=9, epoch=2, run="sleep 100"))

    with pytest.raises(StaleEpochError):
        await old.launch(request("fenced", job_id=9, epoch=1, run="sleep 100"))
    with pytest.raises(StaleEpochError):
        await old.terminate(old.handle_for("fenced"), epoch=1)
    assert (await holder.observe(handle)).cluster is ClusterStatus.UP

    await holder.terminate(handle, epoch=2)
    # The hosts remember the job's epoch after the cluster is gone.
    with pytest.raises(StaleEpochError):
        await old.launch(request("fenced", job_id=9, epoch=1))


async def test_a_fresh_instance_finds_a_running_cluster_by_name(backends: Factory) -> None:
    launcher, fresh = backends(), backends()
    handle = await launcher.launch(request("findme", num_nodes=2, run="echo found; sleep 100"))
    await observed(launcher, handle, TaskStatus.RUNNING)

    lazy = fresh.handle_for("findme")
    assert lazy.data == {}
    seen = await fresh.observe_many([lazy, fresh.handle_for("never-launched")])
    assert seen["findme"] == Observation(ClusterStatus.UP, TaskStatus.RUNNING)
    assert seen["never-launched"] == Observation(ClusterStatus.DOWN)
    assert await fresh.read_logs(lazy) == b"(rank=0) found\n(rank=1) found\n"
    assert fresh.handle_for("findme").data["hosts"] == handle.data["hosts"]

    await fresh.terminate(lazy, epoch=1)
    assert (await launcher.observe(handle)).cluster is ClusterStatus.DOWN


async def test_relaunch_while_a_host_is_silent_is_reaped_when_it_returns(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1, 2, **SHORT)
    old = await backend.launch(request("moved", run="sleep 1000"))
    old_host = host_of(hosts, old.data["hosts"][0])
    await observed(backend, old, TaskStatus.RUNNING)

    old_host.pause()
    try:
        new = await backend.launch(request("moved", run="sleep 1000"))
    finally:
        old_host.resume()
    assert new.data["hosts"] != old.data["hosts"]
    assert old_host.clusters_running() == {"moved"}

    released = await backend.reap()

    assert [(r.host, r.cluster) for r in released] == [(old.data["hosts"][0], "moved")]
    await wait_for(lambda: no_task_processes(old_host), what="old processes gone")
    assert reservation_of(old_host) is None
    assert (await backend.observe(new)).task is TaskStatus.RUNNING


async def test_preemption_notice_writes_the_file_and_sigterms(
    backends: Factory, hosts: SshHosts
) -> None:
    backend = backends(1)
    run = (
        "trap 'cp \"$MJ_PREEMPTION_NOTICE_FILE\" $HOME/notice; exit 0' TERM; "
        "while true; do sleep 0.1; done"
    )
    handle = await backend.launch(request("noticed", run=run))
    await observed(backend, handle, TaskStatus.RUNNING)

    await backend.notify_preemption(handle, epoch=1, deadline=1234.5)

    async def gone() -> bool:
        return (await backend.observe(handle)).cluster is ClusterStatus.DOWN

    await wait_for(gone, what="the cluster to read as preempted")
    # A stopped task did not end: no end time, so it is recovered, not succeeded.
    assert (await backend.observe(handle)).end is None
    assert (hosts.hosts[0].home / "notice").read_text() == "1234.5\n"


async def test_tail_follows_the_log_until_the_task_ends(backends: Factory, hosts: SshHosts) -> None:
    backend = backends(1)
    # The second line waits for a file the test makes once it saw the first one.
    run = "echo first; while [ ! -e go ]; do sleep 0.05; done; echo second"
    handle = await backend.launch(request("tail", run=run))
    workdir = hosts.hosts[0].home / ".mj" / "clusters" / f"tail.{handle.data['launch']}" / "workdir"

    chunks = []
    async for chunk in backend.tail_logs(handle):
        chunks.append(chunk)
        if b"first" in chunk:
            (workdir / "go").touch()

    assert b"".join(chunks) == b"first\nsecond\n" == await backend.read_logs(handle)
    assert chunks[0] == b"first\n"


async def test_make_backend_builds_ssh_from_the_settings(hosts: SshHosts, tmp_path: Path) -> None:
    path = hosts.pool_file(tmp_path / "pools.yaml", {"a": {"hosts": [1]}, "b": {"hosts": [2]}})
    backend = make_backend("ssh", {"ssh_node_pools": str(path), "ssh_reap_interval": 0})
    try:
        assert backend.name == "ssh" and backend.launch_concurrency == 64
        assert backend.regions() == ["a", "b"]
        assert await backend.reachable()
    finally:
        await backend.close()
    with pytest.raises(ValueError, match="ssh_node_pools"):
        make_backend("ssh", {})
