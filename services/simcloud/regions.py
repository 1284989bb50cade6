"""Regions, their capacity, and where a launch request may go (the precheck).

Capacity is counted in nodes, per region, in two pools: spot and on-demand. A
cluster takes `num_nodes` from one pool of its region from launch until it is
preempted or terminated. Zones only place a cluster (the least loaded allowed
zone, ties in config order); they have no capacity of their own.

`candidates` turns a request into the ordered list of regions to try, or a
precheck error when no attempt could ever succeed:

- candidate regions are the request's region (or its zone's) when set, else
  every region in config order; a non-empty `candidate_regions` of the call
  keeps only those, in that order; regions not offering the accelerator and
  blocked regions are then left out;
- unknown cloud, region or zone, a zone outside the region, an accelerator no
  region offers, cpus above the cloud's maximum, or nothing left to try are
  FAILED_PRECONDITION (`PrecheckFailed`); malformed or out-of-bounds values
  (`check_shape`: names, ids, epoch, cpus, accelerator count, node count, the task's
  durations and log) are INVALID_ARGUMENT (`PrecheckInvalid`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from services.simcloud import bounds
from services.simcloud.clusters import TaskPlan
from services.simcloud.config import CloudConfig, RegionConfig
from services.simcloud.errors import PrecheckFailed, PrecheckInvalid

_CPUS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*\+?\s*$")
_MAX_ACCELERATORS = 1024


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """A launch request as the model sees it (LaunchRequest without the proto)."""

    cluster_name: str
    job_id: int
    task_id: int
    epoch: int
    cloud: str = ""
    region: str = ""
    zone: str = ""
    cpus: str = ""
    memory: str = ""
    accelerators: str = ""
    use_spot: bool = False
    num_nodes: int = 1
    candidate_regions: tuple[str, ...] = ()
    blocked_regions: tuple[str, ...] = ()
    plan: TaskPlan = dataclasses.field(default_factory=TaskPlan)


class Region:
    """One region's pools, usage and injected faults."""

    def __init__(self, config: RegionConfig, cloud: CloudConfig) -> None:
        self.config = config
        self.cloud_config = cloud
        self.name = config.name
        self.zones = config.zones
        self.accelerators = frozenset(a.lower() for a in config.accelerators)
        self.accelerator_names = config.accelerators
        self.spot_capacity = config.spot_nodes
        self.on_demand_capacity = config.on_demand_nodes
        self.spot_used = 0
        self.on_demand_used = 0
        self.launch_latency = 0.0
        self.preemptions_per_hour = 0.0
        # Simulated seconds between a spot reclaim's notice and the reclaim.
        self.notice_seconds = 0.0
        # Launch attempts still to fail (fault injection).
        self.failing_launches = 0
        self.reset_faults()
        self._zone_nodes = dict.fromkeys(config.zones, 0)

    def reset_faults(self) -> None:
        """Latency, preemption rate and notice as configured; no launch set to fail."""
        config, cloud = self.config, self.cloud_config
        self.launch_latency = (
            cloud.launch_latency_seconds
            if config.launch_latency_seconds is None
            else config.launch_latency_seconds
        )
        self.preemptions_per_hour = (
            cloud.preemptions_per_hour
            if config.preemptions_per_hour is None
            else config.preemptions_per_hour
        )
        self.notice_seconds = (
            cloud.notice_seconds if config.notice_seconds is None else config.notice_seconds
        )
        self.failing_launches = 0

    def has_room(self, spot: bool, nodes: int) -> bool:
        if spot:
            return self.spot_used + nodes <= self.spot_capacity
        return self.on_demand_used + nodes <= self.on_demand_capacity

    def pick_zone(self, allowed: tuple[str, ...]) -> str:
        return min(allowed, key=lambda zone: (self._zone_nodes[zone], allowed.index(zone)))

    def take(self, zone: str, spot: bool, nodes: int) -> None:
        self._adjust(zone, spot, nodes)

    def give(self, zone: str, spot: bool, nodes: int) -> None:
        self._adjust(zone, spot, -nodes)

    def _adjust(self, zone: str, spot: bool, nodes: int) -> None:
        if spot:
            self.spot_used += nodes
        else:
            self.on_demand_used += nodes
        self._zone_nodes[zone] += nodes


def parse_cpus(text: str) -> float | None:
    """`"4"`, `"4+"`, `"0.5"` -> the number; "" -> None.

    Raises:
        PrecheckInvalid: anything else.
    """
    if not text.strip():
        return None
    match = _CPUS_RE.match(text)
    if not match:
        raise PrecheckInvalid(
            f"resources.cpus: cannot read {bounds.quote(text)} (use e.g. 4 or 4+)",
            field="resources.cpus",
        )
    return float(match.group(1))


def parse_accelerator(text: str) -> str | None:
    """`"A100:8"` or `"A100"` -> "A100"; "" -> None.

    Raises:
        PrecheckInvalid: a missing type or a count that is not a number from 1 to 1024
            (fractions of one accelerator allowed).
    """
    if not text.strip():
        return None
    kind, _, count = text.partition(":")
    field = "resources.accelerators"
    if not kind.strip():
        raise PrecheckInvalid(f"{field}: no accelerator type in {bounds.quote(text)}", field=field)
    if count:
        try:
            number = float(count)
        except ValueError:
            number = math.nan
        if not 0 < number <= _MAX_ACCELERATORS:
            raise PrecheckInvalid(f"{field}: bad count in {bounds.quote(text)}", field=field)
    return kind.strip()


def candidates(
    spec: LaunchSpec, regions: dict[str, Region], config: CloudConfig
) -> list[tuple[Region, tuple[str, ...]]]:
    """The regions to try in order, each with its allowed zones.

    Raises:
        PrecheckFailed: a request that no region of this cloud can ever serve (its
            shape is checked first, by `check_shape`).
    """
    zone_region = {zone: r for r in regions.values() for zone in r.zones}
    if spec.cloud and spec.cloud.lower() != config.cloud.lower():
        raise PrecheckFailed(
            f"unknown cloud {bounds.quote(spec.cloud)}: this is the {config.cloud!r} cloud",
            field="cloud",
        )
    if spec.region and spec.region not in regions:
        raise PrecheckFailed(
            f"unknown region {bounds.quote(spec.region)} (regions: {', '.join(regions)})",
            field="region",
        )
    if spec.zone:
        owner = zone_region.get(spec.zone)
        if owner is None:
            raise PrecheckFailed(f"unknown zone {bounds.quote(spec.zone)}", field="zone")
        if spec.region and owner.name != spec.region:
            raise PrecheckFailed(
                f"zone {spec.zone!r} is in {owner.name}, not {spec.region}", field="zone"
            )
    pinned = spec.region or (zone_region[spec.zone].name if spec.zone else "")
    order = [regions[pinned]] if pinned else list(regions.values())
    if spec.candidate_regions:
        unknown = [name for name in spec.candidate_regions if name not in regions]
        if unknown:
            raise PrecheckFailed(
                f"unknown candidate regions {bounds.quote(unknown)}", field="candidate_regions"
            )
        allowed = {r.name for r in order}
        order = [regions[n] for n in dict.fromkeys(spec.candidate_regions) if n in allowed]
    accelerator = parse_accelerator(spec.accelerators)
    if accelerator is not None:
        offered_anywhere = any(accelerator.lower() in r.accelerators for r in regions.values())
        if not offered_anywhere:
            raise PrecheckFailed(
                f"accelerator {bounds.quote(accelerator)} is not offered by this cloud",
                field="accelerators",
            )
        order = [r for r in order if accelerator.lower() in r.accelerators]
    blocked = set(spec.blocked_regions)
    left = [r for r in order if r.name not in blocked]
    if not left:
        what = f"{accelerator} in " if accelerator and order else ""
        raise PrecheckFailed(
            f"no region can take this request: {what}candidates "
            f"{[r.name for r in order] or 'none'} minus blocked {sorted(blocked) or 'none'}",
            field="regions",
        )
    return [(r, (spec.zone,) if spec.zone else r.zones) for r in left]


def check_shape(spec: LaunchSpec, config: CloudConfig) -> None:
    """Every field of a launch within its bounds (services/simcloud/bounds.py).

    Raises:
        PrecheckInvalid: the first field out of bounds, named.
    """
    err = PrecheckInvalid
    bounds.name(spec.cluster_name, "cluster_name", error=err)
    bounds.integer(spec.job_id, "job_id", error=err)
    bounds.integer(spec.task_id, "task_id", error=err)
    bounds.integer(spec.epoch, "epoch", error=err)
    bounds.integer(spec.num_nodes, "resources.num_nodes", 1, bounds.MAX_NODES, error=err)
    for field in ("cloud", "region", "zone"):
        bounds.name(getattr(spec, field), f"resources.{field}", optional=True, error=err)
    for field in ("cpus", "memory", "accelerators"):
        bounds.text(getattr(spec, field), f"resources.{field}", error=err)
    bounds.names(spec.candidate_regions, "candidate_regions", bounds.MAX_REGION_LIST, error=err)
    bounds.names(spec.blocked_regions, "blocked_regions", bounds.MAX_REGION_LIST, error=err)
    cpus = parse_cpus(spec.cpus)
    if cpus is not None and cpus > config.max_cpus:
        raise PrecheckFailed(
            f"resources.cpus: {bounds.quote(spec.cpus)} is more than the {config.max_cpus:g} "
            "CPUs any instance of this cloud has",
            field="cpus",
        )
    parse_accelerator(spec.accelerators)
    plan = spec.plan
    bounds.number(plan.runtime, "behavior.runtime_seconds", error=err)
    bounds.number(plan.setup_seconds, "behavior.setup_seconds", error=err)
    if plan.preempt_after is not None:
        bounds.number(plan.preempt_after, "behavior.preempt_after_seconds", error=err)
    if plan.sigterm_exit is not None:
        bounds.number(plan.sigterm_exit, "behavior.sigterm_exit_seconds", error=err)
    bounds.number(plan.exit_code_runs, "behavior.exit_code_runs", 2**31 - 1, error=err)
    if plan.log_lines is not None:
        bounds.log_lines(plan.log_lines, "behavior.log_lines")
