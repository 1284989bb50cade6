"""One service of a stack as a process, and whether it is ready.

`Service` starts a service's process with its own argv, environment and log file,
and stops it (SIGTERM, then SIGKILL after a timeout). The reliability tests break a
stack one process at a time through it: kill (SIGKILL), pause and resume (SIGSTOP,
SIGCONT), restart with the same arguments.

A service is ready once it reports SERVING on grpc.health.v1 (`wait_serving`). A
process that exits instead fails at once (`StackError`), with its exit code and the
last line of its log: its own error.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import ClientSecurity, open_sync_channel


class StackError(RuntimeError):
    """A service of the stack exited while the stack was starting; the message ends with
    the service's own last line (its error)."""


def last_line(path: Path, limit: int = 8192) -> str:
    """The last non-empty line of a log file (its tail only is read)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, path.stat().st_size - limit))
            lines = file.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def wait_serving(
    address: str, timeout: float = 30.0, security: ClientSecurity | None = None
) -> None:
    """Blocks until the server at `address` reports SERVING on grpc.health.v1."""
    deadline = time.monotonic() + timeout
    with open_sync_channel(address, security or ClientSecurity()) as channel:
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
    security: ClientSecurity = dataclasses.field(default_factory=ClientSecurity)

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

    def failure(self) -> str:
        """Why the process is gone: its exit code and its last line ("" while it runs)."""
        if self.process is None or self.running:
            return ""
        return f"{self.name} exited with {self.process.returncode}: {last_line(self.log_path)}"

    def serving(self) -> bool:
        """Whether the service answers SERVING now (one short health check)."""
        try:
            wait_serving(self.address, 0.2, self.security)
        except TimeoutError:
            return False
        return True

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Blocks until the service reports SERVING.

        Raises:
            StackError: its process exited first (with its last line).
            TimeoutError: it did not become healthy in `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                raise StackError(f"{self.failure()} (log: {self.log_path})")
            try:
                wait_serving(
                    self.address,
                    min(1.0, max(0.1, deadline - time.monotonic())),
                    self.security,
                )
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
