"""Database health: an unreachable database is noticed, reported and retried, not crashed on."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from services.common.errors import Unavailable
from services.scheduler.db import Database
from services.scheduler.health import DbHealth, is_unreachable, unavailable

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/nothing"


async def test_probe_reports_an_unreachable_database() -> None:
    changes: list[bool] = []
    noticed = asyncio.Event()

    async def changed(ok: bool) -> None:
        changes.append(ok)
        noticed.set()

    db = Database.open(UNREACHABLE)
    health = DbHealth(db, changed, interval=0.05)
    health.start()
    try:
        await asyncio.wait_for(noticed.wait(), 5)
    finally:
        await health.stop()
        await db.close()
    assert changes == [False]
    assert not health.ok


async def test_probe_reports_a_reachable_database(database: Database) -> None:
    changes: list[bool] = []
    back = asyncio.Event()

    async def changed(ok: bool) -> None:
        changes.append(ok)
        if ok:
            back.set()

    health = DbHealth(database, changed, interval=0.05)
    await health.failed(OperationalError("SELECT 1", {}, Exception("gone")))
    assert changes == [False]
    health.start()
    try:
        await asyncio.wait_for(back.wait(), 5)
    finally:
        await health.stop()
    assert changes == [False, True]


async def test_retry_waits_for_the_database_and_gives_up_when_bounded() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))
        return "ok"

    async def changed(ok: bool) -> None:
        return None

    db = Database.open(UNREACHABLE)
    health = DbHealth(db, changed)
    assert await health.retry(flaky) == "ok"
    assert calls == 3

    async def never() -> str:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))

    with pytest.raises(OperationalError):
        await health.retry(never, limit=0.2)
    await db.close()


def test_unreachable_means_unavailable_and_bad_requests_do_not() -> None:
    refused = OperationalError("SELECT 1", {}, ConnectionRefusedError("refused"))
    assert is_unreachable(refused)
    assert isinstance(unavailable(refused), Unavailable)
    duplicate = IntegrityError("INSERT", {}, Exception("unique"))
    assert not is_unreachable(duplicate)
    assert unavailable(duplicate) is None


def test_a_server_starting_up_or_shutting_down_is_unreachable() -> None:
    import asyncpg  # type: ignore[import-untyped]
    from sqlalchemy.exc import DBAPIError

    for error in (
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.AdminShutdownError("terminating connection"),
    ):
        wrapped = DBAPIError("SELECT 1", {}, error)
        assert is_unreachable(wrapped), error
        assert isinstance(unavailable(wrapped), Unavailable)
    unique = DBAPIError("INSERT", {}, asyncpg.exceptions.UniqueViolationError("dup"))
    assert not is_unreachable(unique)
