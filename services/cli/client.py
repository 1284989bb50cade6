"""The client side of the API: the scheduler's JobService and SchedulerService, and LogService.

One channel per service, opened on first use (services/common/channels.py: TLS
when a CA is configured, and the caller's bearer token on every call); unary
calls carry the `--timeout` deadline, streams none (a
follow lasts as long as the job). Any failed call becomes a `ServiceError`
naming the service and the address it was reached at, so the message for a
person can say which one is down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import TracebackType

import grpc
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from managedjobs.v1 import (
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    log_service_pb2,
    log_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from services.common.channels import ClientSecurity, open_sync_channel

SCHEDULER = "scheduler"
LOGS = "logs service"
# Large pages keep a 10,000-job queue to a few round trips; the server clamps larger values.
PAGE_SIZE = 500


class ServiceError(Exception):
    """A call to `service` at `address` failed with `code`."""

    def __init__(self, service: str, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.service = service
        self.address = address
        self.code = code
        self.details = details


@contextlib.contextmanager
def _calling(service: str, address: str) -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        raise ServiceError(service, address, code, details or "") from None


SUBMIT_ATTEMPTS = 6


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    )


def _never(exc: BaseException) -> bool:
    return False


class Client:
    """Typed calls to the services; use as a context manager to close the channels."""

    def __init__(
        self,
        scheduler_address: str,
        logs_address: str,
        security: ClientSecurity,
        timeout: float,
    ) -> None:
        self.scheduler_address = scheduler_address
        self.logs_address = logs_address
        self._timeout = timeout
        self._security = security
        self._channels: dict[str, grpc.Channel] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = open_sync_channel(address, self._security)
        return self._channels[address]

    def _jobs(self) -> job_service_pb2_grpc.JobServiceStub:
        return job_service_pb2_grpc.JobServiceStub(self._channel(self.scheduler_address))

    def _scheduler(self) -> scheduler_service_pb2_grpc.SchedulerServiceStub:
        return scheduler_service_pb2_grpc.SchedulerServiceStub(
            self._channel(self.scheduler_address)
        )

    def _logs(self) -> log_service_pb2_grpc.LogServiceStub:
        return log_service_pb2_grpc.LogServiceStub(self._channel(self.logs_address))

    def submit_job(self, request: job_service_pb2.SubmitJobRequest) -> int:
        """Submits; with an idempotency key, a scheduler restarting meanwhile is ridden out
        (the key makes a repeat return the first job, never a second one)."""
        retrying = Retrying(
            retry=retry_if_exception(_transient if request.idempotency_key else _never),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            stop=stop_after_attempt(SUBMIT_ATTEMPTS),
            reraise=True,
        )
        with _calling(SCHEDULER, self.scheduler_address):
            response = retrying(self._jobs().SubmitJob, request, timeout=self._timeout)
        return response.job_id

    def submit_jobs(self, requests: list[job_service_pb2.SubmitJobRequest]) -> list[int]:
        """Submits several jobs in one call, all or none; retried like `submit_job` when
        every one of them has an idempotency key."""
        keyed = all(request.idempotency_key for request in requests)
        retrying = Retrying(
            retry=retry_if_exception(_transient if keyed else _never),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            stop=stop_after_attempt(SUBMIT_ATTEMPTS),
            reraise=True,
        )
        request = job_service_pb2.SubmitJobsRequest(jobs=requests)
        with _calling(SCHEDULER, self.scheduler_address):
            response = retrying(self._jobs().SubmitJobs, request, timeout=self._timeout)
        return list(response.job_ids)

    def get_job(self, job_id: int) -> job_pb2.Job:
        with _calling(SCHEDULER, self.scheduler_address):
            response = self._jobs().GetJob(
                job_service_pb2.GetJobRequest(job_id=job_id),
                timeout=self._timeout,
            )
        return response.job

    def list_jobs(
        self,
        statuses: Iterable[job_pb2.JobStatus.ValueType],
        user: str,
        page_size: int = PAGE_SIZE,
        limit: int | None = None,
    ) -> Iterator[job_pb2.Job]:
        """Every matching job (the first `limit` only, when given), page by page: the next
        page is asked for as soon as a page arrives, so the scheduler builds it while
        the caller works through this one."""
        stub = self._jobs()
        statuses = list(statuses)

        def ask(page_token: str = "") -> grpc.Future:
            request = job_service_pb2.ListJobsRequest(
                statuses=statuses, user=user, page_size=page_size, page_token=page_token
            )
            return stub.ListJobs.future(request, timeout=self._timeout)

        pending: grpc.Future | None = ask()
        wanted = limit
        try:
            while pending is not None:
                with _calling(SCHEDULER, self.scheduler_address):
                    response = pending.result()
                jobs = response.jobs if wanted is None else response.jobs[:wanted]
                if wanted is not None:
                    wanted -= len(jobs)
                more = response.next_page_token and (wanted is None or wanted > 0)
                pending = ask(response.next_page_token) if more else None
                yield from jobs
        finally:
            if pending is not None:
                pending.cancel()

    def cancel_jobs(self, request: job_service_pb2.CancelJobsRequest) -> list[int]:
        with _calling(SCHEDULER, self.scheduler_address):
            response = self._jobs().CancelJobs(request, timeout=self._timeout)
        return list(response.cancelled_job_ids)

    def watch_jobs(self, job_ids: Iterable[int], after_event_id: int) -> Iterator[job_pb2.JobEvent]:
        """Events after `after_event_id`, until the scheduler ends the stream.

        The scheduler may close a watch with UNAVAILABLE for the client to come
        back; when the stream had delivered events, this resumes after the last one.
        """
        job_ids = list(job_ids)
        while True:
            delivered = False
            call = self._jobs().WatchJobs(
                job_service_pb2.WatchJobsRequest(
                    job_ids=job_ids, after_event_id=after_event_id, batched=True
                ),
            )
            try:
                with _calling(SCHEDULER, self.scheduler_address):
                    for response in call:
                        for event in response.events:
                            delivered = True
                            after_event_id = event.event_id
                            yield event
                return
            except ServiceError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE or not delivered:
                    raise
            finally:
                call.cancel()

    def read_logs(self, request: log_service_pb2.ReadLogsRequest) -> Iterator[bytes]:
        """The bytes of a task's (or the controller's) log as the logs service sends them."""
        call = self._logs().ReadLogs(request)
        try:
            with _calling(LOGS, self.logs_address):
                for response in call:
                    yield response.data
        finally:
            call.cancel()

    def scheduler_state(self) -> scheduler_service_pb2.GetSchedulerStateResponse:
        with _calling(SCHEDULER, self.scheduler_address):
            return self._scheduler().GetSchedulerState(
                scheduler_service_pb2.GetSchedulerStateRequest(),
                timeout=self._timeout,
            )
