"""The KV of token ranges of one context, for sequence-sharded caches (spec §6.9 "Retained ranges
keep their memory in place"; §4.3 layout ``kvsp-layout-1``).

A *range array* is the KV of tokens ``[start, end)``, all layers, as ``uint8`` of shape
``[layers, 2, tokens, row]`` (``2`` = K then V; ``row`` = ``kv_heads × head_dim × element
size`` octets of one token). Row ``t`` of ``[l, 0]`` is exactly token ``t``'s part of layer
``l``'s K section in a §4.3 raw container, so a range travels as one KVB1 container whose token
count is the range's length, and octets are compared bit for bit whatever the element type.

:class:`TokenPages` holds a range in fixed pages of ``page_tokens`` tokens (``[layers, 2,
page_tokens, row]`` each), aligned at an *anchor* (the start of the range when it was first
stored). Narrowing a range to a sub-range (:meth:`TokenPages.slice`) keeps the very same page
arrays, never copies them, and lets go of the pages wholly outside; so a range retained across a
reshard stays where it is, and releasing part of it frees every page not shared with the kept
part (at most one partly used page at each end stays). :class:`ShardSet` is the disjoint ranges
one instance holds of one context at one version, and :func:`gather_kv` rebuilds the whole
context from the pieces of all instances.

Where the first version's shards come from is the engine's business: :func:`pages_from_paged_cache`
splits a prefill held in the engine's paged KV (:class:`kvsp.engine.kvcache.PagedKVCache`) by
range; tests fill a context deterministically instead (:func:`seeded_kv`), which is what the
64k-token reshard acceptance tests do. numpy only: torch is an optional extra, and
:func:`to_torch` imports it on use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from kvsp.container import Container, Geometry, encode_container_parts
from kvsp.errors import BadRequest, Incompatible, NotFound
from kvsp.records_common import TokenRange
from kvsp.registries import Codec

if TYPE_CHECKING:
    import torch

KVArray = npt.NDArray[np.uint8]
"""A range array: ``uint8[layers, 2, tokens, row]``."""

DEFAULT_PAGE_TOKENS = 256
UINT32_MAX = 2**32 - 1
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")
SEED_CHUNK_TOKENS = 1024
""":func:`seeded_kv` draws each run of this many tokens from its own generator, so any
sub-range is reproducible alone."""


class RangeNotHeld(NotFound):
    """Tokens asked for that are not held here (404 ``kvsp-not-found``)."""


class ShardLayoutError(BadRequest):
    """Ranges that overlap, leave a gap, or do not fit the geometry (400)."""


def row_bytes(geometry: Geometry) -> int:
    """Octets of one token in one K or V section (§4.3 raw)."""
    return geometry.kv_heads * geometry.head_dim * geometry.element_size


def token_bytes(geometry: Geometry) -> int:
    """Octets of one token's KV over all layers, K and V."""
    return 2 * geometry.layers * row_bytes(geometry)


def _check_range(start: int, end: int) -> None:
    if not 0 <= start < end:
        raise ShardLayoutError(f"expected a non-empty range start < end, got [{start}, {end})")


class TokenPages:
    """The KV of tokens ``[start, end)`` in pages of ``page_tokens`` tokens aligned at
    ``anchor``: page ``first + i`` of :attr:`pages` covers ``[anchor + (first+i)·P,
    anchor + (first+i+1)·P)``."""

    __slots__ = ("anchor", "end", "first", "page_tokens", "pages", "start")

    def __init__(
        self,
        start: int,
        end: int,
        *,
        anchor: int,
        first: int,
        pages: Sequence[KVArray],
        page_tokens: int,
    ) -> None:
        self.start = start
        self.end = end
        self.anchor = anchor
        self.first = first
        self.pages = tuple(pages)
        self.page_tokens = page_tokens

    @classmethod
    def allocate(
        cls, start: int, end: int, geometry: Geometry, page_tokens: int = DEFAULT_PAGE_TOKENS
    ) -> TokenPages:
        """Fresh (uninitialized) pages for ``[start, end)``, anchored at ``start``.

        Raises:
            ShardLayoutError: an empty range or a page size below 1.
        """
        _check_range(start, end)
        if page_tokens < 1:
            raise ShardLayoutError(f"page_tokens must be positive, got {page_tokens}")
        count = -(-(end - start) // page_tokens)
        shape = (geometry.layers, 2, page_tokens, row_bytes(geometry))
        pages = [np.empty(shape, dtype=np.uint8) for _ in range(count)]
        return cls(start, end, anchor=start, first=0, pages=pages, page_tokens=page_tokens)

    @classmethod
    def from_array(
        cls, start: int, kv: KVArray, geometry: Geometry, page_tokens: int = DEFAULT_PAGE_TOKENS
    ) -> TokenPages:
        """Copy a range array of tokens ``[start, start + n)`` into fresh pages.

        Raises:
            ShardLayoutError: an array that is not ``uint8[layers, 2, n, row]`` of ``geometry``.
        """
        check_kv_array(kv, geometry)
        pieces = cls.allocate(start, start + kv.shape[2], geometry, page_tokens)
        pieces.write(start, kv)
        return pieces

    @property
    def length(self) -> int:
        """Tokens held."""
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Octets of the pages this range keeps alive."""
        return sum(page.nbytes for page in self.pages)

    def _page_span(self, a: int, b: int) -> tuple[int, int]:
        """Indices into :attr:`pages` of the pages holding tokens ``[a, b)``."""
        first = (a - self.anchor) // self.page_tokens - self.first
        last = (b - 1 - self.anchor) // self.page_tokens - self.first
        return first, last

    def _runs(self, a: int, b: int) -> Iterable[tuple[KVArray, int, int, int]]:
        """``(page, slot_from, slot_to, offset)`` for each page part holding ``[a, b)``;
        ``offset`` is the first token's position relative to ``a``."""
        first, last = self._page_span(a, b)
        for i in range(first, last + 1):
            page_start = self.anchor + (self.first + i) * self.page_tokens
            lo = max(a, page_start)
            hi = min(b, page_start + self.page_tokens)
            yield self.pages[i], lo - page_start, hi - page_start, lo - a

    def _check_inside(self, a: int, b: int) -> None:
        if not self.start <= a < b <= self.end:
            raise RangeNotHeld(f"tokens [{a}, {b}) are not all in [{self.start}, {self.end})")

    def write(self, at: int, kv: KVArray) -> None:
        """Copy a range array of tokens ``[at, at + n)`` into the pages.

        Raises:
            RangeNotHeld: the tokens are not all in this range.
        """
        n = int(kv.shape[2])
        self._check_inside(at, at + n)
        for page, lo, hi, offset in self._runs(at, at + n):
            page[:, :, lo:hi] = kv[:, :, offset : offset + hi - lo]

    def write_container(self, at: int, container: Container) -> None:
        """Copy a decoded raw container of all layers (tokens ``[at, at + token_count)``) into
        the pages, each octet once.

        Raises:
            RangeNotHeld: the tokens are not all in this range.
            Incompatible: not all layers from 0, or sections of another row size.
        """
        layers = self.pages[0].shape[0]
        row = self.pages[0].shape[3]
        n = container.token_count
        if container.first_layer != 0 or container.layer_count != layers:
            raise Incompatible(f"expected layers 0-{layers - 1} in the container")
        self._check_inside(at, at + n)
        for layer in container.layers:
            for half, section in enumerate((layer.k, layer.v)):
                if section.nbytes != n * row:
                    raise Incompatible(f"layer {layer.index}: section of {section.nbytes} octets")
                rows = np.frombuffer(section, dtype=np.uint8).reshape(n, row)
                for page, lo, hi, offset in self._runs(at, at + n):
                    page[layer.index, half, lo:hi] = rows[offset : offset + hi - lo]

    def read(self, a: int, b: int) -> KVArray:
        """A new contiguous range array of tokens ``[a, b)``.

        Raises:
            RangeNotHeld: the tokens are not all in this range.
        """
        self._check_inside(a, b)
        layers, _, _, row = self.pages[0].shape
        out = np.empty((layers, 2, b - a, row), dtype=np.uint8)
        for page, lo, hi, offset in self._runs(a, b):
            out[:, :, offset : offset + hi - lo] = page[:, :, lo:hi]
        return out

    def slice(self, a: int, b: int) -> TokenPages:
        """Tokens ``[a, b)`` over the same page arrays (nothing is copied); pages wholly
        outside are not kept.

        Raises:
            RangeNotHeld: the tokens are not all in this range.
        """
        self._check_inside(a, b)
        first, last = self._page_span(a, b)
        return TokenPages(
            a,
            b,
            anchor=self.anchor,
            first=self.first + first,
            pages=self.pages[first : last + 1],
            page_tokens=self.page_tokens,
        )


def check_kv_array(kv: KVArray, geometry: Geometry) -> None:
    """Require a range array of ``geometry``.

    Raises:
        ShardLayoutError: not ``uint8[layers, 2, n ≥ 1, row]``.
    """
    expected = (geometry.layers, 2, row_bytes(geometry))
    shape = tuple(kv.shape)
    if kv.dtype != np.uint8 or len(shape) != 4 or (shape[0], shape[1], shape[3]) != expected:
        raise ShardLayoutError(
            f"expected uint8[{expected[0]}, 2, n, {expected[2]}], got {kv.dtype}{list(shape)}"
        )
    if shape[2] < 1:
        raise ShardLayoutError("a range array holds at least one token")


def distinct_page_bytes(pieces: Iterable[TokenPages]) -> int:
    """Octets of the distinct page arrays behind ``pieces`` (shared pages counted once)."""
    seen: dict[int, int] = {}
    for piece in pieces:
        for page in piece.pages:
            seen[id(page)] = page.nbytes
    return sum(seen.values())


class ShardSet:
    """The disjoint token ranges one instance holds of one context at one version.

    Raises:
        ShardLayoutError: pieces that overlap.
    """

    __slots__ = ("_pieces",)

    def __init__(self, pieces: Iterable[TokenPages] = ()) -> None:
        self._pieces: list[TokenPages] = []
        for piece in pieces:
            self.add(piece)

    def __len__(self) -> int:
        return len(self._pieces)

    @property
    def pieces(self) -> tuple[TokenPages, ...]:
        """The pieces in token order."""
        return tuple(self._pieces)

    def ranges(self) -> list[TokenRange]:
        """The pieces' ranges in token order (adjacent pieces are not merged)."""
        return [(p.start, p.end) for p in self._pieces]

    @property
    def nbytes(self) -> int:
        """Octets of the distinct pages held."""
        return distinct_page_bytes(self._pieces)

    def add(self, piece: TokenPages) -> None:
        """Add a piece.

        Raises:
            ShardLayoutError: it overlaps a piece already held.
        """
        for held in self._pieces:
            if piece.start < held.end and held.start < piece.end:
                raise ShardLayoutError(
                    f"[{piece.start}, {piece.end}) overlaps [{held.start}, {held.end}) held"
                )
        self._pieces.append(piece)
        self._pieces.sort(key=lambda p: p.start)

    def covers(self, a: int, b: int) -> bool:
        """Whether every token of ``[a, b)`` is held."""
        at = a
        for piece in self._pieces:
            if piece.end <= at:
                continue
            if piece.start > at:
                return False
            at = piece.end
            if at >= b:
                return True
        return at >= b

    def slice(self, a: int, b: int) -> list[TokenPages]:
        """Tokens ``[a, b)`` as pieces over the held pages (nothing is copied).

        Raises:
            RangeNotHeld: some token of ``[a, b)`` is not held.
        """
        if not self.covers(a, b):
            raise RangeNotHeld(f"tokens [{a}, {b}) are not all held")
        return [
            p.slice(max(a, p.start), min(b, p.end))
            for p in self._pieces
            if p.start < b and a < p.end
        ]

    def read(self, a: int, b: int) -> KVArray:
        """A new contiguous range array of tokens ``[a, b)``.

        Raises:
            RangeNotHeld: some token of ``[a, b)`` is not held.
        """
        parts = self.slice(a, b)
        if len(parts) == 1:
            return parts[0].read(a, b)
        return np.concatenate([p.read(p.start, p.end) for p in parts], axis=2)


def gather_kv(parts: Iterable[tuple[int, KVArray]]) -> tuple[int, KVArray]:
    """Rebuild one context from range arrays ``(start, kv)`` given in any order: the first
    token's position and the range array of the whole context.

    Raises:
        ShardLayoutError: no parts, or parts that overlap or leave a gap.
    """
    ordered = sorted(parts, key=lambda part: part[0])
    if not ordered:
        raise ShardLayoutError("nothing to gather")
    at = ordered[0][0]
    for start, kv in ordered:
        if start != at:
            what = "overlap" if start < at else "gap"
            raise ShardLayoutError(f"{what} at token {min(start, at)}: ranges must be contiguous")
        at = start + int(kv.shape[2])
    return ordered[0][0], np.concatenate([kv for _, kv in ordered], axis=2)


def gather_sets(shard_sets: Iterable[ShardSet]) -> tuple[int, KVArray]:
    """Rebuild one context from the shard sets of all the instances of a version.

    Raises:
        ShardLayoutError: the pieces overlap or leave a gap.
    """
    return gather_kv((p.start, p.read(p.start, p.end)) for s in shard_sets for p in s.pieces)


def container_parts(kv: KVArray, geometry: Geometry) -> list[bytes | memoryview]:
    """A range array as a KVB1 raw container of all layers (§4.3), uncopied views.

    Raises:
        ShardLayoutError: not a range array of ``geometry``.
    """
    check_kv_array(kv, geometry)
    kv = np.ascontiguousarray(kv)
    return encode_container_parts(
        [(kv[layer, 0], kv[layer, 1]) for layer in range(geometry.layers)],
        first_layer=0,
        token_count=int(kv.shape[2]),
        codec=Codec.RAW,
        geometry=geometry,
    )


def parse_token_range(text: str, name: str = "tokens") -> TokenRange:
    """Parse ``start-end``: a half-open range of uint32 token positions with ``start < end``.

    Raises:
        BadRequest: any other form; ``path`` names the parameter.
    """
    first, sep, last = text.partition("-")
    if not sep or _DECIMAL.fullmatch(first) is None or _DECIMAL.fullmatch(last) is None:
        raise BadRequest(f"expected start-end in decimal, got {text[:40]!r}", path=name)
    start, end = int(first), int(last)
    if not start < end <= UINT32_MAX:
        raise BadRequest(f"expected start < end <= {UINT32_MAX}, got {start}-{end}", path=name)
    return start, end


def range_path(map_name: str, tokens: TokenRange, version: int) -> str:
    """The range resource's path relative to an instance base (with its ``version``)."""
    return f"shards/{map_name}/{tokens[0]}-{tokens[1]}?version={version}"


def seeded_kv(geometry: Geometry, start: int, end: int, seed: int) -> KVArray:
    """A deterministic range array of tokens ``[start, end)`` of a context named by ``seed``
    (random octets; any sub-range gives the same octets as the whole).

    Raises:
        ShardLayoutError: an empty range.
    """
    _check_range(start, end)
    row = row_bytes(geometry)
    out = np.empty((geometry.layers, 2, end - start, row), dtype=np.uint8)
    chunk = SEED_CHUNK_TOKENS
    for index in range(start // chunk, (end - 1) // chunk + 1):
        rng = np.random.default_rng([seed, index])
        block = rng.integers(0, 256, size=(geometry.layers, 2, chunk, row), dtype=np.uint8)
        lo = max(start, index * chunk)
        hi = min(end, (index + 1) * chunk)
        out[:, :, lo - start : hi - start] = block[:, :, lo - index * chunk : hi - index * chunk]
    return out


class HostPages(Protocol):
    """What :func:`pages_from_paged_cache` reads from the engine's paged KV
    (:class:`kvsp.engine.kvcache.PagedKVCache`)."""

    @property
    def block_tokens(self) -> int:
        """Tokens per page."""
        ...

    def host_page_bytes(self, page: int, timeout: float | None = None) -> memoryview:
        """The page's octets (layers × K, V sections) in host memory."""
        ...


def pages_from_paged_cache(
    cache: HostPages,
    page_table: Sequence[int],
    start: int,
    end: int,
    geometry: Geometry,
    page_tokens: int = DEFAULT_PAGE_TOKENS,
) -> TokenPages:
    """Tokens ``[start, end)`` of a sequence in the engine's paged KV (token ``t`` at page
    ``page_table[t // block_tokens]``, slot ``t % block_tokens``), copied into shard pages:
    the first version's shard of a prefill.

    Raises:
        ShardLayoutError: an empty range, or one past the sequence's pages.
        Incompatible: pages whose size does not fit ``geometry``.
    """
    _check_range(start, end)
    block = cache.block_tokens
    if end > len(page_table) * block:
        raise ShardLayoutError(
            f"tokens up to {end} asked, the sequence has {len(page_table)} pages"
        )
    shape = (geometry.layers, 2, block, row_bytes(geometry))
    out = TokenPages.allocate(start, end, geometry, page_tokens)
    for index in range(start // block, (end - 1) // block + 1):
        raw = np.frombuffer(cache.host_page_bytes(page_table[index]), dtype=np.uint8)
        if raw.size != int(np.prod(shape)):
            raise Incompatible(f"engine page of {raw.size} octets, expected {shape}")
        lo = max(start, index * block)
        hi = min(end, (index + 1) * block)
        out.write(lo, raw.reshape(shape)[:, :, lo - index * block : hi - index * block])
    return out


def to_torch(kv: KVArray, geometry: Geometry, kv_dtype: str) -> torch.Tensor:
    """A range array as a torch tensor ``[layers, 2, tokens, kv_heads, head_dim]`` of
    ``kv_dtype``, sharing the array's memory (torch is imported here, on use).

    Raises:
        ShardLayoutError: not a range array of ``geometry``.
        BadRequest: ``kv_dtype`` is not one torch holds, or its size is not the geometry's.
    """
    from kvsp.engine.kvcache import torch_dtype

    check_kv_array(kv, geometry)
    import torch

    dtype = torch_dtype(kv_dtype)
    if torch.empty((), dtype=dtype).element_size() != geometry.element_size:
        raise BadRequest(f"{kv_dtype} elements are not {geometry.element_size} octets")
    flat = torch.from_numpy(np.ascontiguousarray(kv))
    shape = (geometry.layers, 2, int(kv.shape[2]), geometry.kv_heads, geometry.head_dim)
    return flat.view(dtype).reshape(shape)
