"""Calls made at once go as one batch, each answered on its own (services/common/coalesce.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.coalesce import Coalescer


class Sender:
    """Records every batch; an item "bad" fails alone, a batch holding "down" fails whole."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[str]]] = []
        self.hold: asyncio.Event | None = None

    async def send(self, key: str, items: list[str]) -> list[str | BaseException]:
        self.batches.append((key, items))
        if self.hold is not None:
            await self.hold.wait()
        if "down" in items:
            raise ConnectionError("the service is down")
        return [ValueError(f"{i} refused") if i == "bad" else f"{key}:{i}" for i in items]


async def one_in_flight(
    in_flight: int | None = 1,
) -> tuple[Sender, Coalescer[str, str, str], asyncio.Task[str]]:
    """A coalescer whose first call ("1") is sent and held in flight."""
    sender = Sender()
    sender.hold = asyncio.Event()
    coalescer: Coalescer[str, str, str] = Coalescer(sender.send, in_flight=in_flight)
    first = asyncio.create_task(coalescer.call("k", "1"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return sender, coalescer, first


async def test_calls_made_in_the_same_moment_go_as_one_batch_per_key() -> None:
    sender = Sender()
    coalescer = Coalescer(sender.send)
    results = await asyncio.gather(
        coalescer.call("a", "1"), coalescer.call("b", "2"), coalescer.call("a", "3")
    )
    assert results == ["a:1", "b:2", "a:3"]
    assert sorted(sender.batches) == [("a", ["1", "3"]), ("b", ["2"])]
    assert coalescer.batches == 2


async def test_a_lone_call_goes_at_once_and_calls_made_meanwhile_go_next_together() -> None:
    sender, coalescer, first = await one_in_flight()
    assert sender.batches == [("k", ["1"])]
    later = [asyncio.create_task(coalescer.call("k", str(n))) for n in (2, 3)]
    await asyncio.sleep(0)
    assert len(sender.batches) == 1  # they wait for the batch in flight
    sender.hold.set()
    assert await first == "k:1"
    assert [await task for task in later] == ["k:2", "k:3"]
    assert sender.batches == [("k", ["1"]), ("k", ["2", "3"])]


async def test_up_to_in_flight_batches_go_at_once_and_the_rest_wait_for_one() -> None:
    sender, coalescer, first = await one_in_flight(in_flight=2)
    second = [asyncio.create_task(coalescer.call("k", str(n))) for n in (2, 3)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sender.batches == [("k", ["1"]), ("k", ["2", "3"])]  # went without waiting
    third = asyncio.create_task(coalescer.call("k", "4"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(sender.batches) == 2  # two are out: it waits for one of them
    sender.hold.set()
    assert [await t for t in [first, *second, third]] == ["k:1", "k:2", "k:3", "k:4"]
    assert sender.batches[2] == ("k", ["4"])


async def test_without_an_in_flight_limit_no_call_waits_for_an_answer() -> None:
    """Slow answers (a stop's, once its grace ran out) never hold up a later call:
    each turn's calls go at once, together, however many batches are out."""
    sender, coalescer, first = await one_in_flight(in_flight=None)
    later = []
    for n in range(2, 12, 2):
        later += [asyncio.create_task(coalescer.call("k", str(m))) for m in (n, n + 1)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert sender.batches == [("k", ["1"])] + [("k", [str(n), str(n + 1)]) for n in range(2, 12, 2)]
    sender.hold.set()
    assert [await t for t in [first, *later]] == [f"k:{n}" for n in range(1, 12)]


async def test_an_item_that_fails_fails_only_its_own_caller() -> None:
    coalescer = Coalescer(Sender().send)
    results = await asyncio.gather(
        coalescer.call("k", "1"), coalescer.call("k", "bad"), return_exceptions=True
    )
    assert results[0] == "k:1"
    assert isinstance(results[1], ValueError) and "bad refused" in str(results[1])


async def test_a_batch_that_fails_fails_every_caller_in_it_and_the_next_one_goes() -> None:
    sender = Sender()
    coalescer = Coalescer(sender.send)
    results = await asyncio.gather(
        coalescer.call("k", "1"), coalescer.call("k", "down"), return_exceptions=True
    )
    assert all(isinstance(r, ConnectionError) for r in results)
    assert await coalescer.call("k", "2") == "k:2"


async def test_a_caller_that_gives_up_before_its_batch_leaves_drops_out() -> None:
    sender, coalescer, first = await one_in_flight()
    quitter = asyncio.create_task(coalescer.call("k", "2"))
    stayer = asyncio.create_task(coalescer.call("k", "3"))
    await asyncio.sleep(0)
    quitter.cancel()
    sender.hold.set()
    assert (await first, await stayer) == ("k:1", "k:3")
    assert sender.batches == [("k", ["1"]), ("k", ["3"])]


async def test_batches_stay_within_their_size_in_the_order_asked() -> None:
    sender = Sender()
    coalescer = Coalescer(sender.send, max_batch=2)
    results = await asyncio.gather(*(coalescer.call("k", str(n)) for n in range(5)))
    assert results == [f"k:{n}" for n in range(5)]
    assert [items for _, items in sender.batches] == [["0", "1"], ["2", "3"], ["4"]]


async def test_a_sender_that_answers_the_wrong_number_of_items_fails_the_batch() -> None:
    async def short(key: str, items: list[str]) -> list[str | BaseException]:
        return items[:1]

    coalescer: Coalescer[str, str, str] = Coalescer(short)
    with pytest.raises(RuntimeError, match="1 outcomes for 2 calls"):
        await asyncio.gather(coalescer.call("k", "1"), coalescer.call("k", "2"))


async def test_an_item_done_for_a_caller_that_gave_up_in_flight_is_handed_to_abandoned() -> None:
    sender = Sender()
    sender.hold = asyncio.Event()
    left: list[tuple[str, str]] = []
    coalescer: Coalescer[str, str, str] = Coalescer(
        sender.send, abandoned=lambda item, result: left.append((item, result))
    )
    gone = asyncio.create_task(coalescer.call("k", "1"))
    failed = asyncio.create_task(coalescer.call("k", "bad"))
    stays = asyncio.create_task(coalescer.call("k", "2"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sender.batches == [("k", ["1", "bad", "2"])]  # in flight
    gone.cancel()
    failed.cancel()
    sender.hold.set()
    assert await stays == "k:2"
    # Only what succeeded for nobody: not a failed item, not one a caller still awaited.
    assert left == [("1", "k:1")]
    # A caller that gave up before its batch left is not sent, so never abandoned.
    sender.hold = asyncio.Event()
    first = asyncio.create_task(coalescer.call("k", "3"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    quitter = asyncio.create_task(coalescer.call("k", "4"))
    await asyncio.sleep(0)
    quitter.cancel()
    sender.hold.set()
    assert await first == "k:3"
    assert left == [("1", "k:1")]
