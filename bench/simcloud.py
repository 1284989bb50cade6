"""Benchmark: the sim cloud's launch throughput and its memory at 20,000 live clusters.

Starts `mj-simcloud` as its own process (as in production), launches N clusters
(default 20,000) with day-long runtimes through the Launch RPC, many at a time
(bounded) as an admin with a bearer token (security on, as in production), and
reports launch calls per second. Then, with every cluster live,
reads the process's RSS with psutil. Launch latency is 0 in the bench's config,
so the figure is what the API and the model can take, not how long a simulated
provision lasts. Records one JSON line with the figures and the machine
(`results.py`); stops the cloud afterwards.

    python bench/simcloud.py [--clusters 20000] [--concurrency 256]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from harness.bench.results import record
from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.common.channels import ClientSecurity, open_channel, open_sync_channel
from services.common.security.auth import Role, add_token
from services.launcher.ports import free_port
from services.launcher.service import wait_serving

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
seed: 1
time_scale: 1
launch_latency_seconds: 0
regions:
  - {name: us-east-1, zones: [us-east-1a, us-east-1b], spot_nodes: 10000, on_demand_nodes: 10000}
  - {name: us-west-2, zones: [us-west-2a, us-west-2b], spot_nodes: 10000, on_demand_nodes: 10000}
  - {name: eu-west-1, zones: [eu-west-1a, eu-west-1b], spot_nodes: 10000, on_demand_nodes: 10000}
"""


async def launch_all(
    address: str, security: ClientSecurity, clusters: int, concurrency: int
) -> float:
    """Launches every cluster; returns the seconds it took."""
    async with open_channel(address, security) as channel:
        stub = pb_grpc.SimCloudServiceStub(channel)
        await stub.ListRegions(pb.ListRegionsRequest(), timeout=10)
        behavior = pb.TaskBehavior(runtime_seconds=86_400.0)
        next_index = iter(range(clusters))

        async def worker() -> None:
            for index in next_index:
                request = pb.LaunchRequest(
                    cluster_name=f"mj-{index + 1}-0",
                    job_id=index + 1,
                    task_id=0,
                    epoch=1,
                    resources=pb.Resources(use_spot=index % 2 == 0),
                    behavior=behavior,
                )
                await stub.Launch(request, timeout=60)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def cloud_state(address: str, security: ClientSecurity) -> pb.GetCloudStateResponse:
    with open_sync_channel(address, security) as channel:
        stub = pb_grpc.SimOperatorServiceStub(channel)
        reply: pb.GetCloudStateResponse = stub.GetCloudState(pb.GetCloudStateRequest(), timeout=60)
        return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clusters", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args()
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "simcloud.yaml"
        config.write_text(CONFIG)
        security = ClientSecurity.of(add_token(Path(tmp) / "tokens.yaml", "bench", Role.ADMIN))
        log = (Path(tmp) / "simcloud.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.simcloud.main", "--port", address.split(":")[1]]
            + ["--config", str(config), "--log-level", "WARNING", "--data-dir", tmp],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_serving(address, timeout=30)
            cloud = psutil.Process(proc.pid)
            rss_idle = cloud.memory_info().rss
            seconds = asyncio.run(launch_all(address, security, args.clusters, args.concurrency))
            state = cloud_state(address, security)
            rss_live = cloud.memory_info().rss
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    if state.live_clusters != args.clusters:
        raise SystemExit(f"expected {args.clusters} live clusters, not {state.live_clusters}")
    record(
        "simcloud",
        {
            "live_clusters": state.live_clusters,
            "launch_calls_per_second": round(args.clusters / seconds, 1),
            "launch_seconds": round(seconds, 2),
            "concurrency": args.concurrency,
            "rss_mb_idle": round(rss_idle / 2**20, 1),
            "rss_mb_at_live_clusters": round(rss_live / 2**20, 1),
            "rss_kb_per_cluster": round((rss_live - rss_idle) / 1024 / args.clusters, 2),
            "events": state.head_seq,
        },
    )


if __name__ == "__main__":
    main()
