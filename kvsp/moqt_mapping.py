"""KV blocks over MOQT: the one mapping (DESIGN.md §4; spec §4.3 digests, §4.4 ``moqt_namespace``).

Publisher, consumer, relay and Replica Record take their names from here, one spelling each:

* namespace = five ASCII fields ``("kvsp", "1", compat_id hex32, scope_id hex16, block_key
  hex32)``; an instance PUBLISH_NAMESPACEs the four-field scope prefix;
* a stored replica's track is named by its replica digest as hex32, so a name pins the bytes;
* a block being produced is the track ``live-`` + ``uri_id(producer)``;
* group 0, object id = layer index, payload = K section ‖ V section of that layer; layers
  ``a..b`` are FETCHed as ``{0,a}`` .. ``{0,b+1}`` (an End Object of 0 means the whole group);
* each object may carry its layer digest in our private extension :data:`LAYER_DIGEST_TYPE`
  inside IMMUTABLE_EXTENSIONS, so a live consumer checks a layer as it arrives;
* a record's ``moqt_namespace`` is base64url without padding of the five fields, each after a
  one-octet length.

Parsers are strict, so a relay refuses a name that is not a KV block without guessing (names
raise :class:`~kvsp.errors.InvalidIdentifier`; ``moqt_namespace`` a
:class:`~kvsp.errors.RecordError` naming its JSON path). :class:`LayerAssembler` turns a
block's objects back into layers. Sans-I/O: of moqt, only its wire and object codecs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvsp import ids, sha256x2
from kvsp.container import DIGEST_SIZE, Geometry, Layer, layer_digest
from kvsp.container_reader import LayerSink
from kvsp.errors import ContainerError, InvalidIdentifier, RecordError
from kvsp.fields import type_name
from kvsp.ids import BlockKey, CompatId, ScopeId
from moqt.errors import KeyValueFormattingError
from moqt.objects import ObjectRun, encode_immutable_extensions, immutable_extensions
from moqt.wire import Bytes, KeyValuePair, Location, TrackNamespace

KV_TAG = b"kvsp"
"""Field 1: the application tag, for PUBLISH_NAMESPACE / SUBSCRIBE_NAMESPACE prefix matching."""
KV_MAPPING_VERSION = b"1"
"""Field 2: the version of this mapping."""
KV_NAMESPACE_FIELDS = 5
"""A block's Track Namespace has five fields; its scope prefix the first four."""
KV_GROUP = 0
"""A block is one group; its objects are its layers."""
LIVE_PREFIX = b"live-"
"""A live track's name: this prefix, then the producer's uri_id (hex16)."""
LAYER_DIGEST_TYPE = 0x4B57
"""Our private object extension (odd, ≥ 16384: first-come-first-served, MOQT §13): the layer's
SHA-256, 32 octets, carried inside IMMUTABLE_EXTENSIONS."""
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
_Id = TypeVar("_Id", bound=bytes)


# -- namespaces and track names ----------------------------------------------------------------


def _hex(value: bytes, size: int, what: str) -> bytes:
    return ids.check_length(value, size, what).hex().encode("ascii")


def _parse_hex(value: Bytes, parse: Callable[[object], _Id]) -> _Id | None:
    """``value`` parsed as the ASCII of a :mod:`kvsp.ids` hex identifier, or None."""
    try:
        return parse(bytes(value).decode("ascii"))
    except (UnicodeDecodeError, InvalidIdentifier):
        return None


def _parse_field(value: Bytes, parse: Callable[[object], _Id], what: str) -> _Id:
    parsed = _parse_hex(value, parse)
    if parsed is None:
        shown = bytes(value)[:80]
        raise InvalidIdentifier(f"namespace field {what} is not lowercase hex: {shown!r}")
    return parsed


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
    """The five Track Namespace Fields of one block.

    Raises:
        InvalidIdentifier: an identifier of the wrong length.
    """
    return (*kv_scope_prefix(compat, scope), _hex(key, 32, "block_key"))


def _parse_prefix(fields: Sequence[Bytes]) -> tuple[CompatId, ScopeId]:
    tag, version = bytes(fields[0]), bytes(fields[1])
    if tag != KV_TAG or version != KV_MAPPING_VERSION:
        raise InvalidIdentifier(f"not a KVSP v1 namespace: {tag[:16]!r}/{version[:16]!r}")
    compat = _parse_field(fields[2], ids.parse_compat_id, "compat_id")
    return compat, _parse_field(fields[3], ids.parse_scope_id, "scope_id")


def parse_kv_namespace(fields: Sequence[Bytes]) -> tuple[CompatId, ScopeId, BlockKey]:
    """The (compat_id, scope_id, block_key) a block's namespace names.

    Raises:
        InvalidIdentifier: not five fields, another tag or mapping version, or an identifier
            field that is not lowercase hex of its exact length.
    """
    if len(fields) != KV_NAMESPACE_FIELDS:
        raise InvalidIdentifier(f"a KV namespace has 5 fields, got {len(fields)}")
    compat, scope = _parse_prefix(fields)
    return compat, scope, _parse_field(fields[4], ids.parse_block_key, "block_key")


def is_kv_namespace(fields: Sequence[Bytes]) -> bool:
    """Whether ``fields`` is a well-formed block namespace (:func:`parse_kv_namespace`)."""
    try:
        parse_kv_namespace(fields)
    except InvalidIdentifier:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Plain:
    """A namespace outside KVSP."""


@dataclass(frozen=True, slots=True)
class Broad:
    """A ``kvsp`` namespace that names no single scope (too short, or malformed)."""


@dataclass(frozen=True, slots=True)
class Scoped:
    """A KV namespace with its scope (4 fields: a scope prefix; 5: one block)."""

    scope_id: ScopeId


NamespaceClass = Plain | Broad | Scoped


def classify(fields: Sequence[Bytes]) -> NamespaceClass:
    """Which authorization rule applies to a namespace or namespace prefix (DESIGN §3, §4):
    outside KVSP, KVSP but no single scope, or within the scope its first four fields name."""
    if not fields or bytes(fields[0]) != KV_TAG:
        return Plain()
    if len(fields) < 4:
        return Broad()
    try:
        return Scoped(_parse_prefix(fields)[1])
    except InvalidIdentifier:
        return Broad()


def stored_track_name(digest: bytes) -> bytes:
    """The track of a stored replica: its replica digest (§4.3) as hex32.

    Raises:
        InvalidIdentifier: ``digest`` is not 32 octets.
    """
    return _hex(digest, DIGEST_SIZE, "replica digest")


def parse_stored_track_name(name: Bytes) -> bytes | None:
    """The replica digest a stored track's name carries; None for any other name (live ones)."""
    return _parse_hex(name, ids.parse_hex32)


def live_track_name(producer_uri: str) -> bytes:
    """The track of a block being produced by ``producer_uri``: ``live-`` + its uri_id."""
    return LIVE_PREFIX + ids.uri_id(producer_uri).encode("ascii")


def is_live_track_name(name: Bytes) -> bool:
    """Whether ``name`` has the form of a live track name."""
    raw = bytes(name)
    if not raw.startswith(LIVE_PREFIX):
        return False
    return _parse_hex(raw[len(LIVE_PREFIX) :], ids.parse_hex16) is not None


# -- moqt_namespace (§4.4) ---------------------------------------------------------------------


def encode_namespace_octets(fields: Sequence[bytes]) -> bytes:
    """The ``moqt_namespace`` octets: each of the five fields preceded by its length as one octet.

    Raises:
        RecordError: not exactly five fields, or a field that is empty or over 255 octets.
    """
    if len(fields) != KV_NAMESPACE_FIELDS:
        raise RecordError(f"expected {KV_NAMESPACE_FIELDS} namespace fields, got {len(fields)}")
    out = bytearray()
    for field in fields:
        if not 1 <= len(field) <= 255:
            raise RecordError(f"a namespace field has 1-255 octets, got {len(field)}")
        out.append(len(field))
        out += field
    return bytes(out)


def split_namespace_octets(raw: bytes, path: str = "$") -> tuple[bytes, ...]:
    """The five fields of ``moqt_namespace`` octets (:func:`encode_namespace_octets` reversed).

    Raises:
        RecordError: a field that is empty or truncated, other than five fields, or octets after
            the fifth.
    """
    fields: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(fields) == KV_NAMESPACE_FIELDS:
            raise RecordError("trailing octets after the fifth namespace field", path=path)
        length = raw[offset]
        end = offset + 1 + length
        if length == 0 or end > len(raw):
            raise RecordError(f"namespace field {len(fields)} is empty or truncated", path=path)
        fields.append(raw[offset + 1 : end])
        offset = end
    if len(fields) != KV_NAMESPACE_FIELDS:
        raise RecordError(
            f"expected {KV_NAMESPACE_FIELDS} namespace fields, got {len(fields)}", path=path
        )
    return tuple(fields)


def format_moqt_namespace(raw: bytes) -> str:
    """``moqt_namespace`` octets as JSON text: base64url without padding."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def read_moqt_namespace(text: object, path: str = "$") -> bytes:
    """The octets of a ``moqt_namespace`` JSON value, checked to be five fields.

    Raises:
        RecordError: not a string, padding or a non-base64url character, non-canonical
            trailing bits, or octets :func:`split_namespace_octets` refuses.
    """
    if not isinstance(text, str):
        raise RecordError(f"expected a base64url string, got {type_name(text)}", path=path)
    # §4.4: base64url *without padding*; '=' and the '+/' alphabet are rejected.
    if _BASE64URL.fullmatch(text) is None or len(text) % 4 == 1:
        raise RecordError("expected base64url without padding", path=path)
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise RecordError(f"expected base64url without padding: {exc}", path=path) from None
    # Non-canonical trailing bits would let two strings name one namespace.
    if format_moqt_namespace(raw) != text:
        raise RecordError("non-canonical base64url (trailing bits set)", path=path)
    split_namespace_octets(raw, path)
    return raw


def encode_moqt_namespace(fields: Sequence[bytes]) -> str:
    """Encode Track Namespace Fields as ``moqt_namespace`` text.

    Raises:
        RecordError: see :func:`encode_namespace_octets`.
    """
    return format_moqt_namespace(encode_namespace_octets(fields))


def decode_moqt_namespace(text: str, path: str = "$") -> tuple[bytes, ...]:
    """Decode ``moqt_namespace`` text into its five Track Namespace Fields.

    Raises:
        RecordError: see :func:`read_moqt_namespace`.
    """
    return split_namespace_octets(read_moqt_namespace(text, path), path)


# -- objects: layer ranges, payloads, the in-band layer digest ---------------------------------


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


def layer_digest_extension(digest: bytes, *, others: Sequence[KeyValuePair] = ()) -> KeyValuePair:
    """IMMUTABLE_EXTENSIONS holding the layer digest (plus ``others``), for one object.

    Raises:
        ValueError: ``digest`` is not 32 octets, or ``others`` holds a digest or a nested
            IMMUTABLE_EXTENSIONS.
    """
    if len(digest) != DIGEST_SIZE:
        raise ValueError(f"layer digest must be 32 octets, got {len(digest)}")
    if any(pair[0] == LAYER_DIGEST_TYPE for pair in others):
        raise ValueError("others may not hold a layer digest")
    return encode_immutable_extensions([*others, (LAYER_DIGEST_TYPE, bytes(digest))])


def find_layer_digest(extensions: Sequence[KeyValuePair]) -> bytes | None:
    """The layer digest in an object's IMMUTABLE_EXTENSIONS, or None when absent.

    Raises:
        MalformedTrack: IMMUTABLE_EXTENSIONS cannot be parsed (MOQT §11.2).
        KeyValueFormattingError: the digest is not 32 octets (MOQT §1.4.2).
    """
    for ext_type, value in immutable_extensions(extensions):
        if ext_type == LAYER_DIGEST_TYPE and isinstance(value, bytes):
            if len(value) != DIGEST_SIZE:
                raise KeyValueFormattingError(f"layer digest of {len(value)} octets, not 32")
            return value
    return None


# -- objects back into layers -----------------------------------------------------------------


class LayerAssembler:
    """The objects of one block (group 0, object id = layer) as layers ``first..last``.

    Feed each object as ``begin`` / ``feed`` (any number of pieces) / ``end``; ``end`` returns
    the layer (views of the block buffer, or of the sink's memory) and its SHA-256, the layer
    digest (§4.3). Codec raw: every payload is K ‖ V with K and V of equal length; with
    ``token_count`` None the token count is read off the first payload's length and the
    geometry. The receiver thus rebuilds what the container header would have said.

    With ``hash_below`` set, the payload is hashed as it arrives only when the whole range
    (layers × payload length, known at the first object) is shorter than that many octets;
    otherwise :attr:`hashing` is False and ``end`` returns no digest, for the caller to hash
    the layers elsewhere (a worker thread, in batches: :mod:`kvsp.transfer.moqt_transfer`).
    ``allocate(size)`` gives the block buffer (without a sink): a writable octet view whose
    contents need not be zero, e.g. a pooled one (:class:`kvsp.transfer.buffers.BufferPool`);
    by default a fresh ``bytearray``.

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
        hash_below: int | None = None,
        allocate: Callable[[int], memoryview] | None = None,
    ) -> None:
        if not 0 <= first <= last < geometry.layers:
            raise ContainerError(f"layers {first}..{last} of a {geometry.layers}-layer block")
        self.geometry = geometry
        self.first = first
        self.last = last
        self.token_count = token_count
        self.hashing = True
        """Whether the payload is hashed as it arrives (``end`` then returns the digest)."""
        self._hash_below = hash_below
        self._sink = sink
        self._allocate = allocate
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
        layers = self._layers
        return tuple([layers[index] for index in sorted(layers)])

    def span(self, first: int, last: int) -> memoryview | None:
        """The payload octets of layers ``first..last`` (ended ones, absolute indices) as one
        view of the block buffer, K ‖ V of each in turn; None when the layers are in a sink's
        memory (not one contiguous buffer)."""
        if self._buffer is None or self._payload_length is None:
            return None
        size = self._payload_length
        return self._buffer[(first - self.first) * size : (last + 1 - self.first) * size]

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
        k, v = self._place(group_id, object_id, payload_length)
        self._current = (object_id, k, v)
        if self.hashing:
            self._hash = hashlib.sha256()
        self._filled = 0

    def _place(
        self, group_id: int, object_id: int, payload_length: int
    ) -> tuple[memoryview, memoryview]:
        """Where the K and V sections of layer ``object_id`` go, once it is found to be a new
        layer of the range with the block's payload length."""
        if self._current is not None:
            raise ContainerError(f"object {object_id} begins inside layer {self._current[0]}")
        if group_id != KV_GROUP or not self.first <= object_id <= self.last:
            raise ContainerError(f"object {group_id}/{object_id} is not a layer {self.first}..")
        if object_id in self._layers:
            raise ContainerError(f"layer {object_id} arrived twice")
        if self._payload_length is None:
            self._section_length(payload_length)
            self._payload_length = payload_length
            below = self._hash_below
            self.hashing = below is None or self.count * payload_length < below
        elif payload_length != self._payload_length:
            raise ContainerError(
                f"layer {object_id} has {payload_length} octets, the others {self._payload_length}"
            )
        section = payload_length // 2
        if self._sink is not None:
            return self._sink.layer_buffer(object_id, section, section)
        if self._buffer is None:
            size = self.count * payload_length
            allocate = self._allocate
            self._buffer = memoryview(bytearray(size)) if allocate is None else allocate(size)
        start = (object_id - self.first) * payload_length
        buffer = self._buffer
        return buffer[start : start + section], buffer[start + section : start + payload_length]

    def feed(self, data: memoryview) -> None:
        """The next piece of the current object's payload.

        Raises:
            ContainerError: no object has begun, or more octets than its payload length.
        """
        current, length = self._current, self._payload_length
        if current is None or length is None:
            raise ContainerError("payload outside an object")
        size, offset = len(data), self._filled
        if offset + size > length:
            raise ContainerError("more payload than the object declared")
        if self.hashing:
            self._hash.update(data)
        _, k, v = current
        section = len(k)
        self._filled = offset + size
        if size == length:  # the whole payload in one piece (a small layer): K then V
            k[:] = data[:section]
            v[:] = data[section:]
            return
        taken = 0
        if offset < section:
            taken = min(size, section - offset)
            k[offset : offset + taken] = data[:taken]
        if taken < size:
            start = offset + taken - section
            v[start : start + size - taken] = data[taken:]

    def land(self, run: ObjectRun, landed: list[Layer]) -> None:
        """The whole objects of ``run`` (each header came with all of its payload), each
        placed and copied as :meth:`begin`, :meth:`feed` and :meth:`end` would, its layer
        appended to ``landed``; not hashed (see :meth:`digests`).

        Raises:
            ContainerError: as :meth:`begin`, for the first object that is not a layer of the
                range (the layers before it are landed).
        """
        data, place, layers = run.data, self._place, self._layers
        for group_id, _, object_id, _, _, start, length in run.objects:
            k, v = place(group_id, object_id, length)
            section = len(k)
            k[:] = data[start : start + section]
            v[:] = data[start + section : start + length]
            layer = layers[object_id] = Layer(object_id, k, v)
            landed.append(layer)

    def digests(self, layers: Sequence[Layer]) -> list[bytes]:
        """The layer digests (§4.3) of ``layers``, landed ones: consecutive layers in the block
        buffer hashed in one native call (:mod:`kvsp.sha256x2`, two layers at a time),
        others one by one."""
        first = layers[0].index if layers else 0
        span = self.span(first, first + len(layers) - 1) if layers else None
        ascending = [layer.index for layer in layers] == list(range(first, first + len(layers)))
        if span is None or not ascending or not sha256x2.ACCELERATED:
            return [layer_digest(layer.k, layer.v) for layer in layers]
        return sha256x2.digests(span, len(span) // len(layers))

    def end(self) -> tuple[Layer, bytes | None]:
        """The current object is complete: its layer and layer digest (None when not
        :attr:`hashing`: the caller hashes the layer).

        Raises:
            ContainerError: no object has begun, or its payload is short.
        """
        current, self._current = self._current, None
        if current is None or self._filled != self._payload_length:
            raise ContainerError("an object ended before its payload was complete")
        index, k, v = current
        layer = self._layers[index] = Layer(index, k, v)
        return layer, self._hash.digest() if self.hashing else None
