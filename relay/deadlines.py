"""Deadline heaps for the relay's upkeep: the cache's expiries (d16 §8, MAX_CACHE_DURATION) and
tombstones, the holder's record refreshes and replica expiries (spec §6.1, §6.6).

Each is a min-heap of ``(deadline ms, key)``. A deadline that moves (a track evicted, a record
refreshed, a replica withdrawn) is not looked for in the heap: its old entry stays and its
owner drops it when it comes due, against the key's current deadline. Left at that, a relay
that turns its cache over faster than MAX_CACHE_DURATION (an hour's TTL, a cache that fills in
minutes) would keep an entry, and its key, for every track it held within the hour. So the heap
also compacts itself: once it has doubled since it last held only live entries, it keeps the
entries its owner still counts (the current deadline, or a later one queued again), one per
key. Memory stays proportional to what the relay holds, at amortised O(1) a push.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

_K = TypeVar("_K")

COMPACT_FLOOR = 1024
"""The fewest entries a heap holds before it compacts itself."""


class Deadlines(Generic[_K]):
    """A min-heap of ``(deadline ms, key)`` that compacts away its stale entries.

    ``current(key)`` is the key's live deadline, or None when nothing is due for the key any
    more: an entry is live when its deadline is at or after that one (an entry queued again
    when it came due stays live until its owner acts). Entries are validated by the owner as
    they come due (:meth:`pop_due`), not here.
    """

    def __init__(self, current: Callable[[_K], int | None]) -> None:
        self._heap: list[tuple[int, _K]] = []
        self._current = current
        self._floor = self._limit = COMPACT_FLOOR

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, deadline: int, key: _K) -> None:
        """Queue ``key`` for ``deadline``."""
        heapq.heappush(self._heap, (deadline, key))
        if len(self._heap) > self._limit:
            self.compact()

    def pop_due(self, now_ms: int) -> Iterator[tuple[int, _K]]:
        """Pop the entries due at ``now_ms``, earliest first (stale ones included: the owner
        checks each against its state)."""
        heap = self._heap
        while heap and heap[0][0] <= now_ms:
            yield heapq.heappop(heap)

    def compact(self) -> None:
        """Keep the earliest live entry of each key; drop the rest."""
        current = self._current
        earliest: dict[_K, int] = {}
        for deadline, key in self._heap:
            live = current(key)
            if live is not None and deadline >= live:
                known = earliest.get(key)
                if known is None or deadline < known:
                    earliest[key] = deadline
        self._heap = [(deadline, key) for key, deadline in earliest.items()]
        heapq.heapify(self._heap)
        self._limit = max(self._floor, 2 * len(self._heap))
