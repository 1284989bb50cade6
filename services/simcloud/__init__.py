"""The sim cloud: a simulated multi-region cloud served as `mj-simcloud` (contract §10).

Regions and zones with spot and on-demand capacity, launch latency and
failures, spot preemption (seeded random or scripted), tasks whose runtime,
exit codes and log lines come from the spec's `sim` key, a watch stream of
every change, and an inventory of every cluster ever launched. No process,
thread or task per cluster: one timer heap drives them all.

Public surface: `Cloud` (the model), `CloudConfig`/`load_config`, the clocks,
`start` (an in-process server) and `list_inventory` (every inventory page).
"""

from services.simcloud.clock import ManualClock, ScaledClock
from services.simcloud.cloud import Cloud
from services.simcloud.config import DEFAULT_CONFIG, CloudConfig, ConfigError, load_config
from services.simcloud.inventory import CloudState, list_inventory
from services.simcloud.server import RunningCloud, start

__all__ = [
    "DEFAULT_CONFIG",
    "Cloud",
    "CloudConfig",
    "CloudState",
    "ConfigError",
    "ManualClock",
    "RunningCloud",
    "ScaledClock",
    "list_inventory",
    "load_config",
    "start",
]
