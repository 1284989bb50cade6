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
  FAILED_PRECONDITION (`PrecheckFailed`); malformed values (name, cpus,
  accelerator count, node count) are INVALID_ARGUMENT (`PrecheckInvalid`).
"""

from __future__ import annotations

import dataclasses
import re

from services.simcloud.clusters import TaskPlan
from services.simcloud.config import CloudConfig, RegionConfig
from services.simcloud.errors import PrecheckFailed, PrecheckInvalid

CLUSTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CPUS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*\+?\s*$")


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
    accelerators: str = ""
    use_spot: bool = False
    num_nodes: int = 1
    candidate_regions: tuple[str, ...] = ()
    blocked_regions: tuple[str, ...] = ()
    plan: TaskPlan = dataclasses.field(default_factory=TaskPlan)


class Region:
    """One region's pools, usage and injected faults."""

    def __init__(self, config: RegionConfig, cloud: CloudConfig) -> None:
        self.name = config.name
        self.zones = config.zones
        self.accelerators = frozenset(a.lower() for a in config.accelerators)
        self.accelerator_names = config.accelerators
        self.spot_capacity = config.spot_nodes
        self.on_demand_capacity = config.on_demand_nodes
        self.spot_used = 0
        self.on_demand_used = 0
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
        # Launch attempts still to fail (fault injection).
        self.failing_launches = 0
        self._zone_nodes = dict.fromkeys(config.zones, 0)

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
        raise PrecheckInvalid(f"resources.cpus: cannot read {text!r} (use e.g. 4 or 4+)")
    return float(match.group(1))


def parse_accelerator(text: str) -> str | None:
    """`"A100:8"` or `"A100"` -> "A100"; "" -> None.

    Raises:
        PrecheckInvalid: a missing type or a count that is not a positive number.
    """
    if not text.strip():
        return None
    kind, _, count = text.partition(":")
    if not kind.strip():
        raise PrecheckInvalid(f"resources.accelerators: no accelerator type in {text!r}")
    if count:
        try:
            valid = float(count) > 0
        except ValueError:
            valid = False
        if not valid:
            raise PrecheckInvalid(f"resources.accelerators: bad count in {text!r}")
    return kind.strip()


def candidates(
    spec: LaunchSpec, regions: dict[str, Region], config: CloudConfig
) -> list[tuple[Region, tuple[str, ...]]]:
    """The regions to try in order, each with its allowed zones.

    Raises:
        PrecheckInvalid: a malformed request.
        PrecheckFailed: a request that no region of this cloud can ever serve.
    """
    _check_shape(spec, config)
    zone_region = {zone: r for r in regions.values() for zone in r.zones}
    if spec.cloud and spec.cloud.lower() != config.cloud.lower():
        raise PrecheckFailed(
            f"unknown cloud {spec.cloud!r}: this is the {config.cloud!r} cloud", field="cloud"
        )
    if spec.region and spec.region not in regions:
        raise PrecheckFailed(
            f"unknown region {spec.region!r} (regions: {', '.join(regions)})", field="region"
        )
    if spec.zone:
        owner = zone_region.get(spec.zone)
        if owner is None:
            raise PrecheckFailed(f"unknown zone {spec.zone!r}", field="zone")
        if spec.region and owner.name != spec.region:
            raise PrecheckFailed(
                f"zone {spec.zone!r} is in {owner.name}, not {spec.region}", field="zone"
            )
    pinned = spec.region or (zone_region[spec.zone].name if spec.zone else "")
    order = [regions[pinned]] if pinned else list(regions.values())
    if spec.candidate_regions:
        unknown = [name for name in spec.candidate_regions if name not in regions]
        if unknown:
            raise PrecheckFailed(f"unknown candidate regions {unknown}", field="candidate_regions")
        allowed = {r.name for r in order}
        order = [regions[n] for n in dict.fromkeys(spec.candidate_regions) if n in allowed]
    accelerator = parse_accelerator(spec.accelerators)
    if accelerator is not None:
        offered_anywhere = any(accelerator.lower() in r.accelerators for r in regions.values())
        if not offered_anywhere:
            raise PrecheckFailed(
                f"accelerator {accelerator!r} is not offered by this cloud", field="accelerators"
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


def _check_shape(spec: LaunchSpec, config: CloudConfig) -> None:
    if not CLUSTER_NAME_RE.fullmatch(spec.cluster_name):
        raise PrecheckInvalid(f"invalid cluster name {spec.cluster_name!r}", field="cluster_name")
    if spec.num_nodes < 1:
        raise PrecheckInvalid(f"num_nodes must be >= 1, not {spec.num_nodes}", field="num_nodes")
    cpus = parse_cpus(spec.cpus)
    if cpus is not None and cpus > config.max_cpus:
        raise PrecheckFailed(
            f"resources.cpus: {spec.cpus} is more than the {config.max_cpus:g} CPUs "
            "any instance of this cloud has",
            field="cpus",
        )
    plan = spec.plan
    durations = [("runtime_seconds", plan.runtime), ("setup_seconds", plan.setup_seconds)]
    if plan.preempt_after is not None:
        durations.append(("preempt_after_seconds", plan.preempt_after))
    for name, value in durations:
        if not value >= 0 or value == float("inf"):
            raise PrecheckInvalid(f"sim.{name} must be a finite number >= 0, not {value}")
