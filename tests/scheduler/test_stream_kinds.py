"""Every kind of request a replica's stream may carry has one place that handles it.

The request's `message` oneof is dispatched by its field's name: the hello opens the
stream (`replicas.py`), a batch is unpacked (`session.unbatched`), heartbeats and
draining are the reader's (`Session.AT_ONCE`), and every other kind is a report
(`reports.REPORTS`). A kind added to the proto without a handler, or a table entry
whose message is another kind's, fails here.
"""

from __future__ import annotations

import pytest

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.scheduler.reports import REPORTS
from services.scheduler.session import Session, unbatched

ENVELOPE = {"hello", "batch"}


def kinds() -> set[str]:
    oneof = pb.ConnectControllerRequest.DESCRIPTOR.oneofs_by_name["message"]
    return {field.name for field in oneof.fields}


def test_each_kind_of_request_has_exactly_one_handler() -> None:
    handled = [ENVELOPE, set(Session.AT_ONCE), set(REPORTS)]
    assert set().union(*handled) == kinds()
    assert sum(len(group) for group in handled) == len(kinds())


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_a_report_kind_reads_the_message_of_its_own_field(name: str) -> None:
    request = pb.ConnectControllerRequest(seq=1)
    field = pb.ConnectControllerRequest.DESCRIPTOR.fields_by_name[name]
    getattr(request, name).SetInParent()
    message = REPORTS[name].message(request)
    assert message.DESCRIPTOR is field.message_type


def test_a_batch_is_unpacked_and_anything_else_stands_alone() -> None:
    heartbeat = pb.ConnectControllerRequest(seq=4, heartbeat=pb.ControllerHeartbeat())
    batch = pb.ConnectControllerRequest(batch=pb.RequestBatch(requests=[heartbeat, heartbeat]))
    assert list(unbatched(batch)) == [heartbeat, heartbeat]
    assert list(unbatched(heartbeat)) == [heartbeat]
