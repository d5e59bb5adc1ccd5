"""The Compatibility Descriptor and the Compatibility ID (spec §4.1).

A :class:`CompatibilityDescriptor` names everything that makes two KV caches interchangeable:
the model and its weights, the tokenizer, the adapters, the cache geometry, the element type,
the positional encoding and the block layout. :func:`compat_id` hashes its RFC 8785 (JCS) form.
The ``*_digest_of`` helpers and :func:`descriptor_from_files` compute the digests from files,
streaming them through a fixed buffer.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import rfc8785

from kvsp.errors import DescriptorError, RecordError
from kvsp.fields import Fields, parse_digest_at
from kvsp.ids import CompatId, Digest, format_digest
from kvsp.registries import LAYOUTS, element_type, parse_positional

StrPath = str | os.PathLike[str]
"""A file system path as the descriptor helpers accept it."""

COMPAT_LABEL = b"KVSP-COMPAT-1\x00"
"""``"KVSP-COMPAT-1" || 0x00``, the prefix of the Compatibility ID input (§4.1)."""

MAX_DIMENSION = 2**32 - 1
"""The largest ``layers``/``kv_heads``/``head_dim``/``block_tokens`` accepted."""

_CHUNK = 1 << 20
_INT_MEMBERS = ("layers", "kv_heads", "head_dim", "block_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompatibilityDescriptor:
    """A Compatibility Descriptor (§4.1); digests are 32 raw octets, ``adapters`` None = absent.

    Construction validates every member, so an instance is always a valid descriptor.

    Raises:
        DescriptorError: a member violates §4.1; ``path`` names it (``$.layers``).
    """

    model: str
    model_digest: bytes
    tokenizer_digest: bytes
    adapters: tuple[bytes, ...] | None = None
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    positional: str
    block_tokens: int
    layout: str = "kvsp-layout-1"

    def __post_init__(self) -> None:
        _check_model(self.model, "$.model")
        _check_digest(self.model_digest, "$.model_digest")
        _check_digest(self.tokenizer_digest, "$.tokenizer_digest")
        if self.adapters is not None:
            _check_adapters(self.adapters)
        for name in _INT_MEMBERS:
            _check_dimension(getattr(self, name), f"$.{name}")
        element_type(self.kv_dtype, "$.kv_dtype")
        parse_positional(self.positional, "$.positional")
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS:
            known = ", ".join(sorted(LAYOUTS))
            raise DescriptorError(f"unknown layout {self.layout!r} ({known})", path="$.layout")

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a descriptor from parsed JSON; unknown members are ignored (§4.4).

        Raises:
            DescriptorError: not an object, or a member is missing or invalid; ``path`` names it.
        """
        try:
            members = _read_members(Fields(obj, path))
        except DescriptorError:
            raise
        except RecordError as exc:
            raise DescriptorError(exc.detail, path=exc.path) from None
        try:
            return cls(**members)
        except DescriptorError as exc:
            # __post_init__ names members relative to "$"; rebase onto this object's path.
            rebased = None if exc.path is None else path + exc.path[1:]
            raise DescriptorError(exc.detail, path=rebased) from None

    def to_json(self) -> dict[str, Any]:
        """Render as a JSON object; ``adapters`` is omitted when absent (§4.1)."""
        obj: dict[str, Any] = {
            "model": self.model,
            "model_digest": format_digest(self.model_digest),
            "tokenizer_digest": format_digest(self.tokenizer_digest),
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "kv_dtype": self.kv_dtype,
            "positional": self.positional,
            "block_tokens": self.block_tokens,
            "layout": self.layout,
        }
        if self.adapters is not None:
            obj["adapters"] = [format_digest(a) for a in self.adapters]
        return obj


def _read_members(fields: Fields) -> dict[str, Any]:
    """The members' JSON types checked and converted; their meaning is checked on construction."""
    members = {
        name: fields.integer(name, minimum=1, maximum=MAX_DIMENSION) for name in _INT_MEMBERS
    }
    for name in ("model", "kv_dtype", "positional", "layout"):
        members[name] = fields.string(name)
    members["model_digest"] = fields.digest("model_digest")
    members["tokenizer_digest"] = fields.digest("tokenizer_digest")
    if fields.has("adapters"):
        members["adapters"] = tuple(parse_digest_at(v, at) for v, at in fields.items("adapters"))
    return members


def _check_model(model: object, path: str) -> None:
    if not isinstance(model, str) or not model:
        raise DescriptorError("expected a non-empty string", path=path)
    try:
        model.encode("utf-8")
    except UnicodeEncodeError:
        # JCS (RFC 8785) input is I-JSON: a lone surrogate has no canonical form.
        raise DescriptorError("contains a lone surrogate", path=path) from None


def _check_digest(digest: object, path: str) -> None:
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise DescriptorError("expected a 32-octet SHA-256 digest", path=path)


def _check_adapters(adapters: object) -> None:
    if not isinstance(adapters, tuple):
        raise DescriptorError("expected a tuple of digests or None", path="$.adapters")
    if not adapters:
        # §4.1: "The member MUST be absent when no adapter is applied; an empty array is not
        # allowed."
        raise DescriptorError("must be absent rather than empty", path="$.adapters")
    for i, digest in enumerate(adapters):
        _check_digest(digest, f"$.adapters[{i}]")


def _check_dimension(value: object, path: str) -> None:
    # Only a real int: 3.0 or True would render differently in the JCS form.
    if type(value) is not int:
        raise DescriptorError(f"expected an integer, got {type(value).__name__}", path=path)
    if not 1 <= value <= MAX_DIMENSION:
        raise DescriptorError(f"must be in [1, {MAX_DIMENSION}], got {value}", path=path)


def compat_id(descriptor: Mapping[str, Any] | CompatibilityDescriptor) -> CompatId:
    """The Compatibility ID: SHA-256("KVSP-COMPAT-1" || 0x00 || JCS(descriptor)) (§4.1).

    A mapping is validated first and hashed in its canonical form (the validated descriptor's
    :meth:`~CompatibilityDescriptor.to_json`): unknown members are ignored and do not change
    the identity, and integral numbers such as ``32.0`` hash as ``32``. Results are cached per
    descriptor value, since JCS is slow.

    Raises:
        DescriptorError: the mapping is not a valid descriptor.
    """
    if not isinstance(descriptor, CompatibilityDescriptor):
        descriptor = CompatibilityDescriptor.from_json(descriptor)
    return _cached_compat_id(descriptor)


@functools.lru_cache(maxsize=1024)
def _cached_compat_id(descriptor: CompatibilityDescriptor) -> CompatId:
    return compute_compat_id(descriptor)


def compute_compat_id(descriptor: CompatibilityDescriptor) -> CompatId:
    """:func:`compat_id` without the cache (for benchmarks and cross-checks)."""
    canonical: bytes = rfc8785.dumps(descriptor.to_json())
    return CompatId(hashlib.sha256(COMPAT_LABEL + canonical).digest())


def file_digest(paths: Sequence[StrPath]) -> Digest:
    """SHA-256 over the files concatenated in the given order, streamed in 1 MiB chunks.

    Raises:
        DescriptorError: a file cannot be read (the message names it).
        TypeError: ``paths`` is a single path rather than a sequence of paths.
    """
    if isinstance(paths, str | bytes | os.PathLike):
        raise TypeError("file_digest takes a sequence of paths, not a single path")
    hasher = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as file:
                while size := file.readinto(buffer):
                    hasher.update(view[:size])
        except OSError as exc:
            raise DescriptorError(f"cannot read {os.fspath(path)!r}: {exc.strerror}") from exc
    return Digest(hasher.digest())


def model_digest_of(weight_files: Sequence[StrPath]) -> Digest:
    """The ``model_digest``: the weight files concatenated in ascending byte order of their
    file names (§4.1), whatever order they are given in.

    Raises:
        DescriptorError: no files, two files with the same name, or a file cannot be read.
    """
    if isinstance(weight_files, str | bytes | os.PathLike):
        raise TypeError("model_digest_of takes a sequence of paths, not a single path")
    named = sorted((os.fsencode(Path(p).name), i) for i, p in enumerate(weight_files))
    if not named:
        raise DescriptorError("no weight files given")
    for (name, _), (following, _) in itertools.pairwise(named):
        if name == following:
            # The order of two equally named files is undefined, so is the digest.
            raise DescriptorError(f"two weight files are named {os.fsdecode(name)!r}")
    return file_digest([weight_files[i] for _, i in named])


def tokenizer_digest_of(path: StrPath) -> Digest:
    """The ``tokenizer_digest``: SHA-256 of the tokenizer definition file (§4.1).

    Raises:
        DescriptorError: the file cannot be read.
    """
    return file_digest([path])


def _adapter_digest(adapter: StrPath | Sequence[StrPath]) -> Digest:
    if isinstance(adapter, str | os.PathLike):
        return file_digest([adapter])
    return model_digest_of(adapter)


def descriptor_from_files(
    *,
    model: str,
    weight_files: Sequence[StrPath],
    tokenizer_file: StrPath,
    layers: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    positional: str,
    block_tokens: int,
    layout: str = "kvsp-layout-1",
    adapter_files: Sequence[StrPath | Sequence[StrPath]] | None = None,
) -> CompatibilityDescriptor:
    """Build a descriptor, computing the model, tokenizer and adapter digests from files (§4.1).

    Each adapter is one file or a sequence of files (digested like the weights), in the order
    of application; no adapters (None or empty) leaves the member absent, as §4.1 requires.

    Raises:
        DescriptorError: a file cannot be read, or a member is invalid.
    """
    adapters = tuple(_adapter_digest(a) for a in adapter_files or ())
    return CompatibilityDescriptor(
        model=model,
        model_digest=model_digest_of(weight_files),
        tokenizer_digest=tokenizer_digest_of(tokenizer_file),
        adapters=adapters or None,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        positional=positional,
        block_tokens=block_tokens,
        layout=layout,
    )
