"""kvsp.sha256x2.digest_pair: two messages, each given as pieces, hashed on two lanes (or with
hashlib, one after the other, where the native entry point is absent) give hashlib's digests,
whatever the pieces' sizes and however the two messages' lengths differ."""

from __future__ import annotations

import hashlib
import random

from kvsp import sha256x2


def cut(message: bytes, rng: random.Random) -> list[sha256x2.Buffer]:
    """``message`` in 0 to 6 pieces at random offsets, empty pieces included."""
    cuts = sorted(rng.randrange(len(message) + 1) for _ in range(rng.randrange(7)))
    view = memoryview(message)
    bounds = [0, *cuts, len(message)]
    return [view[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


SIZES = [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 129, 4095, 65536, 70001]


def test_digest_pair_is_sha256_of_each_message(lanes: str) -> None:
    rng = random.Random(20)
    for _ in range(400):
        a = rng.randbytes(rng.choice(SIZES))
        b = rng.randbytes(rng.choice(SIZES))
        want = (hashlib.sha256(a).digest(), hashlib.sha256(b).digest())
        assert sha256x2.digest_pair(cut(a, rng), cut(b, rng)) == want
        assert sha256x2.digest_pieces(cut(a, rng)) == want[0]


def test_digest_pair_takes_any_buffer(lanes: str) -> None:
    a, b = b"x" * 200, bytearray(b"y" * 70)
    assert sha256x2.digest_pair([a], (memoryview(b)[:30], b[30:])) == (
        hashlib.sha256(a).digest(),
        hashlib.sha256(b).digest(),
    )


def test_the_pair_lanes_are_used_where_the_native_module_offers_them() -> None:
    native = sha256x2._native
    offered = native is not None and hasattr(native, "digest_pair")
    assert (sha256x2.ACCELERATED and offered) == sha256x2.PAIRED
