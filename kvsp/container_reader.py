"""Incremental KVB1 parsing (spec §4.3): each layer is yielded as soon as its last octet arrives.

§4.3 orders layers ascending so that "a receiver [can] start using layer l as soon as it has
been received"; :class:`ContainerReader` is that receiver's parser. It is sans-I/O: the caller
feeds whatever chunks its transport delivers (one octet at a time works) and gets back the
layers those chunks completed. A short read means "need more"; :meth:`ContainerReader.close`
says whether the input ended cleanly.

Where the octets go:

* with a :class:`LayerSink`, straight into caller-owned memory (for example a pinned staging
  buffer of a device cache), one copy from the wire into the destination;
* without one, a K or V section that lies wholly inside one immutable ``bytes`` chunk is
  yielded as a view of that chunk (no copy); any other section is assembled in a fresh buffer
  of its own, which the caller then owns. The reader never stages more than the layer in
  progress, and a section longer than :data:`EAGER_SECTION` grows as its octets arrive.

Each layer is verified against the Replica Record's ``layer_digests`` as it completes (§6.7),
hashing the octets as they pass, and a running SHA-256 over everything fed lets an HTTP client
check ``Repr-Digest`` in the same pass without keeping the body.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvsp.container import (
    DEFAULT_LIMITS,
    KVB1_HEADER,
    Buffer,
    ContainerHeader,
    ContainerLimits,
    Geometry,
    Layer,
    byte_view,
    check_digest_list,
    check_magic_prefix,
    header_size,
    mismatch,
    parse_fixed_header,
    parse_header,
    replica_digest,
)
from kvsp.errors import ContainerError, DigestMismatch

if TYPE_CHECKING:
    from hashlib import _Hash


EAGER_SECTION = 1 << 20
"""Sections up to this many octets get their whole buffer on their first octet; longer ones
grow as their octets arrive, so memory follows what a peer sent, not what it declared."""


class LayerSink(Protocol):
    """Caller-owned destinations for layers (DESIGN.md §5: device sinks)."""

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        """Writable views of exactly ``k_len`` and ``v_len`` octets for layer ``index``."""
        ...


class ContainerReader:
    """Sans-I/O incremental parser of one KVB1 container (§4.3), verifying as it goes (§6.7).

    ``layer_digests`` is the Replica Record's full list, indexed by absolute layer number; when
    ``digest`` is given too, the list is first checked against that replica digest. With
    ``compute_digests`` the layer digests are computed (see :attr:`digests`) even without a
    list to check them against, e.g. by a holder that stores a block and publishes its record.

    Raises:
        DigestMismatch: ``layer_digests`` does not hash to ``digest``.
        ValueError: ``digest`` without ``layer_digests``.
    """

    def __init__(
        self,
        geometry: Geometry | None = None,
        *,
        limits: ContainerLimits = DEFAULT_LIMITS,
        layer_digests: Sequence[bytes] | None = None,
        digest: bytes | None = None,
        sink: LayerSink | None = None,
        compute_digests: bool = False,
        hash_container: bool = True,
    ) -> None:
        if digest is not None:
            if layer_digests is None:
                raise ValueError("a replica digest needs the layer_digests it covers")
            if replica_digest(layer_digests) != digest:
                raise DigestMismatch("layer digest list does not hash to the replica digest")
        self._geometry = geometry
        self._limits = limits
        self._expected = layer_digests
        self._sink = sink
        self._hashing = compute_digests or layer_digests is not None
        self._container_hash = hashlib.sha256() if hash_container else None
        self._head = bytearray()
        self._need = KVB1_HEADER.size
        self._header: ContainerHeader | None = None
        self._layer = 0  # position in header.lengths of the layer in progress
        self._section = 0  # of that layer: 0 for K, 1 for V
        self._pos = 0  # octets of that section received
        self._views: list[memoryview | None] = [None, None]  # the layer's K and V destinations
        self._growing = bytearray()  # a section beyond EAGER_SECTION, as much as has arrived
        self._layer_hash: _Hash | None = None
        self._digests: list[bytes] = []
        self._fed = 0
        self._failed = False

    @property
    def header(self) -> ContainerHeader | None:
        """The parsed header, once all of it has arrived."""
        return self._header

    @property
    def done(self) -> bool:
        """Whether every layer the header declares has arrived."""
        return self._header is not None and self._layer == self._header.layer_count

    @property
    def bytes_fed(self) -> int:
        """Octets fed so far."""
        return self._fed

    @property
    def digests(self) -> list[bytes]:
        """Layer digests of the completed layers, when verifying or ``compute_digests``."""
        return list(self._digests)

    def feed(self, chunk: Buffer) -> list[Layer]:
        """Consume ``chunk`` and return the layers it completed, ascending.

        Raises:
            ContainerError: the input so far cannot begin a valid container, octets follow
                the last layer, or the reader failed on earlier input.
            ContainerTooLarge: declared sizes beyond the limits.
            Incompatible: the container's layers are not covered by ``layer_digests``.
            DigestMismatch: a completed layer differs from its layer digest.
        """
        if self._failed:
            raise ContainerError("container reader failed on earlier input")
        mv = byte_view(chunk, "chunk")
        try:
            return self._feed(mv)
        except BaseException:
            self._failed = True
            raise

    def close(self) -> None:
        """Declare the end of input.

        Raises:
            ContainerError: the input ended before the last layer (or the reader had failed).
        """
        if self._failed:
            raise ContainerError("container reader failed on earlier input")
        if not self.done:
            self._failed = True
            raise ContainerError(self._truncation())

    def container_digest(self) -> bytes:
        """SHA-256 of the whole container as fed, for checking ``Repr-Digest`` (§6.7).

        Raises:
            ContainerError: the container is not complete.
        """
        if self._container_hash is None:
            raise ValueError("created with hash_container=False")
        if not self.done or self._failed:
            raise ContainerError("container digest asked for before the container was complete")
        return self._container_hash.digest()

    # -- internals ------------------------------------------------------------------------------

    def _feed(self, mv: memoryview) -> list[Layer]:
        self._fed += len(mv)
        if self._container_hash is not None and mv:
            self._container_hash.update(mv)
        # a layer that lies in one immutable chunk can be handed out as a view of it
        stable = isinstance(mv.obj, bytes)
        out: list[Layer] = []
        off, end = 0, len(mv)
        while off < end:
            header = self._header
            if header is None:
                off = self._take_header(mv, off, out)
            elif self._layer < header.layer_count:
                off = self._take_data(header, mv, off, stable, out)
            else:
                raise ContainerError(f"trailing bytes: {end - off} after the last layer")
        return out

    def _take_header(self, mv: memoryview, off: int, out: list[Layer]) -> int:
        take = min(self._need - len(self._head), len(mv) - off)
        self._head += mv[off : off + take]
        off += take
        if len(self._head) < self._need:
            check_magic_prefix(self._head)
            return off
        # bytes() so that no view pins the growing bytearray
        if self._need == KVB1_HEADER.size:
            fixed = parse_fixed_header(memoryview(bytes(self._head)), self._geometry, self._limits)
            self._need = header_size(fixed.layer_count)
            return off
        header = parse_header(memoryview(bytes(self._head)), self._geometry, self._limits)
        if self._expected is not None:
            check_digest_list(self._expected, header.first_layer, header.layer_count, None)
        self._header = header
        self._head = bytearray()
        self._start_layer()
        self._advance(header, out)
        return off

    def _take_data(
        self, header: ContainerHeader, mv: memoryview, off: int, stable: bool, out: list[Layer]
    ) -> int:
        section, pos = self._section, self._pos
        length = header.lengths[self._layer][section]
        n = min(length - pos, len(mv) - off)
        piece = mv[off : off + n]
        if self._layer_hash is not None:
            self._layer_hash.update(piece)
        if n == length and stable and self._sink is None:
            self._views[section] = piece  # the whole section in one immutable chunk
        elif self._sink is None and length > EAGER_SECTION:
            # staged as it arrives: a declared length alone never allocates its octets
            self._growing += piece
        else:
            dst = self._views[section]
            if dst is None:
                dst = self._open_section(header, length)
            dst[pos : pos + n] = piece
        self._pos = pos + n
        if self._pos == length:
            self._advance(header, out)
        return off + n

    def _open_section(self, header: ContainerHeader, length: int) -> memoryview:
        if self._sink is None:
            view = memoryview(bytearray(length))
            self._views[self._section] = view
            return view
        index = header.first_layer + self._layer
        k_len, v_len = header.lengths[self._layer]
        k_dst, v_dst = self._sink.layer_buffer(index, k_len, v_len)
        k_mv, v_mv = byte_view(k_dst, "sink K buffer"), byte_view(v_dst, "sink V buffer")
        if k_mv.readonly or v_mv.readonly or k_mv.nbytes != k_len or v_mv.nbytes != v_len:
            raise ValueError(
                f"sink gave layer {index} buffers of {k_mv.nbytes} and {v_mv.nbytes} octets "
                f"(writable {k_len} and {v_len} needed)"
            )
        self._views = [k_mv, v_mv]
        return v_mv if self._section else k_mv

    def _advance(self, header: ContainerHeader, out: list[Layer]) -> None:
        # complete every section that has all its octets; an empty one needs none
        lengths, views = header.lengths, self._views
        while self._layer < header.layer_count:
            if self._pos < lengths[self._layer][self._section]:
                return
            if views[self._section] is None:  # empty, or staged in _growing
                views[self._section] = memoryview(self._growing)
                self._growing = bytearray()
            self._pos = 0
            if self._section == 0:
                self._section = 1
            else:
                out.append(self._finish(header))
                views = self._views

    def _finish(self, header: ContainerHeader) -> Layer:
        index = header.first_layer + self._layer
        k, v = self._views
        if k is None or v is None:  # _advance fills both before it calls here
            raise RuntimeError("layer finished before its sections")
        if self._layer_hash is not None:
            got = self._layer_hash.digest()
            if self._expected is not None and got != self._expected[index]:
                raise mismatch(index, got, self._expected[index])
            self._digests.append(got)
        self._layer += 1
        self._start_layer()
        return Layer(index, k, v)

    def _start_layer(self) -> None:
        self._section = 0
        self._pos = 0
        self._views = [None, None]
        self._layer_hash = hashlib.sha256() if self._hashing else None

    def _truncation(self) -> str:
        header = self._header
        if header is None:
            return f"truncated header: {len(self._head)} of {self._need} octets"
        name = "KV"[self._section]
        length = header.lengths[self._layer][self._section]
        return (
            f"truncated data: layer {header.first_layer + self._layer} {name} section has "
            f"{self._pos} of {length} octets ({self._fed} of {header.total_length} container "
            "octets)"
        )
