"""KV blocks as MOQT tracks, seen from the relay (DESIGN.md §4; spec §4.3, §4.4): sans-I/O.

The mapping itself (names, objects, the in-band layer digest) is :mod:`kvsp.moqt_mapping`;
this module applies it to the relay's cache:

* :func:`block_track` says which block a cached track stores, if it is a stored replica track;
* :func:`check_layer` checks each object against its in-band layer digest, when present;
* :func:`complete_replica` knows a stored track is complete when the layer digests of objects
  0..L-1 hash to the track name: the name pins the bytes, so no end-of-group signal is needed;
* :class:`ReplicaWatch` follows those digests as objects are cached (one running hash), so that
  :func:`complete_replica` runs once per block, when they first hash to the name, not once
  per object;
* :func:`replica_record` builds the Replica Record the relay publishes for such a track.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvsp.container import header_size, replica_digest
from kvsp.errors import InvalidIdentifier
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import (
    KV_GROUP,
    encode_namespace_octets,
    find_layer_digest,
    parse_kv_namespace,
    parse_stored_track_name,
)
from kvsp.records import ReplicaRecord, Residency
from kvsp.registries import Codec, Tier
from moqt.errors import MOQTError
from moqt.wire import Location

from .cache import CachedObject, CacheTrack, TrackKey


@dataclass(frozen=True, slots=True)
class BlockTrack:
    """A stored replica track's identity: the block and the replica digest it names."""

    compat_id: CompatId
    scope_id: ScopeId
    block_key: BlockKey
    digest: bytes

    @property
    def packed(self) -> bytes:
        """compat ‖ scope ‖ key: the lease and record key of the block (80 octets)."""
        return self.compat_id + self.scope_id + self.block_key


def block_track(key: TrackKey) -> BlockTrack | None:
    """The block a track stores, when ``key`` names a stored replica track (DESIGN §4)."""
    namespace, name = key
    digest = parse_stored_track_name(name)
    if digest is None:
        return None
    try:
        compat, scope, block_key = parse_kv_namespace(namespace)
    except InvalidIdentifier:
        return None
    return BlockTrack(compat, scope, block_key, digest)


def check_layer(obj: CachedObject) -> str | None:
    """Why the object's in-band layer digest (DESIGN §4) rejects it, or None.

    An object without the extension passes: the track name still pins the bytes.
    """
    try:
        claimed = find_layer_digest(obj.extensions)
    except MOQTError as exc:
        return f"unreadable layer digest extension: {exc.reason}"
    if claimed is not None and obj.digest is not None and claimed != obj.digest:
        return f"layer {obj.object_id}: payload does not match its layer digest"
    return None


@dataclass(frozen=True, slots=True)
class KVReplica:
    """A complete, verified stored replica in the cache."""

    block: BlockTrack
    key: TrackKey
    layer_digests: tuple[bytes, ...]
    size: int
    expires_ms: int | None

    @property
    def layers(self) -> int:
        """L, the number of layers."""
        return len(self.layer_digests)


def complete_replica(block: BlockTrack, track: CacheTrack) -> KVReplica | None:
    """The replica, when group 0 of ``track`` holds objects 0..L-1 whose layer digests hash to
    the track name (spec §4.3 replica digest), and no object beyond them."""
    layers: list[CachedObject] = []
    for obj in track.in_group(KV_GROUP):
        if obj.object_id != len(layers) or obj.digest is None:
            break
        layers.append(obj)
    if not layers or len(layers) != len(track.objects):
        return None
    digests = tuple(obj.digest for obj in layers if obj.digest is not None)
    if replica_digest(digests) != block.digest:
        return None
    size = header_size(len(layers)) + sum(obj.size for obj in layers)
    return KVReplica(block, track.key, digests, size, track.expires_ms())


class ReplicaWatch:
    """Whether a stored replica track may have just become complete, in O(1) per cached object.

    It keeps a running SHA-256 over the layer digests of group 0's objects 0, 1, ... as far as
    the cache holds them without a gap (objects cached by other requests included). Only when
    a newly cached object extends that run and the run hashes to the track name is
    :func:`complete_replica` asked, which checks the whole track again: the watch only decides
    when to ask. The run restarts when the cache entry was replaced (evicted, tombstoned) or
    objects expired out of it (:attr:`CacheTrack.dropped`).
    """

    def __init__(self, block: BlockTrack) -> None:
        self.block = block
        self._track: CacheTrack | None = None
        self._dropped = 0
        self._count = 0
        self._hash = hashlib.sha256()

    def stored(self, track: CacheTrack) -> KVReplica | None:
        """An object of ``track`` was just cached: the replica, when the track is now complete."""
        if track is not self._track or track.dropped != self._dropped:
            self._track, self._dropped = track, track.dropped
            self._count, self._hash = 0, hashlib.sha256()
        objects, count, extended = track.objects, self._count, False
        while (obj := objects.get(Location(KV_GROUP, count))) is not None:
            if obj.digest is None:
                break
            self._hash.update(obj.digest)
            count += 1
            extended = True
        self._count = count
        if not extended or self._hash.copy().digest() != self.block.digest:
            return None
        return complete_replica(self.block, track)


def replica_record(
    replica: KVReplica,
    *,
    holder: str,
    lease_base: str | None,
    ttl_ms: int,
    carriers: tuple[str, ...] = (),
    site: str | None = None,
    zone: str | None = None,
) -> ReplicaRecord:
    """The Replica Record the relay publishes for a cached replica (§4.4, DESIGN §4).

    ``holder`` is the relay's ``moqt://`` URI, ``lease_base`` its HTTP face, ``carriers`` its
    QMux URIs (``moqt_carriers``), ``site``/``zone`` its labels (extension members); every
    layer is in host memory; ``size`` is the container size (header plus payloads), codec raw.
    """
    block = replica.block
    return ReplicaRecord(
        block_key=block.block_key,
        compat_id=block.compat_id,
        scope_id=block.scope_id,
        holder=holder,
        codec=Codec.RAW.value,
        size=replica.size,
        digest=block.digest,
        layer_digests=replica.layer_digests,
        residency=(Residency(tier=Tier.HOST, first=0, last=replica.layers - 1),),
        ttl_ms=ttl_ms,
        moqt_namespace=encode_namespace_octets(replica.key[0]),
        lease_base=lease_base,
        moqt_carriers=carriers or None,
        site=site,
        zone=zone,
    )
