"""Which pools a launch may try, and which of their hosts fit it (the precheck).

A task asks for `cpus`, `memory` (GB) and `accelerators` per node: "4" and "4+"
both mean at least 4, since a cluster gets whole hosts; "A100:2" means a host
with at least two A100s, "A100" one. The pools to try are the plan's region
when it names one, else every pool in file order; a non-empty `candidate_regions`
keeps only those, in that order; pools with fewer fitting hosts than `num_nodes`
and blocked pools are then left out. A plan that no pool could ever serve is
a `PrecheckError`: an unknown cloud, region or candidate, a zone (pools have
none), malformed resources, or more than any pool's hosts offer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from services.backends.base import LaunchPlan, PrecheckError
from services.backends.ssh.config import Accelerators, Host, NodePool, parse_accelerators

CLOUD = "ssh"
_AT_LEAST_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:gb?)?\s*\+?\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Need:
    """What one node of a task needs from its host."""

    cpus: float | None = None
    memory: float | None = None
    accelerators: Accelerators | None = None

    def __str__(self) -> str:
        parts = []
        if self.cpus is not None:
            parts.append(f"cpus>={self.cpus:g}")
        if self.memory is not None:
            parts.append(f"memory>={self.memory:g}GB")
        if self.accelerators is not None:
            parts.append(str(self.accelerators))
        return ", ".join(parts) or "any host"


def _at_least(text: str, field: str) -> float | None:
    if not text.strip():
        return None
    match = _AT_LEAST_RE.match(text)
    if not match:
        raise PrecheckError(f"resources.{field}: cannot read {text[:200]!r} (use e.g. 4 or 4+)")
    return float(match.group(1))


def parse_need(plan: LaunchPlan) -> Need:
    """The per-node needs of a plan.

    Raises:
        PrecheckError: a malformed cpus, memory or accelerators value.
    """
    accelerators = None
    if plan.accelerators.strip():
        try:
            accelerators = parse_accelerators(plan.accelerators, "resources.accelerators")
        except ValueError as exc:
            raise PrecheckError(str(exc)) from None
    return Need(
        cpus=_at_least(plan.cpus, "cpus"),
        memory=_at_least(plan.memory, "memory"),
        accelerators=accelerators,
    )


def fits(host: Host, need: Need) -> bool:
    """Whether one node of the task fits on `host` (unknown cpus or memory fit anything)."""
    if need.cpus is not None and host.cpus is not None and host.cpus < need.cpus:
        return False
    if need.memory is not None and host.memory is not None and host.memory < need.memory:
        return False
    if need.accelerators is not None:
        offered = host.accelerators
        if offered is None or offered.kind.lower() != need.accelerators.kind.lower():
            return False
        if offered.count < need.accelerators.count:
            return False
    return True


def pools_to_try(
    pools: Mapping[str, NodePool],
    plan: LaunchPlan,
    need: Need,
) -> list[tuple[NodePool, list[Host]]]:
    """The pools to try in order, each with its hosts that fit one node.

    Raises:
        PrecheckError: the plan can never launch (see the module docstring).
    """
    if plan.cloud and plan.cloud.lower() != CLOUD:
        raise PrecheckError(f"unknown cloud {plan.cloud[:200]!r}: the ssh backend is {CLOUD!r}")
    if plan.zone:
        raise PrecheckError(f"node pools have no zones (zone {plan.zone[:200]!r})")
    if plan.num_nodes < 1:
        raise PrecheckError(f"num_nodes must be >= 1, not {plan.num_nodes}")
    if plan.region and plan.region not in pools:
        raise PrecheckError(
            f"unknown region {plan.region[:200]!r}; the node pools are {', '.join(pools)}"
        )
    order = [pools[plan.region]] if plan.region else list(pools.values())
    if plan.candidate_regions:
        unknown = [name for name in plan.candidate_regions if name not in pools]
        if unknown:
            raise PrecheckError(f"unknown candidate regions {unknown[:10]}")
        allowed = {pool.name for pool in order}
        order = [pools[name] for name in dict.fromkeys(plan.candidate_regions) if name in allowed]
    fitting = {
        pool.name: [host for host in pool.hosts if fits(host, need)] for pool in pools.values()
    }
    big_enough = [pool for pool in order if len(fitting[pool.name]) >= plan.num_nodes]
    if not any(len(hosts) >= plan.num_nodes for hosts in fitting.values()) or (
        plan.region and not big_enough
    ):
        where = f"pool {plan.region}" if plan.region else "any pool"
        raise PrecheckError(
            f"no {plan.num_nodes} host(s) of {where} could ever fit {need} per node"
        )
    blocked = set(plan.blocked_regions)
    left = [pool for pool in big_enough if pool.name not in blocked]
    if not left:
        raise PrecheckError(
            "no pool can take this request: candidates "
            f"{[p.name for p in big_enough] or 'none'} minus blocked {sorted(blocked) or 'none'}"
        )
    return [(pool, fitting[pool.name]) for pool in left]
