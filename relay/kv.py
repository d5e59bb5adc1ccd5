"""KV blocks as MOQT tracks, seen from the relay (DESIGN.md §4; spec §4.3, §4.4): sans-I/O.

A stored replica track has the namespace ``("kvsp", "1", compat hex32, scope hex16, block key
hex32)`` and the replica digest (hex32) as its name; group 0 holds one object per layer, whose
payload is K‖V of that layer, so SHA-256(payload) is the layer digest. The relay:

* classifies a namespace for authorization (:func:`classify`): plain, a KV scope, or a
  ``kvsp`` namespace too short (or malformed) to name one scope;
* checks each object of a stored track against its in-band layer digest, when present
  (:func:`check_layer`);
* knows a stored track is complete when the layer digests of objects 0..L-1 hash to the track
  name (:func:`complete_replica`): the name pins the bytes, so no end-of-group signal is needed;
* builds the Replica Record it publishes for such a track (:func:`replica_record`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from kvsp.container import header_size
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import ReplicaRecord, Residency
from kvsp.registries import Tier
from moqt.errors import MOQTError
from moqt.objects import find_layer_digest
from moqt.wire import TrackNamespace

from .cache import CachedObject, CacheTrack, TrackKey

KV_APP = b"kvsp"
KV_VERSION = b"1"
CODEC_RAW = 1
_HEX32 = re.compile(rb"[0-9a-f]{64}")
_HEX16 = re.compile(rb"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Plain:
    """A namespace outside KVSP."""


@dataclass(frozen=True, slots=True)
class Broad:
    """A ``kvsp`` namespace that names no single scope (too short, or malformed)."""


@dataclass(frozen=True, slots=True)
class Scoped:
    """A KV namespace with its scope (4 fields: a scope prefix; 5: one block)."""

    scope_id: bytes


NamespaceClass = Plain | Broad | Scoped


def classify(namespace: TrackNamespace) -> NamespaceClass:
    """Which authorization rule applies to ``namespace`` (DESIGN §3, §4)."""
    if not namespace or namespace[0] != KV_APP:
        return Plain()
    if len(namespace) < 4 or namespace[1] != KV_VERSION:
        return Broad()
    if _HEX32.fullmatch(namespace[2]) is None or _HEX16.fullmatch(namespace[3]) is None:
        return Broad()
    return Scoped(bytes.fromhex(namespace[3].decode("ascii")))


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
    if len(namespace) != 5 or not isinstance(classify(namespace), Scoped):
        return None
    if _HEX32.fullmatch(namespace[4]) is None or _HEX32.fullmatch(name) is None:
        return None
    return BlockTrack(
        CompatId(bytes.fromhex(namespace[2].decode())),
        ScopeId(bytes.fromhex(namespace[3].decode())),
        BlockKey(bytes.fromhex(namespace[4].decode())),
        bytes.fromhex(name.decode()),
    )


def layer_digest(payload: bytes) -> bytes:
    """The layer digest of one object's payload (spec §4.3: SHA-256 of K‖V)."""
    return hashlib.sha256(payload).digest()


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
    for obj in track.in_group(0):
        if obj.object_id != len(layers) or obj.digest is None:
            break
        layers.append(obj)
    if not layers or len(layers) != len(track.objects):
        return None
    digests = tuple(obj.digest for obj in layers if obj.digest is not None)
    if hashlib.sha256(b"".join(digests)).digest() != block.digest:
        return None
    size = header_size(len(layers)) + sum(len(obj.payload) for obj in layers)
    return KVReplica(block, track.key, digests, size, track.expires_ms())


def encode_namespace_octets(namespace: TrackNamespace) -> bytes:
    """``moqt_namespace`` octets: each field preceded by its length as one octet (§4.4)."""
    out = bytearray()
    for part in namespace:
        out.append(len(part))
        out += part
    return bytes(out)


def replica_record(
    replica: KVReplica, *, holder: str, lease_base: str | None, ttl_ms: int
) -> ReplicaRecord:
    """The Replica Record the relay publishes for a cached replica (§4.4, DESIGN §4).

    ``holder`` is the relay's ``moqt://`` URI, ``lease_base`` its HTTP face; every layer is in
    host memory; ``size`` is the container size (header plus payloads), codec raw.
    """
    block = replica.block
    return ReplicaRecord(
        block_key=block.block_key,
        compat_id=block.compat_id,
        scope_id=block.scope_id,
        holder=holder,
        codec=CODEC_RAW,
        size=replica.size,
        digest=block.digest,
        layer_digests=replica.layer_digests,
        residency=(Residency(tier=Tier.HOST, first=0, last=replica.layers - 1),),
        ttl_ms=ttl_ms,
        moqt_namespace=encode_namespace_octets(replica.key[0]),
        lease_base=lease_base,
    )
