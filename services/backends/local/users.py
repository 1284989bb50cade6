"""Confinement of user code on the local backend (contract §14 "User code").

A task's setup and run are code from whoever submitted the job, so the local
backend never runs them with the service's privileges. When the service runs as
root:
- Every cluster gets a uid of its own, handed out from `--run-as-uids` (a range
  no account uses) under the clusters root's lock, skipping the uids of every
  cluster folder that still exists. The ranks run as that uid, with the primary
  group of the `--run-as` user (created with useradd when missing) and no
  supplementary groups.
- The cluster folder and the clusters root are root's, mode 0711: a rank can
  reach its own folder but list or write neither. Only `workdir/` and `home/`
  (HOME) belong to the cluster's uid, mode 0700, so no other cluster can enter
  them. task.json, status.json, the logs and the fence are root's: code can
  neither forge its task's end nor another replica's epoch. The supervisor stays
  root and writes the logs through file descriptors the ranks inherit.
- So a rank cannot write the data dir, the database, the fence, its own status
  or another cluster's folder, and cannot signal another cluster's processes;
  teardown finds every process of the cluster by its uid, however it escaped.
When the service is not root it cannot change users: code runs as the service's
own user, and only the workdir check below and HOME inside the cluster hold.

Whatever the user, `workdir` must resolve (after `~` and symlinks) under one of
`--workdir-roots`, so a spec cannot have the service copy `/etc` or `../..` into
a cluster. A relative workdir is refused: `mj` makes it absolute before submitting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from services.backends.base import PrecheckError, ResourcesUnavailableError
from services.backends.local.cluster import write_atomic

DEFAULT_RUN_AS = "mj-run"
DEFAULT_RUN_AS_UIDS = "200000-299999"
_MAX_QUOTE = 200
# What useradd accepts as a user name.
_USER_NAME_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def parse_uid_range(text: str) -> range:
    """Parses `FIRST-LAST` (inclusive) into the range of uids clusters may use.

    Raises:
        ValueError: not two numbers, in order, within 1000 .. 2**32 - 2.
    """
    first, sep, last = text.strip().partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        raise ValueError(
            f"run_as_uids must look like 200000-299999, not {text[:_MAX_QUOTE]!r}"
        ) from None
    if not sep or low < 1000 or high < low or high > 2**32 - 2:
        raise ValueError(
            f"run_as_uids {text[:_MAX_QUOTE]!r} must be FIRST-LAST with 1000 <= FIRST <= LAST"
        )
    return range(low, high + 1)


def uid_range_setting(text: str) -> str:
    """The `run_as_uids` setting's type: checks the text, keeps it as it is."""
    try:
        parse_uid_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def run_as_setting(text: str) -> str:
    """The `run_as` setting's type: a user name useradd would accept."""
    if not _USER_NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"run_as {text[:_MAX_QUOTE]!r} is not a user name")
    return text


def parse_workdir_roots(text: str) -> tuple[Path, ...]:
    """Parses a colon-separated list of folders; empty means the current folder."""
    parts = [part for part in text.split(":") if part.strip()]
    return tuple(Path(part).expanduser() for part in parts) or (Path.cwd(),)


@dataclasses.dataclass(frozen=True)
class RunAs:
    """Who a cluster's code runs as; recorded in task.json as `run_as`."""

    user: str
    uid: int
    gid: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Confinement:
    """The users, uids and workdir roots user code is confined to on this host."""

    def __init__(
        self,
        run_as: str = DEFAULT_RUN_AS,
        uids: range = parse_uid_range(DEFAULT_RUN_AS_UIDS),
        workdir_roots: Sequence[Path] | None = None,
        *,
        privileged: bool | None = None,
    ) -> None:
        """Describes the confinement; changes nothing on the host yet.

        Args:
            run_as: The user whose primary group the clusters' uids get.
            uids: The uids handed out, one per cluster.
            workdir_roots: Folders a workdir must be under (default: the current one).
            privileged: Whether users can be changed (default: running as root).

        Raises:
            ValueError: `run_as` is not a user name.
        """
        try:
            run_as_setting(run_as)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        self.run_as = run_as
        self.uids = uids
        roots = workdir_roots if workdir_roots is not None else (Path.cwd(),)
        self.workdir_roots = tuple(Path(root).expanduser().resolve() for root in roots)
        self.privileged = os.geteuid() == 0 if privileged is None else privileged
        self._gid: int | None = None

    def resolve_workdir(self, workdir: str) -> Path | None:
        """The folder to copy into a cluster, after checking it is under a root.

        Raises:
            PrecheckError: relative, outside every root, or not a folder.
        """
        if not workdir:
            return None
        quoted = repr(workdir[:_MAX_QUOTE])
        path = Path(workdir).expanduser()
        if not path.is_absolute():
            raise PrecheckError(f"workdir {quoted} is relative; it must be an absolute path")
        resolved = path.resolve()
        if not any(resolved.is_relative_to(root) for root in self.workdir_roots):
            roots = ":".join(str(root) for root in self.workdir_roots)
            raise PrecheckError(
                f"workdir {quoted} is outside the workdir roots {roots} "
                "(--workdir-roots, MJ_WORKDIR_ROOTS)"
            )
        if not resolved.is_dir():
            raise PrecheckError(f"workdir {quoted} is not an existing directory")
        return resolved

    def group(self) -> int:
        """The run-as user's primary gid; creates the user when missing.

        Blocking: call from a thread, under the clusters root's lock (so replicas
        do not race to create it).

        Raises:
            PrecheckError: the user is missing and cannot be created.
        """
        if self._gid is None:
            try:
                self._gid = pwd.getpwnam(self.run_as).pw_gid
            except KeyError:
                self._gid = _create_user(self.run_as)
        return self._gid

    def allocate(self, used: Collection[int], next_file: Path) -> RunAs | None:
        """Who the next cluster runs as: a free uid of the range, or None if unprivileged.

        Blocking: call from a thread, under the clusters root's lock, with `used`
        the uids of every cluster folder that exists. The search starts after the
        last uid handed out (kept in `next_file`), so a uid is reused as late as
        possible.

        Raises:
            ResourcesUnavailableError: every uid of the range is in use.
        """
        if not self.privileged:
            return None
        gid = self.group()
        try:
            start = int(next_file.read_text())
        except (OSError, ValueError):
            start = self.uids.start
        size = len(self.uids)
        offset = (start - self.uids.start) % size
        for step in range(size):
            uid = self.uids[(offset + step) % size]
            if uid not in used:
                write_atomic(next_file, f"{uid + 1}\n".encode())
                return RunAs(self.run_as, uid, gid)
        raise ResourcesUnavailableError(
            f"all {size} uids of run_as_uids are in use by local clusters",
            regions_tried=["local"],
        )


def give_to(path: Path, run_as: RunAs | None) -> None:
    """Makes `path` (a folder, recursively) the cluster's own: its uid, mode 0700."""
    if run_as is not None:
        for parent, dirs, files in os.walk(path):
            os.lchown(parent, run_as.uid, run_as.gid)
            for name in (*dirs, *files):
                os.lchown(os.path.join(parent, name), run_as.uid, run_as.gid)
    path.chmod(0o700)


def _create_user(name: str) -> int:
    useradd = shutil.which("useradd")
    if useradd is None:
        raise PrecheckError(f"the run-as user {name!r} does not exist and useradd is missing")
    nologin = shutil.which("nologin") or "/bin/false"
    done = subprocess.run(
        [useradd, "--system", "--user-group", "--no-create-home"]
        + ["--home-dir", "/nonexistent", "--shell", nologin, name],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        # Another host process may have created it meanwhile: then useradd failed.
        return pwd.getpwnam(name).pw_gid
    except KeyError:
        raise PrecheckError(
            f"cannot create the run-as user {name!r}: {done.stderr.strip()[:_MAX_QUOTE]}"
        ) from None
