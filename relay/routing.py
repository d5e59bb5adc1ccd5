"""Where the relay sends requests, and who hears of namespaces (MOQT draft-16 relays): sans-I/O.

* :class:`NamespaceRoutes`: namespaces announced with PUBLISH_NAMESPACE, by source. A request
  for a track is routed to the source of the **longest** announced prefix of its namespace
  (matched field by field: ``(foo, bar)`` is under ``(foo)``, not under ``(foob)``); among
  equal prefixes the latest announcement wins.
* :class:`NamespaceSubscribers`: SUBSCRIBE_NAMESPACE prefixes per session, with the
  PREFIX_OVERLAP rule, and which of them hear of a namespace (with the suffix to send).
* :class:`DeliveryFilter`: which new objects a downstream subscription asked for (§5.1.2).

Sources and subscribers are opaque hashable handles chosen by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from moqt.messages_params import FilterType, SubscriptionFilter
from moqt.wire import Location, TrackNamespace

S = TypeVar("S", bound=Hashable)


def is_prefix(prefix: TrackNamespace, namespace: TrackNamespace) -> bool:
    """Whether ``prefix`` is a field-wise prefix of ``namespace`` (equal counts)."""
    return len(prefix) <= len(namespace) and namespace[: len(prefix)] == prefix


class NamespaceRoutes(Generic[S]):
    """Announced namespaces and their sources, for longest-prefix routing."""

    def __init__(self) -> None:
        self._sources: dict[TrackNamespace, list[S]] = {}  # latest announcement last

    def announce(self, namespace: TrackNamespace, source: S) -> bool:
        """Add ``source`` for ``namespace``; True when the namespace is newly announced."""
        sources = self._sources.setdefault(namespace, [])
        fresh = not sources
        if source in sources:
            sources.remove(source)
        sources.append(source)
        return fresh

    def withdraw(self, namespace: TrackNamespace, source: S) -> bool:
        """Remove ``source`` for ``namespace``; True when no source announces it any more."""
        sources = self._sources.get(namespace)
        if sources is None or source not in sources:
            return False
        sources.remove(source)
        if sources:
            return False
        del self._sources[namespace]
        return True

    def withdraw_source(self, source: S) -> list[TrackNamespace]:
        """Remove every announcement of ``source``; the namespaces no longer announced."""
        gone = [ns for ns, sources in list(self._sources.items()) if source in sources]
        return [ns for ns in gone if self.withdraw(ns, source)]

    def route(
        self,
        namespace: TrackNamespace,
        *,
        exclude: S | None = None,
        usable: Callable[[S], bool] | None = None,
    ) -> S | None:
        """The source of the longest announced prefix of ``namespace`` (latest first), passing
        over ``exclude`` and any source ``usable`` rejects (one that is leaving, or that a
        request already failed on)."""
        for length in range(len(namespace), 0, -1):
            sources = self._sources.get(namespace[:length])
            if sources:
                for source in reversed(sources):
                    if source != exclude and (usable is None or usable(source)):
                        return source
        return None

    def under(self, prefix: TrackNamespace) -> list[TrackNamespace]:
        """Every announced namespace that has ``prefix`` as a prefix."""
        return [ns for ns in self._sources if is_prefix(prefix, ns)]

    def sources_of(self, namespace: TrackNamespace) -> list[S]:
        """The sources announcing exactly ``namespace``."""
        return list(self._sources.get(namespace, ()))


@dataclass(frozen=True, slots=True)
class NamespaceSubscription(Generic[S]):
    """One SUBSCRIBE_NAMESPACE: the session that sent it, its Request ID and prefix."""

    session: S
    request_id: int
    prefix: TrackNamespace


class NamespaceSubscribers(Generic[S]):
    """SUBSCRIBE_NAMESPACE prefixes by session (§9.25)."""

    def __init__(self) -> None:
        self._subs: dict[tuple[S, int], NamespaceSubscription[S]] = {}

    def overlaps(self, session: S, prefix: TrackNamespace) -> bool:
        """Whether ``session`` already has a prefix that is a prefix of ``prefix`` or has it
        as one (§9.25: PREFIX_OVERLAP)."""
        return any(
            sub.session == session
            and (is_prefix(sub.prefix, prefix) or is_prefix(prefix, sub.prefix))
            for sub in self._subs.values()
        )

    def add(self, session: S, request_id: int, prefix: TrackNamespace) -> NamespaceSubscription[S]:
        """Record a subscription (check :meth:`overlaps` first)."""
        sub = NamespaceSubscription(session, request_id, prefix)
        self._subs[(session, request_id)] = sub
        return sub

    def remove(self, session: S, request_id: int) -> None:
        """Forget one subscription."""
        self._subs.pop((session, request_id), None)

    def remove_session(self, session: S) -> None:
        """Forget every subscription of ``session``."""
        for key in [k for k in self._subs if k[0] == session]:
            del self._subs[key]

    def interested(
        self, namespace: TrackNamespace
    ) -> list[tuple[NamespaceSubscription[S], TrackNamespace]]:
        """The subscriptions whose prefix covers ``namespace``, each with the suffix to send."""
        return [
            (sub, namespace[len(sub.prefix) :])
            for sub in self._subs.values()
            if is_prefix(sub.prefix, namespace)
        ]


@dataclass(frozen=True, slots=True)
class DeliveryFilter:
    """Which new objects one downstream subscription receives (§5.1.2).

    ``start`` None means every new object; ``end_group`` None means no end.
    """

    start: Location | None = None
    end_group: int | None = None
    forward: bool = True

    @classmethod
    def of(
        cls,
        subscription_filter: SubscriptionFilter | None,
        largest: Location | None,
        forward: int | None,
    ) -> DeliveryFilter:
        """The filter of a SUBSCRIBE with ``subscription_filter``, given the largest Location
        the relay has seen of the track (None when none)."""
        sending = forward != 0
        if subscription_filter is None:
            return cls(forward=sending)
        kind = subscription_filter.filter_type
        if kind == FilterType.NEXT_GROUP_START:
            start = Location(0, 0) if largest is None else Location(largest.group + 1, 0)
            return cls(start, forward=sending)
        if kind == FilterType.LARGEST_OBJECT:
            start = (
                Location(0, 0) if largest is None else Location(largest.group, largest.object + 1)
            )
            return cls(start, forward=sending)
        return cls(subscription_filter.start, subscription_filter.end_group, forward=sending)

    def wants(self, group_id: int, object_id: int) -> bool:
        """Whether the object at (group, object) is delivered."""
        if not self.forward:
            return False
        if self.start is not None and Location(group_id, object_id) < self.start:
            return False
        return self.end_group is None or group_id <= self.end_group
