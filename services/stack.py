"""Starts the whole system on this host: scheduler, controller replicas and logs.

`python -m services.stack` (what `make up` runs) starts a scheduler, two
controller replicas and the logs service as separate processes, with SQLite
under the data dir and the local backend, and stops them all on Ctrl-C. With
`--backend sim` it first starts `mj-simcloud` (on port 50071, with
`--simcloud-config` if given) and runs the controllers and logs on the sim
backend; with `--backend ssh --ssh-node-pools FILE` they run on the hosts of
that node pools file. The end-to-end tests start the same topology through `Stack`
(`simcloud_args` not None: with a sim cloud; `database_url`: on PostgreSQL), and
the reliability tests break it one process at a time through `Service`: kill
(SIGKILL), pause and resume (SIGSTOP, SIGCONT), restart with the same arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.backends.ssh.config import NodePool, load_node_pools


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(address: str, timeout: float = 30.0) -> None:
    """Blocks until the server at `address` reports SERVING on grpc.health.v1."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy in {timeout:.0f}s")
            time.sleep(0.1)


@dataclasses.dataclass
class Service:
    """One service process: started, signalled, stopped and restarted with the same argv."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    address: str = ""
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited (a paused one is running)."""
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Blocks until the service reports SERVING; raises if its process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                code = self.process.returncode if self.process is not None else None
                raise RuntimeError(f"{self.name} exited with {code}; see {self.log_path}")
            try:
                wait_serving(self.address, min(1.0, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} at {self.address} did not become healthy in {timeout:.0f}s"
                    ) from None

    def kill(self) -> None:
        """SIGKILL: the process dies at once, with no chance to hand anything back."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the process stays alive but does nothing (as a long GC pause or a VM stall)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        self.signal(signal.SIGCONT)

    def restart(self, timeout: float = 30.0, kill: bool = False) -> None:
        """Stops the process (SIGTERM, or SIGKILL with `kill`) and starts it again, serving."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()
        if self.address:
            self.wait_serving(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        # A paused process handles SIGTERM only once it runs again.
        self.signal(signal.SIGCONT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait()


class Stack:
    """The topology of SPEC §13 as local processes, on the ports given or free ones."""

    def __init__(
        self,
        data_dir: Path,
        replicas: int = 2,
        scheduler_port: int = 0,
        logs_port: int = 0,
        controller_ports: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
        controller_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        simcloud_args: Sequence[str] | None = None,
        simcloud_port: int = 0,
        database_url: str = "",
        ssh_node_pools: str = "",
    ) -> None:
        self.data_dir = data_dir.resolve()
        base = dict(os.environ if env is None else env)
        base.setdefault("MJ_DATA_DIR", str(self.data_dir))
        base.setdefault("PYTHONUNBUFFERED", "1")
        self.env = base
        self.scheduler_address = f"127.0.0.1:{scheduler_port or free_port()}"
        self.logs_address = f"127.0.0.1:{logs_port or free_port()}"
        py = [sys.executable, "-m"]
        logs_dir = self.data_dir / "service-logs"
        # With a sim cloud, controllers and logs use the sim backend pointed at it.
        self.simcloud: Service | None = None
        self.simcloud_address = ""
        backend_env: dict[str, str] = {}
        if simcloud_args is not None:
            self.simcloud_address = f"127.0.0.1:{simcloud_port or free_port()}"
            cloud_port = self.simcloud_address.split(":")[1]
            self.simcloud = Service(
                "simcloud",
                [*py, "services.simcloud.main", "--port", cloud_port, *simcloud_args],
                base,
                logs_dir / "simcloud.log",
                self.simcloud_address,
            )
            backend_env = {"MJ_BACKEND": "sim", "MJ_SIMCLOUD_ADDRESS": self.simcloud_address}
        elif ssh_node_pools:
            # Controllers and logs on the hosts of a node pools file (the ssh backend).
            pools = str(Path(ssh_node_pools).expanduser().resolve())
            backend_env = {"MJ_BACKEND": "ssh", "MJ_SSH_NODE_POOLS": pools}
        # A database URL (PostgreSQL for several replicas); empty: SQLite in the data dir.
        self.database_url = database_url
        database = ["--database-url", database_url] if database_url else []
        self.scheduler = Service(
            "scheduler",
            [*py, "services.scheduler.main", "--port", self.scheduler_address.split(":")[1]]
            + database
            + list(scheduler_args),
            base,
            logs_dir / "scheduler.log",
            self.scheduler_address,
        )
        self.logs = Service(
            "logs",
            [*py, "services.logs.main", "--port", self.logs_address.split(":")[1]],
            {**base, **backend_env, "MJ_SCHEDULER_ADDRESS": self.scheduler_address},
            logs_dir / "logs.log",
            self.logs_address,
        )
        self.controllers: list[Service] = []
        for index in range(replicas):
            port = controller_ports[index] if index < len(controller_ports) else free_port()
            self.controllers.append(
                Service(
                    f"controller-{index + 1}",
                    [*py, "services.controller.main", "--port", str(port)]
                    + ["--controller-id", f"controller-{index + 1}", *controller_args],
                    {
                        **base,
                        **backend_env,
                        "MJ_SCHEDULER_ADDRESS": self.scheduler_address,
                        "MJ_LOGS_ADDRESS": self.logs_address,
                    },
                    logs_dir / f"controller-{index + 1}.log",
                    f"127.0.0.1:{port}",
                )
            )

    @property
    def services(self) -> list[Service]:
        cloud = [self.simcloud] if self.simcloud is not None else []
        return [*cloud, self.scheduler, self.logs, *self.controllers]

    def service(self, name: str) -> Service:
        """The service of this name: "scheduler", "logs", "simcloud" or "controller-N"."""
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(f"no service named {name!r}")

    def exited(self) -> list[Service]:
        """Services whose process was started and has exited."""
        return [s for s in self.services if s.process is not None and not s.running]

    def start(self, timeout: float = 30.0) -> None:
        if self.simcloud is not None:
            self.simcloud.start()
            wait_serving(self.simcloud.address, timeout)
        self.scheduler.start()
        wait_serving(self.scheduler_address, timeout)
        for service in [self.logs, *self.controllers]:
            service.start()
        for service in [self.logs, *self.controllers]:
            wait_serving(service.address, timeout)

    def stop(self) -> None:
        # Replicas first, so that they hand their jobs back to a live scheduler.
        for service in [*self.controllers, self.logs, self.scheduler]:
            service.stop()
        # The cloud last: replicas tear clusters down through it until they stop.
        if self.simcloud is not None:
            self.simcloud.stop()

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", default=os.environ.get("MJ_DATA_DIR", ".mj"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--poll-interval", default=os.environ.get("MJ_POLL_INTERVAL", "1"))
    parser.add_argument(
        "--backend",
        choices=["local", "sim", "ssh"],
        default=os.environ.get("MJ_BACKEND", "local"),
        help="local: processes on this host; sim: start mj-simcloud and use it; "
        "ssh: the hosts of --ssh-node-pools",
    )
    parser.add_argument(
        "--ssh-node-pools",
        default=os.environ.get("MJ_SSH_NODE_POOLS", ""),
        help="ssh_node_pools.yaml of the ssh backend (env MJ_SSH_NODE_POOLS)",
    )
    parser.add_argument(
        "--simcloud-config",
        default=os.environ.get("MJ_SIMCLOUD_CONFIG", ""),
        help="YAML config of the sim cloud (default: its built-in three regions)",
    )
    args = parser.parse_args(argv)
    simcloud_args: list[str] | None = None
    pools: dict[str, NodePool] = {}
    if args.backend == "sim":
        simcloud_args = ["--config", args.simcloud_config] if args.simcloud_config else []
    if args.backend == "ssh":
        if not args.ssh_node_pools:
            parser.error("--backend ssh needs --ssh-node-pools FILE (or MJ_SSH_NODE_POOLS)")
        try:
            pools = load_node_pools(args.ssh_node_pools)
        except ValueError as exc:
            parser.error(str(exc))
    stack = Stack(
        Path(args.data_dir),
        replicas=args.replicas,
        scheduler_port=50051,
        logs_port=50052,
        controller_ports=[50061 + i for i in range(args.replicas)],
        controller_args=["--poll-interval", str(args.poll_interval)],
        simcloud_args=simcloud_args,
        simcloud_port=50071,
        ssh_node_pools=args.ssh_node_pools if args.backend == "ssh" else "",
    )
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    stack.start()
    if stack.simcloud is not None:
        print(f"simcloud   {stack.simcloud_address}")
    if args.backend == "ssh":
        print(f"ssh pools  {', '.join(f'{p.name} ({len(p.hosts)} hosts)' for p in pools.values())}")
    print(f"scheduler  {stack.scheduler_address}")
    print(f"logs       {stack.logs_address}")
    for service in stack.controllers:
        print(f"{service.name:<10} {service.address}")
    print(f"data dir   {stack.data_dir}  (service logs in {stack.data_dir / 'service-logs'})")
    print("try: mj launch examples/hello.yaml   (Ctrl-C stops everything)")
    try:
        while not stopping:
            for service in stack.services:
                if service.process is not None and service.process.poll() is not None:
                    print(f"{service.name} exited with {service.process.returncode}; stopping")
                    stopping = True
            time.sleep(0.5)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
