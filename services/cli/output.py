"""Printing for people: aligned tables, coloured statuses on a terminal, plain in a pipe.

Cells are printed as they are (a value such as `1x[spot](cpus=2)` is never read as
markup). Tables take the width they need, as `sky jobs queue` does: a narrow
terminal wraps a row rather than cutting an id or a status short, and `grep` or
`awk` always see whole rows.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_STATUS_STYLES = {
    "SUCCEEDED": "green",
    "RUNNING": "green",
    "CANCELLED": "yellow",
    "CANCELLING": "yellow",
    "RECOVERING": "cyan",
    "STARTING": "cyan",
}
_ANSI = {"green": "32", "yellow": "33", "cyan": "36", "red": "31"}


def _style(header: str, cell: str) -> str:
    if header != "STATUS":
        return ""
    return _STATUS_STYLES.get(cell, "red" if cell.startswith("FAILED") else "")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns aligned, no borders, like `sky jobs queue`; STATUS coloured on a terminal.

    Laid out here, not by a table library, whose layout costs seconds for a queue of
    tens of thousands of rows: each column as wide as its widest cell, two spaces
    between columns, no trailing blanks (they only get in the way of `diff` and `awk`).
    """
    widths = [max(map(len, column)) for column in zip(headers, *rows, strict=True)]
    if not sys.stdout.isatty():
        # Plain: one format for every line (a queue may have tens of thousands).
        template = "  ".join([*(f"{{:<{width}}}" for width in widths[:-1]), "{}"])
        lines = [template.format(*headers), *(template.format(*row) for row in rows)]
        sys.stdout.write("".join(text.rstrip() + "\n" for text in lines))
        return
    status = headers.index("STATUS") if "STATUS" in headers else -1
    last = len(headers) - 1

    def line(cells: Sequence[str], header: bool = False) -> str:
        parts = []
        for index, cell in enumerate(cells):
            padded = cell if index == last else cell.ljust(widths[index])
            if header:
                padded = f"\x1b[1m{padded}\x1b[0m"
            elif index == status and (style := _style("STATUS", cell)):
                padded = f"\x1b[{_ANSI[style]}m{padded}\x1b[0m"
            parts.append(padded)
        return "  ".join(parts).rstrip() + "\n"

    sys.stdout.write(line(headers, header=True) + "".join(line(row) for row in rows))


def print_fields(fields: Sequence[tuple[str, str]]) -> None:
    """Label/value pairs, one per line, values aligned."""
    width = max((len(label) for label, _ in fields), default=0)
    for label, value in fields:
        print(f"{label + ':':<{width + 1}}  {value}")
