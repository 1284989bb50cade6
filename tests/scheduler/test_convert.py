"""Rows to messages: times set in place agree with protobuf's own conversion."""

from __future__ import annotations

import datetime as dt

from google.protobuf import timestamp_pb2
from hypothesis import given
from hypothesis import strategies as st

from managedjobs.v1 import job_pb2
from services.scheduler.convert import NewEvent, event_message, set_time

# Timestamp's own range: 0001-01-01 to 9999-12-31, UTC.
NAIVE = st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30))
ZONES = st.sampled_from([dt.UTC, dt.timezone(dt.timedelta(hours=5, minutes=30)),
                         dt.timezone(dt.timedelta(hours=-8))])  # fmt: skip


def reference(value: dt.datetime) -> timestamp_pb2.Timestamp:
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(value if value.tzinfo else value.replace(tzinfo=dt.UTC))
    return out


@given(NAIVE)
def test_a_naive_time_is_utc(value: dt.datetime) -> None:
    field = timestamp_pb2.Timestamp()
    set_time(field, value)
    assert field == reference(value)
    assert 0 <= field.nanos < 1_000_000_000


@given(NAIVE, ZONES)
def test_an_aware_time_is_converted_to_utc(value: dt.datetime, zone: dt.tzinfo) -> None:
    aware = value.replace(tzinfo=zone)
    field = timestamp_pb2.Timestamp()
    set_time(field, aware)
    assert field == reference(aware)
    assert field.ToDatetime(tzinfo=dt.UTC) == aware


def test_none_leaves_the_field_unset_and_a_time_sets_it() -> None:
    job = job_pb2.Job()
    set_time(job.end_time, None)
    assert not job.HasField("end_time")
    set_time(job.end_time, dt.datetime(2026, 12, 1, 20, 0, 0, 250))
    assert job.HasField("end_time")
    assert (job.end_time.seconds, job.end_time.nanos) == (1796155200, 250_000)


def test_an_event_carries_its_time() -> None:
    moment = dt.datetime(2026, 12, 1, 20, 0, 1, 500_000)
    event = event_message(NewEvent(7, 3, 0, 1, 2, moment, "submitted"))
    assert event.time == reference(moment)
    assert (event.event_id, event.job_id, event.message) == (7, 3, "submitted")
