"""The tiny model the holder tests store blocks of: 4 layers of 2 tokens, 1 KV head of 4
dimensions (a block is a few hundred octets), one scope, and blocks made from a seed."""

from __future__ import annotations

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, encode_container
from kvsp.ids import BlockKey, ScopeId

DESCRIPTOR = CompatibilityDescriptor(
    model="tiny",
    model_digest=b"\x01" * 32,
    tokenizer_digest=b"\x02" * 32,
    layers=4,
    kv_heads=1,
    head_dim=4,
    kv_dtype="fp16",
    positional="rope",
    block_tokens=2,
)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
COMPAT = compat_id(DESCRIPTOR)
SCOPE = ScopeId(b"\x0a" * 16)


def key(n: int) -> BlockKey:
    """Block key ``n`` (32 octets of ``n``)."""
    return BlockKey(bytes([n]) * 32)


def container(seed: int, first: int = 0, count: int = 4, tokens: int = 2) -> bytes:
    """A valid container of layers ``first``..``first + count - 1`` whose octets depend on
    ``seed`` and the layer."""
    section = GEOMETRY.section_length(tokens)
    layers = [
        (bytes([seed, i]) * (section // 2), bytes([i, seed]) * (section // 2))
        for i in range(first, first + count)
    ]
    return encode_container(layers, first_layer=first, token_count=tokens, geometry=GEOMETRY)


SIZE = len(container(0))
"""The size of a whole block."""
