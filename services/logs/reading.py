"""Reading logs: byte ranges of a file in chunks, and where its last lines begin.

Reads never hold a file open between chunks, so a log replaced whole (store.py)
meanwhile is read from its new copy on, and a missing file reads as empty.
The same tail rule serves bytes in memory (`tail_start`) and bytes on disk
(`tail_offset`): a final newline ends the last line rather than starting another.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 64 * 1024


def chunks(data: bytes) -> Iterator[bytes]:
    """`data` in pieces small enough for one message each."""
    for start in range(0, len(data), CHUNK_BYTES):
        yield data[start : start + CHUNK_BYTES]


def tail_start(data: bytes, lines: int) -> int:
    """Offset in `data` where its last `lines` lines begin (0 for all, or when `lines` <= 0)."""
    if lines <= 0:
        return 0
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        end = data.rfind(b"\n", 0, end)
        if end < 0:
            return 0
    return end + 1


def read_range(path: Path, start: int, end: int | None = None) -> Iterator[bytes]:
    """Bytes [start, end) of a file in chunks; stops early at the end of the file."""
    position = start
    while end is None or position < end:
        want = CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - position)
        try:
            with path.open("rb") as file:
                file.seek(position)
                block = file.read(want)
        except FileNotFoundError:
            return
        if not block:
            return
        position += len(block)
        yield block


def read_bytes(path: Path, start: int, end: int) -> bytes:
    return b"".join(read_range(path, start, end))


def tail_offset(path: Path, lines: int, start: int = 0, end: int | None = None) -> int:
    """Offset where the last `lines` lines of bytes [start, end) of a file begin.

    `start` when `lines` <= 0, when there are no more lines than that, or when there
    is no file; `end` defaults to the end of the file.
    """
    if lines <= 0:
        return start
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return start
    end = size if end is None else min(end, size)
    if end <= start:
        return start
    with path.open("rb") as file:
        # A final newline ends the last line rather than starting another one.
        file.seek(end - 1)
        position = end - 1 if file.read(1) == b"\n" else end
        remaining = lines
        while position > start:
            block_start = max(start, position - CHUNK_BYTES)
            file.seek(block_start)
            block = file.read(position - block_start)
            found = len(block)
            while (found := block.rfind(b"\n", 0, found)) >= 0:
                remaining -= 1
                if remaining == 0:
                    return block_start + found + 1
            position = block_start
    return start
