"""Task logs saved at once are written together, each stored or failed on its own."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from services.logs import durable
from services.logs.reading import read_bytes
from services.logs.store import LogStore


def temporary_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


async def test_logs_saved_at_once_share_thread_trips_and_each_lands_whole(tmp_path: Path) -> None:
    store = LogStore(tmp_path)
    sizes = await asyncio.gather(
        *(
            store.save_task_attempt(job, 0, 1, f"mj-{job}-0", b"log %d\n" % job)
            for job in range(1, 101)
        )
    )
    assert sizes == [len(b"log %d\n" % job) for job in range(1, 101)]
    # One trip per batch of at most 64 writes: far fewer than one per log.
    assert store._writes.batches <= 4
    for job in range(1, 101):
        stored = store.task_log(job, 0)
        assert stored is not None
        assert [(s.attempt, s.cluster_name, s.size) for s in stored.sections] == [
            (1, f"mj-{job}-0", len(b"log %d\n" % job))
        ]
        assert read_bytes(stored.path, 0, stored.size) == b"log %d\n" % job
    assert temporary_files(tmp_path) == []


async def test_a_log_that_cannot_be_written_fails_alone(tmp_path: Path) -> None:
    store = LogStore(tmp_path)
    (tmp_path / "2").write_text("a file where job 2's folder should be")
    outcomes = await asyncio.gather(
        *(store.save_task_attempt(job, 0, 1, f"mj-{job}-0", b"x\n") for job in (1, 2, 3)),
        return_exceptions=True,
    )
    assert outcomes[0] == outcomes[2] == 2
    assert isinstance(outcomes[1], OSError)
    assert store.task_log(1, 0) is not None and store.task_log(3, 0) is not None
    assert (tmp_path / "2").read_text() == "a file where job 2's folder should be"


async def test_a_second_attempt_joins_the_first_and_gets_an_index(tmp_path: Path) -> None:
    store = LogStore(tmp_path)
    await store.save_task_attempt(1, 0, 1, "mj-1-0", b"first\n")
    assert not (tmp_path / "1" / "task-0.sections.json").exists()
    await store.save_task_attempt(1, 0, 2, "mj-1-0", b"second\n")
    stored = store.task_log(1, 0)
    assert stored is not None
    assert [s.attempt for s in stored.sections] == [1, 2]
    assert (tmp_path / "1" / "task-0.sections.json").exists()
    section = stored.section(2)
    assert section is not None
    assert read_bytes(stored.path, section.offset, section.end) == b"second\n"


def test_the_c_librarys_syncfs_is_found_on_linux() -> None:
    if sys.platform.startswith("linux"):
        assert durable._syncfs is not None


class Syncs:
    """Records the syncs a store makes (each before any log took its place) and does them."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, syncfs_answer: int = 0):
        self.filesystems = 0
        self.files: list[Path] = []
        real_fsync = durable._fsync

        def syncfs(fd: int) -> int:
            assert list(root.rglob("*.log")) == []  # nothing in place yet
            self.filesystems += 1
            os.sync()
            return syncfs_answer

        def fsync(path: Path) -> None:
            assert path.suffix == ".tmp"
            self.files.append(path)
            real_fsync(path)

        monkeypatch.setattr(durable, "_syncfs", syncfs)
        monkeypatch.setattr(durable, "_fsync", fsync)


async def save(store: LogStore, jobs: range) -> None:
    await asyncio.gather(
        *(store.save_task_attempt(job, 0, 1, f"mj-{job}-0", b"log %d\n" % job) for job in jobs)
    )


def assert_saved(store: LogStore, jobs: range) -> None:
    for job in jobs:
        stored = store.task_log(job, 0)
        assert stored is not None
        assert read_bytes(stored.path, 0, stored.size) == b"log %d\n" % job
    assert temporary_files(store.root) == []


async def test_a_trip_of_several_logs_syncs_their_filesystem_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several logs in one trip: one syncfs before any takes its place, no fsync per file;
    a lone log is synced alone."""
    syncs = Syncs(tmp_path, monkeypatch)
    store = LogStore(tmp_path)
    jobs = range(1, durable.SYNC_AT_ONCE * 3)
    await save(store, jobs)
    assert store._writes.batches == syncs.filesystems == 1
    assert syncs.files == []
    assert_saved(store, jobs)
    await save(store, range(100, 101))
    assert syncs.filesystems == 1
    assert [p.name for p in syncs.files] == ["task-0.log.tmp"]
    assert_saved(store, range(100, 101))


@pytest.mark.parametrize("syncfs", ["fails", "missing"])
async def test_without_a_working_syncfs_every_file_is_synced_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: str
) -> None:
    """A syncfs that reports an error (or none on this system): each file is synced on its
    own before it takes its place, and every log lands."""
    syncs = Syncs(tmp_path, monkeypatch, syncfs_answer=-1)
    if syncfs == "missing":
        monkeypatch.setattr(durable, "_syncfs", None)
    store = LogStore(tmp_path)
    jobs = range(1, durable.SYNC_AT_ONCE * 2)
    await save(store, jobs)
    assert sorted(p.parent.name for p in syncs.files) == sorted(str(job) for job in jobs)
    assert_saved(store, jobs)
