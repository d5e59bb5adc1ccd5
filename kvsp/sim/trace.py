"""Mooncake trace loading and the mapping of its hash ids to KVSP Block Keys (spec §4.2).

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one hash id per 512-token block of the prompt, the last one covering
the partial tail. Only complete blocks have keys (§4.2), so a request has
``input_length // 512`` keys and its tail is always recomputed.

Keys: a block with hash id ``h`` stands for the 512 tokens ``h * 512 + n`` for ``n = 0..511``
(hash ids are refused from ``2**32 / 512`` up, so the tokens fit in uint32 and stay distinct
per id), and the keys are the real §4.2 chain (:class:`~kvsp.keys.BlockKeyChain`) over
those tokens. Equal hash-id prefixes therefore give equal keys, and a hash id after a different
prefix gives a different key, exactly as the chain does for real tokens. A memo of
``(parent key, hash id) -> key`` makes each distinct block cost one HMAC for the whole trace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsp.errors import BadRequest
from kvsp.ids import BlockKey
from kvsp.keys import TOKEN_MAX, ZERO_KEY, BlockKeyChain


class TraceError(BadRequest):
    """A trace line that cannot be replayed; ``line`` is its 1-based number."""

    def __init__(self, line: int, detail: str) -> None:
        self.line = line
        super().__init__(detail, path=f"line {line}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One trace line, checked."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimRequest:
    """A request as the simulator replays it: arrival, prompt length and Block Keys."""

    rid: int
    arrival_us: float
    input_tokens: int
    output_tokens: int
    keys: tuple[BlockKey, ...]


def _integer(obj: dict[str, Any], name: str, line: int, minimum: int) -> int:
    value = obj.get(name)
    if type(value) is not int or value < minimum:
        raise TraceError(line, f"{name}: expected an integer >= {minimum}, got {value!r:.40}")
    return value


def parse_line(text: str, line: int, block_tokens: int) -> TraceRequest:
    """Check one trace line.

    Raises:
        TraceError: not a JSON object, a bad member, or fewer hash ids than complete blocks.
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(line, f"malformed JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise TraceError(line, "expected a JSON object")
    stamp = obj.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not 0 <= stamp < math.inf:
        raise TraceError(line, f"timestamp: expected a number >= 0, got {stamp!r:.40}")
    length = _integer(obj, "input_length", line, 1)
    output = _integer(obj, "output_length", line, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        type(h) is int and 0 <= h <= TOKEN_MAX // block_tokens for h in ids
    ):
        raise TraceError(
            line, f"hash_ids: expected an array of integers in [0, {TOKEN_MAX // block_tokens}]"
        )
    if len(ids) < length // block_tokens:
        raise TraceError(
            line,
            f"hash_ids: {len(ids)} ids for {length // block_tokens} complete blocks "
            f"of {block_tokens} tokens",
        )
    return TraceRequest(
        line=line,
        timestamp_ms=float(stamp),
        input_length=length,
        output_length=output,
        hash_ids=tuple(ids),
    )


def parse_trace(lines: Iterable[str], block_tokens: int) -> list[TraceRequest]:
    """Check every line (blank lines are skipped); timestamps must not go backwards.

    Raises:
        TraceError: the first bad line, by number.
    """
    out: list[TraceRequest] = []
    last = 0.0
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        request = parse_line(text, number, block_tokens)
        if request.timestamp_ms < last:
            raise TraceError(number, f"timestamp {request.timestamp_ms} goes back from {last}")
        last = request.timestamp_ms
        out.append(request)
    return out


def load_trace(path: str | Path, block_tokens: int) -> list[TraceRequest]:
    """Read and check a JSONL trace file.

    Raises:
        TraceError: a bad line (line 0 when the file cannot be read).
    """
    try:
        with Path(path).open(encoding="utf-8") as handle:
            return parse_trace(handle, block_tokens)
    except OSError as exc:
        raise TraceError(0, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(0, f"{path}: not UTF-8 text") from None


class KeyMapper:
    """Hash ids to chained Block Keys (§4.2), memoized per ``(parent key, hash id)``."""

    __slots__ = ("_block_tokens", "_compat_id", "_memo", "_offsets", "_scope_key")

    def __init__(self, scope_key: bytes, compat_id: bytes, block_tokens: int) -> None:
        """Raises: BadRequest: a short scope key or bad ``block_tokens`` (as the chain does)."""
        BlockKeyChain(scope_key, compat_id, block_tokens)  # validates the arguments once
        self._scope_key = scope_key
        self._compat_id = compat_id
        self._block_tokens = block_tokens
        self._offsets = np.arange(block_tokens, dtype=np.uint64)
        self._memo: dict[tuple[bytes, int], BlockKey] = {}

    @property
    def distinct_blocks(self) -> int:
        """How many distinct blocks (prefix + hash id) were keyed so far."""
        return len(self._memo)

    def tokens(self, hash_ids: Sequence[int]) -> np.ndarray[Any, np.dtype[np.uint32]]:
        """The synthetic tokens of the blocks ``hash_ids``: ``h * B + n`` for ``n < B``."""
        ids = np.asarray(hash_ids, dtype=np.uint64)[:, None] * np.uint64(self._block_tokens)
        return (ids + self._offsets).astype(np.uint32).ravel()

    def keys(self, hash_ids: Sequence[int], complete: int) -> tuple[BlockKey, ...]:
        """The Block Keys of the first ``complete`` blocks of a prompt."""
        out: list[BlockKey] = []
        parent = ZERO_KEY
        memo = self._memo
        for h in hash_ids[:complete]:
            key = memo.get((parent, h))
            if key is None:
                break
            out.append(key)
            parent = key
        done = len(out)
        if done < complete:
            chain = BlockKeyChain(
                self._scope_key, self._compat_id, self._block_tokens, parent=parent
            )
            rest = hash_ids[done:complete]
            for h, key in zip(rest, chain.extend(self.tokens(rest)), strict=True):
                memo[(parent, h)] = key
                out.append(key)
                parent = key
        return tuple(out)


def to_requests(
    trace: Sequence[TraceRequest], mapper: KeyMapper, block_tokens: int
) -> list[SimRequest]:
    """Turn checked trace lines into simulator requests, arrival times relative to the first."""
    start = trace[0].timestamp_ms if trace else 0.0
    return [
        SimRequest(
            rid=n,
            arrival_us=(r.timestamp_ms - start) * 1000.0,
            input_tokens=r.input_length,
            output_tokens=r.output_length,
            keys=mapper.keys(r.hash_ids, r.input_length // block_tokens),
        )
        for n, r in enumerate(trace)
    ]
