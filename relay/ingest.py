"""Objects arriving from upstream, checked against the cache and cached (d16 relay rules): sans-I/O.

One :class:`ObjectIngest` follows the objects of one upstream request (a subscription, a
PUBLISH or a FETCH) piece by piece, as the session hands them out:

* an object already cached is compared with the cached copy as its payload arrives, so a
  differing copy is caught before its differing bytes are forwarded (``begin``/``data`` return
  the reason; the track is then tombstoned as malformed);
* a new object is cached at its end, as the pieces it arrived in (read-only received data is
  kept, never copied or joined: :func:`~relay.cache.frozen_payload`);
  for a stored KV replica track its layer digest is computed then (two objects at a time
  where a batch completed several: :meth:`ObjectIngest.store_each`), checked against the
  in-band digest, and the completed replica is reported when the layer digests hash to the
  track name (:mod:`relay.kv`; :class:`~relay.kv.ReplicaWatch` asks once per block);
* status objects are not cached (FETCH carries none in d16); END_OF_GROUP and END_OF_TRACK, and
  a FIN on a stream whose header says END_OF_GROUP, record the group's last object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvsp import sha256x2
from moqt.errors import ObjectStatus
from moqt.objects import ObjectDatagram, ObjectStart
from moqt.wire import Bytes, Location

from .cache import (
    CachedObject,
    Held,
    ObjectCache,
    PutResult,
    TrackKey,
    frozen_payload,
    same_bytes,
)
from .kv import BlockTrack, KVReplica, ReplicaWatch, block_track, check_layer


@dataclass(slots=True)
class _Object:
    start: ObjectStart
    cached: CachedObject | None  # the copy to compare with, or None for a new object
    pieces: list[Held] = field(default_factory=list)  # of a new object, as they arrived
    offset: int = 0


@dataclass(frozen=True, slots=True)
class CompleteObject:
    """A new object whose payload is complete, not yet cached (:meth:`ObjectIngest.store`)."""

    start: ObjectStart
    pieces: list[Held]


def _cached_object(complete: CompleteObject, digest: bytes | None, now_ms: int) -> CachedObject:
    start, pieces = complete.start, complete.pieces
    return CachedObject(
        group_id=start.group_id,
        object_id=start.object_id,
        subgroup_id=start.subgroup_id,
        publisher_priority=start.publisher_priority,
        extensions=start.extensions,
        status=start.status,
        payload=pieces[0] if len(pieces) == 1 else tuple(pieces),
        arrived_ms=now_ms,
        digest=digest,
    )


@dataclass(frozen=True, slots=True)
class Ended:
    """What the end of an object did: ``malformed`` holds the reason when the track is now
    malformed; ``replica`` the KV replica it completed."""

    malformed: str | None = None
    replica: KVReplica | None = None


class ObjectIngest:
    """The objects of one upstream request of track ``key``, into ``cache``."""

    def __init__(self, cache: ObjectCache, key: TrackKey) -> None:
        self.cache = cache
        self.key = key
        self.block: BlockTrack | None = block_track(key)
        self._watch = None if self.block is None else ReplicaWatch(self.block)
        self._objects: dict[int, _Object] = {}  # stream id → object in progress
        self._last: dict[int, Location] = {}  # stream id → last object seen on it

    def _malformed(self, reason: str, now_ms: int) -> str:
        self.cache.mark_malformed(self.key, now_ms, reason)
        return reason

    def begin(self, stream_id: int, start: ObjectStart, now_ms: int) -> str | None:
        """An object header arrived; the reason when it makes the track malformed."""
        if self.cache.is_malformed(self.key, now_ms):
            return "the track is malformed"
        location = Location(start.group_id, start.object_id)
        self._last[stream_id] = location
        if start.status != ObjectStatus.NORMAL:
            if start.object_id > 0:  # the status object itself is past the group's last object
                self.cache.set_group_end(self.key, start.group_id, start.object_id - 1)
            return None
        cached = self.cache.get(self.key, location, now_ms)
        if cached is not None:
            reason = cached.header_conflict(
                start.subgroup_id, start.publisher_priority, start.status
            )
            if reason is None and cached.size != start.payload_length:
                reason = "a different payload length for a cached object"
            if reason is not None:
                return self._malformed(reason, now_ms)
        self._objects[stream_id] = _Object(start, cached)
        return None

    def data(self, stream_id: int, chunk: Bytes, now_ms: int) -> str | None:
        """A piece of the current object's payload; the reason when it differs from the
        cached copy. A read-only piece is kept as it is (the caller may forward it too)."""
        current = self._objects.get(stream_id)
        if current is None:
            return None
        if current.cached is not None:
            end = current.offset + len(chunk)
            if not same_bytes(current.cached.payload_bytes()[current.offset : end], chunk):
                self._objects.pop(stream_id)
                return self._malformed("a different payload for a cached object", now_ms)
        else:
            current.pieces.append(frozen_payload(chunk))
        current.offset += len(chunk)
        return None

    def end(self, stream_id: int, now_ms: int) -> Ended:
        """The current object's payload is complete: cache it."""
        return self.store(self.complete(stream_id), now_ms)

    def complete(self, stream_id: int) -> CompleteObject | None:
        """The current object's payload is complete: take it off the stream (the next object
        may begin) to :meth:`store` later; None when there is nothing to store."""
        current = self._objects.pop(stream_id, None)
        if current is None or current.cached is not None:
            return None
        return CompleteObject(current.start, current.pieces)

    def store(self, complete: CompleteObject | None, now_ms: int) -> Ended:
        """Cache an object :meth:`complete` took (its layer digest computed now, for a KV
        track)."""
        if complete is None:
            return Ended()
        digest = None if self.block is None else sha256x2.digest_pieces(complete.pieces)
        return self._store(_cached_object(complete, digest, now_ms), now_ms)

    def store_each(self, completes: Sequence[CompleteObject], now_ms: int) -> Iterator[Ended]:
        """Cache objects :meth:`complete` took, in the order they completed, yielding what each
        did; the caller stops at the first malformed one (the rest would be refused).

        For a KV track their layer digests are computed two at a time, on the two lanes of
        :func:`kvsp.sha256x2.digest_pair`, each checked (:func:`~relay.kv.check_layer`) before
        its object is cached; an object left without a partner is hashed alone, so nothing
        waits past this call for an object that may never come.
        """
        if self.block is None:
            for complete in completes:
                yield self._store(_cached_object(complete, None, now_ms), now_ms)
            return
        for at in range(0, len(completes), 2):
            pair = completes[at : at + 2]
            if len(pair) == 2:
                digests: tuple[bytes, ...] = sha256x2.digest_pair(pair[0].pieces, pair[1].pieces)
            else:
                digests = (sha256x2.digest_pieces(pair[0].pieces),)
            for complete, digest in zip(pair, digests, strict=True):
                yield self._store(_cached_object(complete, digest, now_ms), now_ms)

    def _store(self, obj: CachedObject, now_ms: int) -> Ended:
        if self.block is not None:
            reason = check_layer(obj)
            if reason is not None:
                return Ended(malformed=self._malformed(reason, now_ms))
        result = self.cache.put(self.key, obj)
        if result == PutResult.MALFORMED:
            return Ended(malformed="a different copy of a cached object")
        if result != PutResult.STORED or self._watch is None:
            return Ended()
        track = self.cache.track(self.key)
        replica = None if track is None else self._watch.stored(track)
        if replica is not None:
            self.cache.set_group_end(self.key, 0, replica.layers - 1)
        return Ended(replica=replica)

    def stream_finished(self, stream_id: int, end_of_group: bool) -> None:
        """The stream ended with a FIN; with END_OF_GROUP its last object ends the group."""
        self._objects.pop(stream_id, None)
        last = self._last.pop(stream_id, None)
        if end_of_group and last is not None:
            self.cache.set_group_end(self.key, last.group, last.object)

    def stream_reset(self, stream_id: int) -> None:
        """The stream was reset: drop the object in progress."""
        self._objects.pop(stream_id, None)
        self._last.pop(stream_id, None)

    def datagram(self, datagram: ObjectDatagram, now_ms: int) -> Ended:
        """A whole object that arrived as a datagram."""
        if self.cache.is_malformed(self.key, now_ms):
            return Ended(malformed="the track is malformed")
        if datagram.status != ObjectStatus.NORMAL:
            if datagram.object_id > 0:
                self.cache.set_group_end(self.key, datagram.group_id, datagram.object_id - 1)
            return Ended()
        payload = frozen_payload(datagram.payload)
        obj = CachedObject(
            group_id=datagram.group_id,
            object_id=datagram.object_id,
            subgroup_id=None,
            publisher_priority=datagram.publisher_priority,
            extensions=datagram.extensions,
            status=datagram.status,
            payload=payload,
            arrived_ms=now_ms,
            digest=hashlib.sha256(payload).digest() if self.block is not None else None,
        )
        ended = self._store(obj, now_ms)
        if datagram.end_of_group and ended.malformed is None:
            self.cache.set_group_end(self.key, datagram.group_id, datagram.object_id)
        return ended
