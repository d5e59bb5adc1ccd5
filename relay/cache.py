"""The relay's object cache (MOQT draft-16 relay and caching rules; DESIGN.md §1, §4): sans-I/O.

The cache key is (Full Track Name, Group ID, Object ID). Every object keeps what the draft says
a cache must store (subgroup, priority, forwarding preference, status, extensions, payload) and
the time it arrived. The rules applied here:

* A duplicate of a cached object with a different payload, subgroup, priority or status makes
  the track **malformed**: its objects are dropped, never served, and the track stays refused
  (a tombstone) for ``tombstone_ms`` so that neither copy is handed out; the sweep forgets
  it after that, so that tombstones of tracks never asked for again do not pile up.
* MAX_CACHE_DURATION (a track extension) bounds how long after its arrival an object may start
  being forwarded; past it the object's state is unknown and it is dropped. Every read drops
  what has expired in the track it reads; :meth:`ObjectCache.expire` sweeps the rest, taking
  from a heap only the tracks whose first expiry has come, so that a sweep costs nothing
  while nothing expires, however many tracks are cached.
* A byte budget with LRU eviction by whole track (a KV block is useless in part). The cache
  never evicts by itself: :meth:`ObjectCache.victims` proposes tracks, least recently used
  first and skipping pinned ones (leased blocks), and the caller withdraws their records before
  calling :meth:`ObjectCache.evict` (spec §6.1). Above ``hard_limit`` objects are not cached.

Payloads are kept as they arrived when that is safe: a read-only buffer (``bytes``, or a read-only
view of received data, which the transports never rewrite) is cached by reference, and an
object that arrived in several pieces keeps them (:data:`Payload`), so a relay caches and
forwards what it receives without copying it. Such a view keeps the buffer it was received
into alive while cached, so only views of at least :data:`KEEP_VIEW_MIN` octets are kept; short
pieces, and anything writable, are copied (:func:`frozen_payload`).

Nothing cached can be part of a reference cycle, so, where ``moqt._frozen`` is built, the cache
keeps a view as a ``FrozenSlice`` and takes each cached object and its Location off the cyclic
garbage collector's lists: a full collection then costs the same whatever the cache holds,
instead of walking four objects per cached object (about 100 ms of the event loop for a 1 GiB
cache of 4 KiB objects). Without it, payloads stay memoryviews and everything is tracked.

Nothing here reads a clock: every call that needs the time takes ``now_ms``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

from moqt.errors import ObjectStatus
from moqt.messages_params import ExtensionType, track_extension
from moqt.wire import Bytes, KeyValuePair, Location, TrackNamespace

from .deadlines import Deadlines

if TYPE_CHECKING:
    from moqt._frozen import FrozenSlice

_frozen: ModuleType | None
try:
    from moqt import _frozen
except ImportError:  # built without the C extension: payloads stay memoryviews, all tracked
    _frozen = None

TrackKey = tuple[TrackNamespace, bytes]
"""A Full Track Name: (Track Namespace fields, Track Name)."""

OBJECT_OVERHEAD = 64
"""Octets charged per cached object besides its payload (bookkeeping)."""
DEFAULT_TOMBSTONE_MS = 60_000

Held: TypeAlias = "Bytes | FrozenSlice"
"""A read-only buffer the cache keeps: ``bytes``, or a slice of received data."""
Payload: TypeAlias = "Held | tuple[Held, ...]"
"""A cached payload: one read-only buffer, or the read-only pieces it arrived in, in order
(never joined; :meth:`CachedObject.sendable` is what a session writes)."""


KEEP_VIEW_MIN = 16 << 10
"""A read-only view at least this long is cached as it is; a shorter one is copied, so that a
small piece never keeps a whole receive buffer (up to 1 MiB) alive by itself."""


def frozen_payload(data: Bytes) -> Held:
    """``data`` as a payload the cache may keep: itself when ``bytes``; a read-only view
    (received data, which is never rewritten) of at least :data:`KEEP_VIEW_MIN` octets, as a
    ``FrozenSlice`` of the same octets where that is built; else a copy."""
    if type(data) is bytes:
        return data
    if type(data) is memoryview and data.readonly and len(data) >= KEEP_VIEW_MIN:
        if _frozen is not None and data.c_contiguous and data.itemsize == 1:
            try:
                frozen: FrozenSlice = _frozen.FrozenSlice(data)
            except (TypeError, ValueError, BufferError):
                return data  # an exporter that will not export itself plainly: keep the view
            return frozen
        return data
    return bytes(data)


def _untrack(frozen: ModuleType, obj: CachedObject, location: Location) -> None:
    """Take a cached object off the collector's lists, with its Location, its payload's tuple
    and its extensions (pairs of an int, an enum member or bytes): nothing of it refers to
    anything that could refer back to it, so no cycle passes through it."""
    untrack = frozen.untrack
    untrack(obj)
    untrack(location)
    if type(obj.payload) is tuple:
        untrack(obj.payload)
    if obj.extensions:
        for pair in obj.extensions:
            untrack(pair)
        untrack(obj.extensions)


def _sendable(piece: Held) -> Bytes:
    """A kept buffer as a session writes it (a FrozenSlice through a view of it)."""
    return piece if type(piece) is bytes or type(piece) is memoryview else memoryview(piece)


def same_bytes(a: Bytes, b: Bytes) -> bool:
    """Whether two buffers hold the same octets (compared as ``bytes``: comparing memoryviews
    goes item by item, some twenty times slower)."""
    if len(a) != len(b):
        return False
    return (a if type(a) is bytes else bytes(a)) == (b if type(b) is bytes else bytes(b))


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedObject:
    """One cached object: the canonical properties and the payload (d16 §8 caching).

    ``subgroup_id`` None means the object was sent as a datagram; ``publisher_priority`` None
    means it inherited the default; ``digest`` is the SHA-256 of the payload when the relay
    computed it (KV block tracks). ``payload`` is read-only (see :func:`frozen_payload`), maybe
    in pieces (:data:`Payload`): :attr:`size` and :meth:`payload_bytes` see it whole.
    """

    group_id: int
    object_id: int
    subgroup_id: int | None
    publisher_priority: int | None
    extensions: tuple[KeyValuePair, ...]
    status: ObjectStatus
    payload: Payload
    arrived_ms: int
    digest: bytes | None = None

    @property
    def location(self) -> Location:
        """The object's Location."""
        return Location(self.group_id, self.object_id)

    @property
    def size(self) -> int:
        """The payload's length in octets."""
        payload = self.payload
        return sum(map(len, payload)) if type(payload) is tuple else len(payload)

    def payload_bytes(self) -> Bytes:
        """The payload as one buffer (joined, a copy, when it is in pieces)."""
        payload = self.payload
        return b"".join(payload) if isinstance(payload, tuple) else _sendable(payload)

    def sendable(self) -> Bytes | tuple[Bytes, ...]:
        """The payload as a session writes it: the same buffers, none joined or copied."""
        payload = self.payload
        if isinstance(payload, tuple):
            return tuple(map(_sendable, payload))
        return _sendable(payload)

    @property
    def charge(self) -> int:
        """Octets this object counts against the budget."""
        return self.size + OBJECT_OVERHEAD

    def conflict(self, other: CachedObject) -> str | None:
        """Why ``other`` (a copy of this object) makes the track malformed, or None.

        Extensions may change between copies (d16: only as each extension allows); the
        payload, subgroup, priority and status may not.
        """
        if not same_bytes(other.payload_bytes(), self.payload_bytes()):
            return "a different payload for a cached object"
        return self.header_conflict(other.subgroup_id, other.publisher_priority, other.status)

    def header_conflict(
        self, subgroup_id: int | None, publisher_priority: int | None, status: ObjectStatus
    ) -> str | None:
        """Why a copy with these header fields conflicts with this object, or None."""
        if subgroup_id != self.subgroup_id:
            return "a different subgroup or forwarding preference for a cached object"
        priorities = (publisher_priority, self.publisher_priority)
        if None not in priorities and publisher_priority != self.publisher_priority:
            return "a different publisher priority for a cached object"
        if status != self.status:
            return "a different status for a cached object"
        return None


@dataclass(slots=True)
class CacheTrack:
    """The cached objects of one track, with what is known of its extent."""

    key: TrackKey
    extensions: tuple[KeyValuePair, ...] = ()
    objects: dict[Location, CachedObject] = field(default_factory=dict)
    group_ends: dict[int, int] = field(default_factory=dict)
    """Group ID → last Object ID, once known (END_OF_GROUP, a digest match, FETCH_OK)."""
    size: int = 0
    dropped: int = 0
    """How many times objects expired out of this entry (objects are otherwise only added
    while it exists), so that a reader can tell whether what it saw is all still here."""
    oldest_ms: int | None = None
    """The earliest ``arrived_ms`` of the cached objects (None: none cached), so that a look
    for expired objects costs nothing until the first of them expires."""

    @property
    def max_cache_ms(self) -> int | None:
        """MAX_CACHE_DURATION of the track in ms, or None when absent (no limit)."""
        value = track_extension(self.extensions, ExtensionType.MAX_CACHE_DURATION)
        return value if isinstance(value, int) else None

    @property
    def largest(self) -> Location | None:
        """The largest cached Location."""
        return max(self.objects) if self.objects else None

    def expires_ms(self) -> int | None:
        """When the earliest object stops being servable, or None when nothing expires."""
        duration = self.max_cache_ms
        if duration is None or self.oldest_ms is None:
            return None
        return self.oldest_ms + duration

    def in_group(self, group_id: int) -> list[CachedObject]:
        """The cached objects of one group, by Object ID."""
        found = [obj for loc, obj in self.objects.items() if loc.group == group_id]
        return sorted(found, key=lambda obj: obj.object_id)


class PutResult(Enum):
    """What :meth:`ObjectCache.put` did with an object."""

    STORED = "stored"
    DUPLICATE = "duplicate"  # the same object was already cached
    MALFORMED = "malformed"  # it conflicts with the cached copy: the track is dropped
    REFUSED = "refused"  # the track is tombstoned or the cache is past its hard limit


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """A FETCH the cache can answer: the objects in order and the FETCH_OK fields."""

    objects: tuple[CachedObject, ...]
    end_location: Location
    end_of_track: bool
    extensions: tuple[KeyValuePair, ...]


class Malformed(Enum):
    """The lookup's answer for a tombstoned track."""

    TRACK = "malformed"


class ObjectCache:
    """Objects by (Full Track Name, Group, Object), a byte budget and LRU order by track.

    Raises:
        ValueError: a budget that is not positive, or a hard limit below the budget.
    """

    def __init__(
        self,
        budget: int,
        *,
        hard_limit: int | None = None,
        tombstone_ms: int = DEFAULT_TOMBSTONE_MS,
    ) -> None:
        if budget <= 0:
            raise ValueError("the cache budget must be positive")
        self.budget = budget
        self.hard_limit = 2 * budget if hard_limit is None else hard_limit
        if self.hard_limit < budget:
            raise ValueError("the hard limit must be at least the budget")
        self.tombstone_ms = tombstone_ms
        self.size = 0
        self._tracks: OrderedDict[TrackKey, CacheTrack] = OrderedDict()  # LRU first
        self._tombstones: dict[TrackKey, tuple[int, str]] = {}  # key → (until_ms, reason)
        self._evicting: set[TrackKey] = set()
        # (first expiry, track), and the earliest one queued per cached track: expire() pops
        # the due ones; a track whose first expiry moved later is looked at then, queued again
        self._queued: dict[TrackKey, int] = {}
        self._deadlines: Deadlines[TrackKey] = Deadlines(self._queued.get)
        self._stones: Deadlines[TrackKey] = Deadlines(self._stone_until)  # the tombstones

    def __len__(self) -> int:
        return len(self._tracks)

    def __contains__(self, key: object) -> bool:
        return key in self._tracks

    def keys(self) -> list[TrackKey]:
        """The cached tracks, least recently used first."""
        return list(self._tracks)

    @property
    def tombstones(self) -> int:
        """How many malformed tracks are remembered (refused until their time is over)."""
        return len(self._tombstones)

    @property
    def over_budget(self) -> bool:
        """Whether the cached octets exceed the budget."""
        return self.size > self.budget

    # --- tracks ----------------------------------------------------------------------------

    def track(self, key: TrackKey) -> CacheTrack | None:
        """The cached track, without touching its LRU position."""
        return self._tracks.get(key)

    def open_track(self, key: TrackKey, extensions: Iterable[KeyValuePair] = ()) -> CacheTrack:
        """The track's entry, created when absent; ``extensions`` (from SUBSCRIBE_OK, PUBLISH
        or FETCH_OK) replace the known ones when given."""
        entry = self._tracks.get(key)
        if entry is None:
            entry = self._tracks[key] = CacheTrack(key)
        given = tuple(extensions)
        if given:
            entry.extensions = given
            self._queue_expiry(entry)  # MAX_CACHE_DURATION may have come or shortened
        return entry

    def touch(self, key: TrackKey) -> None:
        """Mark the track as just used (LRU)."""
        if key in self._tracks:
            self._tracks.move_to_end(key)

    def set_group_end(self, key: TrackKey, group_id: int, last_object_id: int) -> None:
        """Record that ``last_object_id`` is the last object of the group."""
        entry = self._tracks.get(key)
        if entry is not None:
            entry.group_ends[group_id] = last_object_id

    # --- objects ---------------------------------------------------------------------------

    def get(self, key: TrackKey, location: Location, now_ms: int) -> CachedObject | None:
        """The cached, unexpired object at ``location``."""
        entry = self._tracks.get(key)
        if entry is None:
            return None
        self._drop_expired(entry, now_ms)
        return entry.objects.get(location)

    def put(self, key: TrackKey, obj: CachedObject) -> PutResult:
        """Cache ``obj`` (its ``arrived_ms`` is the current time).

        A copy that differs from the cached object marks the track malformed: its objects are
        dropped and it is tombstoned (d16: a relay does not cache or serve a malformed track).
        """
        now_ms = obj.arrived_ms
        if self._tombstones and self.is_malformed(key, now_ms):
            return PutResult.REFUSED
        entry = self._tracks.get(key)
        if entry is None:
            entry = self._tracks[key] = CacheTrack(key)
        elif self._drop_expired(entry, now_ms) and key not in self._tracks:
            # every object had expired, and the entry with them: a fresh one, same extensions
            entry = self._tracks[key] = CacheTrack(key, entry.extensions)
        location = obj.location
        cached = entry.objects.get(location)
        if cached is not None:
            reason = cached.conflict(obj)
            if reason is not None:
                self.mark_malformed(key, now_ms, reason)
                return PutResult.MALFORMED
            return PutResult.DUPLICATE
        charge = obj.charge
        if self.size + charge > self.hard_limit:
            return PutResult.REFUSED
        entry.objects[location] = obj
        if _frozen is not None:
            _untrack(_frozen, obj, location)
        if entry.oldest_ms is None or obj.arrived_ms < entry.oldest_ms:
            entry.oldest_ms = obj.arrived_ms
            self._queue_expiry(entry)
        entry.size += charge
        self.size += charge
        self._tracks.move_to_end(key)
        return PutResult.STORED

    # --- malformed tracks ------------------------------------------------------------------

    def mark_malformed(self, key: TrackKey, now_ms: int, reason: str) -> None:
        """Drop the track and refuse it for ``tombstone_ms`` (d16 malformed track)."""
        self._remove(key)
        self._tombstones[key] = (now_ms + self.tombstone_ms, reason)
        self._stones.push(now_ms + self.tombstone_ms, key)

    def _stone_until(self, key: TrackKey) -> int | None:
        stone = self._tombstones.get(key)
        return None if stone is None else stone[0]

    def is_malformed(self, key: TrackKey, now_ms: int) -> bool:
        """Whether the track is tombstoned as malformed at ``now_ms``."""
        if not self._tombstones:
            return False
        stone = self._tombstones.get(key)
        if stone is None:
            return False
        if now_ms >= stone[0]:
            del self._tombstones[key]
            return False
        return True

    # --- serving FETCH ---------------------------------------------------------------------

    def lookup(
        self, key: TrackKey, start: Location, end: Location, now_ms: int
    ) -> FetchPlan | Malformed | None:
        """The objects of a standalone FETCH ``start``..``end`` (End is the last Location plus
        one; End Object 0 means the whole group), when the cache holds all of them.

        Returns None on a miss: a track or an object not cached (or expired), or a range whose
        end is unknown here. Returns :data:`Malformed.TRACK` for a tombstoned track.
        """
        if self.is_malformed(key, now_ms):
            return Malformed.TRACK
        entry = self._tracks.get(key)
        if entry is None or end < start:
            return None
        self._drop_expired(entry, now_ms)
        largest = entry.largest
        if largest is None or end.group > largest.group:
            return None
        found: list[CachedObject] = []
        for group_id in range(start.group, end.group + 1):
            part = self._group_range(entry, group_id, start, end)
            if part is None:
                return None
            found.extend(part)
        if not found:
            return None
        self._tracks.move_to_end(key)
        last = found[-1].location
        return FetchPlan(tuple(found), last, False, entry.extensions)

    def between(
        self, key: TrackKey, start: Location, last: Location, now_ms: int
    ) -> list[CachedObject]:
        """Whatever is cached from ``start`` to ``last`` inclusive, in order (a joining FETCH
        is answered with the history the relay holds)."""
        entry = self._tracks.get(key)
        if entry is None or self.is_malformed(key, now_ms):
            return []
        self._drop_expired(entry, now_ms)
        found = [obj for loc, obj in entry.objects.items() if start <= loc <= last]
        return sorted(found, key=lambda obj: obj.location)

    @staticmethod
    def _group_range(
        entry: CacheTrack, group_id: int, start: Location, end: Location
    ) -> list[CachedObject] | None:
        first = start.object if group_id == start.group else 0
        known_end = entry.group_ends.get(group_id)
        if group_id == end.group and end.object > 0:
            last = end.object - 1
            if known_end is not None:
                last = min(last, known_end)
        elif known_end is not None:
            last = known_end
        else:
            return None  # the whole group is asked for and its end is unknown
        present = entry.in_group(group_id)
        if not present or last > present[-1].object_id:
            return None
        wanted = [obj for obj in present if first <= obj.object_id <= last]
        if len(wanted) != last - first + 1:
            return None  # a gap: unknown whether those objects exist
        return wanted

    # --- expiry and eviction ---------------------------------------------------------------

    def _drop_expired(self, entry: CacheTrack, now_ms: int) -> bool:
        duration = entry.max_cache_ms
        oldest = entry.oldest_ms
        if duration is None or oldest is None or now_ms < oldest + duration:
            return False  # nothing has expired yet: no scan of the track's objects
        # d16: a relay MUST NOT start forwarding an object MAX_CACHE_DURATION after arrival
        stale = [loc for loc, obj in entry.objects.items() if now_ms >= obj.arrived_ms + duration]
        for loc in stale:
            obj = entry.objects.pop(loc)
            entry.size -= obj.charge
            self.size -= obj.charge
        entry.oldest_ms = min((obj.arrived_ms for obj in entry.objects.values()), default=None)
        if stale:
            entry.dropped += 1
        if stale and not entry.objects:
            self._remove(entry.key)
        return bool(stale)

    def expire(self, now_ms: int) -> list[TrackKey]:
        """Drop every expired object, and the tombstones whose time is over; return the
        tracks that lost objects. Only the tracks whose first expiry has come are looked at
        (amortised O(log n) each)."""
        for _, key in self._stones.pop_due(now_ms):
            self.is_malformed(key, now_ms)  # drops it unless a later one replaced it
        queued = self._queued
        due: list[TrackKey] = []
        for deadline, key in self._deadlines.pop_due(now_ms):
            if queued.get(key) == deadline:  # else stale: moved, or its track left the cache
                del queued[key]
                due.append(key)
        lost: list[TrackKey] = []
        for key in due:
            entry = self._tracks.get(key)
            if entry is None:
                continue  # evicted or found malformed since
            if self._drop_expired(entry, now_ms):
                lost.append(key)
            if self._tracks.get(key) is entry:
                self._queue_expiry(entry)  # its next object to expire
        return lost

    def _queue_expiry(self, entry: CacheTrack) -> None:
        """Queue the track's first expiry for :meth:`expire`, unless one no later is queued."""
        deadline = entry.expires_ms()
        if deadline is None:
            return
        queued = self._queued.get(entry.key)
        if queued is None or deadline < queued:
            self._queued[entry.key] = deadline
            self._deadlines.push(deadline, entry.key)

    def victims(self, pinned: Callable[[TrackKey], bool]) -> list[TrackKey]:
        """Tracks to evict, least recently used first, until the rest fits the budget.

        Pinned tracks (leased blocks, spec §6.6) and tracks already being evicted are skipped;
        the proposed tracks are marked as being evicted until :meth:`evict` or
        :meth:`keep`.
        """
        excess = self.size - self.budget - sum(self._tracks[k].size for k in self._evicting)
        chosen: list[TrackKey] = []
        for key, entry in self._tracks.items():
            if excess <= 0:
                break
            if key in self._evicting or pinned(key):
                continue
            chosen.append(key)
            excess -= entry.size
        self._evicting.update(chosen)
        return chosen

    def keep(self, key: TrackKey) -> None:
        """Cancel a proposed eviction (the track became pinned meanwhile)."""
        self._evicting.discard(key)

    def evict(self, key: TrackKey) -> CacheTrack | None:
        """Remove the track; returns its entry (None when it was not cached)."""
        return self._remove(key)

    def _remove(self, key: TrackKey) -> CacheTrack | None:
        self._evicting.discard(key)
        self._queued.pop(key, None)
        entry = self._tracks.pop(key, None)
        if entry is not None:
            self.size -= entry.size
        return entry
