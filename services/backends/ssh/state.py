"""What the hosts say, as values: launches, reservations, ranks, and one cluster's
observation.

A `Launch` is one launch of a cluster (what a full handle carries). The node
script's replies are parsed here into `Reservation` (who holds a host), `HostScan`
(a host's reservation, folders and fence records) and `RankState` (one rank of one
launch), and a cluster's ranks are judged together (`judge`):

- every rank's host must still hold the launch, else the cluster is DOWN (it was
  released, terminated or replaced);
- a rank not started yet (`ready` unset) is INIT while the launch is younger than
  the launch timeout, DOWN after (its launcher died half-way);
- a rank whose runner is gone without an end time was killed: DOWN (preempted);
- otherwise UP; the task's status is the ranks' together: the end once known,
  else SETTING_UP while any rank sets up, PENDING while any has not begun,
  RUNNING otherwise.

The task's end is known once any rank failed (its setup or run exited non-zero:
FAILED_SETUP or FAILED, with that code and time), or once every rank ended with
0 (SUCCEEDED, at the last end time). It stays readable while the files remain,
even after the processes died.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from services.backends.base import ClusterHandle, ClusterStatus, Observation, TaskEnd, TaskStatus
from services.backends.ssh.hosts import Fields

BACKEND_NAME = "ssh"

# Launch keys order launches of one cluster name: epoch first, then the launcher's
# clock (one epoch is one controller's, so its clock orders its own launches).
LaunchKey = tuple[int, int]


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None and text != "-" else None
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a cluster: its pool, its id, and its hosts in rank order."""

    name: str
    pool: str
    launch: str
    epoch: int
    job: int
    hosts: tuple[str, ...]

    def handle(self) -> ClusterHandle:
        data = {"launch": self.launch, "epoch": self.epoch, "job": self.job}
        return ClusterHandle(
            self.name, BACKEND_NAME, region=self.pool, data={**data, "hosts": list(self.hosts)}
        )

    @classmethod
    def from_handle(cls, handle: ClusterHandle) -> Launch | None:
        """The launch a full handle names; None for a lazy (or unreadable) handle."""
        data = handle.data
        hosts, launch = data.get("hosts"), data.get("launch")
        if not isinstance(hosts, list) or not hosts or not isinstance(launch, str):
            return None
        epoch, job = data.get("epoch", 0), data.get("job", 0)
        if not isinstance(epoch, int) or not isinstance(job, int):
            return None
        return cls(handle.cluster_name, handle.region, launch, epoch, job, tuple(map(str, hosts)))


@dataclasses.dataclass(frozen=True)
class Reservation:
    """A host held by one launch of a cluster."""

    cluster: str
    job: int
    epoch: int
    launch: str
    started: int
    pool: str
    # Seconds since it was taken, by the host's clock.
    age: float
    ready: bool
    rank: int | None = None
    # Host ids in rank order, once the launch started the ranks.
    hosts: tuple[str, ...] = ()

    @property
    def key(self) -> LaunchKey:
        return (self.epoch, self.started)

    def launch_of(self) -> Launch | None:
        """The launch holding the host, once its ranks were placed (hosts known)."""
        if not self.hosts:
            return None
        return Launch(self.cluster, self.pool, self.launch, self.epoch, self.job, self.hosts)

    @classmethod
    def parse(cls, fields: Fields) -> Reservation:
        hosts = fields.get("hosts", "")
        return cls(
            cluster=fields.get("cluster", ""),
            job=_int(fields.get("job")),
            epoch=_int(fields.get("epoch")),
            launch=fields.get("launch", ""),
            started=_int(fields.get("started")),
            pool=fields.get("pool", ""),
            age=float(_int(fields.get("age"))),
            ready=fields.get("ready") == "1",
            rank=_int(fields["rank"]) if "rank" in fields else None,
            hosts=tuple(h for h in hosts.split(",") if h),
        )


@dataclasses.dataclass(frozen=True)
class HostScan:
    """One host's reservation, cluster folders, and what it recorded of some names."""

    reservation: Reservation | None
    folders: tuple[str, ...] = ()
    # Cluster name -> the newest launch key recorded here for it.
    fences: dict[str, LaunchKey] = dataclasses.field(default_factory=dict)
    # The highest epoch recorded here for the job asked about.
    job_epoch: int = 0
    # Cluster name -> how many of its processes run here.
    tagged: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, lines: Sequence[tuple[str, Fields]]) -> HostScan:
        reservation = None
        folders: list[str] = []
        fences: dict[str, LaunchKey] = {}
        tagged: dict[str, int] = {}
        job_epoch = 0
        for word, fields in lines:
            if word == "reservation":
                reservation = Reservation.parse(fields)
            elif word == "folder":
                folders.append(fields.get("name", ""))
            elif word == "fence" and fields.get("launch", "-") != "-":
                fences[fields["name"]] = (_int(fields.get("epoch")), _int(fields.get("started")))
            elif word == "job":
                job_epoch = _int(fields.get("epoch"))
            elif word == "tagged":
                tagged[fields.get("name", "")] = _int(fields.get("count"))
        return cls(reservation, tuple(folders), fences, job_epoch, tagged)

    def holds(self, cluster: str) -> bool:
        """Whether anything of the cluster is here: its reservation, a folder, a process."""
        return (
            (self.reservation is not None and self.reservation.cluster == cluster)
            # A folder is NAME.LAUNCH, and launch ids have no dots.
            or any(folder.rpartition(".")[0] == cluster for folder in self.folders)
            or self.tagged.get(cluster, 0) > 0
        )


@dataclasses.dataclass(frozen=True)
class RankState:
    """One rank of one launch, as its host sees it."""

    # False: the host no longer holds this launch.
    present: bool
    ready: bool = False
    alive: bool = False
    age: float = 0.0
    phase: str = "PENDING"
    setup_exit: int | None = None
    run_exit: int | None = None
    end_time: float | None = None

    @classmethod
    def parse(cls, fields: Fields) -> RankState:
        if fields.get("state") != "ours":
            return cls(present=False)
        setup_exit, run_exit = fields.get("setup_exit", "-"), fields.get("run_exit", "-")
        return cls(
            present=True,
            ready=fields.get("ready") == "1",
            alive=fields.get("alive") == "1",
            age=float(_int(fields.get("age"))),
            phase=fields.get("phase", "PENDING"),
            setup_exit=None if setup_exit == "-" else _int(setup_exit),
            run_exit=None if run_exit == "-" else _int(run_exit),
            end_time=_float(fields.get("end_time")),
        )

    @property
    def failed(self) -> bool:
        return self.end_time is not None and bool(self.setup_exit or self.run_exit)


def task_end(ranks: Sequence[RankState], complete: bool = True) -> TaskEnd | None:
    """The task's end from its ranks (see the module docstring); with `complete` False
    (some ranks unknown) only a failure is an end."""
    failures = sorted((r for r in ranks if r.failed), key=lambda r: r.end_time or 0.0)
    setup_failures = [r for r in failures if r.setup_exit]
    if setup_failures:
        first = setup_failures[0]
        assert first.end_time is not None
        return TaskEnd(TaskStatus.FAILED_SETUP, first.setup_exit, first.end_time)
    if failures:
        first = failures[0]
        assert first.end_time is not None
        return TaskEnd(TaskStatus.FAILED, first.run_exit, first.end_time)
    if complete and ranks and all(r.end_time is not None for r in ranks):
        return TaskEnd(TaskStatus.SUCCEEDED, 0, max(r.end_time or 0.0 for r in ranks))
    return None


def proves_down(rank: RankState, launch_timeout: float) -> bool:
    """Whether this rank alone shows the cluster is gone."""
    if not rank.present:
        return True
    if not rank.ready:
        return rank.age > launch_timeout
    return not rank.alive and rank.end_time is None


def judge(ranks: Sequence[RankState], launch_timeout: float) -> Observation:
    """The observation of a cluster whose every rank answered (module docstring)."""
    present = [r for r in ranks if r.present]
    end = task_end(present, complete=len(present) == len(ranks))
    if any(proves_down(r, launch_timeout) for r in ranks):
        return Observation(ClusterStatus.DOWN, None, end)
    if not all(r.ready for r in ranks):
        return Observation(ClusterStatus.INIT, None, end)
    if end is not None:
        return Observation(ClusterStatus.UP, end.status, end)
    phases = {r.phase for r in ranks if r.end_time is None}
    if "SETTING_UP" in phases:
        task = TaskStatus.SETTING_UP
    elif "PENDING" in phases:
        task = TaskStatus.PENDING
    else:
        task = TaskStatus.RUNNING
    return Observation(ClusterStatus.UP, task, None)
