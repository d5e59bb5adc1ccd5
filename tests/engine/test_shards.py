"""The KV of token ranges held in pages (spec §6.9 "Retained ranges keep their memory in place";
§4.3 layout): reads give back exactly what was written, narrowing a range shares its pages and
lets go of the others, and gathering the pieces of all instances rebuilds the context bit for
bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.container import Geometry, decode_container
from kvsp.engine.shards import (
    RangeNotHeld,
    ShardLayoutError,
    ShardSet,
    TokenPages,
    check_kv_array,
    container_parts,
    distinct_page_bytes,
    gather_kv,
    gather_sets,
    pages_from_paged_cache,
    parse_token_range,
    range_path,
    row_bytes,
    seeded_kv,
    token_bytes,
)
from kvsp.errors import BadRequest, Incompatible

GEOMETRY = Geometry(layers=2, kv_heads=2, head_dim=16, element_size=2)  # fp16


def test_row_and_token_sizes_follow_the_geometry() -> None:
    assert row_bytes(GEOMETRY) == 2 * 16 * 2
    assert token_bytes(GEOMETRY) == 2 * 2 * 64


def test_seeded_kv_is_reproducible_by_sub_range() -> None:
    whole = seeded_kv(GEOMETRY, 100, 3000, seed=7)
    assert whole.shape == (2, 2, 2900, 64) and whole.dtype == np.uint8
    part = seeded_kv(GEOMETRY, 1500, 2100, seed=7)
    assert np.array_equal(part, whole[:, :, 1400:2000])
    assert not np.array_equal(seeded_kv(GEOMETRY, 100, 3000, seed=8), whole)


@pytest.mark.parametrize("page_tokens", [1, 7, 256, 5000])
def test_pages_read_back_what_was_written(page_tokens: int) -> None:
    kv = seeded_kv(GEOMETRY, 1000, 3333, seed=1)
    pages = TokenPages.from_array(1000, kv, GEOMETRY, page_tokens)
    assert pages.length == 2333
    assert np.array_equal(pages.read(1000, 3333), kv)
    assert np.array_equal(pages.read(1500, 1501), kv[:, :, 500:501])
    assert np.array_equal(pages.read(2999, 3333), kv[:, :, 1999:])
    expected_pages = -(-2333 // page_tokens)
    assert len(pages.pages) == expected_pages
    assert pages.nbytes == expected_pages * page_tokens * token_bytes(GEOMETRY)


def test_slice_shares_pages_and_drops_the_rest() -> None:
    kv = seeded_kv(GEOMETRY, 0, 1000, seed=2)
    pages = TokenPages.from_array(0, kv, GEOMETRY, page_tokens=100)
    kept = pages.slice(250, 730)
    assert (kept.start, kept.end) == (250, 730)
    assert len(kept.pages) == 6  # pages 2..7: the partly used ends stay
    for page in kept.pages:
        assert any(page is original for original in pages.pages)
    assert kept.nbytes == 6 * 100 * token_bytes(GEOMETRY)
    assert np.array_equal(kept.read(250, 730), kv[:, :, 250:730])
    again = kept.slice(300, 301)  # slicing a slice keeps the page arithmetic right
    assert again.pages[0] is pages.pages[3]
    assert np.array_equal(again.read(300, 301), kv[:, :, 300:301])
    with pytest.raises(RangeNotHeld):
        kept.read(200, 260)
    with pytest.raises(RangeNotHeld):
        kept.slice(700, 731)


def test_a_write_lands_in_shared_pages() -> None:
    pages = TokenPages.from_array(0, seeded_kv(GEOMETRY, 0, 300, seed=3), GEOMETRY, 64)
    kept = pages.slice(100, 200)
    fresh = seeded_kv(GEOMETRY, 0, 10, seed=99)
    kept.write(150, fresh)
    assert np.array_equal(pages.read(150, 160), fresh)


def test_write_container_round_trip() -> None:
    kv = seeded_kv(GEOMETRY, 40, 540, seed=4)
    body = b"".join(bytes(p) for p in container_parts(kv, GEOMETRY))
    container = decode_container(body, GEOMETRY)
    assert container.token_count == 500 and container.layer_count == 2
    assert bytes(container.layers[1].v) == kv[1, 1].tobytes()
    pages = TokenPages.allocate(0, 1000, GEOMETRY, page_tokens=33)
    pages.write_container(40, container)
    assert np.array_equal(pages.read(40, 540), kv)
    with pytest.raises(RangeNotHeld):
        pages.write_container(600, container)


def test_write_container_refuses_other_layers_or_rows() -> None:
    kv = seeded_kv(GEOMETRY, 0, 10, seed=5)
    body = b"".join(bytes(p) for p in container_parts(kv, GEOMETRY))
    container = decode_container(body)
    narrow = Geometry(layers=2, kv_heads=1, head_dim=16, element_size=2)
    with pytest.raises(Incompatible):
        TokenPages.allocate(0, 20, narrow).write_container(0, container)
    three = Geometry(layers=3, kv_heads=2, head_dim=16, element_size=2)
    with pytest.raises(Incompatible):
        TokenPages.allocate(0, 20, three).write_container(0, container)


def test_check_kv_array_names_the_shape() -> None:
    with pytest.raises(ShardLayoutError, match=r"uint8\[2, 2, n, 64\]"):
        check_kv_array(np.zeros((2, 2, 5, 32), dtype=np.uint8), GEOMETRY)
    with pytest.raises(ShardLayoutError):
        check_kv_array(np.zeros((2, 2, 5, 64), dtype=np.float16), GEOMETRY)
    with pytest.raises(ShardLayoutError):
        check_kv_array(np.zeros((2, 2, 0, 64), dtype=np.uint8), GEOMETRY)
    with pytest.raises(ShardLayoutError):
        TokenPages.allocate(5, 5, GEOMETRY)


def test_shard_set_coverage_reads_and_overlaps() -> None:
    kv = seeded_kv(GEOMETRY, 0, 900, seed=6)
    shards = ShardSet(
        [
            TokenPages.from_array(300, kv[:, :, 300:600], GEOMETRY, 50),
            TokenPages.from_array(0, kv[:, :, 0:300], GEOMETRY, 64),
            TokenPages.from_array(700, kv[:, :, 700:900], GEOMETRY, 64),
        ]
    )
    assert shards.ranges() == [(0, 300), (300, 600), (700, 900)]
    assert shards.covers(0, 600) and shards.covers(250, 350) and shards.covers(700, 900)
    assert not shards.covers(500, 701) and not shards.covers(0, 901)
    assert np.array_equal(shards.read(200, 450), kv[:, :, 200:450])
    with pytest.raises(RangeNotHeld):
        shards.read(590, 710)
    with pytest.raises(ShardLayoutError):
        shards.add(TokenPages.from_array(650, kv[:, :, 650:701], GEOMETRY))
    assert len(shards) == 3


def test_distinct_page_bytes_counts_shared_pages_once() -> None:
    pages = TokenPages.from_array(0, seeded_kv(GEOMETRY, 0, 400, seed=7), GEOMETRY, 100)
    left, right = pages.slice(0, 150), pages.slice(150, 400)  # page 1 is in both
    assert distinct_page_bytes([left, right]) == pages.nbytes
    assert left.nbytes + right.nbytes == pages.nbytes + 100 * token_bytes(GEOMETRY)


def test_gather_rebuilds_the_context_from_shuffled_parts() -> None:
    kv = seeded_kv(GEOMETRY, 0, 5000, seed=8)
    cuts = [0, 1, 777, 2048, 4999, 5000]
    parts = [(a, kv[:, :, a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    random.Random(1).shuffle(parts)
    start, whole = gather_kv(parts)
    assert start == 0 and np.array_equal(whole, kv)
    with pytest.raises(ShardLayoutError, match="gap"):
        gather_kv([(0, kv[:, :, :10]), (11, kv[:, :, 11:20])])
    with pytest.raises(ShardLayoutError, match="overlap"):
        gather_kv([(0, kv[:, :, :10]), (9, kv[:, :, 9:20])])
    with pytest.raises(ShardLayoutError):
        gather_kv([])


def test_gather_sets_over_instances() -> None:
    kv = seeded_kv(GEOMETRY, 0, 1000, seed=9)
    a = ShardSet([TokenPages.from_array(0, kv[:, :, :400], GEOMETRY, 64)])
    b = ShardSet([TokenPages.from_array(400, kv[:, :, 400:], GEOMETRY, 64)])
    assert np.array_equal(gather_sets([b, a])[1], kv)


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(0, 300),
    length=st.integers(1, 400),
    page_tokens=st.integers(1, 70),
    data=st.data(),
)
def test_any_slice_reads_like_the_array(
    start: int, length: int, page_tokens: int, data: st.DataObject
) -> None:
    kv = seeded_kv(GEOMETRY, start, start + length, seed=10)
    pages = TokenPages.from_array(start, kv, GEOMETRY, page_tokens)
    a = data.draw(st.integers(start, start + length - 1))
    b = data.draw(st.integers(a + 1, start + length))
    kept = pages.slice(a, b)
    assert np.array_equal(kept.read(a, b), kv[:, :, a - start : b - start])
    assert len(kept.pages) == (b - 1 - start) // page_tokens - (a - start) // page_tokens + 1


def test_first_version_from_the_engine_paged_cache() -> None:
    torch = pytest.importorskip("torch", reason="the paged KV cache needs the engine extra")
    from kvsp.engine.kvcache import PagedKVCache
    from kvsp.engine.shards import to_torch

    cache = PagedKVCache(
        num_pages=12, layers=2, block_tokens=16, kv_heads=2, head_dim=16, kv_dtype="fp16"
    )
    generator = torch.Generator().manual_seed(0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator).to(torch.float16))
    table = [11, 3, 7, 0, 5, 9]  # a sequence of 96 tokens in scattered pages
    shard = pages_from_paged_cache(cache, table, 20, 77, GEOMETRY, page_tokens=10)
    got = to_torch(shard.read(20, 77), GEOMETRY, "fp16")
    per_token = cache.kv[table].permute(1, 2, 0, 3, 4, 5).reshape(2, 2, 96, 2, 16)
    assert torch.equal(got, per_token[:, :, 20:77])
    with pytest.raises(ShardLayoutError):
        pages_from_paged_cache(cache, table, 90, 97, GEOMETRY)


def test_token_range_text_form() -> None:
    assert parse_token_range("0-1") == (0, 1)
    assert parse_token_range("21846-43691") == (21_846, 43_691)
    assert parse_token_range(f"0-{2**32 - 1}") == (0, 2**32 - 1)
    for bad in ("1-1", "2-1", "01-5", "1-", "-5", "1_5", "a-b", "1--5", f"0-{2**32}", "1-5-7"):
        with pytest.raises(BadRequest) as caught:
            parse_token_range(bad)
        assert caught.value.path == "tokens"
    assert range_path("m", (3, 9), 4) == "shards/m/3-9?version=4"
