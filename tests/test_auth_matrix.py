"""The auth matrix (contract §16), generated from the one policy table.

Every RPC of every service (scheduler, a controller replica, logs, sim cloud; real
servers in this process) x every caller (no token, unknown token, user, other user,
admin, controller, service) x {plaintext, TLS with mTLS}: the expected status of
each cell follows from `access.POLICY` alone, and every cell is asserted.

- no token, unknown token: UNAUTHENTICATED;
- a role the table does not list for the method: PERMISSION_DENIED;
- a listed role: anything but those two, with a minimal valid request. The
  requests name job 1, which belongs to the "user" caller (alice), so the "other
  user" (bob) gets PERMISSION_DENIED from the per-object rules of the methods
  that act on a given job (`OWNED_BY_USER`). Job 1 is assigned to no replica, so
  the controller passes the edge on the logs RPCs replicas call and is then
  refused by their per-object rule (`HELD_BY_REPLICA`: PERMISSION_DENIED with
  reason JOB_NOT_HELD, never the edge's ROLE_FORBIDDEN).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message, message_factory
from google.rpc import error_details_pb2, status_pb2
from identities import CALLERS, REGISTERED, Identities, make_identities
from inprocess import System, running_system
from rpcs import JOB_SPEC, REQUESTS, method_descriptor

from managedjobs.v1 import job_service_pb2
from services.common.access import POLICY, Rule, render_policy, service_of
from services.common.channels import open_channel

ROOT = Path(__file__).resolve().parent.parent
OWNED_BY_USER = {
    "/managedjobs.v1.JobService/GetJob",
    "/managedjobs.v1.JobService/CancelJobs",
    "/managedjobs.v1.JobService/WatchJobs",
    "/managedjobs.v1.LogService/ReadLogs",
}
HELD_BY_REPLICA = {
    "/managedjobs.v1.LogService/FetchTaskLogs",
    "/managedjobs.v1.LogService/AppendControllerLogs",
}
DENIED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
ALLOWED = "allowed"
NOT_HELD = "JOB_NOT_HELD"


def expected(method: str, rule: Rule, caller: str) -> grpc.StatusCode | str:
    if caller not in REGISTERED:
        return grpc.StatusCode.UNAUTHENTICATED
    role = REGISTERED[caller][1]
    if role not in rule.roles:
        return grpc.StatusCode.PERMISSION_DENIED
    if caller == "other user" and method in OWNED_BY_USER:
        return grpc.StatusCode.PERMISSION_DENIED
    if method in HELD_BY_REPLICA:
        return NOT_HELD
    return ALLOWED


async def call(
    channel: grpc.aio.Channel, method: str, request: message.Message
) -> tuple[grpc.StatusCode, str]:
    """Calls `method`; the status it ended with (a stream: after its first message) and
    the ErrorInfo reason of an error."""
    desc = method_descriptor(method)
    reply = message_factory.GetMessageClass(desc.output_type)
    encode, decode = type(request).SerializeToString, reply.FromString
    try:
        if desc.client_streaming:
            try:
                await _stream(channel.stream_stream(method, encode, decode), request)
            except grpc.aio.AioRpcError as error:
                if not _write_lost_the_race(error):
                    raise
                await _stream(channel.stream_stream(method, encode, decode), request, patient=True)
        elif desc.server_streaming:
            responses = channel.unary_stream(method, encode, decode)(request, timeout=10)
            await responses.read()
            responses.cancel()
        else:
            await channel.unary_unary(method, encode, decode)(request, timeout=10)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.INTERNAL:  # say which, if a cell ever sees one
            return error.code(), f"{error.details()} {error.debug_error_string()}"
        return error.code(), error_reason(error)
    return grpc.StatusCode.OK, ""


async def _stream(
    open_call: grpc.aio.StreamStreamMultiCallable, request: message.Message, patient: bool = False
) -> None:
    """Sends `request` on a new stream and reads the first answer. `patient`: first waits
    up to a second for the server to end the call, and sends nothing if it did."""
    stream = open_call(None, timeout=10)  # written to below
    if patient:
        ended = asyncio.ensure_future(stream.code())
        await asyncio.wait([ended], timeout=1)
        if ended.done():
            await stream.read()  # raises with the server's status
    await stream.write(request)
    await stream.read()
    stream.cancel()


def _write_lost_the_race(error: grpc.aio.AioRpcError) -> bool:
    """grpcio's asyncio client reports INTERNAL instead of the server's status when its
    write of a request fails because the server has just ended the call (a denied one:
    the edge refuses it before reading any request; grpc/grpc issue 36066)."""
    debug = error.debug_error_string() or ""
    return error.code() == grpc.StatusCode.INTERNAL and "SendMessageOperation" in debug


def error_reason(error: grpc.aio.AioRpcError) -> str:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:  # type: ignore[arg-type]
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    return ""


def test_the_table_covers_every_rpc_of_every_service() -> None:
    services = {service_of(m) for m in POLICY}
    pool = descriptor_pool.Default()
    declared = {
        f"/{name}/{m.name}" for name in services for m in pool.FindServiceByName(name).methods
    }
    assert declared == set(POLICY) == set(REQUESTS)
    assert services == {
        "managedjobs.v1.JobService",
        "managedjobs.v1.SchedulerService",
        "managedjobs.v1.ControllerService",
        "managedjobs.v1.LogService",
        "managedjobs.simcloud.v1.SimCloudService",
        "managedjobs.simcloud.v1.SimOperatorService",
    }


def test_docs_carry_the_policy_table() -> None:
    assert render_policy() in (ROOT / "docs" / "security.md").read_text()


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    return make_identities(tmp_path_factory.mktemp("identities"))


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_every_cell_of_the_auth_matrix(ids: Identities, tls: bool, tmp_path: Path) -> None:
    async with running_system(ids, tls, tmp_path) as system:
        await own_job_1(system, ids, tls)
        mismatches = []
        cells = 0
        for method, rule in POLICY.items():
            for caller in CALLERS:
                want = expected(method, rule, caller)
                async with open_channel(
                    system.address(service_of(method)), ids.client(caller, tls)
                ) as channel:
                    got, reason = await call(channel, method, REQUESTS[method])
                cells += 1
                if want == ALLOWED:
                    ok = got not in DENIED
                elif want == NOT_HELD:
                    ok = (got, reason) == (grpc.StatusCode.PERMISSION_DENIED, NOT_HELD)
                else:
                    ok = got == want
                if not ok:
                    mismatches.append(
                        f"{method} as {caller}: want {want}, got {got.name} {reason}".rstrip()
                    )
    assert cells == len(POLICY) * len(CALLERS)
    assert mismatches == []


async def own_job_1(system: System, ids: Identities, tls: bool) -> None:
    """Job 1 is alice's (the "user" caller's), submitted by herself."""
    async with open_channel(system.scheduler, ids.client("user", tls)) as channel:
        method = "/managedjobs.v1.JobService/SubmitJob"
        encode = job_service_pb2.SubmitJobRequest.SerializeToString
        submit = channel.unary_unary(method, encode, job_service_pb2.SubmitJobResponse.FromString)
        reply = await submit(job_service_pb2.SubmitJobRequest(spec_yaml=JOB_SPEC), timeout=10)
    assert reply.job_id == 1
