"""Who may call what: the one policy table, the caller of the current RPC, and the
per-object checks handlers make with it.

`POLICY` maps every RPC of every service to the roles that may call it and whether
it mutates state (mutating calls are audited). The edge (edge.py) refuses a method
outside the caller's role with PERMISSION_DENIED and a method missing from the
table likewise (fail closed); grpc.health.v1 and reflection are open to anyone.
The table is the documentation: docs/security.md holds `render_policy()`'s output
and a test keeps the two equal.

Rules about objects (whose job this is, which replica a controller is) need the
request and the database, so handlers make them with `current_principal()` and
the helpers below: `require_user`, `require_owner`, `require_controller`.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Mapping

from services.common.bounds import quote
from services.common.errors import PermissionDenied, Unauthenticated
from services.common.security.auth import Principal, Role

USER, ADMIN, CONTROLLER, SERVICE = Role.USER, Role.ADMIN, Role.CONTROLLER, Role.SERVICE

# Services that need no token: load balancers probe health, grpcurl lists services.
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """The roles that may call a method, and whether a call changes state (audited)."""

    roles: frozenset[Role]
    mutating: bool = False


def _rule(*roles: Role, mutating: bool = False) -> Rule:
    return Rule(frozenset(roles), mutating)


def _service(name: str, **methods: Rule) -> dict[str, Rule]:
    return {f"/{name}/{method}": rule for method, rule in methods.items()}


POLICY: Mapping[str, Rule] = {
    **_service(
        "managedjobs.v1.JobService",
        SubmitJob=_rule(USER, ADMIN, mutating=True),
        SubmitJobs=_rule(USER, ADMIN, mutating=True),
        GetJob=_rule(USER, ADMIN, SERVICE),
        ListJobs=_rule(USER, ADMIN, SERVICE),
        CancelJobs=_rule(USER, ADMIN, mutating=True),
        WatchJobs=_rule(USER, ADMIN, SERVICE),
    ),
    **_service(
        "managedjobs.v1.SchedulerService",
        ConnectController=_rule(CONTROLLER, mutating=True),
        GetSchedulerState=_rule(ADMIN),
    ),
    **_service(
        "managedjobs.v1.ControllerService",
        GetControllerState=_rule(ADMIN),
    ),
    **_service(
        "managedjobs.v1.LogService",
        ReadLogs=_rule(USER, ADMIN),
        FetchTaskLogs=_rule(CONTROLLER, mutating=True),
        BatchFetchTaskLogs=_rule(CONTROLLER, mutating=True),
        AppendControllerLogs=_rule(CONTROLLER, mutating=True),
    ),
    **_service(
        "managedjobs.simcloud.v1.SimCloudService",
        Launch=_rule(CONTROLLER, ADMIN, mutating=True),
        LaunchClusters=_rule(CONTROLLER, ADMIN, mutating=True),
        Terminate=_rule(CONTROLLER, ADMIN, mutating=True),
        TerminateClusters=_rule(CONTROLLER, ADMIN, mutating=True),
        NotifyPreemption=_rule(CONTROLLER, ADMIN, mutating=True),
        GetCluster=_rule(CONTROLLER, ADMIN, SERVICE),
        GetClusters=_rule(CONTROLLER, ADMIN, SERVICE),
        ReadLogs=_rule(CONTROLLER, ADMIN, SERVICE),
        GetLogs=_rule(CONTROLLER, ADMIN, SERVICE),
        WatchEvents=_rule(CONTROLLER, ADMIN, SERVICE),
        ListRegions=_rule(CONTROLLER, ADMIN, SERVICE),
    ),
    **_service(
        "managedjobs.simcloud.v1.SimOperatorService",
        PreemptCluster=_rule(ADMIN, mutating=True),
        PreemptRegion=_rule(ADMIN, mutating=True),
        SetCapacity=_rule(ADMIN, mutating=True),
        InjectFaults=_rule(ADMIN, mutating=True),
        ResetFaults=_rule(ADMIN, mutating=True),
        ListInventory=_rule(ADMIN),
        GetCloudState=_rule(ADMIN),
    ),
}


def service_of(method: str) -> str:
    """`/pkg.Service/Method` -> `pkg.Service`."""
    return method.strip("/").split("/", 1)[0]


def is_open(method: str) -> bool:
    """Whether anyone may call the method, with or without a token."""
    return service_of(method) in OPEN_SERVICES


def render_policy() -> str:
    """The policy table as Markdown (docs/security.md carries it verbatim)."""
    lines = [
        "| method | user | admin | controller | service | audited |",
        "|---|---|---|---|---|---|",
    ]
    for method, rule in POLICY.items():
        marks = ["yes" if role in rule.roles else "" for role in Role]
        audited = "yes" if rule.mutating else ""
        lines.append(f"| `{method.strip('/')}` | {' | '.join(marks)} | {audited} |")
    return "\n".join(lines) + "\n"


# --- the caller of the current RPC ---------------------------------------------------------

_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal")


def set_principal(principal: Principal) -> None:
    """Makes `principal` the caller for the rest of this task (the edge calls it)."""
    _principal.set(principal)


def current_principal() -> Principal:
    """The caller of the RPC being handled (tasks it starts inherit it).

    Raises:
        Unauthenticated: called outside an RPC that went through the edge.
    """
    try:
        return _principal.get()
    except LookupError:
        raise Unauthenticated("no authenticated caller", reason="TOKEN_MISSING") from None


def require_user(principal: Principal, user: str) -> str:
    """The user a request acts for: a `user` field naming someone else is refused for a user.

    Returns:
        For a `user`-role caller, the token's user (`user` must be empty or the same);
        for admins and services, `user` as given (possibly empty).

    Raises:
        PermissionDenied: a user acting for someone else (reason USER_FORBIDDEN).
    """
    if principal.sees_every_job:
        return user
    if user and user != principal.user:
        raise PermissionDenied(
            f"user: {quote(user)} is not you ({principal.user!r})", reason="USER_FORBIDDEN"
        )
    return principal.user


def require_owner(principal: Principal, owner: str, what: str) -> None:
    """Refuses a user access to `what` (e.g. "job 7") unless it is theirs.

    Raises:
        PermissionDenied: reason JOB_FORBIDDEN.
    """
    if not principal.sees_every_job and owner != principal.user:
        raise PermissionDenied(f"{what} belongs to another user", reason="JOB_FORBIDDEN")


def require_controller(principal: Principal, controller_id: str) -> None:
    """Refuses a controller speaking for a replica other than the one it is.

    The token must be bound to `controller_id`, and under mTLS the client
    certificate must name it too (common name or subject alternative name).

    Raises:
        PermissionDenied: reason CONTROLLER_MISMATCH.
    """
    if principal.role is Role.ADMIN and not principal.user:
        return  # --auth none: every caller is an anonymous admin
    if principal.role is not Role.CONTROLLER or principal.controller_id != controller_id:
        raise PermissionDenied(
            f"controller_id: {quote(controller_id)} is not the controller this token is bound "
            f"to ({principal.controller_id or 'none'!r})",
            reason="CONTROLLER_MISMATCH",
        )
    if principal.cert_names and controller_id not in principal.cert_names:
        raise PermissionDenied(
            f"controller_id: {quote(controller_id)} is not named by the client certificate",
            reason="CONTROLLER_MISMATCH",
        )
