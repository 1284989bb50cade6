"""A replica whose lease ran out changes nothing at the backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.backends import (
    TaskRequest,
)
from services.backends.local import LocalBackend
from services.controller.fencing import LeaseGuard
from services.controller.link import LeaseLost, Link, Rejected


async def test_no_launch_or_terminate_without_a_lease(tmp_path: Path) -> None:
    lease = {"valid": False}
    backend = LocalBackend(tmp_path)
    guard = LeaseGuard(backend, lambda: lease["valid"])
    request = TaskRequest(job_id=1, task_id=0, epoch=3, cluster_name="mj-1-0", run="sleep 30")
    with pytest.raises(LeaseLost):
        await guard.launch(request)
    assert not await backend.cluster_exists("mj-1-0")

    lease["valid"] = True
    handle = await guard.launch(request)
    try:
        lease["valid"] = False
        with pytest.raises(LeaseLost):
            await guard.terminate(handle)
        assert await backend.cluster_exists("mj-1-0")
        # Reads still pass: a replica may look, it may not act.
        assert guard.handle_for("mj-1-0").cluster_name == "mj-1-0"
    finally:
        await backend.terminate(handle)
    assert not await backend.cluster_exists("mj-1-0")


def test_lease_lost_stops_a_job_like_a_refused_report() -> None:
    assert issubclass(LeaseLost, Rejected)


def test_lease_view_runs_out_after_the_ttl_without_answers() -> None:
    now = [100.0]

    async def nothing(*_: object) -> None:
        return None

    link = Link("127.0.0.1:1", lambda: None, nothing, nothing, clock=lambda: now[0])  # type: ignore[arg-type]
    assert not link.lease_valid()  # never renewed
    link.lease_ttl = 10.0
    link.last_renewal = 100.0
    now[0] = 109.0
    assert link.lease_valid()
    now[0] = 110.5
    assert not link.lease_valid()
