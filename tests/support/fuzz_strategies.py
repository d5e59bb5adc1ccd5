"""Hypothesis strategies shared by the fuzz tests: byte-level mutations of valid encodings,
arbitrary JSON trees and tree mutations, and the fuzz targets of ``interop/fuzz``."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from interop.fuzz import targets

__all__ = ["DELETE", "json_values", "mutate_tree", "mutated", "paths_in", "targets"]

BOUNDARY_BYTES = [
    b"\x00",
    b"\xff",
    b"\x3f",
    b"\x40\x00",
    b"\x7f\xff",
    b"\x80\x00\x00\x00",
    b"\xbf\xff\xff\xff",
    b"\xc0\x00\x00\x01\x00\x00\x00\x00",
    b"\xff" * 8,
    b"\x00\x00\x00\x00\x80\x00\x00\x00",
    b"\x00\x00\x01\x00\x00\x00\x00\x00",
    b'"',
    b"[",
    b"{",
    b"]",
    b"}",
    b"\\",
    b"1e400",
    b"-0",
    b"9" * 30,
    b"\xed\xa0\x80",
]
"""Octets on a boundary: varint prefixes, 32/64-bit extremes, JSON syntax, a lone surrogate."""


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """One of ``seeds`` with 1–6 byte-level mutations (flip, set, splice a boundary value,
    insert, delete a range, duplicate a range, truncate)."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 6))
        pos = draw(st.integers(0, len(data)))
        if op == 0 and data:
            at = min(pos, len(data) - 1)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == 1 and data:
            data[min(pos, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == 2:
            value = draw(st.sampled_from(BOUNDARY_BYTES))
            data[pos : pos + len(value)] = value
        elif op == 3:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == 4:
            del data[pos : pos + draw(st.integers(1, 40))]
        elif op == 5 and data:
            start = draw(st.integers(0, len(data) - 1))
            data[pos:pos] = data[start : start + draw(st.integers(1, 64))]
        else:
            del data[pos:]
    return bytes(data)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(
        [
            targets.HEX32,
            targets.HEX16,
            targets.HEX32.upper(),
            "sha-256:" + targets.HEX32,
            "https://h.example/kvsp/",
            "moqt://r.example:4443",
            "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
            "active",
            "host",
            "top-p",
            2**32,
            2**64,
            -1,
            0,
            1.5e308,
        ]
    )
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["tier", "layers", "state", "tokens", "map", "params", "p", "holder", "ttl_ms"]
            )
            | st.text(max_size=6),
            children,
            max_size=4,
        )
    ),
    max_leaves=24,
)
"""Arbitrary JSON trees, with values that are valid somewhere in the records."""

DELETE = object()
"""A mutation that removes the member or element."""


def paths_in(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indexes) to a member or element inside ``value``."""
    out: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            out.append((*prefix, key))
            out += paths_in(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.append((*prefix, i))
            out += paths_in(item, (*prefix, i))
    return out


def mutate_tree(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """A deep copy of ``value`` with the node at ``path`` replaced by ``new`` (or removed)."""
    out = copy.deepcopy(value)
    node = out
    for step in path[:-1]:
        node = node[step]
    if new is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return out
