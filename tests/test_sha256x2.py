"""The native two-stream SHA-256 (:mod:`kvsp.sha256x2`, spec §6.7's two passes) gives exactly
hashlib's digests, however the octets are split, and refuses misuse with a clear error."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import sha256x2

pytestmark = pytest.mark.skipif(
    not sha256x2.ACCELERATED, reason="kvsp._sha256x2 not built or no SHA extensions here"
)

# every length around the padding edges (55/56 octets leave room for the length or not)
EDGES = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 4095, 4096, 4097, 1 << 16]


@pytest.mark.parametrize("n", EDGES)
def test_one_stream_matches_hashlib(n: int) -> None:
    data = os.urandom(n)
    assert sha256x2.Sha256(data).digest() == hashlib.sha256(data).digest()
    h = sha256x2.Sha256()
    h.update(memoryview(data))
    assert h.digest() == hashlib.sha256(data).digest() and h.length == n


def test_known_answers() -> None:  # FIPS 180-4 examples
    assert sha256x2.Sha256(b"abc").digest().hex() == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
    two_blocks = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
    assert sha256x2.Sha256(two_blocks).digest().hex() == (
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    )


def test_digest_leaves_the_stream_open() -> None:
    h = sha256x2.Sha256(b"ab")
    assert h.digest() == hashlib.sha256(b"ab").digest()
    h.update(b"c")
    assert h.digest() == h.digest() == hashlib.sha256(b"abc").digest()


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.binary(max_size=200),
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
)
def test_pairs_match_two_hashlib_passes(prefix: bytes, data: bytes, cuts: list[int]) -> None:
    """Stream a has seen ``prefix`` already (the container header before a layer), so the two
    streams are at different offsets within their 64-octet blocks."""
    a, b = sha256x2.Sha256(prefix), sha256x2.Sha256()
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    view = memoryview(data)
    for start, stop in zip(bounds, bounds[1:], strict=False):
        sha256x2.update2(a, b, view[start:stop])
    assert a.digest() == hashlib.sha256(prefix + data).digest()
    assert b.digest() == hashlib.sha256(data).digest()
    assert (a.length, b.length) == (len(prefix) + len(data), len(data))


def test_large_pairs_release_the_gil_and_stay_right() -> None:
    data = [os.urandom((2 << 20) + i) for i in range(4)]
    results: list[bool] = []

    def work(chunk: bytes) -> None:
        a, b = sha256x2.Sha256(b"x" * 17), sha256x2.Sha256()
        sha256x2.update2(a, b, chunk)
        results.append(
            a.digest() == hashlib.sha256(b"x" * 17 + chunk).digest()
            and b.digest() == hashlib.sha256(chunk).digest()
        )

    threads = [threading.Thread(target=work, args=(chunk,)) for chunk in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4


def test_misuse_is_refused() -> None:
    h = sha256x2.Sha256()
    with pytest.raises(ValueError, match="two different"):
        sha256x2.update2(h, h, b"x")
    with pytest.raises(TypeError):
        sha256x2.update2(h, b"not a hasher", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        h.update("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        sha256x2.Sha256(12)  # type: ignore[arg-type]
    assert h.digest() == hashlib.sha256().digest()  # the refused calls fed nothing


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.binary(max_size=130),
    data=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=10),
)
def test_feed_layers_ends_and_restarts_the_layer_stream(
    prefix: bytes, data: bytes, cuts: list[int]
) -> None:
    ends = sorted(c for c in cuts if c <= len(data))  # repeats: empty layers
    a, b = sha256x2.Sha256(prefix), sha256x2.Sha256()
    digests = sha256x2.feed_layers(a, b, data, ends)
    pieces = [data[x:y] for x, y in zip([0, *ends], ends, strict=False)]
    assert digests == [hashlib.sha256(p).digest() for p in pieces]
    rest = data[ends[-1] if ends else 0 :]
    assert b.digest() == hashlib.sha256(rest).digest()  # the open layer goes on
    assert a.digest() == hashlib.sha256(prefix + data).digest()


def test_feed_layers_refuses_bad_ends_and_feeds_nothing() -> None:
    a, b = sha256x2.Sha256(), sha256x2.Sha256()
    for ends in ([5, 3], [-1], [11], ["x"], 7):
        with pytest.raises((ValueError, TypeError)):
            sha256x2.feed_layers(a, b, b"0123456789", ends)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two different"):
        sha256x2.feed_layers(a, a, b"x", [])
    assert a.length == b.length == 0


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 300), count=st.integers(0, 7), seed=st.binary(min_size=1, max_size=8))
def test_digests_hashes_each_run_alone(size: int, count: int, seed: bytes) -> None:
    data = (seed * (size * count // len(seed) + 1))[: size * count]
    runs = [data[at : at + size] for at in range(0, len(data), size)]
    assert sha256x2.digests(memoryview(data), size) == [hashlib.sha256(r).digest() for r in runs]


@pytest.mark.parametrize("size", [1, 55, 56, 63, 64, 65, 4097, 1 << 16])
@pytest.mark.parametrize("count", [1, 2, 3, 32])
def test_digests_at_the_padding_edges_and_layer_sizes(size: int, count: int) -> None:
    data = os.urandom(size * count)
    runs = [data[at : at + size] for at in range(0, len(data), size)]
    assert sha256x2.digests(data, size) == [hashlib.sha256(r).digest() for r in runs]


def test_digests_refuses_a_size_that_does_not_divide_the_data() -> None:
    for size in (0, -1, 3):
        with pytest.raises(ValueError, match="divide"):
            sha256x2.digests(b"0123456789", size)
    with pytest.raises(TypeError):
        sha256x2.digests("text", 2)  # type: ignore[arg-type]
