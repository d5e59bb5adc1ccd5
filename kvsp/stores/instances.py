"""The PC's instance registry as a store (spec §6.3 status, lifecycle and epochs; DESIGN.md §1:
the PC's durable state lives in the store abstraction, memory or Redis).

Several PC processes on one Redis share one table of instances: a status record taken by one
PC is listed and placed on by every other, a restart one PC sees ends the epoch for all, and an
expiry is declared once. The rules stay in :mod:`kvsp.lifecycle` as pure functions of
``(entry, input, now) -> new entry``; a store only applies such a function to the entry it
holds as one atomic step per instance (:meth:`InstanceStore.update`): the Redis store
(:mod:`kvsp.stores.redis_instances`) compares and sets the entry it read, re-reading and
re-deciding when another PC wrote in between, so no update is lost and every epoch is checked
against the stored epoch.

:class:`MemoryInstanceStore` keeps the table in this process (an
:class:`~kvsp.lifecycle.InstanceRegistry`), for ``kvsp serve pc`` and ``kvsp serve control``
without Redis. :func:`entry_to_json` and :func:`entry_from_json` are the stored form.

``received_ms`` is the receiving PC's clock: PCs sharing a store should keep their clocks in
step (NTP) well within a status TTL, as the epoch bound already asks (:mod:`kvsp.lifecycle`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvsp.errors import RecordError
from kvsp.lifecycle import InstanceEntry, InstanceRegistry
from kvsp.records import InstanceStatusRecord
from kvsp.registries import InstanceState

Entry = InstanceEntry[InstanceStatusRecord]
T = TypeVar("T")
Decide = Callable[[Entry | None], tuple[Entry | None, T]]
"""A decision on one instance's entry: the entry to keep (``None``: remove it; the entry given,
unchanged: write nothing) and the answer for the caller. It may raise to change nothing."""


class InstanceStore(Protocol):
    """The PC's instance entries by instance URI (§6.3); every update is one atomic step."""

    async def get(self, instance: str) -> Entry | None:
        """The entry of ``instance`` (ended epochs included), or ``None``."""
        ...

    async def entries(self) -> list[Entry]:
        """Every entry (ended epochs included), sorted by URI; one round trip, for placement
        and listing."""
        ...

    async def update(self, instance: str, decide: Decide[T]) -> T:
        """Apply ``decide`` to the entry of ``instance`` atomically and return its answer.

        ``decide`` may run more than once (after another writer changed the entry); only the
        entry of its last run is kept, and only if the stored entry is still the one that run
        was given. An exception from ``decide`` propagates and nothing is written.
        """
        ...

    async def aclose(self) -> None:
        """Release connections (nothing for memory)."""
        ...


class MemoryInstanceStore:
    """An :class:`InstanceStore` over an :class:`~kvsp.lifecycle.InstanceRegistry` in this
    process (single event loop; every update runs to completion without awaiting)."""

    def __init__(self, registry: InstanceRegistry[InstanceStatusRecord]) -> None:
        self.registry = registry

    async def get(self, instance: str) -> Entry | None:
        """The entry of ``instance``, or ``None``."""
        return self.registry.stored(instance)

    async def entries(self) -> list[Entry]:
        """Every entry, sorted by URI."""
        return list(self.registry.all_entries())

    async def update(self, instance: str, decide: Decide[T]) -> T:
        """Apply ``decide`` to the entry of ``instance``."""
        current = await self.get(instance)
        new, answer = decide(current)
        if new is None:
            if current is not None:
                self.registry.drop(instance)
        elif new is not current:
            self.registry.put(new)
        return answer

    async def aclose(self) -> None:
        """Nothing to release."""


def entry_to_json(entry: Entry) -> str:
    """The stored form of ``entry``: compact JSON, members in a fixed order (so that equal
    entries are equal strings, which a compare-and-set relies on)."""
    body: dict[str, Any] = {
        "instance": entry.instance,
        "epoch": entry.epoch,
        "state": str(entry.state),
        "record": entry.record.to_json(),
        "received_ms": entry.received_ms,
        "low_since_ms": entry.low_since_ms,
        "unapplied_from": sorted(str(s) for s in entry.unapplied_from),
        "ordered": sorted(str(s) for s in entry.ordered),
        "ended": entry.ended,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def entry_from_json(text: str | bytes) -> Entry:
    """An entry from :func:`entry_to_json`.

    Raises:
        RecordError: not such an entry (a store written by something else).
    """
    try:
        body = json.loads(text)
        return InstanceEntry(
            instance=str(body["instance"]),
            epoch=int(body["epoch"]),
            state=InstanceState(body["state"]),
            record=InstanceStatusRecord.from_json(body["record"]),
            received_ms=int(body["received_ms"]),
            low_since_ms=None if body["low_since_ms"] is None else int(body["low_since_ms"]),
            unapplied_from=frozenset(InstanceState(s) for s in body["unapplied_from"]),
            ordered=frozenset(InstanceState(s) for s in body["ordered"]),
            ended=bool(body["ended"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordError(f"not a stored instance entry: {exc}") from exc


__all__ = [
    "Decide",
    "Entry",
    "InstanceStore",
    "MemoryInstanceStore",
    "entry_from_json",
    "entry_to_json",
]
