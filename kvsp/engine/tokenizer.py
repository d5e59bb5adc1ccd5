"""The reference engine's byte-level tokenizer and its definition file (the §4.1
``tokenizer_digest`` is the SHA-256 of that file).

Format (``tokenizer.json``, our own, written byte-for-byte deterministically)::

    {"byte_tokens": 256, "kvsp_tokenizer": "byte-level-1",
     "specials": {"bos": 256, "eos": 257, "pad": 258}}

Token ``b`` (0 ≤ b < 256) is the byte ``b``; the specials follow. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvsp.engine.config import CheckpointError, read_json_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_KIND = "byte-level-1"
BYTE_TOKENS = 256
SPECIALS = ("bos", "eos", "pad")


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Bytes ↔ token ids: 256 byte tokens followed by BOS, EOS and PAD."""

    bos: int = BYTE_TOKENS
    eos: int = BYTE_TOKENS + 1
    pad: int = BYTE_TOKENS + 2

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return BYTE_TOKENS + len(SPECIALS)

    def encode(self, data: bytes | str, *, bos: bool = False) -> list[int]:
        """Token ids of ``data`` (str as UTF-8), optionally preceded by BOS."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return ([self.bos] if bos else []) + list(raw)

    def decode(self, tokens: Iterable[int]) -> bytes:
        """The bytes of the byte tokens; specials are dropped.

        Raises:
            ValueError: a token id outside the vocabulary.
        """
        out = bytearray()
        for t in tokens:
            if 0 <= t < BYTE_TOKENS:
                out.append(t)
            elif not BYTE_TOKENS <= t < self.vocab_size:
                raise ValueError(f"token id {t} outside the vocabulary of {self.vocab_size}")
        return bytes(out)

    def definition(self) -> bytes:
        """The definition file's exact octets."""
        obj = {
            "kvsp_tokenizer": TOKENIZER_KIND,
            "byte_tokens": BYTE_TOKENS,
            "specials": {"bos": self.bos, "eos": self.eos, "pad": self.pad},
        }
        return json.dumps(obj, sort_keys=True, separators=(", ", ": ")).encode() + b"\n"

    def save(self, folder: str | Path) -> Path:
        """Write ``tokenizer.json`` into ``folder`` and return its path."""
        path = Path(folder) / TOKENIZER_FILE
        path.write_bytes(self.definition())
        return path


def load_tokenizer(folder: str | Path) -> ByteTokenizer:
    """Read ``tokenizer.json`` from a checkpoint folder.

    Raises:
        CheckpointError: missing, not JSON, or not a byte-level-1 definition.
    """
    path = Path(folder) / TOKENIZER_FILE
    obj = read_json_file(path)
    if not isinstance(obj, dict) or obj.get("kvsp_tokenizer") != TOKENIZER_KIND:
        raise CheckpointError(f"{path}: not a {TOKENIZER_KIND} tokenizer", path="$.kvsp_tokenizer")
    specials = obj.get("specials")
    expected = ByteTokenizer()
    if obj.get("byte_tokens") != BYTE_TOKENS or specials != {
        "bos": expected.bos,
        "eos": expected.eos,
        "pad": expected.pad,
    }:
        raise CheckpointError(f"{path}: unexpected token numbering", path="$.specials")
    return expected
