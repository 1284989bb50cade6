"""A replica's link to the scheduler stops when its task is cancelled (a replica closing).

gRPC may end a call whose task is being cancelled with the call's own error: the
scheduler went away at that moment, and the call fails UNAVAILABLE instead of
raising CancelledError. The link must still stop, not reconnect for good (a
replica's close waits for its link).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.controller.link import Link


async def _nothing(*_: object) -> None:
    return None


async def _no_wait(_: float) -> None:
    await asyncio.sleep(0)


class CancelAnsweredUnavailable(Link):
    """Each stream attempt ends as gRPC may end it when the cancel and the scheduler's
    departure come together: the task has a cancel pending, the call fails UNAVAILABLE."""

    def __init__(self) -> None:
        super().__init__(
            "127.0.0.1:1", pb.ControllerHello, _nothing, _nothing, reconnect_sleep=_no_wait
        )
        self.attempts = 0

    async def _session(self) -> None:
        self.attempts += 1
        task = asyncio.current_task()
        assert task is not None
        if self.attempts == 2:
            task.cancel()
            # The cancel is taken by the call under way, which ends with its own error.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
        )


async def test_a_cancel_that_grpc_answers_with_the_calls_own_error_stops_the_link() -> None:
    link = CancelAnsweredUnavailable()
    running = asyncio.create_task(link.run())
    done, _ = await asyncio.wait({running}, timeout=5)
    assert done, f"the link still reconnects after {link.attempts} attempts"
    assert running.cancelled()
    assert link.attempts == 2
