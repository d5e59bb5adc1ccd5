"""The body of ``POST generate`` at an inference instance (DESIGN.md §3; outside KVSP, but read
with the same rules as a KVSP record: STYLE.md house rule 4, errors naming the JSON path).

A generate request carries the prompt, a scope (``scope_key``, or ``scope_id`` naming a
configured one; §4.2), optionally a ``session`` to run as a §6.8 session, and a ``sampler``
whose draws are a pure function of its seed, so that a resumed session continues the same
sample. It is a module of its own so that the request can be read (and fuzzed) without the
HTTP shell.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Self

from kvsp.engine.api import GREEDY, Sampling
from kvsp.errors import RecordError
from kvsp.fields import Fields
from kvsp.ids import ScopeId
from kvsp.keys import scope_id as scope_id_of
from kvsp.records_common import UINT32_MAX, read_uint32_list, read_uuid

MAX_SCOPE_KEY = 1024
"""Longest scope key in octets."""


def read_sampling(obj: object, path: str = "$.sampler") -> tuple[Sampling, bool]:
    """Read a generate request's ``sampler`` member: ``{"method", "params"?, "seed"?,
    "deterministic"?}`` → (sampling, deterministic). ``deterministic`` defaults to whether the
    sampler is reproducible (greedy, or seeded) and may not claim more.

    Raises:
        RecordError: a bad member, named by its path.
    """
    f = Fields(obj, path)
    params = f.nested("params", optional=True)
    try:
        sampling = Sampling(
            method=f.string("method"),
            params={} if params is None else dict(params.obj),
            seed=f.integer("seed", optional=True, nullable=True),
        )
    except RecordError as exc:
        raise RecordError(exc.detail, path=path + (exc.path or "$")[1:]) from None
    deterministic = f.boolean("deterministic", optional=True)
    if deterministic is None:
        deterministic = sampling.reproducible
    elif deterministic and not sampling.reproducible:
        raise RecordError(
            "a sampler without a seed is not deterministic", path=f.at("deterministic")
        )
    return sampling, deterministic


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """The body of POST generate (outside KVSP; DESIGN §3): ``{"prompt", "max_tokens",
    "scope_key"?, "scope_id"?, "session"?}``."""

    prompt: tuple[int, ...]
    max_tokens: int
    scope_key: bytes | None = None
    scope_id: ScopeId | None = None
    session: uuid.UUID | None = None
    sampling: Sampling = GREEDY
    deterministic: bool = True

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a generate request.

        Raises:
            RecordError: a bad or missing member; a ``scope_id`` that is not the scope of
                ``scope_key``.
        """
        f = Fields(obj, path)
        prompt = read_uint32_list(f.raw("prompt"), f.at("prompt"))
        if not prompt:
            raise RecordError("must not be empty", path=f.at("prompt"))
        key = _read_scope_key(f)
        sid = f.hex16("scope_id", optional=True)
        scope = None if sid is None else ScopeId(sid)
        if key is not None and scope is not None and scope_id_of(key) != scope:
            raise RecordError("is not the scope of scope_key", path=f.at("scope_id"))
        session = f.raw("session", optional=True, nullable=True)
        sampler = f.raw("sampler", optional=True)
        sampling, deterministic = (
            (GREEDY, True) if sampler is None else read_sampling(sampler, f.at("sampler"))
        )
        return cls(
            prompt=prompt,
            max_tokens=f.integer("max_tokens", maximum=UINT32_MAX),
            scope_key=key,
            scope_id=scope,
            session=None if session is None else read_uuid(session, f.at("session")),
            sampling=sampling,
            deterministic=deterministic,
        )


def _read_scope_key(f: Fields) -> bytes | None:
    text = f.string("scope_key", optional=True)
    if text is None:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if key.hex() != text or not 32 <= len(key) <= MAX_SCOPE_KEY:
        raise RecordError("expected 32 to 1024 octets as lowercase hex", path=f.at("scope_key"))
    return key


__all__ = ["MAX_SCOPE_KEY", "GenerateRequest", "read_sampling"]
