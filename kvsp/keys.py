"""Scopes and Block Keys (spec §4.2).

``K[i] = HMAC-SHA-256(scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id || K[i-1] || uint32(t[iB])
… uint32(t[iB+B-1]))`` with ``K[-1]`` = 32 zero octets. The chain is sequential, so speed comes
from doing as little per block as possible (research/perf.md §1): HMAC (RFC 2104) is computed by
hand from SHA-256 states with the inner and outer pads already absorbed, the constant prefix
``"KVSP-BLOCK-1" || 0x00 || compat_id`` is absorbed into the inner state once, and the tokens
are converted to big-endian uint32 octets once for the whole input.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from kvsp.errors import BadRequest, TokenError
from kvsp.ids import BlockKey, ScopeId, check_length

SCOPE_LABEL = b"KVSP-SCOPE-1\x00"
"""``"KVSP-SCOPE-1" || 0x00``, the prefix of the Scope ID input (§4.2)."""
BLOCK_LABEL = b"KVSP-BLOCK-1\x00"
"""``"KVSP-BLOCK-1" || 0x00``, the prefix of every Block Key's HMAC input (§4.2)."""
MIN_SCOPE_KEY = 32
"""§4.2: "Each scope has a Scope Key of at least 32 random octets"."""
TOKEN_MAX = 2**32 - 1
ZERO_KEY = BlockKey(bytes(32))
"""``K[-1]``: 32 zero octets."""

_SHA256_BLOCK = 64
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))
_TOKEN_WIDTH = 4
_UINT32_CODE = next(code for code in "IL" if array.array(code).itemsize == _TOKEN_WIDTH)


def scope_id(scope_key: bytes) -> ScopeId:
    """The Scope ID: the first 16 octets of SHA-256("KVSP-SCOPE-1" || 0x00 || scope_key) (§4.2).

    Raises:
        BadRequest: the scope key is shorter than 32 octets or not bytes.
    """
    key = _check_scope_key(scope_key)
    return ScopeId(hashlib.sha256(SCOPE_LABEL + key).digest()[:16])


def _check_scope_key(scope_key: object) -> bytes:
    if not isinstance(scope_key, bytes | bytearray | memoryview):
        raise BadRequest(f"a scope key is bytes, got {type(scope_key).__name__}")
    key = bytes(scope_key)
    # §4.2 MUST: a scope key has at least 32 random octets.
    if len(key) < MIN_SCOPE_KEY:
        raise BadRequest(f"a scope key has at least {MIN_SCOPE_KEY} octets, got {len(key)}")
    return key


def _pad_states(key: bytes) -> tuple[Any, Any]:
    """SHA-256 states with the HMAC inner and outer pads absorbed (RFC 2104 §2)."""
    if len(key) > _SHA256_BLOCK:
        # RFC 2104: keys longer than the hash block are hashed first.
        key = hashlib.sha256(key).digest()
    padded = key.ljust(_SHA256_BLOCK, b"\x00")
    return hashlib.sha256(padded.translate(_IPAD)), hashlib.sha256(padded.translate(_OPAD))


def hmac_sha256(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA-256 (RFC 2104) computed the way the chain computes it, from pad states.

    Any key length is accepted here; scope keys are checked by the callers.
    """
    inner, outer = _pad_states(bytes(key))
    inner.update(data)
    outer.update(inner.digest())
    digest: bytes = outer.digest()
    return digest


def token_bytes(tokens: object) -> bytes:
    """Encode token ids as big-endian uint32 octets, ``uint32(t)`` of §4.2.

    ``tokens`` is a 1-D sequence of ints (list, tuple, range, …), a 1-D numpy array of an
    integer dtype, or a 1-D integer torch tensor (torch is never imported here).

    Raises:
        TokenError: not 1-D, not integers (floats and booleans are refused), or a value outside
            [0, 2**32-1]; the message names the first offending index and value.
    """
    if isinstance(tokens, np.ndarray):
        return _array_bytes(tokens)
    if type(tokens).__module__.partition(".")[0] == "torch":
        return _array_bytes(_torch_to_numpy(tokens))
    if isinstance(tokens, str | bytes | bytearray | memoryview) or not isinstance(tokens, Sequence):
        raise TokenError(f"expected a 1-D sequence of token ids, got {type(tokens).__name__}")
    return _sequence_bytes(tokens if isinstance(tokens, list | tuple) else list(tokens))


def _torch_to_numpy(tensor: Any) -> np.ndarray[Any, Any]:
    if tensor.dim() != 1:
        raise TokenError(f"expected a 1-D tensor of token ids, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.is_complex():
        value = tensor[0].item() if tensor.numel() else None
        raise _bad_token(0, value, f" (dtype {tensor.dtype})")
    result: np.ndarray[Any, Any] = tensor.detach().cpu().numpy()
    return result


def _array_bytes(tokens: np.ndarray[Any, Any]) -> bytes:
    if tokens.ndim != 1:
        raise TokenError(f"expected a 1-D array of token ids, got shape {tokens.shape}")
    if tokens.dtype.kind == "O":
        return _sequence_bytes(tokens.tolist())
    if tokens.dtype.kind not in "iu":
        value = tokens[0].item() if tokens.size else None
        raise _bad_token(0, value, f" (dtype {tokens.dtype})")
    if tokens.size and (tokens.dtype.kind == "i" or tokens.dtype.itemsize > _TOKEN_WIDTH):
        low, high = tokens.min(), tokens.max()
        if low < 0 or high > TOKEN_MAX:
            index = int(np.flatnonzero((tokens < 0) | (tokens > TOKEN_MAX))[0])
            raise _bad_token(index, tokens[index].item())
    return tokens.astype(">u4", copy=False).tobytes()


def _sequence_bytes(tokens: list[Any] | tuple[Any, ...]) -> bytes:
    try:
        # array() range-checks in C and refuses floats and strings: the fastest validation.
        packed = array.array(_UINT32_CODE, tokens)
    except (TypeError, OverflowError):
        raise _first_bad(tokens) from None
    values = np.frombuffer(packed, dtype=np.uint32)
    # array() takes True as 1: only the values 0 and 1 can hide a boolean.
    for index in np.flatnonzero(values <= 1).tolist():
        if isinstance(tokens[index], bool | np.bool_):
            raise _bad_token(index, tokens[index])
    return values.astype(">u4").tobytes()


def _first_bad(tokens: Iterable[Any]) -> TokenError:
    for index, token in enumerate(tokens):
        is_int = isinstance(token, int | np.integer) and not isinstance(token, bool)
        if not is_int or not 0 <= token <= TOKEN_MAX:
            return _bad_token(index, token)
    return TokenError("token ids must be integers in [0, 2**32-1]")


def _bad_token(index: int, value: object, note: str = "") -> TokenError:
    shown = repr(value.item() if isinstance(value, np.generic) else value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return TokenError(f"token {index} is {shown}: token ids are integers in [0, 2**32-1]{note}")


class BlockKeyChain:
    """The Block Key chain of one token sequence, extended incrementally (§4.2).

    :meth:`extend` hashes each block once, as soon as it is complete, and buffers the tokens of
    the incomplete tail; earlier blocks are never rehashed. ``parent`` continues a chain from the
    key of a known prefix (its last complete block); :attr:`keys` then holds only the keys
    computed here. ``hmac_count`` counts the HMAC computations done.

    Raises:
        BadRequest: the scope key is shorter than 32 octets or ``block_tokens`` < 1.
        InvalidIdentifier: ``compat_id`` or ``parent`` is not 32 octets.
    """

    __slots__ = ("_block_octets", "_inner", "_keys", "_last", "_outer", "_tail", "hmac_count")

    def __init__(
        self,
        scope_key: bytes,
        compat_id: bytes,
        block_tokens: int,
        *,
        parent: bytes | None = None,
    ) -> None:
        key = _check_scope_key(scope_key)
        compat = check_length(compat_id, 32, "compat_id")
        if type(block_tokens) is not int or block_tokens < 1:
            raise BadRequest(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
        self._last = ZERO_KEY if parent is None else BlockKey(check_length(parent, 32, "parent"))
        self._inner, self._outer = _pad_states(key)
        self._inner.update(BLOCK_LABEL + compat)
        self._block_octets = block_tokens * _TOKEN_WIDTH
        self._keys: list[BlockKey] = []
        self._tail = b""
        self.hmac_count = 0

    @property
    def keys(self) -> tuple[BlockKey, ...]:
        """The keys of the blocks completed so far (after ``parent``, if one was given)."""
        return tuple(self._keys)

    @property
    def last_key(self) -> BlockKey:
        """The key of the last complete block: ``parent`` or 32 zero octets before any."""
        return self._last

    @property
    def pending(self) -> int:
        """The number of buffered tokens after the last complete block."""
        return len(self._tail) // _TOKEN_WIDTH

    def extend(self, tokens: object) -> list[BlockKey]:
        """Add tokens; return the keys of the blocks they complete, in order.

        Raises:
            TokenError: a token id is not an integer in [0, 2**32-1]; nothing is added.
        """
        data = token_bytes(tokens)
        if self._tail:
            data = self._tail + data
        whole = len(data) - len(data) % self._block_octets
        self._tail = data[whole:]
        new = self._hash_blocks(data, whole)
        self._keys.extend(new)
        return new

    def _hash_blocks(self, data: bytes, end: int) -> list[BlockKey]:
        keys: list[bytes] = []
        append = keys.append
        inner_copy, outer_copy = self._inner.copy, self._outer.copy
        key: bytes = self._last
        step = self._block_octets
        for offset in range(0, end, step):
            inner = inner_copy()
            inner.update(key)
            inner.update(data[offset : offset + step])
            outer = outer_copy()
            outer.update(inner.digest())
            key = outer.digest()
            append(key)
        self._last = BlockKey(key)
        self.hmac_count += len(keys)
        return cast(list[BlockKey], keys)


def block_keys(
    scope_key: bytes,
    compat_id: bytes,
    tokens: object,
    block_tokens: int,
    *,
    parent: bytes | None = None,
) -> list[BlockKey]:
    """The Block Keys of the complete blocks of ``tokens`` (§4.2); the partial tail is dropped.

    With ``parent`` (the key of the block just before ``tokens``), the chain continues from a
    known prefix without rehashing it.

    Raises:
        BadRequest: the scope key is shorter than 32 octets or ``block_tokens`` < 1.
        InvalidIdentifier: ``compat_id`` or ``parent`` is not 32 octets.
        TokenError: a token id is not an integer in [0, 2**32-1].
    """
    return BlockKeyChain(scope_key, compat_id, block_tokens, parent=parent).extend(tokens)
