"""The conformance vectors of ``interop/vectors`` (spec §4.1–4.3), checked three ways: against
the library, against a straightforward stdlib reference written here, and through the CLI."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rfc8785

import kvsp.errors
from kvsp.cli import main
from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, decode_container, verify_container
from kvsp.ids import parse_digest
from kvsp.keys import block_keys, scope_id
from tests.support import REPO

VECTORS = REPO / "interop" / "vectors"


def load(name: str) -> list[dict[str, Any]]:
    doc = json.loads((VECTORS / name).read_text(encoding="utf-8"))
    assert doc["source"]
    cases: list[dict[str, Any]] = doc["cases"]
    return cases


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c.get("name", str(i)) for i, c in enumerate(cases)]


def reference_compat_id(descriptor: dict[str, Any]) -> bytes:
    known = set(CompatibilityDescriptor.__dataclass_fields__)
    body = rfc8785.dumps({k: v for k, v in descriptor.items() if k in known})
    return hashlib.sha256(b"KVSP-COMPAT-1\x00" + body).digest()


def reference_block_keys(key: bytes, cid: bytes, tokens: list[int], b: int) -> list[bytes]:
    keys, parent = [], bytes(32)
    for i in range(len(tokens) // b):
        msg = b"KVSP-BLOCK-1\x00" + cid + parent + struct.pack(f">{b}I", *tokens[i * b : i * b + b])
        parent = hmac.new(key, msg, hashlib.sha256).digest()
        keys.append(parent)
    return keys


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(args)
    out, err = capsys.readouterr()
    return status, out, err


COMPAT = load("compat_ids.json")


@pytest.mark.parametrize("case", COMPAT, ids=ids(COMPAT))
def test_compat_ids(case: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    assert compat_id(case["descriptor"]).hex() == case["compat_id"]
    assert reference_compat_id(case["descriptor"]).hex() == case["compat_id"]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(case["descriptor"], ensure_ascii=False), encoding="utf-8")
    assert run_cli(["compat-id", str(path)], capsys) == (0, case["compat_id"] + "\n", "")


def test_compat_vectors_distinguish_what_they_claim() -> None:
    by_name = {c["name"]: c["compat_id"] for c in COMPAT}
    assert by_name["keys in reverse insertion order"] == by_name["minimal, adapters absent"]
    assert by_name["unknown member ignored"] == by_name["minimal, adapters absent"]
    assert by_name["one adapter"] != by_name["minimal, adapters absent"]
    assert by_name["two adapters, order matters"] != by_name["two adapters, reversed"]


SCOPES = load("scope_ids.json")


@pytest.mark.parametrize("case", SCOPES, ids=[c["scope_key"][:12] for c in SCOPES])
def test_scope_ids(case: dict[str, Any], capsys: Any) -> None:
    key = bytes.fromhex(case["scope_key"])
    assert scope_id(key).hex() == case["scope_id"]
    ref = hashlib.sha256(b"KVSP-SCOPE-1\x00" + key).digest()[:16]
    assert ref.hex() == case["scope_id"]
    assert run_cli(["scope-id", "--scope-key", case["scope_key"]], capsys)[:2] == (
        0,
        case["scope_id"] + "\n",
    )


BLOCKS = load("block_keys.json")


@pytest.mark.parametrize("case", BLOCKS, ids=ids(BLOCKS))
def test_block_keys(case: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    key, cid = bytes.fromhex(case["scope_key"]), bytes.fromhex(case["compat_id"])
    expected = case["block_keys"]
    got = block_keys(key, cid, case["tokens"], case["block_tokens"])
    assert [k.hex() for k in got] == expected
    ref = reference_block_keys(key, cid, case["tokens"], case["block_tokens"])
    assert [k.hex() for k in ref] == expected
    tokens_file = tmp_path / "t.json"
    tokens_file.write_text(json.dumps(case["tokens"]))
    common = ["block-keys", "--scope-key", case["scope_key"], "--compat-id", case["compat_id"]]
    common += ["--block-tokens", str(case["block_tokens"])]
    want = "".join(k + "\n" for k in expected)
    assert run_cli([*common, "--tokens-file", str(tokens_file)], capsys)[:2] == (0, want)
    listed = ",".join(map(str, case["tokens"]))
    assert run_cli([*common, "--tokens", listed], capsys)[:2] == (0, want)


CONTAINERS = load("containers.json")


@pytest.mark.parametrize("case", CONTAINERS, ids=ids(CONTAINERS))
def test_containers(case: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    data = bytes.fromhex(case["container"])
    descriptor = CompatibilityDescriptor.from_json(case["descriptor"])
    container = decode_container(data, Geometry.from_descriptor(descriptor))
    assert container.first_layer == case["first_layer"]
    assert container.token_count == case["token_count"]
    for layer, (k, v) in zip(container.layers, case["layers"], strict=True):
        assert (bytes(layer.k).hex(), bytes(layer.v).hex()) == (k, v)
    assert [d.hex() for d in container.layer_digests()] == case["layer_digests"]
    # A record lists every layer of the block; place the present ones at their indices.
    full = [bytes(32)] * descriptor.layers
    for i, d in enumerate(case["layer_digests"]):
        full[case["first_layer"] + i] = bytes.fromhex(d)
    verify_container(container, full, None)

    # pack from the raw sections, then inspect: byte-identical and the same digests
    desc_file = tmp_path / "d.json"
    desc_file.write_text(json.dumps(case["descriptor"], ensure_ascii=False), encoding="utf-8")
    args = ["container", "pack", "--descriptor", str(desc_file)]
    args += ["--first-layer", str(case["first_layer"]), "--token-count", str(case["token_count"])]
    for i, (k, v) in enumerate(case["layers"]):
        (tmp_path / f"k{i}").write_bytes(bytes.fromhex(k))
        (tmp_path / f"v{i}").write_bytes(bytes.fromhex(v))
        args += ["--layer-file", str(tmp_path / f"k{i}"), str(tmp_path / f"v{i}")]
    out_file = tmp_path / "block.kvb"
    assert run_cli([*args, "-o", str(out_file)], capsys)[0] == 0
    assert out_file.read_bytes() == data
    status, out, _ = run_cli(["container", "inspect", str(out_file)], capsys)
    report = json.loads(out)
    assert status == 0
    assert report == {
        "version": 1,
        "flags": 0,
        "codec": 1,
        "first_layer": case["first_layer"],
        "layer_count": len(case["layers"]),
        "token_count": case["token_count"],
        "layer_digests": case["layer_digests"],
        "digest": case["digest"],
    }
    concat = b"".join(bytes.fromhex(d) for d in case["layer_digests"])
    assert hashlib.sha256(concat).digest() == parse_digest(case["digest"])


INVALID = load("invalid.json")


def _raise_for(case: dict[str, Any]) -> None:
    kind = case["kind"]
    if kind == "container":
        geometry = Geometry.from_descriptor(CompatibilityDescriptor.from_json(case["descriptor"]))
        decode_container(bytes.fromhex(case["container"]), geometry)
    elif kind == "descriptor":
        compat_id(case["descriptor"])
    elif kind == "block_keys":
        block_keys(
            bytes.fromhex(case["scope_key"]),
            bytes.fromhex(case["compat_id"]),
            case["tokens"],
            case["block_tokens"],
        )
    else:
        scope_id(bytes.fromhex(case["scope_key"]))


@pytest.mark.parametrize("case", INVALID, ids=ids(INVALID))
def test_invalid(case: dict[str, Any]) -> None:
    error_class = getattr(kvsp.errors, case["error"])
    with pytest.raises(error_class) as info:
        _raise_for(case)
    if "message_contains" in case:
        assert case["message_contains"] in str(info.value)
    if "path" in case:
        assert info.value.path == case["path"]


@pytest.mark.parametrize("case", [c for c in INVALID if c["kind"] == "container"], ids=str)
def test_cli_rejects_invalid_containers(case: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "bad.kvb"
    path.write_bytes(bytes.fromhex(case["container"]))
    desc = tmp_path / "d.json"
    desc.write_text(json.dumps(case["descriptor"]))
    status, out, err = run_cli(
        ["container", "inspect", str(path), "--descriptor", str(desc)], capsys
    )
    assert status == 1 and out == ""
    assert err.startswith("kvsp: error: ") and err.count("\n") == 1
    assert case["message_contains"] in err


def test_python_dash_m_kvsp_runs_and_fails_cleanly(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "kvsp", "scope-id", "--scope-key", "00" * 32],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == SCOPES[0]["scope_id"]
    bad = subprocess.run(
        [sys.executable, "-m", "kvsp", "compat-id", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("kvsp: error: cannot read") and "Traceback" not in bad.stderr
