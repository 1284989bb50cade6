"""Rows a transaction reads, changes in Python and writes back: plain values, not ORM objects.

A batch of reports reads the jobs, tasks and attempts it touches up front, changes
them report by report, and writes back what changed (`batch_rows.py`). Through the ORM
that cost most of a batch's time: building an object per row, and the unit of work
that finds each changed attribute and writes each row with a statement of its own.
A `Tracked` row is its columns' values and the names of those that changed;
`write_back` writes every changed row with one prebuilt UPDATE (by primary key) per
table and set of changed columns, and new rows with one INSERT per table, each run
once for many rows.

Nothing else sees a tracked row's changes until they are written back: whoever runs
a statement that may read or move such a row in the same transaction writes back
first (as the ORM flushed before every statement), and the store's transaction
writes back before its events and its commit (`txn.Txn.track`, `Txn.write_back`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, Insert, Result, Table, Update, bindparam, insert, update


def values_of(result: Result[Any]) -> list[dict[str, Any]]:
    """A result's rows as plain values, its column names read once for them all
    (`Row._asdict` builds them again for every row)."""
    keys = list(result.keys())
    return [dict(zip(keys, row, strict=True)) for row in result]


class Tracked:
    """A row as plain values; assigning a column a different value marks it changed."""

    __slots__ = ("_changed", "_new", "_table", "_values")

    def __init__(self, table: Table, values: dict[str, Any], new: bool = False) -> None:
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_changed", set())
        object.__setattr__(self, "_new", new)

    @classmethod
    def new(cls, table: Table, **values: Any) -> Tracked:
        """A row to insert: the columns not given take their defaults (or NULL)."""
        row = {c.name: _default(c) for c in table.columns if not c.name.startswith("_")}
        row.update(values)
        return cls(table, row, new=True)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{self._table.name} has no column {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        values = self._values
        if name not in values:
            raise AttributeError(f"{self._table.name} has no column {name!r}")
        if values[name] != value:
            values[name] = value
            self._changed.add(name)


def _default(column: Any) -> Any:
    default = column.default
    return default.arg if default is not None and default.is_scalar else None


def write_back(connection: Connection, rows: Iterable[Tracked | None]) -> None:
    """Writes the new and changed ones of `rows` in `connection`'s transaction; they are then
    as stored (unchanged, not new)."""
    inserts: dict[Table, list[dict[str, Any]]] = {}
    updates: dict[tuple[Table, tuple[str, ...]], list[dict[str, Any]]] = {}
    for row in rows:
        if row is None or not (row._new or row._changed):
            continue
        table = row._table
        if row._new:
            inserts.setdefault(table, []).append(dict(row._values))
        else:
            columns = tuple(sorted(row._changed))
            params = {f"pk_{c.name}": row._values[c.name] for c in table.primary_key}
            params.update((f"v_{name}", row._values[name]) for name in columns)
            updates.setdefault((table, columns), []).append(params)
        object.__setattr__(row, "_new", False)
        row._changed.clear()
    for table, values in inserts.items():
        connection.execute(_insert(table), values)
    for (table, columns), changes in updates.items():
        connection.execute(_update(table, columns), changes)


@functools.cache
def _insert(table: Table) -> Insert:
    return insert(table)


@functools.cache
def _update(table: Table, columns: tuple[str, ...]) -> Update:
    """UPDATE of `columns` of one row of `table`, by primary key (parameters `pk_<key>`,
    `v_<column>`: a bound parameter may not be named as a column it sets)."""
    return (
        update(table)
        .where(*(c == bindparam(f"pk_{c.name}") for c in table.primary_key))
        .values({name: bindparam(f"v_{name}") for name in columns})
    )
