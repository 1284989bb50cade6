"""A service's background task: started once, stopped by cancelling it and waiting for its
end, a failure logged with its name (services/common/background.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.background import Background


class Loop:
    """A loop that counts its runs, says it started, and waits until cancelled."""

    def __init__(self) -> None:
        self.runs = 0
        self.names: list[str] = []
        self.started = asyncio.Event()
        self.unwound = False

    async def run(self) -> None:
        self.runs += 1
        task = asyncio.current_task()
        assert task is not None
        self.names.append(task.get_name())
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.unwound = True


async def test_stop_returns_once_the_task_has_unwound(caplog: pytest.LogCaptureFixture) -> None:
    loop = Loop()
    background = Background("ticker", loop.run)
    background.start()
    await loop.started.wait()
    assert background.running and loop.names == ["ticker"]
    await background.stop()
    assert loop.unwound and not background.running
    await background.stop()  # a second stop has nothing to do
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_start_while_it_runs_starts_no_second_task() -> None:
    loop = Loop()
    background = Background("pump", loop.run)
    background.start()
    background.start()
    await loop.started.wait()
    background.start()
    await background.stop()
    assert loop.runs == 1


async def test_a_task_that_ended_starts_again() -> None:
    ended = asyncio.Event()
    runs = 0

    async def once() -> None:
        nonlocal runs
        runs += 1
        ended.set()

    background = Background("flush", once)
    background.start()
    await ended.wait()
    assert not background.running
    ended.clear()
    background.start()
    await ended.wait()
    assert runs == 2


async def test_stop_before_start_does_nothing() -> None:
    loop = Loop()
    background = Background("watchdog", loop.run)
    await background.stop()
    assert not background.running and loop.runs == 0


async def test_a_task_that_fails_is_logged_with_its_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = asyncio.Event()

    async def broken() -> None:
        failing.set()
        raise RuntimeError("the probe broke")

    background = Background("db-health", broken)
    background.start()
    await failing.wait()
    await background.stop()
    [record] = [r for r in caplog.records if r.name == "services.common.background"]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "background task failed"
    assert record.__dict__["task"] == "db-health"
    assert record.exc_info is not None and str(record.exc_info[1]) == "the probe broke"
