"""The whole system on one host as processes: `Stack`, the topology of contract §13.

A stack is a scheduler, controller replicas (two by default) and the logs service,
each a separate process (`Service`), with SQLite under the data dir and the local
backend. `simcloud_args` not None starts `mj-simcloud` first and runs the
controllers and logs on the sim backend; `ssh_node_pools` runs them on the hosts of
that node pools file; `database_url` puts the scheduler on that database
(PostgreSQL for several replicas). `make up` (main.py) and the end-to-end tests
start the same topology through it, with security on (credentials.py). Tests talk
to a stack through `credentials.client_security`, `channel()` and `client_env()`.

Starting fails fast (contract §19): a service that exits while the stack starts (a bad
setting: an unknown backend, an unreadable config, a port another process holds)
is reported at once with its own error line, and every service already started is
stopped, so nothing is left running for the next `make up` to trip over.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from services.common.channels import open_sync_channel
from services.launcher.credentials import LOGS_SERVICE, make_credentials
from services.launcher.ports import free_port
from services.launcher.service import Service, StackError


class Stack:
    """The topology of contract §13 as local processes, on the ports given or free ones."""

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
        auth: bool = True,
        tls: bool = False,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ if env is None else env)
        base.setdefault("MJ_DATA_DIR", str(self.data_dir))
        base.setdefault("PYTHONUNBUFFERED", "1")
        self.env = base
        controller_ids = [f"controller-{index + 1}" for index in range(replicas)]
        self.credentials = make_credentials(self.data_dir, controller_ids, auth, tls)
        # With a sim cloud, controllers and logs use the sim backend pointed at it.
        self.simcloud: Service | None = None
        self.simcloud_address = ""
        backend_env: dict[str, str] = {}
        if simcloud_args is not None:
            self.simcloud = self._service(
                "simcloud", "services.simcloud.main", simcloud_port, list(simcloud_args)
            )
            self.simcloud_address = self.simcloud.address
            backend_env = {"MJ_BACKEND": "sim", "MJ_SIMCLOUD_ADDRESS": self.simcloud_address}
        elif ssh_node_pools:
            # Controllers and logs on the hosts of a node pools file (the ssh backend).
            pools = str(Path(ssh_node_pools).expanduser().resolve())
            backend_env = {"MJ_BACKEND": "ssh", "MJ_SSH_NODE_POOLS": pools}
        # A database URL (PostgreSQL for several replicas); empty: SQLite in the data dir.
        self.database_url = database_url
        database = ["--database-url", database_url] if database_url else []
        self.scheduler = self._service(
            "scheduler",
            "services.scheduler.main",
            scheduler_port,
            [*database, *scheduler_args],
        )
        self.scheduler_address = self.scheduler.address
        to_scheduler = {**backend_env, "MJ_SCHEDULER_ADDRESS": self.scheduler_address}
        self.logs = self._service(LOGS_SERVICE, "services.logs.main", logs_port, env=to_scheduler)
        self.logs_address = self.logs.address
        self.controllers = [
            self._service(
                controller_id,
                "services.controller.main",
                controller_ports[index] if index < len(controller_ports) else 0,
                ["--controller-id", controller_id, *controller_args],
                {**to_scheduler, "MJ_LOGS_ADDRESS": self.logs_address},
            )
            for index, controller_id in enumerate(controller_ids)
        ]

    def _service(
        self,
        name: str,
        module: str,
        port: int,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Service:
        """The service `name`, `python -m module` on `port` (0: a free one), with its own
        security settings and its log under the data dir."""
        port = port or free_port()
        return Service(
            name,
            [sys.executable, "-m", module, "--port", str(port), *args],
            {**self.env, **(env or {}), **self.credentials.service_env[name]},
            self.data_dir / "service-logs" / f"{name}.log",
            f"127.0.0.1:{port}",
            security=self.credentials.probe_security,
        )

    def client_env(self) -> dict[str, str]:
        """Variables that point `mj` at this stack; it finds the admin token in the data dir."""
        return {
            "MJ_SCHEDULER_ADDRESS": self.scheduler_address,
            "MJ_LOGS_ADDRESS": self.logs_address,
            "MJ_DATA_DIR": str(self.data_dir),
            **self.credentials.client_env(),
        }

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to one of the stack's servers, as the admin."""
        return open_sync_channel(address, self.credentials.client_security)

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
        """Starts the services in order (the cloud, the scheduler, then the rest together),
        each group serving before the next starts.

        Fails fast: as soon as any started process exits, every service started so far
        is stopped and `StackError` names the one that exited with its own last line
        (e.g. `controller-1 exited with 2: mj-controller: error: argument --backend:
        ...`). Nothing of the stack is left running when this raises.

        Raises:
            StackError: a service exited while starting.
            TimeoutError: a service did not become healthy in `timeout` seconds.
        """
        cloud = [self.simcloud] if self.simcloud is not None else []
        try:
            for group in ([*cloud], [self.scheduler], [self.logs, *self.controllers]):
                for service in group:
                    service.start()
                self._wait_serving(group, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, group: Sequence[Service], timeout: float) -> None:
        """Waits until every service of `group` serves, checking every started process."""
        deadline = time.monotonic() + timeout
        waiting = list(group)
        while waiting:
            for service in self.services:
                failure = service.failure()
                if failure:
                    raise StackError(f"{failure} (log: {service.log_path})")
            waiting = [service for service in waiting if not service.serving()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(service.name for service in waiting)
                raise TimeoutError(f"{names} did not become healthy in {timeout:.0f}s")

    def stop(self) -> None:
        """Stops every service started (each at most once; one never started is skipped)."""
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
