"""Tests for Scope IDs and Block Keys (spec §4.2)."""

from __future__ import annotations

import hashlib
import hmac
import random
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.errors import BadRequest, InvalidIdentifier, TokenError
from kvsp.keys import BlockKeyChain, block_keys, hmac_sha256, scope_id, token_bytes

SCOPE_KEY = bytes(range(100, 140))
COMPAT = hashlib.sha256(b"compat").digest()
TOKEN_MAX = 2**32 - 1


def reference_block_keys(
    scope_key: bytes, compat_id: bytes, tokens: list[int], b: int, parent: bytes = bytes(32)
) -> list[bytes]:
    """§4.2 written out plainly with the standard library."""
    keys = []
    previous = parent
    for i in range(len(tokens) // b):
        block = struct.pack(f">{b}I", *tokens[i * b : (i + 1) * b])
        message = b"KVSP-BLOCK-1" + b"\x00" + compat_id + previous + block
        previous = hmac.new(scope_key, message, hashlib.sha256).digest()
        keys.append(previous)
    return keys


def random_tokens(n: int, seed: int = 7, high: int = 128_256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(high) for _ in range(n)]


# --- HMAC (RFC 4231) ----------------------------------------------------------------------------

RFC4231 = [
    (  # test case 1
        b"\x0b" * 20,
        b"Hi There",
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
    ),
    (  # test case 2: key shorter than the output
        b"Jefe",
        b"what do ya want for nothing?",
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
    ),
    (  # test case 3
        b"\xaa" * 20,
        b"\xdd" * 50,
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
    ),
    (  # test case 4
        bytes(range(1, 26)),
        b"\xcd" * 50,
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
    ),
    (  # test case 6: a 131-octet key is hashed first
        b"\xaa" * 131,
        b"Test Using Larger Than Block-Size Key - Hash Key First",
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
    ),
    (  # test case 7
        b"\xaa" * 131,
        b"This is a test using a larger than block-size key and a larger than block-size data."
        b" The key needs to be hashed before being used by the HMAC algorithm.",
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
    ),
]


@pytest.mark.parametrize(("key", "data", "expected"), RFC4231)
def test_hmac_rfc4231(key: bytes, data: bytes, expected: str) -> None:
    assert hmac_sha256(key, data).hex() == expected
    assert hmac.new(key, data, hashlib.sha256).hexdigest() == expected


@pytest.mark.parametrize("length", [0, 1, 32, 63, 64, 65, 131, 500])
def test_hmac_any_key_length(length: int) -> None:
    key = bytes(i % 251 for i in range(length))
    assert hmac_sha256(key, b"msg") == hmac.new(key, b"msg", hashlib.sha256).digest()


# --- Scope ID ------------------------------------------------------------------------------------


def test_scope_id_known_answer() -> None:
    expected = hashlib.sha256(b"KVSP-SCOPE-1" + b"\x00" + SCOPE_KEY).digest()[:16]
    assert scope_id(SCOPE_KEY) == expected
    assert len(scope_id(bytes(32))) == 16
    assert scope_id(bytearray(SCOPE_KEY)) == expected


@pytest.mark.parametrize("key", [bytes(31), b"", "a" * 40, None])
def test_scope_key_too_short_or_not_bytes(key: Any) -> None:
    with pytest.raises(BadRequest):
        scope_id(key)
    with pytest.raises(BadRequest):
        block_keys(key, COMPAT, [1] * 16, 16)


# --- Block Keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 16, 256])
def test_block_keys_known_answer(b: int) -> None:
    tokens = random_tokens(10 * b + b // 2 + 1, seed=b) + [0, TOKEN_MAX]
    expected = reference_block_keys(SCOPE_KEY, COMPAT, tokens, b)
    keys = block_keys(SCOPE_KEY, COMPAT, tokens, b)
    assert keys == expected
    assert len(keys) == len(tokens) // b  # the partial tail has no key


def test_block_keys_edge_values_and_empty() -> None:
    tokens = [0, 1, TOKEN_MAX, 2**31, 255, 256, 65535, 65536]
    assert block_keys(SCOPE_KEY, COMPAT, tokens, 4) == reference_block_keys(
        SCOPE_KEY, COMPAT, tokens, 4
    )
    assert block_keys(SCOPE_KEY, COMPAT, [], 16) == []
    assert block_keys(SCOPE_KEY, COMPAT, [5] * 15, 16) == []


def test_long_scope_key_is_hashed_first() -> None:
    key = bytes(range(200))  # longer than the 64-octet SHA-256 block
    tokens = random_tokens(64)
    assert block_keys(key, COMPAT, tokens, 16) == reference_block_keys(key, COMPAT, tokens, 16)


def test_keys_depend_on_scope_compat_and_prefix() -> None:
    tokens = random_tokens(32)
    keys = block_keys(SCOPE_KEY, COMPAT, tokens, 16)
    assert block_keys(bytes(32), COMPAT, tokens, 16) != keys
    assert block_keys(SCOPE_KEY, bytes(32), tokens, 16) != keys
    changed = [tokens[0] + 1, *tokens[1:]]
    assert block_keys(SCOPE_KEY, COMPAT, changed, 16)[1] != keys[1]  # K[1] covers block 0


TOKENS = random_tokens(16 * 5 + 3, seed=3, high=30_000)
EXPECTED = reference_block_keys(SCOPE_KEY, COMPAT, TOKENS, 16)


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: np.array(t, dtype=">i8"),
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # strided view
        lambda t: np.array(t, dtype=object),
        lambda t: [np.int64(x) for x in t],
    ],
    ids=[
        "list",
        "tuple",
        "int64",
        "uint32",
        "int32",
        "uint64",
        "uint16",
        "int64-be",
        "strided",
        "object",
        "np-scalars",
    ],
)
def test_token_containers(convert: Any) -> None:
    assert block_keys(SCOPE_KEY, COMPAT, convert(TOKENS), 16) == EXPECTED


def test_range_of_tokens() -> None:
    tokens = range(1000, 1000 + 48)
    expected = reference_block_keys(SCOPE_KEY, COMPAT, list(tokens), 16)
    assert block_keys(SCOPE_KEY, COMPAT, tokens, 16) == expected


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8"])
def test_torch_tensor_tokens(dtype: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is the optional 'engine' extra")
    tensor = torch.tensor(TOKENS if dtype != "uint8" else [t % 256 for t in TOKENS])
    tensor = tensor.to(getattr(torch, dtype))
    plain = [int(x) for x in tensor.tolist()]
    expected = reference_block_keys(SCOPE_KEY, COMPAT, plain, 16)
    assert block_keys(SCOPE_KEY, COMPAT, tensor, 16) == expected


def test_torch_bad_tensors() -> None:
    torch = pytest.importorskip("torch", reason="torch is the optional 'engine' extra")
    bad = [
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
        torch.tensor([[1, 2], [3, 4]]),
        torch.tensor([5, -1, 3]),
        torch.tensor([1, 2], dtype=torch.bfloat16),
    ]
    for tensor in bad:
        with pytest.raises(TokenError):
            block_keys(SCOPE_KEY, COMPAT, tensor, 1)
    with pytest.raises(TokenError, match="token 1 is -1"):
        token_bytes(torch.tensor([5, -1, 3]))
    with pytest.raises(TokenError, match=r"token 0 is 1\.5"):
        token_bytes(torch.tensor([1.5, 2.0]))


@pytest.mark.parametrize(
    ("tokens", "index", "shown"),
    [
        ([1, 2, 3, -1, 5], 3, "-1"),
        ([1, 2**32], 1, "4294967296"),
        ([1, 2, 1.5], 2, "1.5"),
        ([1, 2, 3.0], 2, "3.0"),
        ([7, True, 1], 1, "True"),
        ([0, 1, False], 2, "False"),
        ([1, np.True_], 1, "True"),
        (["5"], 0, "'5'"),
        ([3, None], 1, "None"),
        ([3, 2**80], 1, str(2**80)),
        ([4, np.uint64(2**40)], 1, str(2**40)),
        (np.array([1, 2, 3, 4, 5, -7]), 5, "-7"),
        (np.array([1, 2**32, 3], dtype=np.uint64), 1, "4294967296"),
        (np.array([1, -2], dtype=np.int8), 1, "-2"),
        (np.array([1.0, 2.0]), 0, "1.0"),
        (np.array([True, False]), 0, "True"),
        (np.array([1, "x"], dtype=object), 1, "'x'"),
    ],
)
def test_bad_tokens_name_index_and_value(tokens: Any, index: int, shown: str) -> None:
    with pytest.raises(TokenError) as info:
        block_keys(SCOPE_KEY, COMPAT, tokens, 1)
    assert f"token {index} is {shown}" in str(info.value)


@pytest.mark.parametrize(
    "tokens",
    [
        np.zeros((2, 16), dtype=np.int64),
        np.int64(5),
        np.array(5),
        "12345",
        b"\x00" * 64,
        bytearray(64),
        17,
        None,
        {1, 2, 3},
        iter([1, 2, 3]),
    ],
)
def test_bad_token_shapes(tokens: Any) -> None:
    with pytest.raises(TokenError):
        block_keys(SCOPE_KEY, COMPAT, tokens, 1)


@pytest.mark.parametrize("compat", [bytes(31), bytes(33), b"", "00" * 32])
def test_bad_compat_id(compat: Any) -> None:
    with pytest.raises(InvalidIdentifier):
        block_keys(SCOPE_KEY, compat, [1], 1)


@pytest.mark.parametrize("b", [0, -16, 1.0, True])
def test_bad_block_tokens(b: Any) -> None:
    with pytest.raises(BadRequest):
        block_keys(SCOPE_KEY, COMPAT, [1], b)


def test_bad_parent() -> None:
    with pytest.raises(InvalidIdentifier):
        block_keys(SCOPE_KEY, COMPAT, [1], 1, parent=bytes(16))


# --- continuation and the incremental chain ------------------------------------------------------


def test_parent_continues_a_prefix() -> None:
    tokens = random_tokens(16 * 10 + 5)
    full = block_keys(SCOPE_KEY, COMPAT, tokens, 16)
    rest = block_keys(SCOPE_KEY, COMPAT, tokens[16 * 4 :], 16, parent=full[3])
    assert rest == full[4:]
    expected = reference_block_keys(SCOPE_KEY, COMPAT, tokens[64:], 16, parent=full[3])
    assert rest == expected


def test_chain_state() -> None:
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, 4)
    assert chain.last_key == bytes(32)
    assert chain.keys == ()
    assert chain.extend([1, 2, 3]) == []
    assert chain.pending == 3
    assert chain.hmac_count == 0
    new = chain.extend([4, 5])
    assert new == reference_block_keys(SCOPE_KEY, COMPAT, [1, 2, 3, 4], 4)
    assert chain.pending == 1
    assert chain.last_key == new[0]
    assert chain.keys == tuple(new)
    assert chain.hmac_count == 1


def test_chain_rejects_bad_tokens_without_changing_state() -> None:
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, 2)
    chain.extend([1, 2, 3])
    with pytest.raises(TokenError):
        chain.extend([4, -1])
    assert chain.pending == 1
    assert chain.extend([4]) == reference_block_keys(SCOPE_KEY, COMPAT, [1, 2, 3, 4], 2)[1:]


def test_extending_a_long_chain_does_not_rehash_the_prefix() -> None:
    tokens = np.array(random_tokens(100_000 + 16 + 7, seed=11), dtype=np.int64)
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, 16)
    chain.extend(tokens[:100_000])
    assert chain.hmac_count == 100_000 // 16
    assert (
        chain.extend(tokens[100_000 : 100_000 + 16])
        == block_keys(SCOPE_KEY, COMPAT, tokens[: 100_000 + 16], 16)[-1:]
    )
    assert chain.hmac_count == 100_000 // 16 + 1
    chain.extend(tokens[100_000 + 16 :])  # 7 tokens: no block completes
    assert chain.hmac_count == 100_000 // 16 + 1
    assert chain.pending == 7


def test_chain_with_parent_counts_only_new_blocks() -> None:
    tokens = random_tokens(16 * 3)
    full = block_keys(SCOPE_KEY, COMPAT, tokens, 16)
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, 16, parent=full[1])
    assert chain.last_key == full[1]
    assert chain.extend(tokens[32:]) == full[2:]
    assert chain.hmac_count == 1
    assert chain.keys == (full[2],)


def test_one_token_at_a_time() -> None:
    tokens = random_tokens(16 * 4 + 3)
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, 16)
    collected = [key for token in tokens for key in chain.extend([token])]
    assert collected == list(chain.keys) == reference_block_keys(SCOPE_KEY, COMPAT, tokens, 16)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOKEN_MAX), max_size=120),
    b=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 120), max_size=8),
    as_numpy=st.booleans(),
)
def test_incremental_equals_one_shot(
    tokens: list[int], b: int, cuts: list[int], as_numpy: bool
) -> None:
    one_shot = block_keys(SCOPE_KEY, COMPAT, tokens, b)
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, b)
    collected: list[bytes] = []
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        part = tokens[start:end]
        collected += chain.extend(np.array(part, dtype=np.uint32) if as_numpy else part)
    assert collected == list(chain.keys) == one_shot
    assert chain.hmac_count == len(tokens) // b
    assert chain.pending == len(tokens) % b


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, TOKEN_MAX), max_size=40), b=st.integers(1, 5))
def test_block_keys_property(tokens: list[int], b: int) -> None:
    assert block_keys(SCOPE_KEY, COMPAT, tokens, b) == reference_block_keys(
        SCOPE_KEY, COMPAT, tokens, b
    )
    assert token_bytes(tokens) == struct.pack(f">{len(tokens)}I", *tokens)


def test_core_runs_without_torch() -> None:
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvsp.keys, kvsp.compat\n"
        "import numpy as np\n"
        "k = kvsp.keys.block_keys(bytes(32), bytes(32), np.arange(32), 16)\n"
        "assert len(k) == 2\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
