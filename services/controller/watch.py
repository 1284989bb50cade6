"""News of clusters for the lifecycles watching them (contract §6 "watching").

A lifecycle watching a cluster holds a `Watcher` and sleeps in `Watcher.next`
until there is news: an `Observation` (or the error that stood for one), or a
preemption notice. Where the news comes from depends on the backend:

- A backend that pushes (`Backend.events()`): every event carries the cluster's
  observation, handed to the cluster's watchers as it is, so a running job costs
  nothing until something happens and nobody asks the backend again. After a
  gap in the stream (it broke and was reopened), every watched cluster is looked
  at once, in batches, since the gap may have hidden a change.
- A backend that cannot push: one poller per replica looks at every watched
  cluster each `poll_interval` with `observe_many`, in batches, never one job at
  a time.

`look` (a lifecycle's first look at a cluster, e.g. when it resumes a job) is
batched too: looks asked for in the same moment share one `observe_many`.

Each lifecycle has its own watcher (a job's old and new runner may watch the
same cluster name for a moment); closing one never silences another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    Observation,
)
from services.common.background import Background

log = logging.getLogger(__name__)

BATCH = 500
News = Observation | BackendError


class Watcher:
    """One lifecycle's subscription to one cluster's news."""

    __slots__ = ("_hub", "_news", "_noticed", "_seq", "_wake", "handle", "notice_deadline")

    def __init__(self, hub: ClusterWatch, handle: ClusterHandle) -> None:
        self._hub = hub
        self.handle = handle
        self._news: News | None = None
        self._wake = asyncio.Event()
        self._noticed = False
        # The number of the newest look at the cluster known here (Observation.seq): the
        # launch's own, then every look and every piece of news.
        self._seq = handle.seen.seq if handle.seen is not None else 0
        # Set when a preemption notice came for this cluster (Unix seconds of the reclaim).
        self.notice_deadline: float | None = None

    def deliver(self, news: News | None) -> None:
        """Hands news over (None: "look again", after a gap in pushed events)."""
        if news is not None:
            self._news = news
        self._wake.set()

    def notice(self, deadline: float) -> None:
        self.notice_deadline = deadline
        self._noticed = True
        self._wake.set()

    def saw(self, news: News) -> None:
        """A look at the cluster was made (by the lifecycle, or for it)."""
        if isinstance(news, Observation) and news.seq > self._seq:
            self._seq = news.seq

    def _older(self, news: News) -> bool:
        """Whether pushed news says less than a look already made: a snapshot from
        before it (the event stream lags behind reads), never to be taken as current."""
        return isinstance(news, Observation) and 0 < news.seq < self._seq

    async def next(self, timeout: float | None) -> News | None:
        """The latest news, waiting up to `timeout` seconds; None when none came."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while True:
            if not self._wake.is_set():
                try:
                    left = None if end is None else max(0.0, end - loop.time())
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    return None
            self._wake.clear()
            news, self._news = self._news, None
            noticed, self._noticed = self._noticed, False
            if news is not None and self._older(news):
                if not noticed:
                    continue  # nothing new: wait on
                news = None
            if news is None:
                # Woken without news (a gap, or a notice): look now.
                news = await self._hub.look(self.handle)
            self.saw(news)
            return news

    def close(self) -> None:
        self._hub._remove(self)


class ClusterWatch:
    def __init__(
        self,
        backend: Backend,
        poll_interval: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._backend = backend
        self._poll_interval = poll_interval
        self._sleep = sleep
        self._watchers: dict[str, list[Watcher]] = {}
        self._looks: dict[str, tuple[ClusterHandle, list[asyncio.Future[News]]]] = {}
        # Looks asked for go together, in batches.
        self._looker = Background("cluster-looks", self._look_now)
        self._news = Background("cluster-news", self._follow)
        # Backend calls made for news, for tests and metrics.
        self.observe_calls = 0

    # --- watchers ----------------------------------------------------------------------------

    def watch(self, handle: ClusterHandle) -> Watcher:
        watcher = Watcher(self, handle)
        self._watchers.setdefault(handle.cluster_name, []).append(watcher)
        return watcher

    def _remove(self, watcher: Watcher) -> None:
        name = watcher.handle.cluster_name
        watchers = self._watchers.get(name)
        if watchers is None:
            return
        if watcher in watchers:
            watchers.remove(watcher)
        if not watchers:
            del self._watchers[name]

    @property
    def watched(self) -> int:
        return sum(len(w) for w in self._watchers.values())

    def _deliver(self, name: str, news: News | None) -> None:
        for watcher in self._watchers.get(name, ()):
            watcher.deliver(news)

    # --- looks ---------------------------------------------------------------------------------

    async def look(self, handle: ClusterHandle) -> News:
        """One observation of the cluster now; looks asked for together share a call."""
        future: asyncio.Future[News] = asyncio.get_running_loop().create_future()
        entry = self._looks.get(handle.cluster_name)
        if entry is None:
            self._looks[handle.cluster_name] = (handle, [future])
        else:
            entry[1].append(future)
        self._looker.start()
        return await future

    async def _look_now(self) -> None:
        await asyncio.sleep(0)  # let the looks of this moment gather
        while self._looks:
            batch = dict(list(self._looks.items())[:BATCH])
            for name in batch:
                del self._looks[name]
            results = await self._observe([handle for handle, _ in batch.values()])
            for name, (_, futures) in batch.items():
                for watcher in self._watchers.get(name, ()):
                    watcher.saw(results[name])
                for future in futures:
                    if not future.done():
                        future.set_result(results[name])

    async def _observe(self, handles: Sequence[ClusterHandle]) -> dict[str, News]:
        self.observe_calls += 1
        try:
            return await self._backend.observe_many(handles)
        except BackendError as error:
            return {handle.cluster_name: error for handle in handles}

    async def _look_at_all(self) -> None:
        names = list(self._watchers)
        for start in range(0, len(names), BATCH):
            handles = [
                self._watchers[n][0].handle
                for n in names[start : start + BATCH]
                if n in self._watchers
            ]
            for name, news in (await self._observe(handles)).items():
                self._deliver(name, news)

    # --- the source of news ------------------------------------------------------------------

    def start(self) -> None:
        self._news.start()

    async def _follow(self) -> None:
        """The backend's pushed events where it pushes them; polls where it does not."""
        if self._backend.events() is None:
            await self._poll()
        else:
            await self._pump()

    async def _poll(self) -> None:
        while True:
            await self._sleep(self._poll_interval)
            try:
                await self._look_at_all()
            except Exception:
                log.exception("polling clusters failed")

    async def _pump(self) -> None:
        while True:
            stream = self._backend.events()
            if stream is None:
                return
            try:
                async for event in stream:
                    if event.notice_deadline is not None:
                        for watcher in self._watchers.get(event.cluster_name, ()):
                            watcher.notice(event.notice_deadline)
                    self._deliver(event.cluster_name, event.observation)
            except BackendUnreachableError as error:
                # Expected while the backend is down: the looks below say so per cluster.
                log.warning("backend event stream cut off; reopening", extra={"error": str(error)})
            except Exception:
                log.exception("backend event stream failed; reopening")
            # A gap in events may have hidden a change: look at every watched cluster.
            try:
                await self._look_at_all()
            except Exception:
                log.exception("looking at clusters after an event gap failed")
            await self._sleep(1.0)

    async def close(self) -> None:
        await self._news.stop()
        await self._looker.stop()
