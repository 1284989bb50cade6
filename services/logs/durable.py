"""Putting files in place whole and durable: written aside, synced, then renamed over.

A file is written to `<name>.tmp`, synced to disk, then `os.replace`d over its old
copy, so a reader or a crash sees the old or the new copy whole. Files that go
together (a task log and its index) are put in place in their order, after all of
them are synced; a group that fails leaves no temporary file and fails alone.

On Linux a trip of several groups is synced with one `syncfs` of the filesystem
holding them: a new file's fsync also makes its folder's entry durable (a journal
commit on ext4, a write of each parent folder without a journal), a cost paid once
per file that one syncfs pays once per trip. (It also writes out whatever else on
that filesystem waits to be: give the logs a filesystem of their own where that
matters.) Where syncfs is missing or fails, every file is fsynced alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# Groups in one trip from which the trip syncs the filesystem once instead of each file.
SYNC_AT_ONCE = 4

# A file to write whole: its path and bytes.
File = tuple[Path, bytes]


def put_in_place(
    root: str, groups: Sequence[list[File] | BaseException]
) -> list[BaseException | None]:
    """Writes each group of files under `root` and puts them in place; each failure its own.

    A group given as an exception (its files could not be made) is that group's
    outcome. All files are written first and synced after, with one syncfs where
    it can be. Temporary names are fixed (`<name>.tmp`): the caller writes a path
    from one writer at a time.
    """
    filesystem = _filesystem_of(root) if len(groups) >= SYNC_AT_ONCE else None
    try:
        return _write_and_sync(groups, filesystem)
    finally:
        if filesystem is not None:
            os.close(filesystem)


def _write_and_sync(
    groups: Sequence[list[File] | BaseException], filesystem: int | None
) -> list[BaseException | None]:
    outcomes: list[BaseException | None] = [None] * len(groups)
    staged: list[tuple[int, list[File]]] = []
    for number, files in enumerate(groups):
        if isinstance(files, BaseException):
            outcomes[number] = files
            continue
        try:
            for file_path, body in files:
                file_path.parent.mkdir(parents=True, exist_ok=True)
                _temp(file_path).write_bytes(body)
            staged.append((number, files))
        except Exception as error:  # a file that cannot be written
            outcomes[number] = error
            _discard(files)
    synced = filesystem is not None and _syncfs is not None and _syncfs(filesystem) == 0
    for number, files in staged:
        try:
            if not synced:
                for path, _ in files:
                    _fsync(_temp(path))
            for path, _ in files:
                os.replace(_temp(path), path)
        except OSError as error:
            outcomes[number] = error
            _discard(files)
    return outcomes


def _temp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _load_syncfs() -> Callable[[int], int] | None:
    """Linux's syncfs(2) from the C library, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    syncfs.argtypes = [ctypes.c_int]
    syncfs.restype = ctypes.c_int
    return syncfs


_syncfs = _load_syncfs()


def _filesystem_of(path: str) -> int | None:
    """A descriptor to syncfs the filesystem holding `path` by, or None where there is no
    syncfs. Open it before writing: syncfs reports the write-back errors since then."""
    if _syncfs is None:
        return None
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(files: list[File]) -> None:
    for path, _ in files:
        _temp(path).unlink(missing_ok=True)
