"""Per-object rules: a user sees, watches, cancels and reads the logs of their own jobs only.

Real scheduler and logs service in this process, with tokens for alice and bob
(users), an admin and the logs service; every call goes through the edge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from harness.identities import Identities, make_identities
from harness.inprocess import System, running_system
from managedjobs.v1 import job_pb2, job_service_pb2_grpc, log_service_pb2, log_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as pb
from services.common.channels import open_channel

SPEC = "name: {name}\nrun: echo hi\n"


class Caller:
    """One caller's stubs of JobService and LogService."""

    def __init__(self, system: System, ids: Identities, caller: str) -> None:
        self.jobs_channel = open_channel(system.scheduler, ids.client(caller, tls=False))
        self.logs_channel = open_channel(system.logs, ids.client(caller, tls=False))
        self.jobs = job_service_pb2_grpc.JobServiceStub(self.jobs_channel)
        self.logs = log_service_pb2_grpc.LogServiceStub(self.logs_channel)

    async def submit(self, name: str, user: str = "") -> int:
        request = pb.SubmitJobRequest(spec_yaml=SPEC.format(name=name), user=user)
        return int((await self.jobs.SubmitJob(request, timeout=10)).job_id)

    async def get(self, job_id: int) -> job_pb2.Job:
        return (await self.jobs.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)).job

    async def listed(self, user: str = "") -> list[tuple[int, str]]:
        reply = await self.jobs.ListJobs(pb.ListJobsRequest(user=user), timeout=10)
        return sorted((j.job_id, j.user) for j in reply.jobs)

    async def cancel(self, **fields: object) -> list[int]:
        reply = await self.jobs.CancelJobs(pb.CancelJobsRequest(**fields), timeout=10)  # type: ignore[arg-type]
        return sorted(reply.cancelled_job_ids)

    async def read_logs(self, job_id: int, follow: bool = False) -> bytes:
        request = log_service_pb2.ReadLogsRequest(job_id=job_id, controller=True, follow=follow)
        return b"".join([r.data async for r in self.logs.ReadLogs(request, timeout=10)])

    async def close(self) -> None:
        await self.jobs_channel.close()
        await self.logs_channel.close()


@pytest.fixture
async def people(tmp_path: Path) -> AsyncIterator[dict[str, Caller]]:
    ids = make_identities(tmp_path)
    async with running_system(ids, False, tmp_path) as system:
        callers = {name: Caller(system, ids, name) for name in ("user", "other user", "admin")}
        yield {"alice": callers["user"], "bob": callers["other user"], "admin": callers["admin"]}
        for caller in callers.values():
            await caller.close()


async def denied(call: object) -> error_details_pb2.ErrorInfo:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value.details()
    for key, value in caught.value.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            info = error_details_pb2.ErrorInfo()
            status_pb2.Status.FromString(value).details[0].Unpack(info)
            return info
    raise AssertionError("no ErrorInfo")


async def test_a_user_submits_as_themselves_only(people: dict[str, Caller]) -> None:
    alice, admin = people["alice"], people["admin"]
    job_id = await alice.submit("mine")
    assert (await alice.get(job_id)).user == "alice"
    assert (await denied(alice.submit("theirs", user="bob"))).reason == "USER_FORBIDDEN"
    assert await alice.submit("named", user="alice") > job_id
    # An admin may submit on someone's behalf.
    on_behalf = await admin.submit("for-bob", user="bob")
    assert (await admin.get(on_behalf)).user == "bob"


async def test_a_user_cannot_get_or_list_another_users_jobs(people: dict[str, Caller]) -> None:
    alice, bob, admin = people["alice"], people["bob"], people["admin"]
    a = await alice.submit("a")
    b = await bob.submit("b")
    assert (await denied(bob.get(a))).reason == "JOB_FORBIDDEN"
    assert (await bob.get(b)).job_id == b
    assert await bob.listed() == [(b, "bob")]
    assert (await denied(bob.listed(user="alice"))).reason == "USER_FORBIDDEN"
    assert (await admin.get(a)).user == "alice"
    assert await admin.listed() == [(a, "alice"), (b, "bob")]
    assert await admin.listed(user="alice") == [(a, "alice")]


async def test_a_user_cannot_cancel_another_users_jobs(people: dict[str, Caller]) -> None:
    alice, bob, admin = people["alice"], people["bob"], people["admin"]
    a1, a2 = await alice.submit("same"), await alice.submit("other")
    b1 = await bob.submit("same")
    await denied(bob.cancel(job_ids=[a1, b1]))
    # Refused as a whole: neither job was touched.
    assert (await alice.get(a1)).status == job_pb2.JOB_STATUS_PENDING
    assert (await bob.get(b1)).status == job_pb2.JOB_STATUS_PENDING
    await denied(bob.cancel(all=True, user="alice"))
    # By name or all: only the caller's own jobs.
    assert await bob.cancel(name="same") == [b1]
    assert (await alice.get(a1)).status == job_pb2.JOB_STATUS_PENDING
    assert await bob.cancel(all=True) == []
    assert await admin.cancel(job_ids=[a1]) == [a1]
    assert await alice.cancel(all=True) == [a2]


async def first_events(stream: AsyncIterator[pb.WatchJobsResponse], until_job: int) -> set[int]:
    """The job ids of the events streamed until the first event of `until_job`."""
    seen: set[int] = set()
    async with asyncio.timeout(10):
        async for response in stream:
            seen.add(response.event.job_id)
            if response.event.job_id == until_job:
                return seen
    raise AssertionError(f"the stream ended before job {until_job} showed up")


async def test_a_users_watch_shows_their_own_jobs_only(people: dict[str, Caller]) -> None:
    alice, bob, admin = people["alice"], people["bob"], people["admin"]
    a1 = await alice.submit("a1")
    b1 = await bob.submit("b1")
    await denied(bob.jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[a1])).read())
    bob_watch = bob.jobs.WatchJobs(pb.WatchJobsRequest())
    admin_watch = admin.jobs.WatchJobs(pb.WatchJobsRequest())
    try:
        # The backlog: bob's stream skips alice's job.
        assert await first_events(bob_watch, b1) == {b1}
        # Live events: alice's new job comes first, then bob's; bob sees only his.
        a2 = await alice.submit("a2")
        b2 = await bob.submit("b2")
        assert await first_events(bob_watch, b2) == {b2}
        assert await first_events(admin_watch, b2) == {a1, b1, a2, b2}
    finally:
        bob_watch.cancel()
        admin_watch.cancel()


async def test_only_the_owner_and_admins_read_a_jobs_logs(people: dict[str, Caller]) -> None:
    alice, bob, admin = people["alice"], people["bob"], people["admin"]
    a = await alice.submit("logged")
    assert await alice.read_logs(a) == b""
    assert await admin.read_logs(a) == b""
    assert (await denied(bob.read_logs(a))).reason == "JOB_FORBIDDEN"
    await alice.cancel(job_ids=[a])  # over, so a follow ends
    assert await alice.read_logs(a, follow=True) == b""
    await denied(bob.read_logs(a, follow=True))


async def test_submissions_and_cancels_are_audited_with_their_job_ids(
    people: dict[str, Caller], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="audit")
    alice, bob = people["alice"], people["bob"]
    job_id = await alice.submit("audited")
    with pytest.raises(grpc.aio.AioRpcError):
        await bob.cancel(job_ids=[job_id])
    assert await alice.cancel(job_ids=[job_id]) == [job_id]
    lines = [vars(r) for r in caplog.records if r.name == "audit"]
    assert [(r["user"], r["role"], r["method"].rsplit("/", 1)[1], r["job_ids"], r["code"])
            for r in lines] == [
        ("alice", "user", "SubmitJob", [job_id], "OK"),
        ("bob", "user", "CancelJobs", [job_id], "PERMISSION_DENIED"),
        ("alice", "user", "CancelJobs", [job_id], "OK"),
    ]  # fmt: skip
