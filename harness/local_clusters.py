"""Helpers the local backend's tests share: waiting, finding processes, cleaning up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from harness.waiting import wait_for as wait_for  # the local backend's tests wait with it
from services.backends import ClusterHandle, LaunchPlan, Observation, TaskStatus
from services.backends.local.backend import LocalBackend
from services.backends.local.cluster import cluster_processes


async def wait_task(backend: LocalBackend, handle: ClusterHandle, status: TaskStatus) -> None:
    async def reached() -> bool:
        return await backend.task_status(handle) is status

    await wait_for(reached, what=f"task status {status.value}")


async def wait_end(backend: LocalBackend, handle: ClusterHandle) -> Observation:
    """The first observation that carries the task's end."""

    async def ended() -> Observation | None:
        seen = await backend.observe(handle)
        return seen if seen.end is not None else None

    return await wait_for(ended, what="the task's end")


async def wait_logs(backend: LocalBackend, handle: ClusterHandle, text: bytes) -> bytes:
    async def written() -> bytes:
        logs = await backend.read_logs(handle)
        return logs if text in logs else b""

    return await wait_for(written, what=f"{text!r} in the logs")


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions `marker`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if any(marker in arg for arg in proc.cmdline()) and proc.status() not in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


async def no_process_with(marker: str) -> bool:
    return not processes_with(marker)


async def sleeps_running(marker: str, count: int = 1) -> bool:
    """Whether `count` of the `sleep <marker>` processes themselves (not their shells) run."""
    sleeps = [p for p in processes_with(marker) if p.name() == "sleep"]
    return len(sleeps) == count


def unique_sleep() -> tuple[str, str]:
    """A `sleep` command that is long and recognisable: (command, marker)."""
    marker = f"1000.{uuid.uuid4().int % 10**12:012d}"
    return f"sleep {marker}", marker


def request(name: str, **fields: Any) -> LaunchPlan:
    return LaunchPlan(
        job_id=fields.pop("job_id", 1),
        task_id=fields.pop("task_id", 0),
        epoch=fields.pop("epoch", 0),
        cluster_name=name,
        **fields,
    )


def status_file(backend: LocalBackend, name: str) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(backend.layout(name).status_file.read_text())
    return raw


async def remove_all(backend: LocalBackend) -> None:
    """Terminates every cluster under the backend's root and checks nothing is left."""
    if not backend.root.is_dir():
        return
    for cluster_dir in backend.root.iterdir():
        if cluster_dir.name.startswith("."):
            continue
        await backend.terminate(backend.handle_for(cluster_dir.name))
        assert not cluster_processes(cluster_dir)


@contextlib.contextmanager
def open_folder(mode: int) -> Iterator[Path]:
    """A fresh folder under the system's temp folder with `mode`.

    Test folders of pytest sit in a folder only root may enter; user code running
    as another uid reaches only folders like this one.
    """
    path = Path(tempfile.mkdtemp(prefix="mj-test-"))
    try:
        os.chmod(path, mode)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
