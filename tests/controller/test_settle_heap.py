"""A started service sets its startup's objects aside from the garbage collector
(services/common/server.py: settle_heap, called as a service starts serving)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.common.server import settle_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class Kept:
    """A tracked object that lives as long as the service."""


def test_what_exists_at_start_is_never_scanned_again_and_what_comes_later_is(
    unfrozen: None,
) -> None:
    kept = [Kept() for _ in range(1000)]
    before = gc.get_freeze_count()
    settle_heap()
    assert gc.get_freeze_count() >= before + len(kept)
    # A full collection no longer sees them; new objects are collected as before.
    assert not any(obj is kept[0] for obj in gc.get_objects(generation=2))
    later = Kept()
    assert any(obj is later for obj in gc.get_objects())
