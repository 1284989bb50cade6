"""Shared fixtures: databases (a SQLite file and the PostgreSQL server), stores, and
stubs for the end-to-end modules' `stack` (the scheduler's JobService, the sim
cloud's operator API).

PostgreSQL tests run against 127.0.0.1:5432 (override with MJ_TEST_POSTGRES_URL).
Under CI=true they never skip: an unreachable server fails them. Elsewhere they
skip with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings
from sqlalchemy import Connection

from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_service_pb2_grpc
from services.common.security.edge import ServerSecurity
from services.launcher.stack import Stack
from services.scheduler.admission import Limits
from services.scheduler.db import Database
from services.scheduler.events import EventBus
from services.scheduler.main import SchedulerApp
from services.scheduler.store import Store

POSTGRES_ADMIN_URL = os.environ.get(
    "MJ_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The databases the store's tests run on: both unless narrowed (`make test-fast`: sqlite).
DATABASES = [d for d in os.environ.get("MJ_TEST_DATABASES", "sqlite,postgres").split(",") if d]


def _admin(sql: str) -> None:
    """Runs one statement on the admin database (in a thread: a test's loop may be running)."""
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(POSTGRES_ADMIN_URL, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture(scope="session")
def postgres_base() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    name = f"mj_test_{uuid.uuid4().hex[:10]}"
    try:
        _admin(f'CREATE DATABASE "{name}"')
    except Exception as exc:  # the server is down or refuses us
        if IN_CI:
            pytest.fail(f"PostgreSQL at {POSTGRES_ADMIN_URL} is required under CI: {exc}")
        pytest.skip(f"PostgreSQL at {POSTGRES_ADMIN_URL} is not reachable: {exc}")
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=DATABASES)
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, or the session's PostgreSQL database emptied."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'scheduler.db'}"
    url: str = request.getfixturevalue("postgres_base")
    await _reset_postgres(url)
    return url


async def _reset_postgres(url: str) -> None:
    db = Database.open(url)

    def reset(conn: Connection) -> None:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")

    try:
        await db.write(reset)
    finally:
        await db.close()


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    db = Database.open(database_url)
    await db.migrate()
    yield db
    await db.close()


@pytest.fixture
async def app(database_url: str) -> AsyncIterator[SchedulerApp]:
    """A scheduler on a real port, without authentication (tests of auth start their own)."""
    scheduler = SchedulerApp(database_url, Limits(), security=ServerSecurity.without_auth())
    await scheduler.start()
    yield scheduler
    await scheduler.close()


@pytest.fixture
def bus() -> EventBus:
    return EventBus()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[Store]:
    """A store on a SQLite file of its own (`writers.db`), for what only SQLite does."""
    db = Database.open(f"sqlite:///{tmp_path / 'writers.db'}")
    await db.migrate()
    yield Store(db, EventBus())
    await db.close()


@pytest.fixture
def store(database: Database, bus: EventBus) -> Store:
    return Store(database, bus)


# Under CI, hypothesis runs the same examples every time, so a red run is reproducible;
# the fuzzers (harness/fuzzing.py `explore`) instead draw a fresh seed each run and name it.
hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
if IN_CI:
    hypothesis_settings.load_profile("ci")


@pytest.fixture(scope="module")
def jobs(stack: Stack) -> Iterator[job_service_pb2_grpc.JobServiceStub]:
    """The JobService of the module's `stack` fixture, as its admin."""
    with stack.channel(stack.scheduler_address) as channel:
        yield job_service_pb2_grpc.JobServiceStub(channel)


@pytest.fixture(scope="module")
def cloud(stack: Stack) -> Iterator[spb_grpc.SimOperatorServiceStub]:
    """The sim cloud's operator API of the module's `stack` fixture."""
    with stack.channel(stack.simcloud_address) as channel:
        yield spb_grpc.SimOperatorServiceStub(channel)
