"""The sim cloud's configuration: regions, zones, capacity, latency, preemption, time.

A config is YAML (see examples/simcloud.yaml); without one the cloud is
`DEFAULT_CONFIG`, three regions with room for a few hundred nodes each:

    cloud: sim                    # the only `resources.cloud` accepted besides ""
    seed: 0                       # seeds the one random.Random (preemption times)
    time_scale: 1.0               # simulated seconds per real second
    max_cpus: 64                  # `resources.cpus` above this is a precheck failure
    launch_latency_seconds: 2     # simulated seconds from Launch to UP (per region too)
    preemptions_per_hour: 0       # random preemptions per spot-cluster-hour (per region too)
    notice_seconds: 0             # a spot reclaim is announced this long ahead (per region too;
                                  # AWS gives 120, GCP 30; 0: no notice)
    event_buffer: 100000          # events kept for WatchEvents resume (after_seq)
    regions:                      # tried in this order when the request names none
      - name: us-east-1
        zones: [us-east-1a, us-east-1b]
        spot_nodes: 200           # the spot pool, counted in nodes
        on_demand_nodes: 200      # the on-demand pool
        accelerators: [A100, H100]
        launch_latency_seconds: 2 # optional, overrides the cloud's
        preemptions_per_hour: 0   # optional, overrides the cloud's
        notice_seconds: 120       # optional, overrides the cloud's

Invariants: region and zone names are unique across the cloud and are names the API
accepts (1-128 characters of [A-Za-z0-9._-]), every region has at least one zone,
capacities and durations are not negative and within the API's bounds
(services/simcloud/bounds.py), time_scale is positive.
Unknown keys are errors naming their path, as in job specs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from services.common.bounds import CLOUD_NAME_RE, CLOUD_NAME_RULE
from services.simcloud import bounds

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot describe a cloud; the message names the field path."""


@dataclasses.dataclass(frozen=True)
class RegionConfig:
    name: str
    zones: tuple[str, ...]
    spot_nodes: int = 200
    on_demand_nodes: int = 200
    accelerators: tuple[str, ...] = ()
    # None: the cloud's value.
    launch_latency_seconds: float | None = None
    preemptions_per_hour: float | None = None
    notice_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class CloudConfig:
    regions: tuple[RegionConfig, ...]
    cloud: str = "sim"
    seed: int = 0
    time_scale: float = 1.0
    max_cpus: float = 64.0
    launch_latency_seconds: float = 2.0
    preemptions_per_hour: float = 0.0
    notice_seconds: float = 0.0
    event_buffer: int = 100_000

    def __post_init__(self) -> None:
        _validate(self)

    def with_overrides(
        self, seed: int | None = None, time_scale: float | None = None
    ) -> CloudConfig:
        """This config with the seed and time scale given on the command line, if any."""
        changes: dict[str, Any] = {}
        if seed is not None:
            changes["seed"] = seed
        if time_scale is not None:
            changes["time_scale"] = time_scale
        return dataclasses.replace(self, **changes)


def _validate(config: CloudConfig) -> None:
    if not config.regions:
        raise ConfigError("regions: a cloud needs at least one region")
    if not (config.time_scale > 0 and math.isfinite(config.time_scale)):
        raise ConfigError(f"time_scale: must be a positive number, got {config.time_scale}")
    if config.event_buffer < 1:
        raise ConfigError(f"event_buffer: must be at least 1, got {config.event_buffer}")
    _non_negative(config.max_cpus, "max_cpus")
    for field, high in _TIMED.items():
        _bounded(getattr(config, field), field, high)
    seen: set[str] = set()
    for index, region in enumerate(config.regions):
        path = f"regions[{index}]"
        if not region.zones:
            raise ConfigError(f"{path}.zones: a region needs at least one zone")
        for name in (region.name, *region.zones):
            if not CLOUD_NAME_RE.fullmatch(name):
                raise ConfigError(
                    f"{path}: region and zone names are {CLOUD_NAME_RULE}, got {bounds.quote(name)}"
                )
            if name in seen:
                raise ConfigError(f"{path}: {name!r} is declared twice")
            seen.add(name)
        _non_negative(region.spot_nodes, f"{path}.spot_nodes")
        _non_negative(region.on_demand_nodes, f"{path}.on_demand_nodes")
        for field, high in _TIMED.items():
            value = getattr(region, field)
            if value is not None:
                _bounded(value, f"{path}.{field}", high)


# Per-cloud settings a region may override, with their upper bounds.
_TIMED = {
    "launch_latency_seconds": bounds.MAX_SECONDS,
    "preemptions_per_hour": bounds.MAX_RATE,
    "notice_seconds": bounds.MAX_SECONDS,
}


def _non_negative(value: float, path: str) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{path}: must be a finite number >= 0, got {value}")


def _bounded(value: float, path: str, high: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= high):
        raise ConfigError(f"{path}: must be a finite number from 0 to {high:g}, got {value}")


DEFAULT_CONFIG = CloudConfig(
    regions=(
        RegionConfig("us-east-1", ("us-east-1a", "us-east-1b"), accelerators=("A100", "H100")),
        RegionConfig("us-west-2", ("us-west-2a", "us-west-2b"), accelerators=("A100",)),
        RegionConfig("eu-west-1", ("eu-west-1a", "eu-west-1b"), accelerators=("A100", "V100")),
    )
)


def _typed(kind: type[T] | tuple[type, ...], what: str) -> Callable[[object, str], Any]:
    def convert(value: object, path: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{path}: expected {what}, got {type(value).__name__}")
        return value

    return convert


def _names(value: object, path: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: expected a list of strings")
    return tuple(value)


_number = _typed((int, float), "a number")
_REGION_FIELDS: dict[str, Callable[[object, str], Any]] = {
    "name": _typed(str, "a string"),
    "zones": _names,
    "spot_nodes": _typed(int, "an integer"),
    "on_demand_nodes": _typed(int, "an integer"),
    "accelerators": _names,
    "launch_latency_seconds": _number,
    "preemptions_per_hour": _number,
    "notice_seconds": _number,
}
_CLOUD_FIELDS: dict[str, Callable[[object, str], Any]] = {
    "cloud": _typed(str, "a string"),
    "seed": _typed(int, "an integer"),
    "time_scale": _number,
    "max_cpus": _number,
    "launch_latency_seconds": _number,
    "preemptions_per_hour": _number,
    "notice_seconds": _number,
    "event_buffer": _typed(int, "an integer"),
    "regions": lambda value, path: value,
}


def _fields(
    raw: object, table: Mapping[str, Callable[[object, str], Any]], path: str
) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        field = f"{path}.{key}" if path else str(key)
        if key not in table:
            raise ConfigError(f"{field}: unknown field (allowed: {', '.join(table)})")
        out[key] = table[key](value, field)
    return out


def parse_config(text: str) -> CloudConfig:
    """Parses a YAML config.

    Raises:
        ConfigError: invalid YAML, unknown fields, wrong types or impossible values.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}") from None
    fields = _fields(raw or {}, _CLOUD_FIELDS, "")
    raw_regions = fields.pop("regions", None)
    if not isinstance(raw_regions, list):
        raise ConfigError("regions: expected a list of regions")
    regions = []
    for index, raw_region in enumerate(raw_regions):
        path = f"regions[{index}]"
        region = _fields(raw_region, _REGION_FIELDS, path)
        if "name" not in region:
            raise ConfigError(f"{path}.name: required")
        region.setdefault("zones", (f"{region['name']}a",))
        regions.append(RegionConfig(**region))
    return CloudConfig(regions=tuple(regions), **fields)


def load_config(path: str | Path | None) -> CloudConfig:
    """The config at `path`, or `DEFAULT_CONFIG` when no path is given."""
    if not path:
        return DEFAULT_CONFIG
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return parse_config(text)
