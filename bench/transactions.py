"""What a transaction costs the scheduler before it does anything: the store's fixed price.

Opens the scheduler's `Database` on a SQLite file of its own (migrated, as the
scheduler runs it) and times, in one process, transactions that run a single
`SELECT 1`, the best of several rounds, in CPU microseconds per transaction:
- `client_write`: a client's write (`db.write(fn, client=True)`: the writer's
  turn, then BEGIN IMMEDIATE ... COMMIT on the writer thread, one hop);
- `background_write`: a background write (`db.write(fn)`: the same, in the
  background's turn);
- `read`: a read (`db.read(fn)`, on the event loop's thread);
- `sqlite3_write`: BEGIN IMMEDIATE, the SELECT and COMMIT straight through the
  `sqlite3` module on the same file: SQLite's own share.
A sequential client's job takes a few write transactions (its submission, its
share of admission passes and of report batches); this is what each costs before
its statements' own work.
Then `submission`: real submissions (`Store.submit`, a job of one task, as a
client's `SubmitJob` stores it) one after another, their wall time p50/p99/max in
ms, and how many checkpoints copied SQLite's log back meanwhile: every commit
writes pages, so the log grows and is checkpointed every 100 commits
(`services/scheduler/db/sqlite.py`).
Then `batches`: the batch paths, in CPU microseconds per job: `--batch` jobs
(500) assigned to a replica in one move, their STARTING and RUNNING reports
applied as one batch each (`Reports.apply`), and the jobs released from the
replica, the mean of `--batch-rounds` rounds, on SQLite and (with `--postgres`)
on a fresh PostgreSQL database: what the statements that name many jobs cost.
Records one JSON line (`results.py`).

    .venv/bin/python bench/transactions.py [--number 2000] [--rounds 5] [--submissions 5000]
        [--batch 500] [--batch-rounds 6] [--postgres URL]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sqlite3
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy import Connection, text

from harness.bench.machine import probe_filesystem
from harness.bench.results import record
from harness.bench.system import postgres_database, summary
from harness.store import move_jobs
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler.db import Database
from services.scheduler.events import EventBus
from services.scheduler.releases import release_replica
from services.scheduler.reports import Reports
from services.scheduler.spec.parse import parse_job_spec
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob

SELECT = text("SELECT 1")


async def best_cpu_us(once: Callable[[], Awaitable[None]], number: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(number):
            await once()
        best = min(best, (time.process_time() - start) / number)
    return round(best * 1e6, 1)


async def submissions(db: Database, number: int) -> dict[str, object]:
    """`number` submissions one after another: wall time each, and checkpoints taken."""
    store = Store(db, EventBus())
    spec = parse_job_spec("name: bench\nrun: train\n")
    job = NewJob(spec.name, "bench", 0, "", "", spec.tasks)
    taken = db.checkpointer.taken if db.checkpointer else 0
    times = []
    for _ in range(number):
        start = time.perf_counter()
        await store.submit(job)
        times.append((time.perf_counter() - start) * 1000)
    checkpoints = (db.checkpointer.taken if db.checkpointer else 0) - taken
    return {**summary(times, "ms"), "checkpoints": checkpoints}


async def batches(url: str, size: int, rounds: int, synchronous: str) -> dict[str, float]:
    """CPU per job of a move, two report batches and a release of `size` jobs at once."""
    db = Database.open(url, sqlite_synchronous=synchronous)
    await db.migrate()
    store = Store(db, EventBus())
    reports = Reports(store)
    spec = parse_job_spec("name: bench\nrun: train\n")
    cpu = dict.fromkeys(("move", "starting", "running", "release"), 0.0)
    numbers = itertools.count(1)

    def report(job_id: int, epoch: int, status: JobStatus) -> pb.ConnectControllerRequest:
        change = pb.TaskTransition(job_id=job_id, epoch=epoch, status=int(status), attempt=1)  # type: ignore[arg-type]
        return pb.ConnectControllerRequest(seq=next(numbers), transition=change)

    try:
        for round_ in range(rounds):
            new = [
                NewJob(spec.name, "bench", 0, "", f"{round_}-{i}", spec.tasks) for i in range(size)
            ]
            ids = [job_id for job_id, _ in await store.submit_many(new)]
            start = time.process_time()
            moves = await move_jobs(
                store, ids, ScheduleState.WAITING, ScheduleState.LAUNCHING, assign_to="c1"
            )
            cpu["move"] += time.process_time() - start
            for status, name in ((JobStatus.STARTING, "starting"), (JobStatus.RUNNING, "running")):
                batch = [report(m.job_id, m.epoch, status) for m in moves]
                start = time.process_time()
                applied = await reports.apply("c1", batch)
                cpu[name] += time.process_time() - start
                if not all(ack.accepted for ack in applied.acks):
                    raise RuntimeError(f"a {name} report was refused: {applied.acks[0]}")
            start = time.process_time()
            await release_replica(store, "c1", ids)
            cpu["release"] += time.process_time() - start
    finally:
        await db.close()
    return {f"{name}_cpu_us": round(total / rounds / size * 1e6, 1) for name, total in cpu.items()}


async def measure(
    folder: Path, number: int, rounds: int, submitted: int, synchronous: str
) -> dict[str, object]:
    db = Database.open(f"sqlite:///{folder}/bench.db", sqlite_synchronous=synchronous)
    await db.migrate()

    def select(conn: Connection) -> None:
        conn.execute(SELECT)

    async def write(client: bool) -> None:
        await db.write(select, client=client)

    async def read() -> None:
        await db.read(select)

    raw = sqlite3.connect(folder / "bench.db", isolation_level=None)
    raw.execute(f"PRAGMA synchronous={synchronous.upper()}")

    async def sqlite3_write() -> None:
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("SELECT 1").fetchall()
        raw.execute("COMMIT")

    try:
        return {
            "synchronous": synchronous,
            "client_write_cpu_us": await best_cpu_us(lambda: write(True), number, rounds),
            "background_write_cpu_us": await best_cpu_us(lambda: write(False), number, rounds),
            "read_cpu_us": await best_cpu_us(read, number, rounds),
            "sqlite3_write_cpu_us": await best_cpu_us(sqlite3_write, number, rounds),
            "submission": await submissions(db, submitted),
        }
    finally:
        raw.close()
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=2000, help="transactions per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--submissions", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500, help="jobs per batch")
    parser.add_argument("--batch-rounds", type=int, default=6)
    parser.add_argument("--postgres", default="", help="admin URL: batches on PostgreSQL too")
    parser.add_argument("--sqlite-synchronous", default="full", choices=("full", "normal"))
    args = parser.parse_args()
    sync = args.sqlite_synchronous
    with tempfile.TemporaryDirectory() as tmp:
        probe_filesystem(Path(tmp))
        figures = asyncio.run(measure(Path(tmp), args.number, args.rounds, args.submissions, sync))
        urls = {"sqlite": f"sqlite:///{tmp}/batches.db"}
        if args.postgres:
            urls["postgres"] = postgres_database(args.postgres)
        figures["batches"] = {
            kind: asyncio.run(batches(url, args.batch, args.batch_rounds, sync))
            for kind, url in urls.items()
        }
    record("transactions", figures)


if __name__ == "__main__":
    main()
