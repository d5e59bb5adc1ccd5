"""KV blocks out of and into the paged cache as KVB1 containers (spec §4.3, codec raw).

A page is one block; its (layer, K|V) slices are already ``kvsp-layout-1`` sections, so export
takes byte views of the page and hands them to :func:`~kvsp.container.encode_container_parts`
(no copy) or :func:`~kvsp.container.encode_container` (the one copy into the result). A page on
a CUDA device is first copied to host memory once. Import goes through the verifying
:class:`~kvsp.engine.sink.BlockLoader`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsp.container import (
    Buffer,
    Geometry,
    decode_container,
    encode_container,
    encode_container_parts,
)
from kvsp.engine.kvcache import PagedKVCache
from kvsp.engine.sink import Staging, load_block
from kvsp.errors import LayersUnavailable

LayerRange = tuple[int, int]
"""An inclusive layer range ``(first, last)``, as in ``?layers=a-b`` (§6.7)."""


def geometry_of(cache: PagedKVCache) -> Geometry:
    """The §4.3 geometry of the cache's blocks."""
    return Geometry(cache.layers, cache.kv_heads, cache.head_dim, cache.kv.element_size())


def page_sections(
    cache: PagedKVCache, page: int, layers: LayerRange | None = None
) -> tuple[int, list[tuple[memoryview, memoryview]]]:
    """(first layer, K and V views per layer) of a page; views of the page itself on CPU.

    Raises:
        LayersUnavailable: the range is empty or beyond the model's layers.
    """
    first, last = layers if layers is not None else (0, cache.layers - 1)
    if not 0 <= first <= last < cache.layers:
        raise LayersUnavailable(f"layers {first}-{last} requested, 0-{cache.layers - 1} held")
    data = cache.host_page_bytes(page)
    section = cache.section_length
    out = []
    for layer in range(first, last + 1):
        k = layer * 2 * section
        out.append((data[k : k + section], data[k + section : k + 2 * section]))
    return first, out


def page_container_parts(
    cache: PagedKVCache, page: int, *, layers: LayerRange | None = None
) -> list[bytes | memoryview]:
    """A page as KVB1 header and uncopied section views, for vectored writers (§4.3).

    Raises:
        LayersUnavailable: a bad layer range.
    """
    first, sections = page_sections(cache, page, layers)
    return encode_container_parts(
        sections, first_layer=first, token_count=cache.block_tokens, geometry=geometry_of(cache)
    )


def page_container(cache: PagedKVCache, page: int, *, layers: LayerRange | None = None) -> bytes:
    """A page as one KVB1 container (§4.3), each octet copied once.

    Raises:
        LayersUnavailable: a bad layer range.
    """
    first, sections = page_sections(cache, page, layers)
    return encode_container(
        sections, first_layer=first, token_count=cache.block_tokens, geometry=geometry_of(cache)
    )


def container_layer_digests(container: Buffer, cache: PagedKVCache) -> list[bytes]:
    """The layer digests of a container of the cache's geometry (§4.3), ascending.

    Raises:
        ContainerError: not a valid container for this geometry.
    """
    return decode_container(container, geometry_of(cache)).layer_digests()


def import_container(
    cache: PagedKVCache,
    page: int,
    container: Buffer,
    *,
    layer_digests: Sequence[bytes] | None = None,
    staging: Staging | None = None,
) -> None:
    """Load a whole container into ``page``, verifying each layer against ``layer_digests``.

    Raises:
        KVSPError: a bad container or a digest mismatch; the page's unready layers fail.
    """
    load_block(cache, page, [container], layer_digests=layer_digests, staging=staging)
