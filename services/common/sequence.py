"""Sequence numbers on a replica's stream, checked as messages arrive (contract §11).

Both directions of `ConnectController` number their messages. The scheduler
numbers what it sends on a stream 1, 2, 3, ... from the welcome. A replica
numbers its requests once for all its streams: a request keeps its number when
it is sent again on the next stream (so the scheduler knows it for a replay),
and gets one when first put on a stream. After the hello (numbered H), a stream
carries first the requests sent before and not yet answered, with their numbers
(below H, increasing), then new requests numbered H + 1, H + 2, ... A batch
envelope carries no number of its own; each message in it has its own.

`InOrder` is the receiving side's check: the next message is taken, a number
already passed is a replay, and anything else is a gap: a message went missing,
and the stream must be given up for a fresh one that starts from the database.
"""

from __future__ import annotations


class OutOfSequence(Exception):
    """A message arrived whose number is not the next one: one went missing."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"seq: expected {expected}, got {got}")
        self.expected = expected
        self.got = got


class InOrder:
    """The numbers received on one stream, in one direction.

    Args:
        resent_below: the hello's number on a replica's stream (the requests resent
            from an earlier stream come first, numbered below it); 0 for the
            scheduler's messages, numbered from 1.
    """

    def __init__(self, resent_below: int = 0) -> None:
        self.resent_below = resent_below
        self.last = 0

    @property
    def expected(self) -> int:
        """The number of the next new message."""
        return max(self.last, self.resent_below) + 1

    def check(self, seq: int) -> bool:
        """True for the next message (taken), False for a replay (a number already passed).

        Raises:
            OutOfSequence: a number past the next one.
        """
        if self.last < seq < self.resent_below:
            self.last = seq  # still resending what an earlier stream left unanswered
            return True
        if seq == self.expected:
            self.last = seq
            return True
        if seq < self.expected:
            return False
        raise OutOfSequence(self.expected, seq)
