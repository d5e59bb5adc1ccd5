"""Bad input to the ``kvsp`` CLI: one line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvsp.cli import main

CID = "ab" * 32


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["scope-id", "--scope-key", "zz"], "not hex"),
        (["scope-id", "--scope-key", "00" * 16], "32"),
        (
            [
                "block-keys",
                "--scope-key",
                "00" * 32,
                "--compat-id",
                CID.upper(),
                "--block-tokens",
                "16",
                "--tokens",
                "1",
            ],
            "hex32",
        ),
        (
            [
                "block-keys",
                "--scope-key",
                "00" * 32,
                "--compat-id",
                CID[:-2],
                "--block-tokens",
                "16",
                "--tokens",
                "1",
            ],
            "hex32",
        ),
        (
            [
                "block-keys",
                "--scope-key",
                "00" * 32,
                "--compat-id",
                CID,
                "--block-tokens",
                "0",
                "--tokens",
                "1",
            ],
            "block",
        ),
        (
            [
                "block-keys",
                "--scope-key",
                "00" * 32,
                "--compat-id",
                CID,
                "--block-tokens",
                "1",
                "--tokens",
                "1,x",
            ],
            "decimal",
        ),
        (
            [
                "block-keys",
                "--scope-key",
                "00" * 32,
                "--compat-id",
                CID,
                "--block-tokens",
                "1",
                "--tokens",
                "1,4294967296",
            ],
            "token 1",
        ),
        (["compat-id", "/nonexistent/d.json"], "cannot read"),
    ],
)
def test_bad_input_is_one_line(args: list[str], fragment: str, capsys: Any) -> None:
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("kvsp: error: ") and err.endswith("\n") and err.count("\n") == 1
    assert fragment in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "malformed JSON"),
        ('{"model": 1}', "required member is missing"),
        ("[1, 2]", "object"),
    ],
)
def test_bad_descriptor_files(content: str, fragment: str, tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "d.json"
    path.write_text(content)
    assert main(["compat-id", str(path)]) == 1
    assert fragment in capsys.readouterr().err


def test_tokens_file_must_hold_integers(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps([1, "2"]))
    args = ["block-keys", "--scope-key", "00" * 32, "--compat-id", CID, "--block-tokens", "1"]
    assert main([*args, "--tokens-file", str(path)]) == 1
    assert "array of integers" in capsys.readouterr().err


def test_pack_rejects_sections_of_the_wrong_size(tmp_path: Path, capsys: Any) -> None:
    descriptor = {
        "model": "m",
        "model_digest": "sha-256:" + "00" * 32,
        "tokenizer_digest": "sha-256:" + "11" * 32,
        "layers": 2,
        "kv_heads": 1,
        "head_dim": 4,
        "kv_dtype": "fp16",
        "positional": "none",
        "block_tokens": 2,
        "layout": "kvsp-layout-1",
    }
    (tmp_path / "d.json").write_text(json.dumps(descriptor))
    (tmp_path / "k").write_bytes(b"\0" * 15)
    (tmp_path / "v").write_bytes(b"\0" * 16)
    args = ["container", "pack", "--descriptor", str(tmp_path / "d.json"), "--first-layer", "0"]
    args += ["--token-count", "2", "--layer-file", str(tmp_path / "k"), str(tmp_path / "v")]
    assert main([*args, "-o", str(tmp_path / "out")]) == 1
    assert "kvsp: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_2(capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(["block-keys", "--scope-key", "00"])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_no_arguments_prints_help(capsys: Any) -> None:
    assert main([]) == 0
    assert "compat-id" in capsys.readouterr().out


SCOPE = "ab" * 16


def test_token_mints_a_working_credential(tmp_path: Path, capsys: Any) -> None:
    from kvsp.web.auth import Principals, may_publish_for, may_use_scope

    path = tmp_path / "principals.toml"
    args = ["token", "--principals", str(path), "--name", "h1", "--role", "holder"]
    assert main([*args, "--scope", SCOPE, "--holder", "http://127.0.0.1:9/"]) == 0
    token = capsys.readouterr().out.strip()
    assert (
        main(
            ["token", "--principals", str(path), "--name", "c", "--role", "client", "--scope", "*"]
        )
        == 0
    )
    capsys.readouterr()
    principals = Principals.load(path)
    principal = principals.authenticate(f"Bearer {token}", now_ms=0)
    assert principal.name == "h1" and principal.roles == {"holder"}
    assert may_use_scope(principal, bytes.fromhex(SCOPE))
    assert not may_use_scope(principal, bytes(16))
    assert may_publish_for(principal, "http://127.0.0.1:9/")
    assert token not in path.read_text()  # only its hash is stored
    assert path.stat().st_mode & 0o777 == 0o600


def test_token_refuses_duplicates_and_bad_scopes(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "p.toml"
    base = ["token", "--principals", str(path), "--name", "x", "--role", "client"]
    assert main([*base, "--scope", SCOPE]) == 0
    first = path.read_text()
    capsys.readouterr()
    assert main([*base, "--scope", SCOPE]) == 1
    assert "--replace" in capsys.readouterr().err
    assert main([*base, "--scope", SCOPE.upper(), "--replace"]) == 1
    assert "hex16" in capsys.readouterr().err
    assert path.read_text() == first  # nothing changed by the refused calls
    assert main([*base, "--scope", SCOPE, "--replace"]) == 0
    assert path.read_text() != first and path.read_text().count("[[principal]]") == 1
