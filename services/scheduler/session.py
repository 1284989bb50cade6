"""A transaction's statements, run as SQLAlchemy Core on its one connection.

Everything the scheduler asks of the database is Core: statements on the tables'
columns with bound parameters, their rows read as plain values. SQLAlchemy's ORM
session adds nothing to that and costs on every statement (its transaction
states, its connection lookup, its result wrapping) and on every transaction (a
close of its own): a statement of one row cost ~70 us through `AsyncSession`
against ~35 us straight on the connection, on SQLite on a 2-core machine.

A `Session` runs each statement on the connection's synchronous core. On the
event loop's own SQLite connections (`sqlite_inline`), whose driver calls never
wait for anything, it runs on the spot; on the others (SQLite's worker thread,
asyncpg) in a greenlet that awaits the driver, as SQLAlchemy's asyncio extension
runs them, but in one kept for the next call (`greenlets.py`). Rows are fetched
by the driver as the statement runs, so a result is read after without awaiting.
"""

from __future__ import annotations

from typing import Any, TypeVarTuple, overload

from sqlalchemy import Executable, Result, ScalarResult
from sqlalchemy.engine import Connection
from sqlalchemy.sql.selectable import TypedReturnsRows

from services.scheduler.greenlets import run

Parameters = dict[str, Any] | list[dict[str, Any]] | None
Ts = TypeVarTuple("Ts")


class Session:
    def __init__(self, connection: Connection, inline: bool) -> None:
        self._connection = connection
        self._inline = inline

    @overload
    async def execute(
        self, statement: TypedReturnsRows[*Ts], parameters: Parameters = None
    ) -> Result[*Ts]: ...

    @overload
    async def execute(
        self, statement: Executable, parameters: Parameters = None
    ) -> Result[*tuple[Any, ...]]: ...

    async def execute(
        self, statement: Executable, parameters: Parameters = None
    ) -> Result[*tuple[Any, ...]]:
        if self._inline:
            return self._connection.execute(statement, parameters)
        return await run(self._connection.execute, statement, parameters)

    async def scalars(
        self, statement: Executable, parameters: Parameters = None
    ) -> ScalarResult[Any]:
        return (await self.execute(statement, parameters)).scalars()

    async def scalar(self, statement: Executable, parameters: Parameters = None) -> Any:
        return (await self.execute(statement, parameters)).scalar()
