"""Hostile requests for every RPC, generated from the proto descriptors (contract §19).

`attempts(method)` is a hypothesis strategy of calls to one RPC of `access.POLICY`.
Requests are built by walking each message's `DESCRIPTOR.fields`: every field is
absent or holds a random or extreme value (ints at the int32/int64 edges and
negative, empty, huge and unicode strings, nested messages, repeated fields and
maps with many items, enums out of range, NaN and infinite doubles); half of the
requests start from the method's minimal valid request (`rpcs.REQUESTS`) with some
fields replaced, so the checks past the first one are reached too; some are random
or truncated bytes sent as they are (an identity serializer). Each attempt names
its caller: mostly a role the policy allows (an admin where it may), sometimes a
user or a controller.

`call(channel, attempt)` sends one attempt to a real server and reads at most a
few messages of a stream within a short deadline; `problems(attempt, outcome)`
lists what the answer breaks: INTERNAL or UNKNOWN, UNAVAILABLE while everything
is up, DEADLINE_EXCEEDED on a call that should not wait, an error without an
ErrorInfo or with a bare status name as its reason, a message longer than the
bounds or quoting more than 200 characters of the input. The fuzz tests and
`bench/fuzz.py` share all of it.

`explore` runs a strategy under a seed: each run draws a fresh one (`fuzz_seed`), so
runs differ, and a failure names it: `MJ_FUZZ_SEED=N` draws the same examples again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor, message, message_factory
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from harness.rpcs import JOB_SPEC, REQUESTS, method_descriptor
from services.common.bounds import QUOTE_LIMIT
from services.common.errors import MAX_MESSAGE_BYTES
from services.common.security.access import POLICY
from services.common.security.auth import Role

F = descriptor.FieldDescriptor
Strategy = st.SearchStrategy[Any]

# Streams are read for at most this many messages or this long.
STREAM_MESSAGES = 3
STREAM_DEADLINE = 0.2
UNARY_DEADLINE = 5.0
# Requests stay under the servers' 4 MiB limit: a bigger one only tests gRPC.
MAX_REQUEST_BYTES = 3 * 1024 * 1024
MAX_DEPTH = 3
# The environment variable that fixes the seed of the fuzzers' examples.
SEED_VARIABLE = "MJ_FUZZ_SEED"
STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
STREAMS = frozenset(
    m
    for m in POLICY
    if method_descriptor(m).server_streaming or method_descriptor(m).client_streaming
)

INT32_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 2**31 - 2, 1000, 1001, 10_000_001]
INT64_EDGES = [0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1, 2**31, -(2**31) - 1, 10**18]
UINT32_EDGES = [0, 1, 2**32 - 1, 2**31]
UINT64_EDGES = [0, 1, 2**64 - 1, 2**63, 2**63 - 1]
DOUBLE_EDGES = [0.0, -0.0, -1.0, 1e10, 1e10 + 1, 1e300, -1e300, 5e-324,
                float("inf"), float("-inf"), float("nan")]  # fmt: skip
# Sizes of huge strings: past every quote and name limit, and past the 1 MiB of a spec.
HUGE_SIZES = [100_000, 1024 * 1024 + 1]
STRING_EDGES = ["", " ", "\x00", "\n", "-", ".", "..", "../../etc/passwd", "a" * 65, "A" * 129,
                "é" * 300, "💥" * 1000, "-1", "9" * 30, "null", "{}", "[", "${HOME}", "%s%n",
                "\u202e", "a\x00b"]  # fmt: skip
# Plausible values by field name, so requests reach past the name checks.
HINTS: dict[str, list[Any]] = {
    "cluster_name": ["matrix", "mj-1-0", "nothing"],
    "cluster_names": ["matrix", "mj-1-0"],
    "controller_id": ["controller-1", "controller-2"],
    "region": ["us-east-1", "us-west-2", "nowhere"],
    "zone": ["us-east-1a"],
    "user": ["alice", "bob", "root"],
    "name": ["matrix", "fuzz"],
    "pool": ["gpu", ""],
    "spec_yaml": [
        JOB_SPEC,
        "name: fuzz\nrun: echo hi\nresources:\n  cpus: 99999999\n",
        "name: a\nrun: x\n---\nname: b\nrun: y\n",
        "name: fuzz\nrun: echo hi\nsim:\n  runtime_seconds: 1e300\n",
        "run: [\n",
        "a: &a [*a]\n",
    ],
    "handle_json": [
        '{"cluster_name": "mj-1-0", "backend": "local"}',
        '{"cluster_name": 5}',
        "[]",
        "{",
        '{"cluster_name": "../x", "backend": "local", "data": {"pid": -1}}',
    ],
    "page_token": ["YmVmb3JlOjE=", "YmVmb3JlOjA=", "0", "99999999999999999999", "-1"],
    "job_id": [1, 2, 3],
    "job_ids": [1, 2],
    "cpus": ["4", "4+", "0.5", "-1", "nan", "1e400"],
    "accelerators": ["A100:8", "A100:-1", "H100:99999999999", ":"],
}


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One call: the method, the caller (a name of `identities.CALLERS`) and what it sends.

    `payload` is the request's bytes (a client stream: each message's); `request` the
    message they encode, or None when they are random or truncated bytes.
    """

    method: str
    caller: str
    payload: tuple[bytes, ...]
    requests: tuple[message.Message, ...] = ()

    @property
    def request(self) -> message.Message | None:
        return self.requests[0] if self.requests else None

    def __repr__(self) -> str:
        shown = [str(r)[:300] for r in self.requests] or [repr(p[:100]) for p in self.payload]
        return f"Attempt({self.method} as {self.caller}: {shown})"


@dataclasses.dataclass
class Outcome:
    """How a call ended."""

    code: grpc.StatusCode
    details: str = ""
    reason: str | None = None
    domain: str = ""
    messages: int = 0

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


# --- values of fields -------------------------------------------------------------------------


def _with_edges(edges: list[Any], values: Strategy) -> Strategy:
    return st.one_of(st.sampled_from(edges), values)


def _strings(name: str, small: bool) -> Strategy:
    hints = [h for h in HINTS.get(name, []) if isinstance(h, str) and (not small or len(h) < 100)]
    edges = [s for s in STRING_EDGES if not small or len(s) < 100]
    options = [st.text(max_size=8 if small else 40), st.sampled_from(edges)]
    if not small:
        # Built by a map, so hypothesis never renders a megabyte in a strategy's repr.
        options.append(st.sampled_from(HUGE_SIZES).map(lambda n: "x" * n))
    if hints:
        options.insert(0, st.sampled_from(hints))
    return st.one_of(options)


def _scalar(field: Any, small: bool) -> Strategy:
    kind = field.type
    hints = [h for h in HINTS.get(field.name, []) if isinstance(h, int)]
    if kind in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        values = _with_edges(INT32_EDGES + hints, st.integers(-(2**31), 2**31 - 1))
    elif kind in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        values = _with_edges(INT64_EDGES + hints, st.integers(-(2**63), 2**63 - 1))
    elif kind in (F.TYPE_UINT32, F.TYPE_FIXED32):
        values = _with_edges(UINT32_EDGES + hints, st.integers(0, 2**32 - 1))
    elif kind in (F.TYPE_UINT64, F.TYPE_FIXED64):
        values = _with_edges(UINT64_EDGES + hints, st.integers(0, 2**64 - 1))
    elif kind == F.TYPE_DOUBLE:
        values = _with_edges(DOUBLE_EDGES, st.floats())
    elif kind == F.TYPE_FLOAT:
        values = _with_edges(DOUBLE_EDGES[:3], st.floats(width=32))
    elif kind == F.TYPE_BOOL:
        values = st.booleans()
    elif kind == F.TYPE_STRING:
        values = _strings(field.name, small)
    elif kind == F.TYPE_BYTES:
        huge = st.just(70_000).map(bytes)
        values = st.binary(max_size=64) if small else st.one_of(st.binary(), huge)
    elif kind == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        values = st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    else:
        raise TypeError(f"{field.full_name}: no strategy for type {kind}")
    return values


def _value(field: Any, depth: int, small: bool) -> Strategy:
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1, small)
    return _scalar(field, small)


def _many(element: Strategy) -> Strategy:
    """One element repeated past every limit (1,001 and 40,000 items)."""
    return st.tuples(element, st.sampled_from([40_000, 1001])).map(lambda p: [p[0]] * p[1])


def _repeated(field: Any, depth: int, small: bool) -> Strategy:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        keys = _value(entry.fields_by_name["key"], depth, small=True)
        values = _value(entry.fields_by_name["value"], depth, small)
        maps = st.dictionaries(keys, values, max_size=4)
        if small:
            return maps
        many = st.sampled_from([1001, 20_000]).map(lambda n: {f"K{i}": "v" for i in range(n)})
        return st.one_of(maps, many)
    element = _value(field, depth, small)
    lists = st.lists(element, max_size=4)
    if small:
        return lists
    return st.one_of(lists, _many(_value(field, depth, small=True)))


def _field(field: Any, depth: int, small: bool) -> Strategy:
    if field.is_repeated:
        return _repeated(field, depth, small)
    return _value(field, depth, small)


@functools.cache
def messages(desc: Any, depth: int = 0, small: bool = False) -> Strategy:
    """Messages of type `desc` with any subset of fields set to random or extreme values.

    Below `MAX_DEPTH` nested messages are left empty; `small` keeps strings short and
    lists few (an element repeated 40,000 times must stay small).
    """
    cls = message_factory.GetMessageClass(desc)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    single: dict[str, Strategy] = {}
    for oneof in desc.oneofs:
        if len(oneof.fields) > 1:
            choices = [st.tuples(st.just(f.name), _field(f, depth, small)) for f in oneof.fields]
            single[f"oneof:{oneof.name}"] = st.one_of(choices)
    for field in desc.fields:
        oneof = field.containing_oneof
        if oneof is None or len(oneof.fields) == 1:
            single[field.name] = _field(field, depth, small)

    def build(values: dict[str, Any]) -> message.Message:
        fields: dict[str, Any] = {}
        for key, value in values.items():
            if key.startswith("oneof:"):
                fields[value[0]] = value[1]
            else:
                fields[key] = value
        return cls(**fields)

    return st.fixed_dictionaries({}, optional=single).map(build)


def _mutated(base: message.Message) -> Strategy:
    """`base` with the fields a random message of its type sets replaced by that message's."""

    def merge(random: message.Message) -> message.Message:
        result = type(base)()
        result.CopyFrom(base)
        for field, _ in random.ListFields():
            result.ClearField(field.name)
        result.MergeFrom(random)
        return result

    return messages(base.DESCRIPTOR).map(merge)


def _one_field(base: message.Message) -> Strategy:
    """`base` with one field set to a random or extreme value: each check past the first."""
    desc = base.DESCRIPTOR

    def replaced(pair: tuple[Any, Any]) -> message.Message:
        field, value = pair
        result = type(base)()
        result.CopyFrom(base)
        result.ClearField(field.name)
        result.MergeFrom(type(base)(**{field.name: value}))
        return result

    fields = st.sampled_from(list(desc.fields))
    return fields.flatmap(lambda f: st.tuples(st.just(f), _field(f, 0, False))).map(replaced)


def requests_of(desc: Any, base: message.Message | None) -> Strategy:
    """Random messages of type `desc`, and (given a valid `base`) mutations of it: many
    fields at once, or one."""
    options = [messages(desc)]
    if base is not None:
        options.append(_mutated(base))
    if base is not None and desc.fields:
        options += [_one_field(base), _one_field(base)]
    return st.one_of(options).filter(lambda m: m.ByteSize() < MAX_REQUEST_BYTES)


def _garbage(valid: bytes) -> Strategy:
    """Bytes that are not the request: random, or the valid request cut short or flipped."""

    def cut(at: int) -> bytes:
        return valid[: at % max(len(valid), 1)] if valid else b"\xff"

    def flip(pair: tuple[int, int]) -> bytes:
        if not valid:
            return bytes([pair[1] | 0x80])
        data = bytearray(valid)
        data[pair[0] % len(data)] ^= pair[1] or 1
        return bytes(data)

    return st.one_of(
        st.binary(min_size=1, max_size=200),
        st.integers(0, 10_000).map(cut),
        st.tuples(st.integers(0, 10_000), st.integers(0, 255)).map(flip),
        st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08" * 11, b"\x12\x80"]),
    )


# --- callers ----------------------------------------------------------------------------------

CALLER_OF_ROLE = {
    Role.ADMIN: "admin",
    Role.USER: "user",
    Role.CONTROLLER: "controller",
    Role.SERVICE: "service",
}


def callers(method: str) -> list[str]:
    """Who calls `method`, weighted: mostly an allowed role (an admin where allowed), then
    a user and a controller, allowed or not."""
    roles = POLICY[method].roles
    primary = "admin" if Role.ADMIN in roles else CALLER_OF_ROLE[sorted(roles)[0]]
    return [primary] * 6 + ["user", "controller"]


def attempts(method: str) -> Strategy:
    """Calls of `method`: a caller and a generated request (or a client stream of them)."""
    desc = method_descriptor(method)
    base = REQUESTS.get(method)
    who = st.sampled_from(callers(method))
    one = requests_of(desc.input_type, base)
    if desc.client_streaming:
        follow = st.lists(requests_of(desc.input_type, None), max_size=3)
        stream = st.tuples(one, follow).map(lambda p: (p[0], *p[1]))
    else:
        stream = one.map(lambda m: (m,))

    def encoded(caller: str, sent: tuple[message.Message, ...]) -> Attempt:
        return Attempt(method, caller, tuple(m.SerializeToString() for m in sent), sent)

    def raw(caller: str, data: bytes) -> Attempt:
        return Attempt(method, caller, (data,))

    valid = base.SerializeToString() if base is not None else b""
    return st.one_of(
        st.builds(encoded, who, stream),
        st.builds(encoded, who, stream),
        st.builds(raw, who, _garbage(valid)),
    )


# --- calling ----------------------------------------------------------------------------------


def _same(data: bytes) -> bytes:
    return data


def error_info(metadata: Iterable[tuple[str, Any]] | None) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of an error's trailing metadata, or None."""
    for key, value in metadata or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info
    return None


def _failed(error: Any, read: int) -> Outcome:
    """The outcome of a failed call (an AioRpcError, or a blocking call's RpcError)."""
    info = error_info(error.trailing_metadata())
    return Outcome(
        error.code(),
        error.details() or "",
        info.reason if info is not None else None,
        info.domain if info is not None else "",
        read,
    )


async def call(
    channel: grpc.aio.Channel,
    attempt: Attempt,
    sync_channel: grpc.Channel | None = None,
    stream_deadline: float = STREAM_DEADLINE,
    unary_deadline: float = UNARY_DEADLINE,
) -> Outcome:
    """Sends `attempt` on `channel`; a stream is read for at most `STREAM_MESSAGES`
    messages within `stream_deadline`, then cancelled (which counts as OK).

    A client stream goes on `sync_channel`, in a thread: the asyncio client reports
    INTERNAL ("Internal error from Core") instead of the server's status when the
    server ends the call while the client still writes (grpc/grpc#36066).
    """
    desc = method_descriptor(attempt.method)
    if desc.client_streaming:
        if sync_channel is None:
            raise ValueError(f"{attempt.method} needs a blocking channel")
        return await asyncio.to_thread(_client_stream, sync_channel, attempt, stream_deadline)
    read = 0
    try:
        if desc.server_streaming:
            responses = channel.unary_stream(attempt.method, _same, _same)(
                attempt.payload[0], timeout=stream_deadline
            )
            async for _ in responses:
                read += 1
                if read >= STREAM_MESSAGES:
                    responses.cancel()
                    break
        else:
            unary = channel.unary_unary(attempt.method, _same, _same)
            await unary(attempt.payload[0], timeout=unary_deadline)
            read = 1
    except grpc.aio.AioRpcError as error:
        return _failed(error, read)
    return Outcome(grpc.StatusCode.OK, messages=read)


def _client_stream(channel: grpc.Channel, attempt: Attempt, deadline: float) -> Outcome:
    read = 0
    stream = channel.stream_stream(attempt.method, _same, _same)
    responses = stream(iter(attempt.payload), timeout=deadline)
    try:
        for _ in responses:
            read += 1
            if read >= STREAM_MESSAGES:
                responses.cancel()
                break
    except grpc.RpcError as error:
        if read >= STREAM_MESSAGES and error.code() == grpc.StatusCode.CANCELLED:
            return Outcome(grpc.StatusCode.OK, messages=read)
        return _failed(error, read)
    return Outcome(grpc.StatusCode.OK, messages=read)


# --- judging ----------------------------------------------------------------------------------


def _strings_in(msg: message.Message) -> Iterable[str]:
    for field, value in msg.ListFields():
        values = value if field.is_repeated else [value]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            values = [*value.keys(), *value.values()]
        for item in values:
            if isinstance(item, str):
                yield item
            elif isinstance(item, message.Message):
                yield from _strings_in(item)


def may_wait(attempt: Attempt) -> bool:
    """Whether the call may rightly outlast its deadline: any stream, and a Terminate
    that grants a grace (it returns once the cluster is gone, after the grace)."""
    if attempt.method in STREAMS:
        return True
    request = attempt.request
    return attempt.method.endswith("SimCloudService/Terminate") and bool(
        request is not None and getattr(request, "grace_seconds", 0) > 0
    )


def problems(attempt: Attempt, outcome: Outcome) -> list[str]:
    """What the answer to `attempt` breaks (empty: nothing)."""
    code = outcome.code
    if code == grpc.StatusCode.OK:
        return []
    found = []
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        found.append(f"{code.name}: {outcome.details[:300]}")
    if code == grpc.StatusCode.UNAVAILABLE and "SimCloudService/" not in attempt.method:
        # Every server and the database are up: only the sim cloud's injected outage is.
        found.append(f"UNAVAILABLE with everything up: {outcome.details[:300]}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if not may_wait(attempt):
            found.append("DEADLINE_EXCEEDED on a call that should answer at once")
        return found  # the client's own deadline: no ErrorInfo to expect
    if outcome.reason is None:
        found.append(f"{code.name} without an ErrorInfo: {outcome.details[:300]}")
    elif not outcome.reason or outcome.reason in STATUS_NAMES:
        found.append(f"{code.name} with reason {outcome.reason!r}, not a domain reason")
    if len(outcome.details.encode()) > MAX_MESSAGE_BYTES:
        found.append(f"{code.name}: a message of {len(outcome.details.encode())} bytes")
    # Only a message longer than the limit can quote more than it.
    texts = (s for r in attempt.requests for s in _strings_in(r))
    for text in texts if len(outcome.details) > QUOTE_LIMIT else ():
        if len(text) > QUOTE_LIMIT and text[: QUOTE_LIMIT + 1] in outcome.details:
            found.append(f"{code.name}: the message quotes more than {QUOTE_LIMIT} characters")
            break
    return found


# --- running ----------------------------------------------------------------------------------


def fuzz_seed() -> int:
    """The seed of this run's examples: `MJ_FUZZ_SEED` when set, else a fresh one."""
    given = os.environ.get(SEED_VARIABLE, "").strip()
    return int(given) if given else random.SystemRandom().randrange(2**32)


def explore(
    strategy: Strategy,
    check: Callable[[Any], Awaitable[list[str]]],
    loop: asyncio.AbstractEventLoop,
    *,
    examples: int,
    seed: int,
    budget: float | None = None,
    shrink: bool = True,
) -> int:
    """Runs hypothesis over `strategy` in this (worker) thread; each example is checked by
    the coroutine `check` on `loop`, where the servers run, and fails if it lists problems.

    `seed` decides the examples (never the `ci` profile's derandomizing): the same seed
    draws the same ones, and a failure says `MJ_FUZZ_SEED=seed`. Examples are drawn until
    `examples` ran or, given a `budget`, that many seconds passed since the first (those
    left are skipped); once one failed, the budget no longer applies, so hypothesis can
    shrink it.

    Returns:
        How many examples ran.
    """
    started = 0.0
    ran = 0
    failed = False
    phases = list(Phase) if shrink else [Phase.explicit, Phase.generate]

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        derandomize=False,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(example: Any) -> None:
        nonlocal started, ran, failed
        started = started or time.monotonic()
        if not failed and budget is not None and time.monotonic() - started > budget:
            return
        ran += 1
        found = asyncio.run_coroutine_threadsafe(check(example), loop).result(120)
        failed = failed or bool(found)
        assert not found, f"{example!r}: {found}"

    try:
        one()
    except Exception as error:
        error.add_note(f"{SEED_VARIABLE}={seed} draws these examples again")
        raise
    return ran
