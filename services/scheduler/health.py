"""Database health: the scheduler serves only while its database answers (contract §16).

A probe (`SELECT 1`, every `interval` seconds) and every failed database call
feed one flag. While the database is away, grpc.health.v1 says NOT_SERVING,
client calls get UNAVAILABLE (so clients retry), reports from replicas wait and
retry instead of being refused, and leases do not run out: nothing could move
the jobs anyway. When the database is back, health says SERVING, leases restart
from that moment, and a scheduling pass runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from services.common.background import Background
from services.common.errors import ApiError, Unavailable
from services.scheduler.db import Database, OutcomeUnknown

log = logging.getLogger(__name__)
T = TypeVar("T")


# SQLSTATE classes and codes that mean the server cannot serve now: connection
# exceptions (08), and shutting down or starting up (57P01-57P03).
_UNAVAILABLE_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53300")


def _sqlstate(exc: BaseException) -> str:
    for candidate in (exc, getattr(exc, "orig", None), getattr(exc, "__cause__", None)):
        code = getattr(candidate, "sqlstate", None) or getattr(candidate, "pgcode", None)
        if isinstance(code, str):
            return code
    return ""


def is_unreachable(exc: BaseException) -> bool:
    """Whether an error means "the database cannot be reached", not "the request is bad"."""
    if isinstance(exc, OutcomeUnknown):
        return True
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if _sqlstate(exc).startswith(_UNAVAILABLE_SQLSTATES):
        return True
    return isinstance(exc, OSError | ConnectionError | TimeoutError)


def unavailable(exc: Exception) -> ApiError | None:
    """UNAVAILABLE for a database that failed, naming the failure and what became of the
    call."""
    if isinstance(exc, OutcomeUnknown):
        return Unavailable(
            f"the scheduler's database failed while committing this call ({_brief(exc)}): it "
            "may or may not have taken effect; retry it with the same idempotency_key"
        )
    if is_unreachable(exc):
        return Unavailable(
            f"the scheduler's database failed ({_brief(exc)}); nothing was changed, retry shortly"
        )
    return None


def _brief(exc: BaseException) -> str:
    """The database's own words for a failure: its first line, at most 200 characters."""
    cause = getattr(exc, "orig", None) or exc.__cause__ or exc
    text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return text[:200]


class DbHealth:
    def __init__(
        self,
        db: Database,
        on_change: Callable[[bool], Awaitable[None]],
        interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.ok = True
        self.since = clock()
        self._on_change = on_change
        self._interval = interval
        self._clock = clock
        self._back = asyncio.Event()
        self._back.set()
        self._prober = Background("db-health", self._probe)

    def start(self) -> None:
        self._prober.start()

    async def stop(self) -> None:
        await self._prober.stop()

    async def _probe(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._interval):
                    await self.db.read(lambda conn: conn.execute(text("SELECT 1")).all())
                await self._set(True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_unreachable(exc):
                    log.exception("database probe failed")
                await self._set(False)
            await asyncio.sleep(self._interval)

    async def _set(self, ok: bool) -> None:
        if ok == self.ok:
            return
        self.ok = ok
        self.since = self._clock()
        if ok:
            self._back.set()
            log.warning("database reachable again")
        else:
            self._back.clear()
            log.warning("database unreachable")
        await self._on_change(ok)

    async def failed(self, exc: BaseException) -> None:
        """Reports a database call that could not reach the database."""
        if is_unreachable(exc):
            await self._set(False)

    async def retry(self, call: Callable[[], Awaitable[T]], limit: float = 300.0) -> T:
        """Runs `call`, retrying while the database is unreachable (bounded by `limit` s)."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(is_unreachable),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(limit),
            reraise=True,
            before_sleep=lambda state: log.warning(
                "database call failed; retrying", extra={"attempt": state.attempt_number}
            ),
        ):
            with attempt:
                try:
                    return await call()
                except Exception as exc:
                    await self.failed(exc)
                    raise
        raise AssertionError("unreachable")  # AsyncRetrying either returns or raises

    async def wait_reachable(self) -> None:
        await self._back.wait()


__all__ = ["DbHealth", "is_unreachable", "unavailable"]
