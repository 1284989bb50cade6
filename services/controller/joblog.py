"""Talking to the logs service: lifecycle log lines and log fetches before teardown.

Lifecycle lines are buffered and shipped in batches by one background task, so
a job's `note` never waits on the network. A job that finishes waits, at most
`SHIP_WAIT` seconds, until the lines noted so far are shipped (`shipped`): many
jobs finishing together share the same shipments instead of queueing behind
each other. A fetch is retried a few times; if the logs service stays away the
teardown goes ahead (the job must not leak a cluster because logs could not be
saved), and the lifecycle log says so. Fetches asked for at once (many jobs ending
together, e.g. cancelled together) go as one BatchFetchTaskLogs call, each
answered on its own.

Every line and fetch carries the job's epoch: the logs service takes them only
from the replica holding the job at that epoch. Lines it refuses (the job moved
to another replica meanwhile) are dropped, never retried: no retry could make
them acceptable, and a batch stuck on them would hold back every other job's.
Lines are cut to `MAX_LINE_CHARS` characters so no line can get a batch refused.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import grpc

from managedjobs.v1 import log_service_pb2 as pb
from managedjobs.v1 import log_service_pb2_grpc
from services.backends import ClusterHandle
from services.common.background import Background
from services.common.bounds import MAX_FETCH_BATCH, MAX_LOG_LINE_BYTES
from services.common.channels import ClientSecurity, open_channel
from services.common.coalesce import Coalescer

log = logging.getLogger(__name__)

BATCH_LINES = 500
FETCH_ATTEMPTS = 3
SHIP_WAIT = 2.0
# Within the service's bound on a line's bytes (MAX_LOG_LINE_BYTES) even at 4 bytes a character.
MAX_LINE_CHARS = MAX_LOG_LINE_BYTES // 4 - 64
# Answers that say the request itself is wrong: retrying the same one cannot help.
_FINAL = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


_CODES = {code.name: code for code in grpc.StatusCode}


class FetchFailed(Exception):
    """A fetch the logs service refused or could not do."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class LogsClient:
    def __init__(self, address: str, security: ClientSecurity, flush_interval: float = 0.2) -> None:
        self.address = address
        self._channel = open_channel(address, security)
        self._stub = log_service_pb2_grpc.LogServiceStub(self._channel)
        self._lines: list[pb.ControllerLogLine] = []
        # Lines noted and lines shipped (or given up on) since start, for `shipped`.
        self._noted = 0
        self._done = 0
        self._progressed = asyncio.Event()
        self._wake = asyncio.Event()
        self._flush_interval = flush_interval
        self._shipper = Background("controller-log-shipper", self._ship)
        # One shipment at a time, so that a flush waits for lines already in flight.
        self._flushing = asyncio.Lock()
        # Fetches asked for at once (many jobs ending together) go as one call.
        self._fetches: Coalescer[None, pb.FetchTaskLogsRequest, None] = Coalescer(
            self._fetch_batch, max_batch=MAX_FETCH_BATCH
        )

    def start(self) -> None:
        self._shipper.start()

    def note(self, job_id: int, epoch: int, message: str) -> None:
        """Queues a lifecycle line of a job held at `epoch`."""
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        if len(message) > MAX_LINE_CHARS:
            message = message[:MAX_LINE_CHARS] + " [cut]"
        line = f"{stamp} {message}\n"
        self._lines.append(pb.ControllerLogLine(job_id=job_id, line=line, epoch=epoch))
        self._noted += 1
        self._wake.set()

    async def shipped(self, job_id: int | None = None, timeout: float = SHIP_WAIT) -> bool:
        """Waits until every line noted so far is shipped; False after `timeout` seconds
        (`job_id`: the job waiting, named in the warning)."""
        target = self._noted
        self._wake.set()

        async def reached() -> None:
            while self._done < target:
                await self._progressed.wait()

        try:
            await asyncio.wait_for(reached(), timeout)
        except TimeoutError:
            log.warning("lifecycle log lines not shipped in time", extra={"job_id": job_id})
            return False
        return True

    async def _ship(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
            await asyncio.sleep(self._flush_interval)

    async def flush(self) -> None:
        """Ships every line noted so far; returns once they are stored (or shipping failed)."""
        async with self._flushing:
            await self._ship_pending()

    async def _ship_pending(self) -> None:
        while self._lines:
            batch, self._lines = self._lines[:BATCH_LINES], self._lines[BATCH_LINES:]
            try:
                response = await self._stub.AppendControllerLogs(
                    pb.AppendControllerLogsRequest(lines=batch), timeout=10
                )
            except grpc.aio.AioRpcError as error:
                if error.code() in _FINAL:
                    log.warning(
                        "lifecycle log lines refused",
                        extra={"code": error.code().name, "error": error.details()},
                    )
                    self._advance(len(batch))
                    continue
                # Keep the lines for the next try; drop the oldest past a bound.
                kept = (batch + self._lines)[-100_000:]
                self._advance(len(batch) + len(self._lines) - len(kept))
                self._lines = kept
                log.warning("cannot ship lifecycle logs", extra={"code": error.code().name})
                return
            for refused in response.refused:
                log.info(
                    "lifecycle log lines refused",
                    extra={"job_id": refused.job_id, "code": refused.code},
                )
            self._advance(len(batch))

    def _advance(self, count: int) -> None:
        if not count:
            return
        self._done += count
        # Wake every waiter once; later waiters wait on a fresh event.
        self._progressed.set()
        self._progressed = asyncio.Event()

    async def fetch(
        self, job_id: int, task_id: int, epoch: int, handle: ClusterHandle, attempt: int
    ) -> bool:
        """Has the logs service copy an attempt's logs off the cluster; False if it could not.

        Args:
            job_id: The job, held by this replica at `epoch`.
            task_id: The task whose cluster `handle` is.
            epoch: The job's assignment epoch.
            handle: The cluster, about to be torn down.
            attempt: Which attempt of the task ran on it (1, then one more per recovery
                or restart).
        """
        request = pb.FetchTaskLogsRequest(
            job_id=job_id,
            task_id=task_id,
            cluster_name=handle.cluster_name,
            handle_json=handle.to_json(),
            epoch=epoch,
            attempt=attempt,
        )
        for tries in range(1, FETCH_ATTEMPTS + 1):
            try:
                await self._fetches.call(None, request)
                return True
            except FetchFailed as failed:
                log.warning(
                    "log fetch failed",
                    extra={
                        "job_id": job_id,
                        "attempt": attempt,
                        "try": tries,
                        "code": failed.code.name,
                        "error": failed.message,
                    },
                )
                if failed.code in _FINAL:
                    return False
                await asyncio.sleep(0.5 * tries)
        return False

    async def _fetch_batch(
        self, _: None, fetches: list[pb.FetchTaskLogsRequest]
    ) -> list[BaseException | None]:
        """One BatchFetchTaskLogs call; each failed fetch as its own `FetchFailed`."""
        try:
            reply = await self._stub.BatchFetchTaskLogs(
                pb.BatchFetchTaskLogsRequest(fetches=fetches), timeout=60
            )
        except grpc.aio.AioRpcError as error:
            raise FetchFailed(error.code(), error.details() or "") from error
        return [
            FetchFailed(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message)
            if result.code
            else None
            for result in reply.results
        ]

    async def close(self) -> None:
        await self._shipper.stop()
        await self.flush()
        await self._channel.close()
