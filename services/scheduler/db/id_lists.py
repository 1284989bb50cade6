"""`column IN (ids)` with the ids as one bound parameter: a JSON array.

SQLAlchemy's `IN` with an expanding parameter renders one placeholder per value
and processes each value in Python on every execution, so a lookup's CPU grows
with its list in Python, not only in the database; and each list length made a
statement of its own (PostgreSQL prepares each). Here the statement's text never
changes: the database unpacks the array itself, SQLite with `json_each`,
PostgreSQL with `jsonb_array_elements`, and the primary key still serves the
lookup (the store's tests check the plans).

    in_ids(JOBS.c.id, param=ids_param("ids"))                # a list bound later
    in_ids(TASKS.c.job_id, TASKS.c.task_id, values=[(1, 0)]) # values bound now

A statement that names ids given now takes them in slices (`chunked`), so that each
statement's list stays bounded whatever the number of jobs a cancel or a release
names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import BindParameter, Boolean, ColumnElement, TypeDecorator, Unicode, bindparam
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal

T = TypeVar("T")
# Ids per list given now (see `chunked`).
IN_CHUNK = 1000


class IdList(TypeDecorator[Sequence[Any]]):
    """A list of ids (or of tuples of ids), bound as the text of a JSON array."""

    impl = Unicode
    cache_ok = True

    def process_bind_param(self, value: Iterable[Any] | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return json.dumps([list(v) if isinstance(v, tuple) else v for v in value])


def ids_param(name: str) -> BindParameter[Sequence[Any]]:
    """A parameter named `name` taking a list of ids (or of tuples of ids)."""
    return bindparam(name, type_=IdList())


class InIds(ColumnElement[bool]):
    """`(columns) IN (the rows of a JSON array)`; see the module's docstring."""

    __visit_name__ = "in_ids"
    inherit_cache = True
    type = Boolean()
    # A condition in itself: never rendered as `... = 1` where booleans are integers.
    _is_implicitly_boolean = True
    _traverse_internals = [
        ("columns", InternalTraversal.dp_clauseelement_tuple),
        ("param", InternalTraversal.dp_clauseelement),
    ]

    def __init__(self, columns: tuple[ColumnElement[Any], ...], param: BindParameter[Any]):
        self.columns = columns
        self.param = param


def in_ids(
    *columns: ColumnElement[Any],
    param: BindParameter[Any] | None = None,
    values: Iterable[Any] | None = None,
) -> InIds:
    """`columns IN (...)`, the list bound through `param` (see `ids_param`) or given now
    as `values` (one id per row for one column, a tuple per row for several)."""
    if (param is None) == (values is None):
        raise TypeError("in_ids takes either a parameter or values")
    if param is None:
        param = bindparam(None, list(values or ()), type_=IdList(), unique=True)
    return InIds(tuple(columns), param)


def _parts(element: InIds, compiler: SQLCompiler, **kw: Any) -> tuple[list[str], str]:
    columns = [compiler.process(column, **kw) for column in element.columns]
    return columns, compiler.process(element.param, **kw)


@compiles(InIds, "sqlite")
def _sqlite(element: InIds, compiler: SQLCompiler, **kw: Any) -> str:
    columns, param = _parts(element, compiler, **kw)
    if len(columns) == 1:
        return f"{columns[0]} IN (SELECT value FROM json_each({param}))"
    picks = ", ".join(f"value ->> {i}" for i in range(len(columns)))
    return f"({', '.join(columns)}) IN (SELECT {picks} FROM json_each({param}))"


@compiles(InIds, "postgresql")
def _postgresql(element: InIds, compiler: SQLCompiler, **kw: Any) -> str:
    columns, param = _parts(element, compiler, **kw)
    array = f"CAST({param} AS JSONB)"
    if len(columns) == 1:
        return (
            f"{columns[0]} IN (SELECT CAST(value AS BIGINT) "
            f"FROM jsonb_array_elements_text({array}))"
        )
    picks = ", ".join(f"CAST(value ->> {i} AS BIGINT)" for i in range(len(columns)))
    return f"({', '.join(columns)}) IN (SELECT {picks} FROM jsonb_array_elements({array}))"


def chunked(items: Sequence[T], size: int = IN_CHUNK) -> list[Sequence[T]]:
    """`items` in slices of at most `size`, for lists of ids given to a statement now."""
    return [items[start : start + size] for start in range(0, len(items), size)]
