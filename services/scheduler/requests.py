"""What a client's request may hold, checked before anything is stored (contract §19).

Every input is bounded: a request names at most `MAX_JOB_IDS` job ids, each
positive; a status filter is a set of known statuses; no text holds a NUL
character (no field means one, and PostgreSQL cannot store one); a submission's
priority, key, user, pool and spec are in range, its spec parsed. A refused
request is INVALID_ARGUMENT naming the field, and changes nothing. A page token
is one this server issued: the id the next page starts below.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from google.protobuf.message import Message

from managedjobs.v1 import job_service_pb2 as pb
from services.common.bounds import MAX_INT64, BoundsError, check_pool, check_user, quote
from services.common.errors import InvalidArgument
from services.common.security.access import current_principal, require_user
from services.common.statuses import JobStatus
from services.scheduler.spec.cache import SpecCache
from services.scheduler.spec.parse import SpecError
from services.scheduler.submissions import NewJob

DEFAULT_PAGE_SIZE = 100
MAX_BATCH = 1000
MAX_PAGE_SIZE = 1000
MAX_PRIORITY = 1000
MAX_KEY_CHARS = 256
# Job ids one request may name (CancelJobs, WatchJobs).
MAX_JOB_IDS = 1000
DEFAULT_USER = "default"


def page_token(before_id: int) -> str:
    """The token of the page that starts below `before_id`."""
    return base64.urlsafe_b64encode(f"before:{before_id}".encode()).decode()


def parse_page_token(token: str) -> int:
    """The id a page token starts below (0: the first page).

    Raises:
        InvalidArgument: a token this server did not issue.
    """
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
        prefix, _, value = text.partition(":")
        if prefix != "before" or not value.isdigit() or not 0 < int(value) <= MAX_INT64:
            raise ValueError(text)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument(
            f"page_token: {quote(token)} is not a token this server issued",
            reason="PAGE_TOKEN_INVALID",
        ) from None


def job_ids(values: Sequence[int], field: str = "job_ids") -> list[int]:
    """The distinct job ids a request names, ascending.

    Raises:
        InvalidArgument: more than `MAX_JOB_IDS` ids, or one that is not positive.
    """
    if len(values) > MAX_JOB_IDS:
        raise InvalidArgument(
            f"{field}: at most {MAX_JOB_IDS} job ids per request, got {len(values):,}",
            reason="TOO_MANY_JOB_IDS",
            field=field,
            limit=str(MAX_JOB_IDS),
        )
    for index, job_id in enumerate(values):
        if job_id <= 0:
            raise InvalidArgument(
                f"{field}[{index}]: job ids are positive, got {job_id}", field=f"{field}[{index}]"
            )
    return sorted(set(values))


def no_nul(message: Message, prefix: str = "") -> None:
    """Refuses a NUL character in any text of the request: no field means one, and
    PostgreSQL cannot store one (it would fail the write, not the request).

    Raises:
        InvalidArgument: naming the field.
    """
    for field, value in message.ListFields():
        path = prefix + field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            texts = [(f"{path}[{quote(k)}]", f"{k}{v}") for k, v in value.items()]
        elif field.type == field.TYPE_STRING:
            texts = [(path, v) for v in (value if field.is_repeated else [value])]
        elif field.type == field.TYPE_MESSAGE:
            for index, item in enumerate(value if field.is_repeated else [value]):
                no_nul(item, f"{path}[{index}]." if field.is_repeated else f"{path}.")
            continue
        else:
            continue
        for where, text in texts:
            if "\x00" in text:
                raise InvalidArgument(
                    f"{where}: must not contain NUL characters", field=where, reason="NUL_CHARACTER"
                )


def statuses(values: Sequence[int]) -> list[JobStatus]:
    """The distinct statuses of a filter.

    Raises:
        InvalidArgument: a value that is no status.
    """
    statuses: set[JobStatus] = set()
    for index, value in enumerate(values):
        try:
            statuses.add(JobStatus(value))
        except ValueError:
            raise InvalidArgument(
                f"statuses[{index}]: unknown status {value}", field=f"statuses[{index}]"
            ) from None
    return sorted(statuses)


def _user(user: str, field: str = "user") -> str:
    try:
        check_user(user, field)
    except BoundsError as error:
        raise InvalidArgument(str(error), field=error.field) from None
    return user or DEFAULT_USER


def new_job(
    request: pb.SubmitJobRequest,
    specs: SpecCache,
    regions: frozenset[str] | None,
    prefix: str = "",
) -> NewJob:
    """The validated job of a submission, owned by the caller; errors name the field
    (under `prefix`).

    Raises:
        InvalidArgument: the submission can never run; nothing is stored.
    """
    if not -MAX_PRIORITY <= request.priority <= MAX_PRIORITY:
        raise InvalidArgument(f"{prefix}priority: must be within -{MAX_PRIORITY}..{MAX_PRIORITY}")
    if len(request.idempotency_key) > MAX_KEY_CHARS:
        raise InvalidArgument(f"{prefix}idempotency_key: at most {MAX_KEY_CHARS} characters")
    principal = current_principal()
    user = _user(require_user(principal, request.user) or principal.user, f"{prefix}user")
    try:
        check_pool(request.pool, f"{prefix}pool")
        spec = specs.parse(
            request.spec_yaml,
            name_override=request.name,
            extra_envs=dict(request.envs),
            extra_secrets=dict(request.secrets),
            known_regions=regions,
        )
    except BoundsError as error:
        field = prefix + error.field if isinstance(error, SpecError) else error.field
        message = f"{prefix}{error}" if isinstance(error, SpecError) else str(error)
        reason = "SPEC_INVALID" if isinstance(error, SpecError) else "ARGUMENT_INVALID"
        raise InvalidArgument(message, reason=reason, field=field) from None
    return NewJob(
        name=spec.name,
        user=user,
        priority=request.priority,
        pool=request.pool,
        idempotency_key=request.idempotency_key,
        tasks=spec.tasks,
        secrets=spec.secrets,
        timeouts=spec.timeouts if spec.timeouts.ListFields() else None,
    )
