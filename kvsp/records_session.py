"""Session checkpoints and resume (spec §4.4 Session Checkpoint, §6.8; DESIGN.md §3).

``output_offset`` is "the number of output tokens covered by the checkpoint" and the resumed
instance labels new tokens from ``output_offset`` on, while it needs every generated token to
rebuild the context and the keys of generated blocks. ``generated`` therefore lists all output
tokens so far and a checkpoint must have ``output_offset == len(generated)``: fewer would
relabel listed tokens, more would leave a gap.

Two extension members of ours ride on the checkpoint (§4.4: unknown members are ignored, so
other implementations are unaffected): ``instance``, the base URI of the instance that took the
checkpoint, which the PC checks against the instance serving the session at that epoch, and
``max_tokens``, the number of output tokens the session asked for, which a resumed instance
needs to know where to stop and the PC to know when the session is done.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Self

from kvsp.errors import RecordError
from kvsp.fields import Fields
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records_common import (
    HTTP_SCHEMES,
    UINT32_MAX,
    hex_list,
    read_block_keys,
    read_uint32_list,
    read_uri,
    read_uuid,
)

_METHOD = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def _positive(params: Fields, key: str, *, required: bool, at_most_one: bool = False) -> None:
    value = params.number(key, optional=not required)
    if value is None:
        return
    if value <= 0 or (at_most_one and value > 1):
        rule = "0 < value <= 1" if at_most_one else "value > 0"
        raise RecordError(f"must satisfy {rule}", path=params.at(key))


def _check_params(method: str, params: Fields) -> None:
    """Validate the parameters of the methods we know; others are carried as they are."""
    if method == "top-p":
        _positive(params, "p", required=True, at_most_one=True)
    elif method == "top-k":
        params.integer("k", minimum=1, maximum=UINT32_MAX)
    if method in ("top-p", "top-k", "temperature"):
        _positive(params, "temperature", required=method == "temperature")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampler:
    """The sampler state of a checkpoint (§4.4): ``{"method", "params", "seed", "step",
    "deterministic"}``.

    ``method`` is a lowercase name; for ``greedy``, ``top-p`` (``p`` in (0, 1]), ``top-k``
    (``k`` ≥ 1) and ``temperature`` (``temperature`` > 0; optional for top-p/top-k) the params
    are checked, other members and other methods are carried untouched. ``params`` absent reads
    as ``{}``; ``seed`` absent or ``null`` reads as ``None`` and is written as ``null``.
    """

    method: str
    params: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    step: int
    deterministic: bool

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a sampler.

        Raises:
            RecordError: a bad method name, params that do not fit the method, or a bad member.
        """
        f = Fields(obj, path)
        method = f.string("method")
        if _METHOD.fullmatch(method) is None:
            raise RecordError("expected a lowercase method name", path=f.at("method"))
        params = f.nested("params", optional=True)
        # absent params read as {}, so they must pass the same checks as the {} written back
        _check_params(method, params if params is not None else Fields({}, f.at("params")))
        return cls(
            method=method,
            params={} if params is None else dict(params.obj),
            seed=f.integer("seed", optional=True, nullable=True),
            step=f.integer("step"),
            deterministic=f.boolean("deterministic"),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "method": self.method,
            "params": dict(self.params),
            "seed": self.seed,
            "step": self.step,
            "deterministic": self.deterministic,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCheckpoint:
    """A Session Checkpoint (§4.4, §6.8), the body of PUT sessions/{session}/checkpoint.

    ``session`` is an RFC 9562 UUID (read in either case, written lowercase); ``prompt_tail``
    and ``generated`` are uint32 tokens; ``output_offset`` equals ``len(generated)`` (see the
    module docstring). ``instance`` and ``max_tokens`` are our optional extension members
    (``max_tokens`` ≥ ``output_offset``), written only when set.
    """

    session: uuid.UUID
    epoch: int
    compat_id: CompatId
    scope_id: ScopeId
    prompt_blocks: tuple[BlockKey, ...]
    prompt_tail: tuple[int, ...]
    generated: tuple[int, ...]
    output_offset: int
    sampler: Sampler
    instance: str | None = None
    max_tokens: int | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a checkpoint.

        Raises:
            RecordError: a bad or missing member, ``output_offset`` other than the number of
                generated tokens, or ``max_tokens`` below it.
        """
        f = Fields(obj, path)
        generated = read_uint32_list(f.raw("generated"), f.at("generated"))
        offset = f.integer("output_offset")
        if offset != len(generated):
            raise RecordError(
                f"must equal the number of generated tokens ({len(generated)})",
                path=f.at("output_offset"),
            )
        max_tokens = f.integer("max_tokens", optional=True, maximum=UINT32_MAX)
        if max_tokens is not None and max_tokens < offset:
            raise RecordError(f"must be at least output_offset ({offset})", path=f.at("max_tokens"))
        instance = f.raw("instance", optional=True)
        return cls(
            session=read_uuid(f.raw("session"), f.at("session")),
            epoch=f.integer("epoch"),
            compat_id=CompatId(f.hex32("compat_id")),
            scope_id=ScopeId(f.hex16("scope_id")),
            prompt_blocks=read_block_keys(f, "prompt_blocks"),
            prompt_tail=read_uint32_list(f.raw("prompt_tail"), f.at("prompt_tail")),
            generated=generated,
            output_offset=offset,
            sampler=Sampler.from_json(f.raw("sampler"), f.at("sampler")),
            instance=None
            if instance is None
            else read_uri(instance, f.at("instance"), HTTP_SCHEMES),
            max_tokens=max_tokens,
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {
            "session": str(self.session),
            "epoch": self.epoch,
            "compat_id": self.compat_id.hex(),
            "scope_id": self.scope_id.hex(),
            "prompt_blocks": hex_list(self.prompt_blocks),
            "prompt_tail": list(self.prompt_tail),
            "generated": list(self.generated),
            "output_offset": self.output_offset,
            "sampler": self.sampler.to_json(),
        }
        if self.instance is not None:
            out["instance"] = self.instance
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRequest:
    """The body of POST sessions/{session}/resume (§6.8, DESIGN §3): ``{"epoch": n,
    "checkpoint": {...}}`` — the latest checkpoint and the new session epoch, which must be
    greater than the checkpoint's (the PC increments the epoch on failover)."""

    epoch: int
    checkpoint: SessionCheckpoint

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a resume request.

        Raises:
            RecordError: a bad member, or an epoch not above the checkpoint's.
        """
        f = Fields(obj, path)
        epoch = f.integer("epoch")
        checkpoint = SessionCheckpoint.from_json(f.raw("checkpoint"), f.at("checkpoint"))
        if epoch <= checkpoint.epoch:
            raise RecordError(
                f"must be greater than the checkpoint's epoch {checkpoint.epoch}",
                path=f.at("epoch"),
            )
        return cls(epoch=epoch, checkpoint=checkpoint)

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"epoch": self.epoch, "checkpoint": self.checkpoint.to_json()}
