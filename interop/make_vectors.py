"""Write the conformance vectors in ``interop/vectors/`` (spec §4.1–4.3).

Run by hand after a deliberate change: ``.venv/bin/python interop/make_vectors.py``. Inputs are
derived deterministically (SHA-256 counters), expected values come from this implementation and
are cross-checked in ``tests/test_vectors.py`` against a straightforward stdlib reference.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, encode_container, replica_digest
from kvsp.ids import format_digest
from kvsp.keys import block_keys, scope_id

OUT = Path(__file__).resolve().parent / "vectors"
SOURCE = "kvsp reference implementation (interop/make_vectors.py), cross-checked in tests"


def stream(label: str, n: int) -> bytes:
    """``n`` deterministic pseudo-random octets named by ``label``."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{label}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def tokens(label: str, n: int, vocab: int = 2**32) -> list[int]:
    raw = stream(label, 4 * n)
    return [v % vocab for v in struct.unpack(f">{n}I", raw)]


def digest_text(label: str) -> str:
    return format_digest(hashlib.sha256(label.encode()).digest())


BASE: dict[str, Any] = {
    "model": "kvsp-tiny-llama",
    "model_digest": digest_text("weights"),
    "tokenizer_digest": digest_text("tokenizer"),
    "layers": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "kv_dtype": "bf16",
    "positional": "rope;theta=10000",
    "block_tokens": 16,
    "layout": "kvsp-layout-1",
}


def compat_vectors() -> list[dict[str, Any]]:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("minimal, adapters absent", dict(BASE)),
        ("one adapter", {**BASE, "adapters": [digest_text("lora-a")]}),
        (
            "two adapters, order matters",
            {**BASE, "adapters": [digest_text("lora-a"), digest_text("lora-b")]},
        ),
        (
            "two adapters, reversed",
            {**BASE, "adapters": [digest_text("lora-b"), digest_text("lora-a")]},
        ),
        (
            "positional with parameters",
            {**BASE, "positional": "rope;factor=8;scaling=llama3;theta=500000"},
        ),
        ("positional alibi", {**BASE, "positional": "alibi"}),
        ("non-ASCII model name", {**BASE, "model": "Llama-3-8B-Ü-模型-😀"}),
        ("keys in reverse insertion order", dict(reversed(list(BASE.items())))),
        (
            "fp32, 32 layers, GQA 8x128",
            {**BASE, "kv_dtype": "fp32", "layers": 32, "kv_heads": 8, "head_dim": 128},
        ),
        ("unknown member ignored", {**BASE, "x-vendor-note": "ignored by compat_id"}),
    ]
    return [{"name": name, "descriptor": d, "compat_id": compat_id(d).hex()} for name, d in cases]


def scope_vectors() -> list[dict[str, Any]]:
    keys = [bytes(32), bytes(range(32)), stream("scope-48", 48), stream("scope-100", 100)]
    return [{"scope_key": k.hex(), "scope_id": scope_id(k).hex()} for k in keys]


def block_key_vectors() -> list[dict[str, Any]]:
    cid = compat_id(BASE)
    out = []
    for b, n, key_len in [(1, 5, 32), (16, 50, 32), (16, 64, 32), (256, 600, 32), (16, 40, 80)]:
        sk = stream(f"scope-{b}-{n}", key_len)
        toks = tokens(f"tokens-{b}-{n}", n, vocab=128256 if b != 1 else 2**32)
        out.append(
            {
                "name": f"B={b}, {n} tokens ({n // b} complete blocks), scope key {key_len} octets",
                "scope_key": sk.hex(),
                "compat_id": cid.hex(),
                "block_tokens": b,
                "tokens": toks,
                "block_keys": [k.hex() for k in block_keys(sk, cid, toks, b)],
            }
        )
    out.append(
        {
            "name": "fewer tokens than one block: no keys",
            "scope_key": bytes(32).hex(),
            "compat_id": cid.hex(),
            "block_tokens": 16,
            "tokens": list(range(15)),
            "block_keys": [],
        }
    )
    return out


def container_vectors() -> list[dict[str, Any]]:
    out = []
    for dtype, first, count, token_count in [
        ("bf16", 0, 4, 16),
        ("bf16", 1, 2, 16),
        ("fp32", 3, 1, 4),
        ("fp16", 0, 2, 3),
        ("int8", 2, 2, 16),
        ("fp8_e4m3", 0, 4, 1),
    ]:
        desc = {**BASE, "kv_dtype": dtype}
        geometry = Geometry.from_descriptor(CompatibilityDescriptor.from_json(desc))
        size = geometry.section_length(token_count)
        layers = [
            (stream(f"k{dtype}{i}", size), stream(f"v{dtype}{i}", size))
            for i in range(first, first + count)
        ]
        data = encode_container(
            layers, first_layer=first, token_count=token_count, geometry=geometry
        )
        digests = [hashlib.sha256(k + v).digest() for k, v in layers]
        out.append(
            {
                "name": f"{dtype}, layers {first}..{first + count - 1} of 4, {token_count} tokens",
                "descriptor": desc,
                "first_layer": first,
                "token_count": token_count,
                "layers": [[k.hex(), v.hex()] for k, v in layers],
                "container": data.hex(),
                "layer_digests": [d.hex() for d in digests],
                "digest": format_digest(replica_digest(digests)),
            }
        )
    return out


def invalid_vectors() -> list[dict[str, Any]]:
    good = bytes.fromhex(container_vectors()[2]["container"])  # fp32, one layer
    header = bytearray(good)

    def patched(offset: int, value: bytes) -> str:
        data = bytearray(header)
        data[offset : offset + len(value)] = value
        return bytes(data).hex()

    desc = {**BASE, "kv_dtype": "fp32"}
    containers = [
        ("bad magic", patched(0, b"KVB2"), "magic"),
        ("version 2", patched(4, b"\x02"), "version"),
        ("flags set", patched(5, b"\x01"), "flags"),
        ("unknown codec 2", patched(6, b"\x00\x02"), "codec"),
        ("truncated header", good[:10].hex(), "truncated"),
        ("truncated data", good[:-1].hex(), "truncated"),
        ("trailing byte", (good + b"\x00").hex(), "trailing"),
        ("layer range beyond the descriptor's 4 layers", patched(8, struct.pack(">I", 4)), "layer"),
        ("K length disagrees with the geometry", patched(20, struct.pack(">Q", 8)), "length"),
    ]
    descriptors = [
        ("empty adapters array", {**BASE, "adapters": []}, "$.adapters"),
        (
            "uppercase digest",
            {**BASE, "model_digest": BASE["model_digest"].upper().replace("SHA-256:", "sha-256:")},
            "$.model_digest",
        ),
        ("digest without prefix", {**BASE, "tokenizer_digest": "ab" * 32}, "$.tokenizer_digest"),
        ("unknown kv_dtype", {**BASE, "kv_dtype": "fp64"}, "$.kv_dtype"),
        (
            "unsorted positional params",
            {**BASE, "positional": "rope;theta=1;factor=2"},
            "$.positional",
        ),
        ("unknown positional", {**BASE, "positional": "xpos"}, "$.positional"),
        ("layers zero", {**BASE, "layers": 0}, "$.layers"),
        ("layers a string", {**BASE, "layers": "4"}, "$.layers"),
        (
            "missing block_tokens",
            {k: v for k, v in BASE.items() if k != "block_tokens"},
            "$.block_tokens",
        ),
    ]
    return [
        *(
            {
                "kind": "container",
                "name": n,
                "descriptor": desc,
                "container": c,
                "error": "ContainerError",
                "message_contains": m,
            }
            for n, c, m in containers
        ),
        *(
            {
                "kind": "descriptor",
                "name": n,
                "descriptor": d,
                "error": "DescriptorError",
                "path": p,
            }
            for n, d, p in descriptors
        ),
        {
            "kind": "block_keys",
            "name": "token 2^32",
            "scope_key": bytes(32).hex(),
            "compat_id": compat_id(BASE).hex(),
            "block_tokens": 1,
            "tokens": [0, 2**32],
            "error": "TokenError",
            "message_contains": "token 1",
        },
        {
            "kind": "block_keys",
            "name": "negative token",
            "scope_key": bytes(32).hex(),
            "compat_id": compat_id(BASE).hex(),
            "block_tokens": 2,
            "tokens": [5, -1],
            "error": "TokenError",
            "message_contains": "token 1",
        },
        {
            "kind": "scope_id",
            "name": "scope key of 31 octets",
            "scope_key": bytes(31).hex(),
            "error": "BadRequest",
            "message_contains": "32",
        },
    ]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    files = {
        "compat_ids.json": compat_vectors(),
        "scope_ids.json": scope_vectors(),
        "block_keys.json": block_key_vectors(),
        "containers.json": container_vectors(),
        "invalid.json": invalid_vectors(),
    }
    for name, cases in files.items():
        doc = {"source": SOURCE, "spec": "draft KVSP §4.1-4.3", "cases": cases}
        (OUT / name).write_text(
            json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        print(f"wrote {OUT / name}: {len(cases)} cases")


if __name__ == "__main__":
    main()
