"""The admission counters: jobs per (replica, schedule state), kept in memory (contract §5).

`launching` is the LAUNCHING count, `alive` the LAUNCHING, ALIVE and
ALIVE_WAITING counts together, per replica and in total; jobs no replica holds
are counted under `None`. The counts change in exactly one place, `apply`, fed
by the store's committed moves (`Store.on_moves`), and are rebuilt from a recount
of the database at start.

`reconcile` compares them with a recount made in a quiet turn of the database's
writers (no write under way, none starting until it ends, and every committed
move applied: both views are of the same instant), fixes any difference and
reports it: a difference means a move was committed without being seen (a
commit whose outcome was unknown) and is logged and counted. The quiet turn goes
before every write that asks after it, so steady load cannot put it off.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence

from services.common.statuses import ALIVE_STATES, ScheduleState
from services.scheduler import queries
from services.scheduler.store import Store
from services.scheduler.txn import Move

log = logging.getLogger(__name__)
St = ScheduleState
Key = tuple[str | None, ScheduleState]


@dataclasses.dataclass(frozen=True)
class Slots:
    launching: int = 0
    alive: int = 0


def live_counts(counts: Counter[Key]) -> Counter[Key]:
    """The counts without INACTIVE or DONE jobs and zero entries (what admission keeps)."""
    return Counter({k: n for k, n in counts.items() if n and k[1] not in (St.DONE, St.INACTIVE)})


class Counters:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.counts: Counter[Key] = Counter()
        self.applied = 0
        self.corrections = 0

    def apply(self, moves: Sequence[Move]) -> None:
        """Follows committed moves (the only way a count changes after start)."""
        counts = self.counts
        for move in moves:
            if move.old not in (St.DONE, St.INACTIVE):
                counts[(move.old_controller, move.old)] -= 1
            if move.new not in (St.DONE, St.INACTIVE):
                counts[(move.new_controller, move.new)] += 1
        self.applied += 1

    async def rebuild(self) -> None:
        self.counts = live_counts(await self.store.read(queries.recount))

    def slots(self, controller_id: str | None) -> Slots:
        c = self.counts
        launching = c[(controller_id, St.LAUNCHING)]
        alive = launching + c[(controller_id, St.ALIVE)] + c[(controller_id, St.ALIVE_WAITING)]
        return Slots(launching, alive)

    def totals(self) -> Slots:
        launching = sum(n for (_, s), n in self.counts.items() if s == St.LAUNCHING)
        alive = sum(n for (_, s), n in self.counts.items() if s in ALIVE_STATES)
        return Slots(launching, alive)

    def total(self, state: ScheduleState) -> int:
        """Jobs in `state`, whoever holds them."""
        return sum(n for (_, s), n in self.counts.items() if s == state)

    async def reconcile(self) -> dict[Key, int]:
        """Compares with a recount while no write is under way; fixes and returns any
        difference."""
        async with self.store.db.quiet():
            recount = live_counts(await self.store.read(queries.recount))
            ours = live_counts(self.counts)
            diff = {
                k: recount[k] - ours[k] for k in set(recount) | set(ours) if recount[k] != ours[k]
            }
            if diff:
                self.corrections += sum(abs(n) for n in diff.values())
                log.warning(
                    "admission counters differed from a recount; fixed",
                    extra={"differences": {f"{c}/{s.name}": n for (c, s), n in diff.items()}},
                )
                self.counts = recount
        return diff
