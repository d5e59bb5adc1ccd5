"""Operator commands of ``kvsp``: ``scope-key new`` (§4.2) and the ``descriptor.json`` that
``model init`` writes beside the checkpoint (§4.1)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from kvsp.cli import main


def test_scope_key_new_writes_a_private_key_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "scope.key"
    assert main(["scope-key", "new", str(path)]) == 0
    printed = capsys.readouterr().out.strip()
    text = path.read_text(encoding="ascii")
    assert text.endswith("\n") and len(bytes.fromhex(text.strip())) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert main(["scope-id", "--scope-key-file", str(path)]) == 0
    assert capsys.readouterr().out.strip() == printed  # the Scope ID of the new key

    assert main(["scope-key", "new", str(path)]) == 1
    assert "never overwritten" in capsys.readouterr().err
    assert path.read_text(encoding="ascii") == text

    other = tmp_path / "other.key"
    assert main(["scope-key", "new", str(other)]) == 0
    assert other.read_text(encoding="ascii") != text  # random, not derived


def test_model_init_writes_the_descriptor_compat_id_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch", reason="the reference engine needs the torch extra")
    pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")
    folder = tmp_path / "tiny"
    argv = ["model", "init", str(folder), "--seed", "1", "--layers", "2", "--hidden", "64"]
    assert main([*argv, "--heads", "4", "--kv-heads", "2"]) == 0
    capsys.readouterr()
    written = json.loads((folder / "descriptor.json").read_text(encoding="utf-8"))
    assert main(["model", "descriptor", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out) == written
    assert main(["compat-id", str(folder / "descriptor.json")]) == 0
    assert len(bytes.fromhex(capsys.readouterr().out.strip())) == 32


def test_generate_with_a_scope_id_alone_says_that_no_cached_block_can_be_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the scope key there are no Block Keys (§4.2): placement asks for none, which
    used to pass silently."""
    token = tmp_path / "token"
    token.write_text("t\n", encoding="ascii")
    code = main(
        [
            *("generate", "--pc", "http://127.0.0.1:9/", "--token-file", str(token)),
            *("--compat-id", "ab" * 32, "--scope-id", "cd" * 16, "--prompt", "hi"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1  # nothing listens at the PC
    assert "--scope-id without the scope key" in err and "--scope-key-file" in err
