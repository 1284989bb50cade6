"""User code on the local backend is confined (contract §14 "User code").

The tests that change users need root, as CI runs them: without it they fail
under CI=true and skip elsewhere.
"""

from __future__ import annotations

import pwd
import re
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harness.local_clusters import (
    open_folder,
    processes_with,
    remove_all,
    request,
    sleeps_running,
    unique_sleep,
    wait_end,
    wait_for,
)
from harness.prerequisites import require_root
from services.backends import PrecheckError, ResourcesUnavailableError, TaskStatus
from services.backends.local.backend import LocalBackend


@pytest.fixture
def root() -> None:
    require_root("changing users")


as_root = pytest.mark.usefixtures("root")


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A data dir as a service has it: open to pass through, with a database inside."""
    with open_folder(0o711) as path:
        (path / "scheduler.db").write_bytes(b"the database")
        (path / "src").mkdir()
        (path / "src" / "train.sh").write_text("echo training\n")
        yield path


@pytest.fixture
async def backend(data_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend(data_dir / "clusters", workdir_roots=[data_dir / "src"])
    try:
        yield backend
    finally:
        await remove_all(backend)


def attempt(command: str, what: str) -> str:
    """Shell that runs `command` and says whether it worked, as `<what>: yes|no`."""
    return f'if ( {command} ) 2>/dev/null; then echo "{what}: yes"; else echo "{what}: no"; fi\n'


@as_root
async def test_user_code_cannot_write_the_database_the_data_dir_or_another_cluster(
    backend: LocalBackend, data_dir: Path
) -> None:
    sleep, marker = unique_sleep()
    await backend.launch(request("victim", job_id=1, run=sleep))
    await wait_for(lambda: sleeps_running(marker), what="the other cluster's task")
    victim = backend.layout("victim").dir
    run = (
        'echo "uid=$(id -u)"\n'
        + attempt(f"echo x >> {data_dir}/scheduler.db", "database")
        + attempt(f"touch {data_dir}/intruder", "data dir")
        + attempt(f"touch {backend.root}/intruder", "clusters root")
        + attempt(f"touch {victim}/intruder", "other cluster")
        + attempt(f"touch {victim}/workdir/intruder", "other workdir")
        + attempt(f"touch {victim}/home/intruder", "other home")
        + attempt('echo \'{"status": "SUCCEEDED"}\' > ../status.json', "own status")
        + attempt(f"kill {sleep_pid(marker)}", "other's process")
        + attempt("touch mine", "own workdir")
        + attempt('touch "$HOME/mine"', "own home")
    )

    handle = await backend.launch(request("nosy", job_id=2, workdir=str(data_dir / "src"), run=run))

    seen = await wait_end(backend, handle)
    assert seen.end is not None and seen.end.status is TaskStatus.SUCCEEDED
    logs = (await backend.read_logs(handle)).decode()
    uid = int(re.search(r"uid=(\d+)", logs).group(1))  # type: ignore[union-attr]
    assert uid != 0 and uid in backend.confinement.uids
    for refused in (
        "database",
        "data dir",
        "clusters root",
        "other cluster",
        "other workdir",
        "other home",
        "own status",
        "other's process",
    ):
        assert f"{refused}: no" in logs, logs
    # The same shell could write where it may: the refusals above are the confinement's.
    assert "own workdir: yes" in logs and "own home: yes" in logs, logs
    assert (data_dir / "scheduler.db").read_bytes() == b"the database"
    places = (data_dir, backend.root, victim, victim / "workdir", victim / "home")
    assert not any((place / "intruder").exists() for place in places)
    assert await sleeps_running(marker)


@as_root
async def test_each_cluster_runs_as_its_own_uid_in_the_run_as_group(
    backend: LocalBackend,
) -> None:
    handles = [
        await backend.launch(request(name, job_id=job, run="echo $(id -u) $(id -G) $HOME"))
        for job, name in enumerate(("one", "two"), start=1)
    ]
    group = pwd.getpwnam(backend.confinement.run_as).pw_gid

    lines = []
    for handle in handles:
        await wait_end(backend, handle)
        lines.append((await backend.read_logs(handle)).decode().split())
    uids = {int(uid) for uid, _, _ in lines}
    assert len(uids) == 2 and uids <= set(backend.confinement.uids)
    assert all(int(groups) == group for _, groups, _ in lines), "no other group, root's least"
    assert [home for _, _, home in lines] == [str(backend.layout(n).home) for n in ("one", "two")]


@as_root
async def test_uids_are_handed_out_only_while_free(data_dir: Path) -> None:
    backend = LocalBackend(
        data_dir / "clusters", run_as_uids=range(250000, 250002), workdir_roots=[data_dir]
    )
    try:
        for name in ("a", "b"):
            await backend.launch(request(name, run="sleep 30"))

        with pytest.raises(ResourcesUnavailableError, match="uids"):
            await backend.launch(request("c", run="true"))
        assert not await backend.cluster_exists("c")

        await backend.terminate(backend.handle_for("a"))
        handle = await backend.launch(request("c", run="id -u"))
        await wait_end(backend, handle)
        assert await backend.read_logs(handle) == b"250000\n"
    finally:
        await remove_all(backend)


@pytest.fixture
def new_user() -> Iterator[str]:
    """The name of a user that does not exist yet; removed afterwards."""
    name = f"mjt{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["userdel", name], check=False, capture_output=True)


@as_root
async def test_a_missing_run_as_user_is_created(data_dir: Path, new_user: str) -> None:
    name = new_user
    backend = LocalBackend(data_dir / "clusters", run_as=name, workdir_roots=[data_dir])
    try:
        handle = await backend.launch(request("fresh", run="id -gn"))
        await wait_end(backend, handle)
        assert await backend.read_logs(handle) == f"{name}\n".encode()
        assert pwd.getpwnam(name).pw_shell.endswith(("nologin", "false"))
    finally:
        await remove_all(backend)


@pytest.mark.parametrize(
    ("workdir", "problem"),
    [
        ("/etc", "outside the workdir roots"),
        ("../..", "relative"),
        ("src/../..", "relative"),
        ("{data}/src/../..", "outside the workdir roots"),
        ("{data}/src/escape", "outside the workdir roots"),
        ("~", "outside the workdir roots"),
        ("{data}/src/missing", "not an existing directory"),
    ],
)
async def test_a_workdir_must_resolve_under_a_workdir_root(
    backend: LocalBackend, data_dir: Path, workdir: str, problem: str
) -> None:
    (data_dir / "src" / "escape").symlink_to("/etc")
    path = workdir.format(data=data_dir)

    with pytest.raises(PrecheckError, match=problem) as info:
        await backend.launch(request("wd", workdir=path, run="true"))

    if "roots" in problem:
        assert str(data_dir / "src") in str(info.value), "the message names the roots"
    assert not await backend.cluster_exists("wd")


async def test_a_workdir_under_a_root_is_copied_for_the_task(
    backend: LocalBackend, data_dir: Path
) -> None:
    handle = await backend.launch(
        request("wd", workdir=f"{data_dir}/src/../src", run="bash train.sh")
    )
    await wait_end(backend, handle)
    assert await backend.read_logs(handle) == b"training\n"


def sleep_pid(marker: str) -> int:
    return next(p.pid for p in processes_with(marker) if p.name() == "sleep")
