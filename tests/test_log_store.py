"""Task logs saved at once are written together, each stored or failed on its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
        assert store.read_bytes(stored.path, 0, stored.size) == b"log %d\n" % job
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
    assert store.read_bytes(stored.path, section.offset, section.end) == b"second\n"
