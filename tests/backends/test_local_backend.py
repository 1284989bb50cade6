"""The local backend with real supervisor and user processes (contract §10)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harness.local_clusters import (
    no_process_with,
    processes_with,
    remove_all,
    request,
    sleeps_running,
    status_file,
    unique_sleep,
    wait_for,
    wait_task,
)
from services.backends import (
    ClusterStatus,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    TaskStatus,
    backend_settings,
    make_backend,
)
from services.backends.local.backend import LocalBackend
from services.common.settings import parse


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    root = tmp_path / "clusters"
    backend = LocalBackend(root, poll_interval=0.05, workdir_roots=[tmp_path])
    try:
        yield backend
    finally:
        # Leave no process behind, whatever the test did.
        await remove_all(backend)


async def test_hello_task_succeeds_and_its_output_is_in_the_logs(backend: LocalBackend) -> None:
    handle = await backend.launch(request("hello", run="echo hello from $MJ_CLUSTER_NAME"))

    assert handle.backend == "local" and handle.region == "local"
    await wait_task(backend, handle, TaskStatus.SUCCEEDED)
    assert await backend.read_logs(handle) == b"hello from hello\n"
    end = await backend.task_end(handle)
    assert end is not None and end.status is TaskStatus.SUCCEEDED and end.exit_code == 0
    assert end.end_time == status_file(backend, "hello")["end_time"]
    # The cluster stays up after its task finished, until it is terminated.
    assert await backend.cluster_status(handle) is ClusterStatus.UP
    assert status_file(backend, "hello")["exit_codes"] == {"0": 0}


async def test_each_rank_sees_its_rank_node_count_and_ids(backend: LocalBackend) -> None:
    run = (
        'echo "rank=$MJ_NODE_RANK nodes=$MJ_NUM_NODES job=$MJ_JOB_ID task=$MJ_TASK_ID '
        'sky=$SKYPILOT_NODE_RANK/$SKYPILOT_NUM_NODES greeting=$GREETING"'
    )
    handle = await backend.launch(
        request("multi", job_id=7, num_nodes=2, run=run, envs={"GREETING": "hi"})
    )

    await wait_task(backend, handle, TaskStatus.SUCCEEDED)
    logs = await backend.read_logs(handle)
    assert logs == (
        b"(rank=0) rank=0 nodes=2 job=7 task=0 sky=0/2 greeting=hi\n"
        b"(rank=1) rank=1 nodes=2 job=7 task=0 sky=1/2 greeting=hi\n"
    )
    logs_dir = backend.layout("multi").logs_dir
    assert sorted(p.name for p in logs_dir.iterdir()) == ["rank-0.log", "rank-1.log"]


async def test_nonzero_run_exit_fails_the_task_with_its_code(backend: LocalBackend) -> None:
    handle = await backend.launch(request("exit3", run="echo about to fail; exit 3"))

    await wait_task(backend, handle, TaskStatus.FAILED)
    assert status_file(backend, "exit3")["exit_codes"] == {"0": 3}
    end = await backend.task_end(handle)
    assert end is not None and end.status is TaskStatus.FAILED and end.exit_code == 3
    assert await backend.read_logs(handle) == b"about to fail\n"


async def test_failed_setup_never_starts_run(backend: LocalBackend) -> None:
    sleep, marker = unique_sleep()
    setup = f'if [ "$MJ_NODE_RANK" = 0 ]; then exit 1; fi; {sleep}'
    handle = await backend.launch(request("badsetup", num_nodes=2, setup=setup, run="touch ran"))

    await wait_task(backend, handle, TaskStatus.FAILED_SETUP)
    codes = status_file(backend, "badsetup")["exit_codes"]
    assert codes["0"] == 1 and codes["1"] != 0, "the other rank's setup is stopped"
    end = await backend.task_end(handle)
    assert end is not None and end.exit_code == 1, "the code of the setup that failed first"
    assert not (backend.layout("badsetup").workdir / "ran").exists()
    assert not processes_with(marker)


async def test_one_failed_rank_stops_the_others(backend: LocalBackend) -> None:
    sleep, marker = unique_sleep()
    run = f'if [ "$MJ_NODE_RANK" = 1 ]; then exit 4; fi; {sleep}'
    handle = await backend.launch(request("onefails", num_nodes=2, run=run))

    await wait_task(backend, handle, TaskStatus.FAILED)
    codes = status_file(backend, "onefails")["exit_codes"]
    assert codes["1"] == 4 and codes["0"] != 0
    end = await backend.task_end(handle)
    assert end is not None and end.exit_code == 4, "the rank that failed first, not rank 0"
    assert not processes_with(marker)


async def test_killed_supervisor_is_preemption_and_takes_user_processes_along(
    backend: LocalBackend,
) -> None:
    # `bash` cannot exec a command that is not the last one, so `sleep` is a grandchild.
    sleep, marker = unique_sleep()
    handle = await backend.launch(request("preempt", run=f"echo started; {sleep}; echo never"))

    await wait_task(backend, handle, TaskStatus.RUNNING)
    await wait_for(lambda: sleeps_running(marker), what="sleep started")
    os.kill(handle.data["pid"], signal.SIGKILL)

    async def down() -> bool:
        return await backend.cluster_status(handle) is ClusterStatus.DOWN

    await wait_for(down, what="cluster DOWN")
    assert await backend.observe(handle) == Observation(ClusterStatus.DOWN), "no task, no end"
    await wait_for(lambda: no_process_with(marker), what="user processes gone")
    # Logs of a preempted cluster remain readable until it is torn down.
    assert await backend.read_logs(handle) == b"started\n"
    assert await backend.cluster_exists("preempt")


async def test_rank_dies_with_supervisor_even_without_its_guardian(
    backend: LocalBackend,
) -> None:
    # A single command is exec'd by bash, so PR_SET_PDEATHSIG alone must kill it.
    sleep, marker = unique_sleep()
    handle = await backend.launch(request("pdeath", run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="sleep started")
    children = json.loads(backend.layout("pdeath").children_file.read_text())
    os.kill(children["guardian_pid"], signal.SIGKILL)

    os.kill(handle.data["pid"], signal.SIGKILL)

    await wait_for(lambda: no_process_with(marker), what="user process gone")


async def test_another_backend_instance_finds_the_cluster_by_name(
    backend: LocalBackend,
) -> None:
    sleep, marker = unique_sleep()
    await backend.launch(request("shared", run=sleep))
    other = LocalBackend(backend.root)  # e.g. another controller replica
    handle = other.handle_for("shared")

    await wait_task(other, handle, TaskStatus.RUNNING)
    assert await other.cluster_status(handle) is ClusterStatus.UP
    await other.terminate(handle)
    assert not await backend.cluster_exists("shared")
    assert not processes_with(marker)


async def test_terminate_removes_everything_and_is_idempotent(backend: LocalBackend) -> None:
    sleep, marker = unique_sleep()
    handle = await backend.launch(request("term", num_nodes=2, run=f"{sleep} & wait"))
    await wait_for(lambda: sleeps_running(marker, 2), what="both sleeps started")

    await backend.terminate(handle)

    assert not backend.layout("term").dir.exists()
    assert not processes_with(marker)
    assert not await backend.cluster_exists("term")
    assert await backend.cluster_status(handle) is ClusterStatus.DOWN
    assert await backend.task_status(handle) is None
    assert await backend.read_logs(handle) == b""
    await backend.terminate(handle)
    assert not await backend.cluster_exists("term")


async def test_relaunch_replaces_the_stale_cluster_of_the_same_name(
    backend: LocalBackend,
) -> None:
    sleep, marker = unique_sleep()
    first = await backend.launch(request("again", run=sleep))
    await wait_task(backend, first, TaskStatus.RUNNING)

    second = await backend.launch(request("again", run="echo fresh"))

    assert second.data["pid"] != first.data["pid"]
    assert not processes_with(marker)
    await wait_task(backend, second, TaskStatus.SUCCEEDED)
    assert await backend.read_logs(second) == b"fresh\n"


async def test_tail_logs_follows_output_until_the_task_ends(backend: LocalBackend) -> None:
    run = "for i in 1 2 3; do echo line $i; sleep 0.2; done"
    handle = await backend.launch(request("tail", run=run))

    async def collect() -> list[bytes]:
        return [chunk async for chunk in backend.tail_logs(handle)]

    chunks = await asyncio.wait_for(collect(), timeout=10)
    assert b"".join(chunks) == b"line 1\nline 2\nline 3\n"
    assert len(chunks) >= 2, "output should arrive while the task runs"
    assert await backend.task_status(handle) is TaskStatus.SUCCEEDED


async def test_tail_logs_prefixes_whole_lines_of_each_rank(backend: LocalBackend) -> None:
    run = 'echo "a$MJ_NODE_RANK"; sleep 0.1; printf "b$MJ_NODE_RANK"'
    handle = await backend.launch(request("tail2", num_nodes=2, run=run))

    chunks = [chunk async for chunk in backend.tail_logs(handle)]

    lines = sorted(b"".join(chunks).splitlines(keepends=True))
    assert lines == [b"(rank=0) a0\n", b"(rank=0) b0\n", b"(rank=1) a1\n", b"(rank=1) b1\n"]
    assert (
        await backend.read_logs(handle) == b"(rank=0) a0\n(rank=0) b0\n(rank=1) a1\n(rank=1) b1\n"
    )


async def test_tail_logs_of_a_missing_cluster_ends_at_once(backend: LocalBackend) -> None:
    chunks = [chunk async for chunk in backend.tail_logs(backend.handle_for("nothing"))]
    assert chunks == []


async def test_workdir_is_copied_and_is_the_working_directory(
    backend: LocalBackend, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("payload\n")
    handle = await backend.launch(request("wd", workdir=str(src), run="cat data.txt"))

    await wait_task(backend, handle, TaskStatus.SUCCEEDED)
    assert await backend.read_logs(handle) == b"payload\n"


async def test_missing_workdir_fails_precheck(backend: LocalBackend, tmp_path: Path) -> None:
    with pytest.raises(PrecheckError, match="nowhere"):
        await backend.launch(request("nowd", workdir=str(tmp_path / "nowhere"), run="true"))
    assert not await backend.cluster_exists("nowd")


async def test_blocked_local_region_is_unavailable(backend: LocalBackend) -> None:
    with pytest.raises(ResourcesUnavailableError) as info:
        await backend.launch(request("blocked", run="true", blocked_regions=("local",)))
    assert info.value.regions_tried == ["local"]
    assert not await backend.cluster_exists("blocked")


async def test_foreign_region_fails_precheck(backend: LocalBackend) -> None:
    with pytest.raises(PrecheckError, match="us-east-1"):
        await backend.launch(request("aws", run="true", region="us-east-1"))


async def test_unsafe_cluster_name_fails_precheck(backend: LocalBackend) -> None:
    with pytest.raises(PrecheckError):
        await backend.launch(request("../escape", run="true"))


async def test_reachable_creates_a_writable_root(backend: LocalBackend) -> None:
    assert await backend.reachable()
    assert backend.root.is_dir()


async def test_a_missing_cluster_is_down_without_an_end(backend: LocalBackend) -> None:
    assert await backend.observe(backend.handle_for("nothing")) == Observation(ClusterStatus.DOWN)


def test_launches_scale_with_the_cpus_and_the_only_region_is_local(
    backend: LocalBackend,
) -> None:
    assert backend.launch_concurrency == 4 * (os.cpu_count() or 1)
    assert backend.regions() == ["local"]


def test_make_backend_knows_local_and_names_unknown_ones(tmp_path: Path) -> None:
    backend = make_backend("local", {"data_dir": tmp_path})
    assert isinstance(backend, LocalBackend) and backend.root == tmp_path.resolve() / "clusters"
    assert backend.confinement.run_as == "mj-run"
    assert backend.confinement.workdir_roots == (Path.cwd().resolve(),)
    with pytest.raises(ValueError, match="nimbus"):
        make_backend("nimbus", {})


def test_local_settings_reach_the_backend_and_bad_ones_are_named(tmp_path: Path) -> None:
    backend = make_backend(
        "local",
        {
            "data_dir": tmp_path,
            "run_as": "nobody",
            "run_as_uids": "300000-300009",
            "workdir_roots": f"{tmp_path}:/srv",
        },
    )
    assert isinstance(backend, LocalBackend)
    assert backend.confinement.run_as == "nobody"
    assert backend.confinement.uids == range(300000, 300010)
    assert backend.confinement.workdir_roots == (tmp_path.resolve(), Path("/srv"))
    for bad in ("0-10", "300-200000", "2000-1000", "lots"):
        with pytest.raises(ValueError, match="run_as_uids"):
            make_backend("local", {"data_dir": tmp_path, "run_as_uids": bad})
    with pytest.raises(ValueError, match="not a user name"):
        make_backend("local", {"data_dir": tmp_path, "run_as": "root; rm -rf /"})


@pytest.mark.parametrize(
    ("variable", "value"), [("MJ_RUN_AS_UIDS", "2000-1000"), ("MJ_RUN_AS", "Not A User")]
)
def test_a_bad_local_setting_stops_the_parser_with_its_name(
    variable: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse("mj-test", "", backend_settings(), [], environ={variable: value})
    assert variable in capsys.readouterr().err
