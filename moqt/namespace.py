"""KV blocks as MOQT tracks (DESIGN.md §4; spec §4.3 digests, §4.4 ``moqt_namespace``).

The mapping, sans-I/O, shared by publishers, consumers and the relay:

* namespace = five ASCII fields ``("kvsp", "1", compat_id hex32, scope_id hex16, block_key
  hex32)``; an instance PUBLISH_NAMESPACEs the four-field scope prefix;
* a stored replica's track is named by its replica digest as hex32, so a name pins the bytes;
* a block being produced is the track ``live-`` + ``uri_id(producer)``;
* group 0, object id = layer index, payload = K section ‖ V section of that layer; layers
  ``a..b`` are FETCHed as ``{0,a}`` .. ``{0,b+1}`` (an End Object of 0 means the whole group).

:class:`LayerAssembler` turns the objects of one block back into layers: it places each
payload piece where its layer goes (one buffer for the block, or the caller's
:class:`~kvsp.container_reader.LayerSink`) and hashes it on the way, so a layer can be checked
against its layer digest the moment its last octet arrives.

:func:`parse_kv_namespace` and :func:`parse_stored_track_name` are strict: anything but the
exact form above raises :class:`~kvsp.errors.InvalidIdentifier`, so a relay can refuse a
request for a name that is not a KV block without guessing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from kvsp.container import Geometry, Layer
from kvsp.container_reader import LayerSink
from kvsp.errors import ContainerError, InvalidIdentifier
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id

from .wire import Bytes, Location, TrackNamespace

KV_TAG = b"kvsp"
"""Field 1: the application tag, for PUBLISH_NAMESPACE / SUBSCRIBE_NAMESPACE prefix matching."""
KV_MAPPING_VERSION = b"1"
"""Field 2: the version of this mapping."""
KV_NAMESPACE_FIELDS = 5
KV_GROUP = 0
"""A block is one group; its objects are its layers."""
LIVE_PREFIX = b"live-"
DIGEST_SIZE = 32
_HEX32 = re.compile(rb"[0-9a-f]{64}")
_HEX16 = re.compile(rb"[0-9a-f]{32}")
_LIVE = re.compile(rb"live-[0-9a-f]{32}")


def _hex(value: bytes, size: int, what: str) -> bytes:
    if len(value) != size:
        raise InvalidIdentifier(f"{what} must be {size} octets, got {len(value)}")
    return value.hex().encode("ascii")


def kv_scope_prefix(compat: CompatId | bytes, scope: ScopeId | bytes) -> TrackNamespace:
    """The four-field prefix an instance PUBLISH_NAMESPACEs: every block of one scope.

    Raises:
        InvalidIdentifier: ``compat`` is not 32 octets or ``scope`` not 16.
    """
    return (
        KV_TAG,
        KV_MAPPING_VERSION,
        _hex(compat, 32, "compat_id"),
        _hex(scope, 16, "scope_id"),
    )


def kv_namespace(
    compat: CompatId | bytes, scope: ScopeId | bytes, key: BlockKey | bytes
) -> TrackNamespace:
    """The five Track Namespace Fields of one block (equal to
    :func:`kvsp.records.kv_namespace_fields`).

    Raises:
        InvalidIdentifier: an identifier of the wrong length.
    """
    return (*kv_scope_prefix(compat, scope), _hex(key, 32, "block_key"))


def parse_kv_namespace(fields: Sequence[Bytes]) -> tuple[CompatId, ScopeId, BlockKey]:
    """The (compat_id, scope_id, block_key) a block's namespace names.

    Raises:
        InvalidIdentifier: not five fields, another tag or mapping version, or an identifier
            field that is not lowercase hex of its exact length.
    """
    if len(fields) != KV_NAMESPACE_FIELDS:
        raise InvalidIdentifier(f"a KV namespace has 5 fields, got {len(fields)}")
    tag, version, compat, scope, key = (bytes(field) for field in fields)
    if tag != KV_TAG or version != KV_MAPPING_VERSION:
        raise InvalidIdentifier(f"not a KVSP v1 namespace: {tag[:16]!r}/{version[:16]!r}")
    for value, pattern, what in (
        (compat, _HEX32, "compat_id"),
        (scope, _HEX16, "scope_id"),
        (key, _HEX32, "block_key"),
    ):
        if pattern.fullmatch(value) is None:
            raise InvalidIdentifier(f"namespace field {what} is not lowercase hex: {value[:80]!r}")
    return (
        CompatId(bytes.fromhex(compat.decode())),
        ScopeId(bytes.fromhex(scope.decode())),
        BlockKey(bytes.fromhex(key.decode())),
    )


def is_kv_namespace(fields: Sequence[Bytes]) -> bool:
    """Whether ``fields`` is a well-formed block namespace (:func:`parse_kv_namespace`)."""
    try:
        parse_kv_namespace(fields)
    except InvalidIdentifier:
        return False
    return True


def stored_track_name(digest: bytes) -> bytes:
    """The track of a stored replica: its replica digest (§4.3) as hex32.

    Raises:
        InvalidIdentifier: ``digest`` is not 32 octets.
    """
    return _hex(digest, DIGEST_SIZE, "replica digest")


def parse_stored_track_name(name: Bytes) -> bytes | None:
    """The replica digest a stored track's name carries; None for any other name (live ones)."""
    raw = bytes(name)
    if _HEX32.fullmatch(raw) is None:
        return None
    return bytes.fromhex(raw.decode())


def live_track_name(producer_uri: str) -> bytes:
    """The track of a block being produced by ``producer_uri``: ``live-`` + its uri_id."""
    return LIVE_PREFIX + uri_id(producer_uri).encode("ascii")


def is_live_track_name(name: Bytes) -> bool:
    """Whether ``name`` has the form of a live track name."""
    return _LIVE.fullmatch(bytes(name)) is not None


def layer_range_locations(first: int, last: int) -> tuple[Location, Location]:
    """The standalone FETCH Start and End of layers ``first..last`` inclusive.

    Raises:
        ValueError: an empty or negative range.
    """
    if not 0 <= first <= last:
        raise ValueError(f"not a layer range: {first}..{last}")
    return Location(KV_GROUP, first), Location(KV_GROUP, last + 1)


def fetch_layer_range(start: Location, end: Location, layer_count: int) -> tuple[int, int] | None:
    """The layers ``(first, last)`` a standalone FETCH of a block of ``layer_count`` layers
    asks for, clipped to the block; None when it covers none of them.

    ``end`` is the last Location plus one; an End Object of 0 means its whole group (d16
    §9.16.1), and a block is group 0 only.
    """
    if start.group != KV_GROUP:
        return None  # groups are never negative, so the range starts past the block
    first = start.object
    if end.group > KV_GROUP or end.object == 0:
        last = layer_count - 1
    else:
        last = min(end.object - 1, layer_count - 1)
    return (first, last) if first <= last else None


def layer_payload_length(section_length: int) -> int:
    """An object's payload length: the K and V sections of one layer."""
    return 2 * section_length


def split_layer_payload(payload: memoryview) -> tuple[memoryview, memoryview]:
    """K and V of one layer's payload (two equal halves for codec raw, §4.3).

    Raises:
        ValueError: an odd payload length.
    """
    size = len(payload)
    if size % 2:
        raise ValueError(f"a layer payload of {size} octets does not split into K and V")
    half = size // 2
    return payload[:half], payload[half:]


class LayerAssembler:
    """The objects of one block (group 0, object id = layer) as layers ``first..last``.

    Feed each object as ``begin`` / ``feed`` (any number of pieces) / ``end``; ``end`` returns
    the layer (views of the block buffer, or of the sink's memory) and its SHA-256, the layer
    digest (§4.3). Codec raw: every payload is K ‖ V with K and V of equal length; with
    ``token_count`` None the token count is read off the first payload's length and the
    geometry. The receiver thus rebuilds what the container header would have said.

    Raises (from ``begin``):
        ContainerError: an object outside group 0 or the range, a repeated layer, or a payload
            length the geometry (and token count) does not give.
    """

    def __init__(
        self,
        geometry: Geometry,
        first: int,
        last: int,
        *,
        token_count: int | None = None,
        sink: LayerSink | None = None,
    ) -> None:
        if not 0 <= first <= last < geometry.layers:
            raise ContainerError(f"layers {first}..{last} of a {geometry.layers}-layer block")
        self.geometry = geometry
        self.first = first
        self.last = last
        self.token_count = token_count
        self._sink = sink
        self._payload_length: int | None = None
        self._buffer: memoryview | None = None
        self._layers: dict[int, Layer] = {}
        self._current: tuple[int, memoryview, memoryview] | None = None
        self._hash = hashlib.sha256()
        self._filled = 0

    @property
    def count(self) -> int:
        """Layers in the range."""
        return self.last - self.first + 1

    @property
    def complete(self) -> bool:
        """Whether every layer of the range has ended."""
        return len(self._layers) == self.count

    def layers(self) -> tuple[Layer, ...]:
        """The layers assembled so far, ascending."""
        return tuple(self._layers[index] for index in sorted(self._layers))

    def _section_length(self, payload_length: int) -> int:
        if payload_length % 2:
            raise ContainerError(f"a layer payload of {payload_length} octets is not K and V")
        section = payload_length // 2
        if self.token_count is None:
            per_token = self.geometry.section_length(1)
            if section == 0 or section % per_token:
                raise ContainerError(
                    f"a {section}-octet K section is not whole tokens of {per_token} octets"
                )
            self.token_count = section // per_token
        elif section != self.geometry.section_length(self.token_count):
            raise ContainerError(
                f"layer payload of {payload_length} octets; {self.token_count} tokens "
                f"need {layer_payload_length(self.geometry.section_length(self.token_count))}"
            )
        return section

    def begin(self, group_id: int, object_id: int, payload_length: int) -> None:
        """An object starts: check it is a layer of the range and find its place.

        Raises:
            ContainerError: see the class.
        """
        if self._current is not None:
            raise ContainerError(f"object {object_id} begins inside layer {self._current[0]}")
        if group_id != KV_GROUP or not self.first <= object_id <= self.last:
            raise ContainerError(f"object {group_id}/{object_id} is not a layer {self.first}..")
        if object_id in self._layers:
            raise ContainerError(f"layer {object_id} arrived twice")
        if self._payload_length is None:
            self._section_length(payload_length)
            self._payload_length = payload_length
        elif payload_length != self._payload_length:
            raise ContainerError(
                f"layer {object_id} has {payload_length} octets, the others {self._payload_length}"
            )
        section = payload_length // 2
        if self._sink is not None:
            k, v = self._sink.layer_buffer(object_id, section, section)
        else:
            if self._buffer is None:
                self._buffer = memoryview(bytearray(self.count * payload_length))
            start = (object_id - self.first) * payload_length
            k = self._buffer[start : start + section]
            v = self._buffer[start + section : start + payload_length]
        self._current = (object_id, k, v)
        self._hash = hashlib.sha256()
        self._filled = 0

    def feed(self, data: memoryview) -> None:
        """The next piece of the current object's payload.

        Raises:
            ContainerError: no object has begun, or more octets than its payload length.
        """
        if self._current is None or self._payload_length is None:
            raise ContainerError("payload outside an object")
        size = len(data)
        if self._filled + size > self._payload_length:
            raise ContainerError("more payload than the object declared")
        self._hash.update(data)
        _, k, v = self._current
        section = len(k)
        offset, taken = self._filled, 0
        if offset < section:
            taken = min(size, section - offset)
            k[offset : offset + taken] = data[:taken]
        if taken < size:
            start = offset + taken - section
            v[start : start + size - taken] = data[taken:]
        self._filled += size

    def end(self) -> tuple[Layer, bytes]:
        """The current object is complete: its layer and layer digest.

        Raises:
            ContainerError: no object has begun, or its payload is short.
        """
        current, self._current = self._current, None
        if current is None or self._filled != self._payload_length:
            raise ContainerError("an object ended before its payload was complete")
        index, k, v = current
        layer = self._layers[index] = Layer(index, k, v)
        return layer, self._hash.digest()
