"""The auth matrix (contract §14, §16): every RPC of every service x every caller, each
cell against the status written for it by hand in `EXPECTED`.

The servers are real and in this process (`inprocess`: scheduler, a controller
replica, logs, sim cloud), in plaintext and under TLS with mTLS. The callers are
those of `identities`: no token, an unknown token, a user (alice), another user
(bob), the admin, a controller (bound to controller-1), the logs service; under TLS
each presents its own client certificate, and three more callers are the ways mTLS
refuses: no client certificate, one from another CA (both cut at the handshake:
UNAVAILABLE), and the controller-1 token with controller-2's certificate.

`EXPECTED` is written from the roles of §14 (and docs/security.md's list of them),
not from `access.POLICY`, the table the servers enforce: a role the code grants or
withholds by mistake makes its cells disagree, which
`test_a_wrong_role_in_the_policy_breaks_the_matrix` shows. It covers exactly the RPCs
the servers serve, so a new RPC cannot go without its row.

Each call sends the method's request of `rpcs.REQUESTS`. They name job 1, alice's,
which is never assigned to a replica; the cells run row by row in the table's order
and caller by caller in the columns' order, on one system, so a cell may see what an
earlier one did (the admin's Launch makes the cluster "matrix" the later reads find).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message, message_factory
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from harness.identities import (
    CALLERS,
    FOREIGN_CERT,
    MTLS_CALLERS,
    NO_CERT,
    OTHER_REPLICA_CERT,
    Identities,
    make_identities,
)
from harness.inprocess import System, running_system
from harness.rpcs import JOB_SPEC, REQUESTS, method_descriptor
from managedjobs.v1 import job_service_pb2
from services.common.channels import open_channel
from services.common.security.access import POLICY, Rule, is_open, render_policy, service_of
from services.common.security.auth import Role

ROOT = Path(__file__).resolve().parents[2]
Code = grpc.StatusCode

# What a cell expects: the status code and, for an error the server sends, the reason of
# its ErrorInfo (an mTLS refusal ends the connection before any server code runs).
LEGEND = {
    "OK": (Code.OK, ""),
    "anon": (Code.UNAUTHENTICATED, "TOKEN_MISSING"),
    "unkn": (Code.UNAUTHENTICATED, "TOKEN_UNKNOWN"),
    "role": (Code.PERMISSION_DENIED, "ROLE_FORBIDDEN"),  # the method is outside the role
    "owner": (Code.PERMISSION_DENIED, "JOB_FORBIDDEN"),  # job 1 is another user's
    "held": (Code.PERMISSION_DENIED, "JOB_NOT_HELD"),  # job 1 is not this replica's
    "cert": (Code.PERMISSION_DENIED, "CONTROLLER_MISMATCH"),  # the certificate names another
    "nocl": (Code.NOT_FOUND, "CLUSTER_NOT_FOUND"),  # the request names no cluster there is
    "noreg": (Code.NOT_FOUND, "RESOURCE_NOT_FOUND"),  # the request names no region there is
    "tls": (Code.UNAVAILABLE, ""),  # mTLS refused the client certificate
}
# The columns of `EXPECTED`, callers of `identities`; the last three only TLS has.
COLUMNS = (
    "none", "unknown", "user", "other user", "admin", "controller", "service",
    NO_CERT, FOREIGN_CERT, OTHER_REPLICA_CERT,
)  # fmt: skip
# user: submits; gets, lists, watches, cancels and reads the logs of their own jobs.
# admin: everything, on every user's jobs, with the state and operator RPCs.
# controller: ConnectController as the replica its token (and certificate) names, the
#   logs RPCs for the jobs it holds, the sim cloud's API.
# service: what the logs service needs: reading jobs from the scheduler and clusters
#   from the sim cloud.
EXPECTED = {
    "managedjobs.v1.JobService": {
        #                     none  unknown user  bob   admin ctrl  svc   nocert foreign ctrl-2
        "SubmitJob":         "anon  unkn    OK    OK    OK    role  role  tls    tls     role",
        "SubmitJobs":        "anon  unkn    OK    OK    OK    role  role  tls    tls     role",
        "GetJob":            "anon  unkn    OK    owner OK    role  OK    tls    tls     role",
        "ListJobs":          "anon  unkn    OK    OK    OK    role  OK    tls    tls     role",
        "CancelJobs":        "anon  unkn    OK    owner OK    role  role  tls    tls     role",
        "WatchJobs":         "anon  unkn    OK    owner OK    role  OK    tls    tls     role",
    },
    "managedjobs.v1.SchedulerService": {
        "ConnectController": "anon  unkn    role  role  role  OK    role  tls    tls     cert",
        "GetSchedulerState": "anon  unkn    role  role  OK    role  role  tls    tls     role",
    },
    "managedjobs.v1.ControllerService": {
        "GetControllerState":"anon  unkn    role  role  OK    role  role  tls    tls     role",
    },
    "managedjobs.v1.LogService": {
        "ReadLogs":          "anon  unkn    OK    owner OK    role  role  tls    tls     role",
        "FetchTaskLogs":     "anon  unkn    role  role  role  held  role  tls    tls     held",
        # Judged item by item: the refusal of job 1 is in the response.
        "BatchFetchTaskLogs":"anon  unkn    role  role  role  OK    role  tls    tls     OK",
        "AppendControllerLogs":
                             "anon  unkn    role  role  role  held  role  tls    tls     held",
    },
    "managedjobs.simcloud.v1.SimCloudService": {
        "Launch":            "anon  unkn    role  role  OK    OK    role  tls    tls     OK",
        "LaunchClusters":    "anon  unkn    role  role  OK    OK    role  tls    tls     OK",
        "Terminate":         "anon  unkn    role  role  OK    OK    role  tls    tls     OK",
        "TerminateClusters": "anon  unkn    role  role  OK    OK    role  tls    tls     OK",
        "NotifyPreemption":  "anon  unkn    role  role  nocl  nocl  role  tls    tls     nocl",
        "GetCluster":        "anon  unkn    role  role  OK    OK    OK    tls    tls     OK",
        "GetClusters":       "anon  unkn    role  role  OK    OK    OK    tls    tls     OK",
        "ReadLogs":          "anon  unkn    role  role  OK    OK    OK    tls    tls     OK",
        "GetLogs":           "anon  unkn    role  role  OK    OK    OK    tls    tls     OK",
        "WatchEvents":       "anon  unkn    role  role  OK    OK    OK    tls    tls     OK",
        "ListRegions":       "anon  unkn    role  role  OK    OK    OK    tls    tls     OK",
    },
    "managedjobs.simcloud.v1.SimOperatorService": {
        "PreemptCluster":    "anon  unkn    role  role  nocl  role  role  tls    tls     role",
        "PreemptRegion":     "anon  unkn    role  role  noreg role  role  tls    tls     role",
        "SetCapacity":       "anon  unkn    role  role  noreg role  role  tls    tls     role",
        "InjectFaults":      "anon  unkn    role  role  OK    role  role  tls    tls     role",
        "ResetFaults":       "anon  unkn    role  role  OK    role  role  tls    tls     role",
        "ListInventory":     "anon  unkn    role  role  OK    role  role  tls    tls     role",
        "GetCloudState":     "anon  unkn    role  role  OK    role  role  tls    tls     role",
    },
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cell:
    method: str
    caller: str
    want: tuple[Code, str]


def cells(tls: bool) -> list[Cell]:
    """Every cell of `EXPECTED`, in order; in plaintext without the mTLS columns."""
    found = []
    for service, rows in EXPECTED.items():
        for name, row in rows.items():
            words = row.split()
            assert len(words) == len(COLUMNS), f"{service}/{name}: {len(words)} cells"
            for caller, word in zip(COLUMNS, words, strict=True):
                if tls or caller not in MTLS_CALLERS:
                    found.append(Cell(f"/{service}/{name}", caller, LEGEND[word]))
    return found


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


async def mismatches(system: System, ids: Identities, tls: bool) -> list[str]:
    """Calls every cell in order; the cells whose answer is not the one written."""
    await own_job_1(system, ids, tls)
    found = []
    for cell in cells(tls):
        async with open_channel(
            system.address(service_of(cell.method)), ids.client(cell.caller, tls)
        ) as channel:
            got = await call(channel, cell.method, REQUESTS[cell.method])
        if got != cell.want:
            want, seen = (f"{c.name} {r}".rstrip() for c, r in (cell.want, got))
            found.append(f"{cell.method} as {cell.caller}: want {want}, got {seen}")
    return found


async def own_job_1(system: System, ids: Identities, tls: bool) -> None:
    """Job 1 is alice's (the "user" caller's), submitted by herself."""
    async with open_channel(system.scheduler, ids.client("user", tls)) as channel:
        method = "/managedjobs.v1.JobService/SubmitJob"
        encode = job_service_pb2.SubmitJobRequest.SerializeToString
        submit = channel.unary_unary(method, encode, job_service_pb2.SubmitJobResponse.FromString)
        reply = await submit(job_service_pb2.SubmitJobRequest(spec_yaml=JOB_SPEC), timeout=10)
    assert reply.job_id == 1


async def served(address: str, ids: Identities, tls: bool) -> set[str]:
    """The methods the server at `address` serves behind the edge, as reflection lists
    them (health and reflection left out)."""

    async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async with open_channel(address, ids.client("none", tls)) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        names = [
            s.name
            async for r in stub.ServerReflectionInfo(ask(), timeout=10)
            for s in r.list_services_response.service
        ]
    pool = descriptor_pool.Default()
    return {
        f"/{name}/{m.name}"
        for name in names
        if not is_open(f"/{name}/")
        for m in pool.FindServiceByName(name).methods
    }


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    return make_identities(tmp_path_factory.mktemp("identities"))


async def test_the_table_has_a_row_for_every_rpc_each_server_serves(
    ids: Identities, tmp_path: Path
) -> None:
    rows = {cell.method for cell in cells(tls=True)}
    async with running_system(ids, False, tmp_path) as system:
        by_address: dict[str, set[str]] = {}
        for method in rows:
            by_address.setdefault(system.address(service_of(method)), set()).add(method)
        for address, methods in by_address.items():
            assert await served(address, ids, False) == methods, address
    assert len(by_address) == 4
    assert set(REQUESTS) == rows
    assert (*CALLERS, *MTLS_CALLERS) == COLUMNS  # every caller of `identities` has a column


def test_docs_carry_the_policy_table() -> None:
    assert render_policy() in (ROOT / "docs" / "security.md").read_text()


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_every_cell_of_the_auth_matrix(ids: Identities, tls: bool, tmp_path: Path) -> None:
    async with running_system(ids, tls, tmp_path) as system:
        found = await mismatches(system, ids, tls)
    assert found == []


GRANTED = Rule(POLICY["/managedjobs.v1.SchedulerService/GetSchedulerState"].roles | {Role.USER})
LIST_REGIONS = "/managedjobs.simcloud.v1.SimCloudService/ListRegions"
WITHHELD = Rule(POLICY[LIST_REGIONS].roles - {Role.CONTROLLER})
WRONG_ROLES = [
    (
        "/managedjobs.v1.SchedulerService/GetSchedulerState",
        GRANTED,
        [
            "/managedjobs.v1.SchedulerService/GetSchedulerState as user: "
            "want PERMISSION_DENIED ROLE_FORBIDDEN, got OK",
            "/managedjobs.v1.SchedulerService/GetSchedulerState as other user: "
            "want PERMISSION_DENIED ROLE_FORBIDDEN, got OK",
        ],
    ),
    (
        LIST_REGIONS,
        WITHHELD,
        [f"{LIST_REGIONS} as controller: want OK, got PERMISSION_DENIED ROLE_FORBIDDEN"],
    ),
]


@pytest.mark.parametrize(
    ("method", "rule", "caught"), WRONG_ROLES, ids=["role granted", "role withheld"]
)
async def test_a_wrong_role_in_the_policy_breaks_the_matrix(
    ids: Identities,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    rule: Rule,
    caught: list[str],
) -> None:
    """The servers enforce `POLICY` with one role changed: exactly its cells disagree."""
    monkeypatch.setitem(POLICY, method, rule)  # type: ignore[arg-type]
    async with running_system(ids, False, tmp_path) as system:
        found = await mismatches(system, ids, False)
    assert found == caught
