"""The KV Block Container "KVB1" (spec §4.3) and the digests that protect it (§4.3, §6.7).

A container holds a contiguous range of layers of one block: a fixed header, one
``{K Length, V Length}`` entry per layer, then each layer's K and V octets in ascending layer
order. This module encodes and strictly decodes whole containers; :mod:`kvsp.container_reader`
parses them incrementally, yielding each layer as soon as its last octet arrives.

Decisions the spec leaves open (documented here, enforced on encode and decode alike):

* ``Layer Count`` 0 is rejected: a container holds a non-empty range of layers.
* ``Token Count`` 0 is rejected: a block has tokens.
* For codec raw every K and V section holds ``token_count × kv_heads × head_dim`` elements, so
  all sections of a container have one length. With a :class:`Geometry` that length must equal
  :meth:`Geometry.section_length`; without one, K and V lengths must agree, be equal across
  layers, be non-zero and be a multiple of ``token_count``.
* :class:`ContainerLimits` bounds the declared layer count and size before anything is
  allocated; without a geometry it is the only bound.

Decoded layers are zero-copy ``memoryview`` slices of the input (so :class:`Layer` and
:class:`Container` compare by identity). :func:`encode_container` copies each octet once into
the result; :func:`encode_container_parts` copies nothing, for vectored writers.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypedDict

from kvsp.errors import (
    ContainerError,
    DescriptorError,
    DigestMismatch,
    Incompatible,
    InvalidIdentifier,
    LayersUnavailable,
    PayloadTooLarge,
)
from kvsp.registries import Codec, element_type

Buffer: TypeAlias = bytes | bytearray | memoryview
"""Bytes-like input. Other buffer exporters (numpy arrays) pass through ``memoryview(x)``."""

KVB1_MAGIC = 0x4B564231
"""``"KVB1"``, the first four octets of every container (§4.3, §11.1)."""
KVB1_MAGIC_BYTES = b"KVB1"
KVB1_VERSION = 1
"""The container version this module reads and writes (§4.3)."""

KVB1_HEADER = struct.Struct("!IBBHIII")
"""§4.3 figure, fixed part: Magic, Version, Flags, Codec, First Layer, Layer Count, Token Count."""
KVB1_LAYER_LENGTHS = struct.Struct("!QQ")
"""§4.3 figure, one Layer Count entry: K Length (64), V Length (64)."""

UINT32_MAX = 0xFFFF_FFFF
UINT64_MAX = 0xFFFF_FFFF_FFFF_FFFF
DIGEST_SIZE = 32
_CODECS = frozenset(int(c) for c in Codec)


class ContainerTooLarge(ContainerError, PayloadTooLarge):
    """A container whose declared layer count or size exceeds :class:`ContainerLimits` (413)."""


def header_size(layer_count: int) -> int:
    """Octets of a KVB1 header with ``layer_count`` length entries (§4.3)."""
    return KVB1_HEADER.size + layer_count * KVB1_LAYER_LENGTHS.size


# -- geometry and limits -----------------------------------------------------------------------


class DescriptorGeometry(Protocol):
    """What :meth:`Geometry.from_descriptor` reads from a Compatibility Descriptor (§4.1)."""

    @property
    def layers(self) -> int:
        """Number of layers of the model."""

    @property
    def kv_heads(self) -> int:
        """Number of KV heads."""

    @property
    def head_dim(self) -> int:
        """Dimension of one head."""

    @property
    def kv_dtype(self) -> str:
        """Element type name from the "KVSP Element Types" registry (§11.2.3)."""


def _check_positive(name: str, value: object, maximum: int = UINT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise DescriptorError(
            f"expected an integer in 1..{maximum}, got {value!r}", path=f"$.{name}"
        )


@dataclass(frozen=True, slots=True)
class Geometry:
    """The cache geometry a container must match (§4.1 ``layers``/``kv_heads``/``head_dim``).

    Raises:
        DescriptorError: a member is not a positive integer.
    """

    layers: int
    kv_heads: int
    head_dim: int
    element_size: int
    """Octets of one element of ``kv_dtype``."""

    def __post_init__(self) -> None:
        _check_positive("layers", self.layers)
        _check_positive("kv_heads", self.kv_heads)
        _check_positive("head_dim", self.head_dim)
        _check_positive("element_size", self.element_size, 64)

    @classmethod
    def from_descriptor(cls, descriptor: DescriptorGeometry) -> Geometry:
        """The geometry of a Compatibility Descriptor (§4.1).

        Raises:
            DescriptorError: unknown ``kv_dtype`` or a non-positive dimension.
        """
        size = element_type(descriptor.kv_dtype, "$.kv_dtype").size
        return cls(descriptor.layers, descriptor.kv_heads, descriptor.head_dim, size)

    def section_length(self, token_count: int) -> int:
        """Octets of one K or V section for codec raw: tokens × kv_heads × head_dim × size."""
        return token_count * self.kv_heads * self.head_dim * self.element_size


@dataclass(frozen=True, slots=True)
class ContainerLimits:
    """Bounds on what a container may declare, checked before anything is allocated.

    They matter most without a geometry, which otherwise pins every size; they apply always.
    """

    max_layer_count: int = 4096
    max_total_bytes: int = 1 << 30
    """Largest container, header included."""


DEFAULT_LIMITS = ContainerLimits()
_ENCODER_LIMITS = ContainerLimits(UINT32_MAX, UINT64_MAX)


# -- header ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerHeader:
    """A parsed and validated KVB1 header (§4.3); ``lengths`` holds ``(K, V)`` per layer."""

    version: int
    flags: int
    codec: int
    first_layer: int
    layer_count: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        """Octets of the header itself."""
        return header_size(self.layer_count)

    @property
    def data_length(self) -> int:
        """Octets of all K and V sections together."""
        return sum(k + v for k, v in self.lengths)

    @property
    def total_length(self) -> int:
        """Octets of the whole container."""
        return self.size + self.data_length

    def encode(self) -> bytes:
        """The header's wire form (§4.3 figure)."""
        out = bytearray(self.size)
        KVB1_HEADER.pack_into(
            out,
            0,
            KVB1_MAGIC,
            self.version,
            self.flags,
            self.codec,
            self.first_layer,
            self.layer_count,
            self.token_count,
        )
        lengths = _lengths_struct(len(self.lengths))
        lengths.pack_into(out, KVB1_HEADER.size, *(n for pair in self.lengths for n in pair))
        return bytes(out)


@functools.lru_cache(maxsize=64)
def _lengths_struct(layers: int) -> struct.Struct:
    """The Layer Count entries of a header (§4.3 figure) as one structure: K and V Length
    (64 bits each) of ``layers`` layers, packed in one call."""
    return struct.Struct(f"!{2 * layers}Q")


@dataclass(frozen=True, slots=True)
class FixedHeader:
    """The fixed 20-octet part of a header, validated (internal to the parsers)."""

    version: int
    flags: int
    codec: int
    first_layer: int
    layer_count: int
    token_count: int


class HeaderFields(TypedDict):
    """The §4.3 fixed-header fields that :class:`FixedHeader`, :class:`ContainerHeader` and
    :class:`Container` share, as keyword arguments (``Container(**header_fields(h), ...)``)."""

    version: int
    flags: int
    codec: int
    first_layer: int
    layer_count: int
    token_count: int


def header_fields(header: FixedHeader | ContainerHeader | Container) -> HeaderFields:
    """The fixed-header fields of a header or a container, to build another from them."""
    return HeaderFields(
        version=header.version,
        flags=header.flags,
        codec=header.codec,
        first_layer=header.first_layer,
        layer_count=header.layer_count,
        token_count=header.token_count,
    )


def check_magic_prefix(prefix: Buffer) -> None:
    """Reject input whose first octets cannot begin a container.

    Raises:
        ContainerError: the octets differ from ``"KVB1"``.
    """
    n = min(len(prefix), 4)
    if bytes(prefix[:n]) != KVB1_MAGIC_BYTES[:n]:
        raise ContainerError(f"bad magic {bytes(prefix[:4])!r}: expected {KVB1_MAGIC_BYTES!r}")


def parse_fixed_header(
    data: memoryview, geometry: Geometry | None, limits: ContainerLimits
) -> FixedHeader:
    """Parse and check the first :data:`KVB1_HEADER.size` octets of ``data``.

    Raises:
        ContainerError: bad magic, version, flags, codec, counts or layer range.
        ContainerTooLarge: more layers than ``limits`` allow.
    """
    check_magic_prefix(data)
    if len(data) < KVB1_HEADER.size:
        raise ContainerError(f"truncated header: {len(data)} of {KVB1_HEADER.size} octets")
    _, version, flags, codec, first, count, tokens = KVB1_HEADER.unpack_from(data)
    if version != KVB1_VERSION:
        raise ContainerError(f"unsupported version {version} (expected {KVB1_VERSION})")
    if flags != 0:  # §4.3: flags are reserved and set to zero
        raise ContainerError(f"reserved flags must be zero, got 0x{flags:02x}")
    check_fields(codec, first, count, tokens, geometry, limits)
    return FixedHeader(version, flags, codec, first, count, tokens)


def check_fields(
    codec: int,
    first: int,
    count: int,
    tokens: int,
    geometry: Geometry | None,
    limits: ContainerLimits,
) -> None:
    """Check the codec, the layer range ``first .. first+count-1`` and the token count.

    Raises:
        ContainerError: an unknown codec, no layers, no tokens, or a range beyond the geometry
            or beyond uint32.
        ContainerTooLarge: more layers than ``limits`` allow.
    """
    if codec not in _CODECS:
        raise ContainerError(f"unknown codec 0x{codec:04x}")
    check_layer_range(first, count, geometry, limits)
    if tokens == 0:
        raise ContainerError("token count is zero: a block has tokens")


def check_layer_range(
    first: int, count: int, geometry: Geometry | None, limits: ContainerLimits
) -> None:
    """Check that layers ``first .. first+count-1`` can form a container.

    Raises:
        ContainerError: no layers, or a range beyond the geometry or beyond uint32.
        ContainerTooLarge: more layers than ``limits`` allow.
    """
    if count == 0:
        raise ContainerError("layer count is zero: a container holds a range of layers")
    if count > limits.max_layer_count:
        raise ContainerTooLarge(f"layer count {count} exceeds the limit {limits.max_layer_count}")
    if geometry is not None and first + count > geometry.layers:
        raise ContainerError(
            f"layers {first}..{first + count - 1} exceed the descriptor's {geometry.layers} layers"
        )
    if first + count - 1 > UINT32_MAX:
        raise ContainerError(f"layers {first}..{first + count - 1} exceed uint32")


def parse_header(
    data: memoryview, geometry: Geometry | None, limits: ContainerLimits
) -> ContainerHeader:
    """Parse and check a whole header (fixed part and length entries) at the start of ``data``.

    Raises:
        ContainerError: anything §4.3 or the geometry forbids, or fewer octets than the header.
        ContainerTooLarge: declared sizes beyond ``limits``.
    """
    fixed = parse_fixed_header(data, geometry, limits)
    size = header_size(fixed.layer_count)
    if len(data) < size:
        raise ContainerError(f"truncated header: {len(data)} of {size} octets")
    entries = data[KVB1_HEADER.size : size]
    lengths = tuple(KVB1_LAYER_LENGTHS.iter_unpack(entries))
    check_lengths(fixed.codec, fixed.first_layer, fixed.token_count, lengths, geometry, limits)
    return ContainerHeader(**header_fields(fixed), lengths=lengths)


def check_lengths(
    codec: int,
    first_layer: int,
    token_count: int,
    lengths: Sequence[tuple[int, int]],
    geometry: Geometry | None,
    limits: ContainerLimits,
) -> None:
    """Check the K and V lengths against the codec, the geometry and the limits.

    Raises:
        ContainerError: lengths that codec raw or the geometry forbid.
        ContainerTooLarge: a total beyond ``limits.max_total_bytes``.
    """
    if codec == Codec.RAW:
        _check_raw_lengths(first_layer, token_count, lengths, geometry)
    total = header_size(len(lengths))
    for i, (k_len, v_len) in enumerate(lengths):
        total += k_len + v_len
        if total > limits.max_total_bytes:
            raise ContainerTooLarge(
                f"layer {first_layer + i}: declared size exceeds the limit of "
                f"{limits.max_total_bytes} octets"
            )


def _check_raw_lengths(
    first_layer: int,
    token_count: int,
    lengths: Sequence[tuple[int, int]],
    geometry: Geometry | None,
) -> None:
    # §4.3 codec raw: each section holds token_count × kv_heads × head_dim elements
    if geometry is not None:
        expected = geometry.section_length(token_count)
    else:
        expected = lengths[0][0]
        if expected == 0 or expected % token_count:
            raise ContainerError(
                f"layer {first_layer}: raw K length {expected} is not a positive multiple "
                f"of token count {token_count}"
            )
    if all(k_len == expected == v_len for k_len, v_len in lengths):
        return
    why = "the first layer's K length"
    if geometry is not None:
        why = (
            f"{token_count} tokens × {geometry.kv_heads} kv_heads × {geometry.head_dim} "
            f"head_dim × {geometry.element_size} octets"
        )
    for i, (k_len, v_len) in enumerate(lengths):
        name, length = ("K", k_len) if k_len != expected else ("V", v_len)
        if length != expected:
            raise ContainerError(
                f"layer {first_layer + i}: {name} length {length} differs from {expected} ({why})"
            )


# -- digests -----------------------------------------------------------------------------------


def layer_digest(k: Buffer, v: Buffer) -> bytes:
    """The layer digest: SHA-256 of the K section followed by the V section (§4.3)."""
    h = hashlib.sha256(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Sequence[bytes]) -> bytes:
    """The replica digest: SHA-256 of the concatenated layer digests, ascending (§4.3).

    Raises:
        InvalidIdentifier: an entry is not 32 octets.
    """
    h = hashlib.sha256()
    for i, d in enumerate(layer_digests):
        if len(d) != DIGEST_SIZE:
            raise InvalidIdentifier(f"layer digest {i} has {len(d)} octets, expected 32")
        h.update(d)
    return h.digest()


def check_digest_list(
    layer_digests: Sequence[bytes], first_layer: int, layer_count: int, digest: bytes | None
) -> None:
    """Check that a Replica Record's ``layer_digests`` covers the layers and hashes to ``digest``.

    Raises:
        Incompatible: the list does not cover layers ``first_layer .. +layer_count-1``.
        DigestMismatch: the list does not hash to the replica digest ``digest`` (§4.3, §6.7).
    """
    last = first_layer + layer_count - 1
    if last >= len(layer_digests):
        raise Incompatible(
            f"container holds layers {first_layer}..{last} but the replica record lists "
            f"{len(layer_digests)} layer digests"
        )
    if digest is not None and replica_digest(layer_digests) != digest:
        raise DigestMismatch("layer digest list does not hash to the replica digest")


def mismatch(index: int, got: bytes, expected: bytes) -> DigestMismatch:
    """The error for layer ``index`` whose digest is ``got`` instead of ``expected``."""
    return DigestMismatch(
        f"layer {index}: digest {got.hex()} differs from the record's {bytes(expected).hex()}"
    )


# -- containers --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Layer:
    """One layer of a container: its absolute index and its K and V sections (§4.3)."""

    index: int
    k: memoryview
    v: memoryview

    def digest(self) -> bytes:
        """The layer digest (§4.3)."""
        return layer_digest(self.k, self.v)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Container:
    """A decoded KVB1 container (§4.3); ``layers`` are views of the decoded input."""

    version: int
    flags: int
    codec: int
    first_layer: int
    layer_count: int
    token_count: int
    layers: tuple[Layer, ...]

    @property
    def header(self) -> ContainerHeader:
        """The container's header."""
        lengths = tuple((layer.k.nbytes, layer.v.nbytes) for layer in self.layers)
        return ContainerHeader(**header_fields(self), lengths=lengths)

    @property
    def header_bytes(self) -> bytes:
        """The header's wire form."""
        return self.header.encode()

    def layer_digests(self) -> list[bytes]:
        """The layer digest of each layer held, ascending (§4.3)."""
        return [layer.digest() for layer in self.layers]

    def digest(self) -> bytes:
        """SHA-256 over the held layers' digests: the replica digest when all layers are held."""
        return replica_digest(self.layer_digests())

    def select(self, first: int, last: int) -> Container:
        """The inclusive layer range ``first..last`` as a container sharing this one's memory.

        Raises:
            LayersUnavailable: the range is empty or not held here (§6.7).
        """
        if not self.first_layer <= first <= last < self.first_layer + self.layer_count:
            held = f"{self.first_layer}-{self.first_layer + self.layer_count - 1}"
            raise LayersUnavailable(f"layers {first}-{last} requested, {held} held")
        start = first - self.first_layer
        return Container(
            version=self.version,
            flags=self.flags,
            codec=self.codec,
            first_layer=first,
            layer_count=last - first + 1,
            token_count=self.token_count,
            layers=self.layers[start : start + last - first + 1],
        )

    def encode(self) -> bytes:
        """The container's wire form (§4.3)."""
        return b"".join(self.encode_parts())

    def encode_parts(self) -> list[bytes | memoryview]:
        """The container's wire form as header and uncopied K and V views (§4.3)."""
        return encode_container_parts(
            [(layer.k, layer.v) for layer in self.layers],
            first_layer=self.first_layer,
            token_count=self.token_count,
            codec=self.codec,
        )


def byte_view(data: object, what: str = "buffer") -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer.

    Raises:
        ContainerError: ``data`` is not a contiguous buffer.
    """
    if type(data) is memoryview and data.format == "B" and data.ndim == 1 and data.c_contiguous:
        return data  # already one: no new view (a container's layers are such views)
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
        if mv.c_contiguous:
            return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError):
        pass
    raise ContainerError(f"{what} is not a contiguous bytes-like object")


def encode_container_parts(
    layers: Sequence[tuple[Buffer, Buffer]],
    *,
    first_layer: int,
    token_count: int,
    codec: int = Codec.RAW,
    geometry: Geometry | None = None,
) -> list[bytes | memoryview]:
    """A KVB1 container (§4.3) as its header followed by views of each K and V, uncopied.

    For vectored writers (``socket.sendmsg``, a streamed HTTP body): the octets of the parts in
    order are exactly :func:`encode_container`'s.

    Raises:
        ContainerError: a field out of its range, an unknown codec, or lengths that the codec,
            the geometry or the decoder's rules forbid.
    """
    _check_uint("first layer", first_layer, UINT32_MAX)
    _check_uint("token count", token_count, UINT32_MAX)
    _check_uint("codec", codec, 0xFFFF)
    check_fields(codec, first_layer, len(layers), token_count, geometry, _ENCODER_LIMITS)
    views = [
        (_section_view(k, first_layer + i, "K"), _section_view(v, first_layer + i, "V"))
        for i, (k, v) in enumerate(layers)
    ]
    lengths = tuple((k.nbytes, v.nbytes) for k, v in views)
    header = _encoded_header(codec, first_layer, token_count, lengths, geometry)
    return [header, *(part for pair in views for part in pair)]


@functools.lru_cache(maxsize=256)
def _encoded_header(
    codec: int,
    first_layer: int,
    token_count: int,
    lengths: tuple[tuple[int, int], ...],
    geometry: Geometry | None,
) -> bytes:
    """The checked header of an encoding (:func:`check_lengths`, then the wire form); the
    blocks of one model share a few shapes, so recent ones are remembered (the arguments are
    integers already checked, and an error is raised each time, never remembered)."""
    check_lengths(codec, first_layer, token_count, lengths, geometry, _ENCODER_LIMITS)
    header = ContainerHeader(
        version=KVB1_VERSION,
        flags=0,
        codec=codec,
        first_layer=first_layer,
        layer_count=len(lengths),
        token_count=token_count,
        lengths=lengths,
    )
    return header.encode()


def _section_view(data: Buffer, layer: int, section: str) -> memoryview:
    """:func:`byte_view` of a layer's K or V section, its name formatted only for an error."""
    if type(data) is memoryview and data.format == "B" and data.ndim == 1 and data.c_contiguous:
        return data
    return byte_view(data, f"layer {layer} {section}")


def encode_container(
    layers: Sequence[tuple[Buffer, Buffer]],
    *,
    first_layer: int,
    token_count: int,
    codec: int = Codec.RAW,
    geometry: Geometry | None = None,
) -> bytes:
    """Encode layers ``first_layer ..`` as a KVB1 container (§4.3), copying each octet once.

    Raises:
        ContainerError: a field out of its range, an unknown codec, or lengths that the codec,
            the geometry or the decoder's rules forbid.
    """
    parts = encode_container_parts(
        layers, first_layer=first_layer, token_count=token_count, codec=codec, geometry=geometry
    )
    return b"".join(parts)


def _check_uint(name: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise ContainerError(f"{name} must be an integer in 0..{maximum}, got {value!r}")


def decode_container(
    data: Buffer, geometry: Geometry | None = None, *, limits: ContainerLimits = DEFAULT_LIMITS
) -> Container:
    """Strictly decode a whole KVB1 container (§4.3); layers are zero-copy views of ``data``.

    Raises:
        ContainerError: bad magic, version, flags or codec; truncated header or data; trailing
            octets; lengths that codec raw or ``geometry`` forbid; an empty range or no tokens.
        ContainerTooLarge: declared sizes beyond ``limits`` (checked before any allocation).
    """
    mv = byte_view(data, "container")
    header = parse_header(mv, geometry, limits)
    expected = header.total_length
    if len(mv) < expected:
        raise ContainerError(f"truncated data: {len(mv)} of {expected} octets")
    if len(mv) > expected:
        raise ContainerError(f"trailing bytes: {len(mv) - expected} after the last layer")
    layers = []
    offset = header.size
    for i, (k_len, v_len) in enumerate(header.lengths):
        k_end = offset + k_len
        layers.append(Layer(header.first_layer + i, mv[offset:k_end], mv[k_end : k_end + v_len]))
        offset = k_end + v_len
    return Container(**header_fields(header), layers=tuple(layers))


# -- verification (§6.7) -----------------------------------------------------------------------


def verify_layers(container: Container, layer_digests: Sequence[bytes]) -> None:
    """Verify each held layer against the record's ``layer_digests`` (by absolute index, §6.7).

    Raises:
        Incompatible: the list does not cover the container's layers.
        DigestMismatch: a layer's digest differs; the message names the layer.
    """
    check_digest_list(layer_digests, container.first_layer, container.layer_count, None)
    for layer in container.layers:
        got = layer.digest()
        if got != layer_digests[layer.index]:
            raise mismatch(layer.index, got, layer_digests[layer.index])


def verify_container(
    container: Container, layer_digests: Sequence[bytes], digest: bytes | None
) -> None:
    """Verify the held layers and, when ``digest`` is given, the list against it (§4.3, §6.7).

    Checking the list against the replica digest is what lets a client trust a sub-range; when
    all layers are held it amounts to checking the replica digest of the container.

    Raises:
        Incompatible: the list does not cover the container's layers.
        DigestMismatch: the list does not hash to ``digest``, or a layer differs.
    """
    check_digest_list(layer_digests, container.first_layer, container.layer_count, digest)
    verify_layers(container, layer_digests)
