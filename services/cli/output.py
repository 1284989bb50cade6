"""Printing for people: rich tables on a terminal, plain aligned text in a pipe.

Cells are `Text`, never markup, so a value such as `1x[spot](cpus=2)` prints
as it is. Off a terminal rich prints no colours. Tables take the width they
need, as `sky jobs queue` does: a narrow terminal wraps a row rather than
cutting an id or a status short, and `grep` or `awk` always see whole rows.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

_STATUS_STYLES = {
    "SUCCEEDED": "green",
    "RUNNING": "green",
    "CANCELLED": "yellow",
    "CANCELLING": "yellow",
    "RECOVERING": "cyan",
    "STARTING": "cyan",
}
_UNBOUNDED = 100_000


def console() -> Console:
    # Never squeeze a table to the terminal: truncated ids and statuses are worse than a wrap.
    return Console(file=sys.stdout, highlight=False, width=_UNBOUNDED)


def _style(header: str, cell: str) -> str:
    if header != "STATUS":
        return ""
    return _STATUS_STYLES.get(cell, "red" if cell.startswith("FAILED") else "")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns aligned, no borders, like `sky jobs queue`; STATUS coloured on a terminal."""
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for header in headers:
        table.add_column(header, no_wrap=True)
    for row in rows:
        table.add_row(
            *(Text(cell, style=_style(h, cell)) for h, cell in zip(headers, row, strict=True))
        )
    printer = console()
    with printer.capture() as captured:
        printer.print(table)
    # rich pads the last column; trailing blanks only get in the way of `diff` and `awk`.
    lines = captured.get().splitlines()
    sys.stdout.write("".join(line.rstrip() + "\n" for line in lines))


def print_fields(fields: Sequence[tuple[str, str]]) -> None:
    """Label/value pairs, one per line, values aligned."""
    width = max((len(label) for label, _ in fields), default=0)
    for label, value in fields:
        print(f"{label + ':':<{width + 1}}  {value}")
