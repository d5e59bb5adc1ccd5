"""Tests for the Compatibility Descriptor and Compatibility ID (spec §4.1)."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.compat import (
    CompatibilityDescriptor,
    compat_id,
    compute_compat_id,
    descriptor_from_files,
    file_digest,
    model_digest_of,
    tokenizer_digest_of,
)
from kvsp.errors import DescriptorError

DIGEST_A = "sha-256:" + "a1" * 32
DIGEST_B = "sha-256:" + "b2" * 32
DIGEST_C = "sha-256:" + "c3" * 32


def descriptor(**changes: Any) -> dict[str, Any]:
    """A valid descriptor as parsed JSON, with members replaced (or removed when ``...``)."""
    obj: dict[str, Any] = {
        "model": "Llama-3-8B-Instruct",
        "model_digest": DIGEST_A,
        "tokenizer_digest": DIGEST_B,
        "layers": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "kv_dtype": "bf16",
        "positional": "rope;theta=500000",
        "block_tokens": 16,
        "layout": "kvsp-layout-1",
    }
    obj.update(changes)
    return {k: v for k, v in obj.items() if v is not ...}


def reference_compat_id(obj: dict[str, Any]) -> bytes:
    """An independent JCS for descriptors (ASCII keys, strings, small ints) and §4.1's hash."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(b"KVSP-COMPAT-1\x00" + canonical.encode("utf-8")).digest()


# --- RFC 8785 vectors: cross-check the JCS dependency -------------------------------------------


def jcs_names(shared: Path) -> list[str]:
    names = sorted(p.name for p in (shared / "vectors/jcs/input").glob("*.json"))
    assert names, "no JCS vectors found"
    return names


def test_rfc8785_vectors(shared: Path) -> None:
    for name in jcs_names(shared):
        text = (shared / "vectors/jcs/input" / name).read_bytes().decode("utf-8")
        expected = (shared / "vectors/jcs/output" / name).read_bytes()
        assert rfc8785.dumps(json.loads(text)) == expected, name


# --- compat_id -----------------------------------------------------------------------------------


def test_compat_id_known_answer() -> None:
    obj = descriptor()
    assert compat_id(obj) == reference_compat_id(obj)
    assert len(compat_id(obj)) == 32


def test_compat_id_with_adapters_known_answer() -> None:
    obj = descriptor(adapters=[DIGEST_C, DIGEST_A])
    assert compat_id(obj) == reference_compat_id(obj)


def test_adapters_absent_and_present_differ() -> None:
    assert compat_id(descriptor()) != compat_id(descriptor(adapters=[DIGEST_C]))


def test_adapter_order_matters() -> None:
    one = compat_id(descriptor(adapters=[DIGEST_A, DIGEST_C]))
    assert one != compat_id(descriptor(adapters=[DIGEST_C, DIGEST_A]))


def test_non_ascii_model_name() -> None:
    obj = descriptor(model="Llama-3-8B-Ü-模型")
    assert compat_id(obj) == reference_compat_id(obj)
    assert compat_id(obj) != compat_id(descriptor())
    assert CompatibilityDescriptor.from_json(obj).model == "Llama-3-8B-Ü-模型"


def test_key_order_does_not_matter() -> None:
    obj = descriptor(adapters=[DIGEST_C])
    reversed_obj = dict(reversed(list(obj.items())))
    assert list(reversed_obj) != list(obj)
    assert compat_id(reversed_obj) == compat_id(obj)


def test_unknown_members_are_ignored() -> None:
    extended = descriptor(comment="ignored", future={"x": [1, 2.5]})
    assert compat_id(extended) == compat_id(descriptor())


def test_integral_float_hashes_as_integer() -> None:
    assert compat_id(descriptor(layers=32.0)) == compat_id(descriptor())


@pytest.mark.parametrize("member", ["model", "layers", "kv_dtype", "positional", "block_tokens"])
def test_every_member_changes_the_id(member: str) -> None:
    other = {
        "model": "other",
        "layers": 33,
        "kv_dtype": "fp16",
        "positional": "rope",
        "block_tokens": 32,
    }
    assert compat_id(descriptor(**{member: other[member]})) != compat_id(descriptor())


def test_compat_id_accepts_descriptor_object_and_caches() -> None:
    record = CompatibilityDescriptor.from_json(descriptor())
    assert compat_id(record) == compat_id(descriptor()) == compute_compat_id(record)
    assert compat_id(record) is compat_id(record)


@pytest.mark.parametrize(
    "positional",
    ["rope", "rope;factor=8;scaling=llama3;theta=500000", "rope;theta=1e4", "alibi", "none"],
)
def test_positional_accepted(positional: str) -> None:
    obj = descriptor(positional=positional)
    assert CompatibilityDescriptor.from_json(obj).positional == positional
    assert compat_id(obj) == reference_compat_id(obj)


@pytest.mark.parametrize(
    "positional",
    [
        "rope;theta=500000;factor=8",  # keys not sorted
        "rope;factor=8;factor=8",  # repeated key
        "rope;base=10000",  # unknown key
        "rope;theta",  # no value
        "rope;theta=fast",  # bad value
        "alibi;theta=1",  # no parameters registered
        "yarn",  # unknown name
        "",
    ],
)
def test_positional_rejected(positional: str) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor.from_json(descriptor(positional=positional))
    assert info.value.path == "$.positional"


# --- validation with exact paths -----------------------------------------------------------------

REQUIRED = [
    "model",
    "model_digest",
    "tokenizer_digest",
    "layers",
    "kv_heads",
    "head_dim",
    "kv_dtype",
    "positional",
    "block_tokens",
    "layout",
]


@pytest.mark.parametrize("member", REQUIRED)
def test_missing_member(member: str) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor.from_json(descriptor(**{member: ...}))
    assert info.value.path == f"$.{member}"


@pytest.mark.parametrize("member", REQUIRED)
def test_null_member(member: str) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor.from_json(descriptor(**{member: None}))
    assert info.value.path == f"$.{member}"


INVALID = [
    ("model", ""),
    ("model", 5),
    ("model", "bad\ud800surrogate"),
    ("model_digest", "a1" * 32),
    ("model_digest", "sha-256:" + "A1" * 32),
    ("model_digest", "sha-256:" + "a1" * 31),
    ("model_digest", "sha-512:" + "a1" * 32),
    ("tokenizer_digest", 7),
    ("layers", 0),
    ("layers", -1),
    ("layers", True),
    ("layers", 1.5),
    ("layers", "32"),
    ("layers", 2**32),
    ("layers", float("inf")),
    ("kv_heads", 0),
    ("head_dim", 2**64),
    ("block_tokens", 0),
    ("block_tokens", [16]),
    ("kv_dtype", "fp64"),
    ("kv_dtype", "BF16"),
    ("kv_dtype", 2),
    ("positional", 3),
    ("layout", "kvsp-layout-2"),
    ("layout", ["kvsp-layout-1"]),
    ("adapters", []),
    ("adapters", None),
    ("adapters", DIGEST_A),
    ("adapters", {"0": DIGEST_A}),
]


@pytest.mark.parametrize(("member", "value"), INVALID)
def test_invalid_member(member: str, value: object) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor.from_json(descriptor(**{member: value}))
    assert info.value.path == f"$.{member}"


def test_invalid_adapter_item_path() -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor.from_json(descriptor(adapters=[DIGEST_A, "sha-256:zz"]))
    assert info.value.path == "$.adapters[1]"


def test_empty_adapters_message_says_absent() -> None:
    with pytest.raises(DescriptorError, match="absent"):
        compat_id(descriptor(adapters=[]))


@pytest.mark.parametrize("value", [None, [], "descriptor", 3])
def test_not_an_object(value: object) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor.from_json(value)
    assert info.value.path == "$"


def test_nested_paths() -> None:
    base = "$.replicas[2].descriptor"
    for member, value in [("layers", 0), ("model", ...), ("adapters", []), ("kv_dtype", "x")]:
        with pytest.raises(DescriptorError) as info:
            CompatibilityDescriptor.from_json(descriptor(**{member: value}), base)
        assert info.value.path == f"{base}.{member}"


def test_round_trip() -> None:
    for obj in (descriptor(), descriptor(adapters=[DIGEST_C, DIGEST_A], model="Ü")):
        record = CompatibilityDescriptor.from_json(obj)
        assert record.to_json() == obj
        assert CompatibilityDescriptor.from_json(record.to_json()) == record


def test_to_json_omits_absent_adapters() -> None:
    assert "adapters" not in CompatibilityDescriptor.from_json(descriptor()).to_json()


def test_adapters_are_raw_octets_in_order() -> None:
    record = CompatibilityDescriptor.from_json(descriptor(adapters=[DIGEST_C, DIGEST_A]))
    assert record.adapters == (bytes.fromhex("c3" * 32), bytes.fromhex("a1" * 32))
    assert record.model_digest == bytes.fromhex("a1" * 32)


def valid_kwargs(**changes: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": "m",
        "model_digest": bytes(32),
        "tokenizer_digest": bytes(32),
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 64,
        "kv_dtype": "fp16",
        "positional": "none",
        "block_tokens": 16,
    }
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("adapters", ()),
        ("adapters", [bytes(32)]),
        ("layers", True),
        ("layers", 2.0),
        ("model_digest", bytes(31)),
        ("model_digest", "sha-256:" + "00" * 32),
        ("layout", "other"),
    ],
)
def test_construction_validates(member: str, value: object) -> None:
    with pytest.raises(DescriptorError) as info:
        CompatibilityDescriptor(**valid_kwargs(**{member: value}))
    assert info.value.path == f"$.{member}"


def test_descriptor_is_hashable_and_frozen() -> None:
    record = CompatibilityDescriptor(**valid_kwargs(adapters=(bytes(32),)))
    assert hash(record) == hash(CompatibilityDescriptor(**valid_kwargs(adapters=(bytes(32),))))
    with pytest.raises(AttributeError):
        record.layers = 3  # type: ignore[misc]


digests = st.binary(min_size=32, max_size=32).map(lambda b: "sha-256:" + b.hex())


@settings(max_examples=100, deadline=None)
@given(
    model=st.text(min_size=1).filter(lambda s: not any(0xD800 <= ord(c) < 0xE000 for c in s)),
    adapters=st.none() | st.lists(digests, min_size=1, max_size=4),
    layers=st.integers(1, 2**32 - 1),
    theta=st.integers(1, 10**9),
)
def test_round_trip_property(
    model: str, adapters: list[str] | None, layers: int, theta: int
) -> None:
    obj = descriptor(model=model, layers=layers, positional=f"rope;theta={theta}")
    if adapters is not None:
        obj["adapters"] = adapters
    record = CompatibilityDescriptor.from_json(json.loads(json.dumps(obj)))
    assert record.to_json() == obj
    expected = hashlib.sha256(b"KVSP-COMPAT-1\x00" + rfc8785.dumps(obj)).digest()
    assert compat_id(obj) == expected


# --- digests of files ----------------------------------------------------------------------------


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_model_digest_orders_by_file_name_bytes(tmp_path: Path) -> None:
    files = {
        "model-00002-of-00002.safetensors": b"second shard",
        "Model-extra.bin": b"upper case sorts first",
        "model-00001-of-00002.safetensors": b"first shard",
        "\u00e9.bin": b"non-ASCII sorts last",
    }
    # Directories must not influence the order: only the names do.
    dirs = ["z", "a", "m", "b"]
    paths = [
        write(tmp_path / d / name, data)
        for d, (name, data) in zip(dirs, files.items(), strict=True)
    ]
    order = sorted(files, key=os.fsencode)
    expected = hashlib.sha256(b"".join(files[name] for name in order)).digest()
    assert model_digest_of(paths) == expected
    assert model_digest_of(list(reversed(paths))) == expected
    assert model_digest_of([str(p) for p in paths[1:] + paths[:1]]) == expected


def test_model_digest_rejects_duplicate_names(tmp_path: Path) -> None:
    paths = [write(tmp_path / "a" / "w.bin", b"1"), write(tmp_path / "b" / "w.bin", b"2")]
    with pytest.raises(DescriptorError, match="w.bin"):
        model_digest_of(paths)


def test_model_digest_rejects_no_files() -> None:
    with pytest.raises(DescriptorError):
        model_digest_of([])


def test_missing_file_is_a_typed_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.safetensors"
    with pytest.raises(DescriptorError, match="absent.safetensors") as info:
        model_digest_of([missing])
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with pytest.raises(DescriptorError, match="absent"):
        tokenizer_digest_of(missing)
    with pytest.raises(DescriptorError):
        file_digest([tmp_path])  # a directory


def test_single_path_is_not_a_sequence(tmp_path: Path) -> None:
    path = write(tmp_path / "w.bin", b"x")
    with pytest.raises(TypeError):
        file_digest(str(path))
    with pytest.raises(TypeError):
        model_digest_of(path)  # type: ignore[arg-type]


def test_file_digest_concatenates_and_streams(tmp_path: Path) -> None:
    big = os.urandom(5 << 20)
    a = write(tmp_path / "a", big)
    b = write(tmp_path / "b", b"tail")
    empty = write(tmp_path / "e", b"")
    tracemalloc.start()
    try:
        digest = file_digest([a, empty, b])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digest == hashlib.sha256(big + b"tail").digest()
    assert peak < 2 << 20, f"file_digest held {peak} octets at once"


def test_tokenizer_digest(tmp_path: Path) -> None:
    path = write(tmp_path / "tokenizer.json", b'{"bytes": true}')
    assert tokenizer_digest_of(path) == hashlib.sha256(b'{"bytes": true}').digest()


def test_descriptor_from_files(tmp_path: Path) -> None:
    w1 = write(tmp_path / "w-1.bin", b"w1")
    w2 = write(tmp_path / "w-2.bin", b"w2")
    tok = write(tmp_path / "tok.json", b"tok")
    lora = write(tmp_path / "lora.safetensors", b"lora")
    split = [write(tmp_path / "s2.bin", b"B"), write(tmp_path / "s1.bin", b"A")]
    common: dict[str, Any] = {
        "model": "tiny",
        "weight_files": [w2, w1],
        "tokenizer_file": tok,
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 64,
        "kv_dtype": "fp32",
        "positional": "rope;theta=10000",
        "block_tokens": 16,
    }
    plain = descriptor_from_files(**common)
    assert plain.model_digest == hashlib.sha256(b"w1w2").digest()
    assert plain.tokenizer_digest == hashlib.sha256(b"tok").digest()
    assert plain.adapters is None
    assert plain.layout == "kvsp-layout-1"
    assert descriptor_from_files(**common, adapter_files=[]).adapters is None
    adapted = descriptor_from_files(**common, adapter_files=[lora, split])
    assert adapted.adapters == (hashlib.sha256(b"lora").digest(), hashlib.sha256(b"AB").digest())
    assert compat_id(adapted) != compat_id(plain)
    with pytest.raises(DescriptorError) as info:
        descriptor_from_files(**{**common, "layers": 0})
    assert info.value.path == "$.layers"
    with pytest.raises(DescriptorError, match="nope"):
        descriptor_from_files(**{**common, "tokenizer_file": tmp_path / "nope"})
