"""Control-plane records: instance status, prefetch, leases, placement (spec §4.4 Instance
Status Record, §6.3, §6.5, §6.6; DESIGN.md §3 resource table for ``place`` and lease bodies).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Self

from kvsp.errors import RecordError
from kvsp.fields import Fields
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records_common import (
    CARRIER_SCHEMES,
    HTTP_SCHEMES,
    MAX_KEYS,
    UINT32_MAX,
    check_unique,
    hex_list,
    number_json,
    read_block_keys,
    read_label,
    read_name,
    read_opaque,
    read_rate,
    read_uri,
    read_uris,
    read_uuid,
)
from kvsp.registries import DirectiveState, InstanceState

RELAY_SCHEMES = frozenset({"moqt"}) | CARRIER_SCHEMES
"""What the ``relay`` extension member may name: the instance's ``--relay`` URI."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """An instance's link to a holder (§4.4): ``{"holder", "mbit_per_s", "rtt_us"}``;
    ``mbit_per_s`` is > 0, ``rtt_us`` ≥ 0."""

    holder: str
    mbit_per_s: float
    rtt_us: float

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a link.

        Raises:
            RecordError: a bad holder URI, a rate that is not > 0, or a negative RTT.
        """
        f = Fields(obj, path)
        return cls(
            holder=read_uri(f.raw("holder"), f.at("holder")),
            mbit_per_s=read_rate(f, "mbit_per_s"),
            rtt_us=f.number("rtt_us"),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "holder": self.holder,
            "mbit_per_s": number_json(self.mbit_per_s),
            "rtt_us": number_json(self.rtt_us),
        }


def _read_state(f: Fields, key: str) -> InstanceState:
    name = f.string(key)
    try:
        return InstanceState(name)
    except ValueError:
        known = ", ".join(InstanceState)
        raise RecordError(f"unknown state {name!r} ({known})", path=f.at(key)) from None


def _read_requested_state(f: Fields) -> InstanceState | None:
    value = f.string("requested_state", optional=True, nullable=True)
    # §6.3: an instance may only ask to sleep; every other request is the PC's to make.
    if value is not None and value != InstanceState.SLEEPING:
        raise RecordError('must be null or "sleeping"', path=f.at("requested_state"))
    return None if value is None else InstanceState.SLEEPING


def _read_links(f: Fields) -> tuple[Link, ...]:
    links = tuple(Link.from_json(v, p) for v, p in f.items("links"))
    check_unique([link.holder for link in links], f.at("links"))
    return links


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceStatusRecord:
    """An Instance Status Record (§4.4, §6.3).

    All members of the spec's example are required except ``requested_state``, which may be
    absent or ``null`` (both ``None``; written as ``null``) or ``"sleeping"``. ``links`` holds at
    most one link per holder; ``kv_utilization`` is in [0, 1].

    Extension members (§4.4: a peer that does not know them ignores them), each absent when
    ``None`` and never ``null``: ``site`` and ``zone``, labels (:data:`LABEL_PATTERN
    <kvsp.records_common.LABEL_PATTERN>`) of where the instance runs, which placement uses to
    prefer nearby sources (:mod:`kvsp.placement`); ``relay``, the URI of the instance's edge
    relay (``--relay``), which a directive may name as the source of a block the instance
    cannot reach elsewhere.
    """

    instance: str
    epoch: int
    state: InstanceState
    running: int
    queued: int
    batch_size: int
    kv_utilization: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    links: tuple[Link, ...]
    requested_state: InstanceState | None
    ttl_ms: int
    site: str | None = None
    zone: str | None = None
    relay: str | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a status record.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        utilization = f.number("kv_utilization")
        if utilization > 1:
            raise RecordError("must be in [0, 1]", path=f.at("kv_utilization"))
        return cls(
            instance=read_uri(f.raw("instance"), f.at("instance"), HTTP_SCHEMES),
            epoch=f.integer("epoch"),
            state=_read_state(f, "state"),
            running=f.integer("running"),
            queued=f.integer("queued"),
            batch_size=f.integer("batch_size"),
            kv_utilization=utilization,
            prefill_tokens_per_s=f.number("prefill_tokens_per_s"),
            decode_tokens_per_s=f.number("decode_tokens_per_s"),
            links=_read_links(f),
            requested_state=_read_requested_state(f),
            ttl_ms=f.integer("ttl_ms"),
            site=read_label(f, "site"),
            zone=read_label(f, "zone"),
            relay=_read_relay(f),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON (``requested_state`` always written, ``null`` when none; the
        extension members only when set)."""
        out: dict[str, Any] = {
            "instance": self.instance,
            "epoch": self.epoch,
            "state": str(self.state),
            "running": self.running,
            "queued": self.queued,
            "batch_size": self.batch_size,
            "kv_utilization": number_json(self.kv_utilization),
            "prefill_tokens_per_s": number_json(self.prefill_tokens_per_s),
            "decode_tokens_per_s": number_json(self.decode_tokens_per_s),
            "links": [link.to_json() for link in self.links],
            "requested_state": None if self.requested_state is None else str(self.requested_state),
            "ttl_ms": self.ttl_ms,
        }
        for name, value in (("site", self.site), ("zone", self.zone), ("relay", self.relay)):
            if value is not None:
                out[name] = value
        return out


def _read_relay(f: Fields) -> str | None:
    raw = f.raw("relay", optional=True)
    return None if raw is None else read_uri(raw, f.at("relay"), RELAY_SCHEMES)


@dataclass(frozen=True, slots=True, kw_only=True)
class StateAnswer:
    """``{"state": …}``: the PC's answer to a status PUT and the body of PUT state (§6.3)."""

    state: InstanceState

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a state body.

        Raises:
            RecordError: missing or unknown state.
        """
        return cls(state=_read_state(Fields(obj, path), "state"))

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"state": str(self.state)}


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectiveBlock:
    """One block of a prefetch directive (§6.5): ``{"block_key", "sources": [uri, ...]}`` with
    at least one source."""

    block_key: BlockKey
    sources: tuple[str, ...]

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a directive block.

        Raises:
            RecordError: a bad key, or no or bad sources.
        """
        f = Fields(obj, path)
        return cls(
            block_key=BlockKey(f.hex32("block_key")),
            sources=read_uris(f.raw("sources"), f.at("sources"), nonempty=True, unique=True),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"block_key": self.block_key.hex(), "sources": list(self.sources)}


def _read_blocks(f: Fields) -> tuple[DirectiveBlock, ...]:
    values = f.array("blocks")
    if not values or len(values) > MAX_KEYS:
        raise RecordError(f"expected 1 to {MAX_KEYS} blocks", path=f.at("blocks"))
    return tuple(DirectiveBlock.from_json(v, p) for v, p in f.items("blocks"))


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchDirective:
    """A prefetch directive (§6.5), the body of POST prefetch.

    ``request_ref`` is optional (absent or ``null`` → ``None``, omitted when ``None``);
    ``blocks`` is non-empty; ``layer_order`` must be ``"ascending"``, the only order the spec
    defines; ``lease_ms`` is at least 1.
    """

    directive: uuid.UUID
    request_ref: str | None
    scope_id: ScopeId
    compat_id: CompatId
    blocks: tuple[DirectiveBlock, ...]
    deadline_ms: int
    lease_ms: int
    layer_order: str = "ascending"

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a directive.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        if f.string("layer_order") != "ascending":
            raise RecordError('only "ascending" is defined', path=f.at("layer_order"))
        return cls(
            directive=read_uuid(f.raw("directive"), f.at("directive")),
            request_ref=read_opaque(f, "request_ref"),
            scope_id=ScopeId(f.hex16("scope_id")),
            compat_id=CompatId(f.hex32("compat_id")),
            blocks=_read_blocks(f),
            deadline_ms=f.integer("deadline_ms"),
            lease_ms=f.integer("lease_ms", minimum=1),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {"directive": str(self.directive)}
        if self.request_ref is not None:
            out["request_ref"] = self.request_ref
        out |= {
            "scope_id": self.scope_id.hex(),
            "compat_id": self.compat_id.hex(),
            "blocks": [b.to_json() for b in self.blocks],
            "layer_order": self.layer_order,
            "deadline_ms": self.deadline_ms,
            "lease_ms": self.lease_ms,
        }
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectiveStatus:
    """A directive's status (§6.5), the body of GET prefetch/{directive}:
    ``{"directive", "state", "loaded": [hex32, ...], "detail"?}``."""

    directive: uuid.UUID
    state: DirectiveState
    loaded: tuple[BlockKey, ...]
    detail: str | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a directive status.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        name = f.string("state")
        try:
            state = DirectiveState(name)
        except ValueError:
            known = ", ".join(DirectiveState)
            raise RecordError(f"unknown state {name!r} ({known})", path=f.at("state")) from None
        return cls(
            directive=read_uuid(f.raw("directive"), f.at("directive")),
            state=state,
            loaded=read_block_keys(f, "loaded"),
            detail=read_opaque(f, "detail"),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {
            "directive": str(self.directive),
            "state": str(self.state),
            "loaded": hex_list(self.loaded),
        }
        if self.detail is not None:
            out["detail"] = self.detail
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRequest:
    """The body of POST leases (§6.6, DESIGN §3): ``{"compat_id", "scope_id", "block_keys",
    "ttl_ms"}`` with at least one key and ``ttl_ms`` ≥ 1."""

    compat_id: CompatId
    scope_id: ScopeId
    block_keys: tuple[BlockKey, ...]
    ttl_ms: int

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a lease request.

        Raises:
            RecordError: a bad or missing member, or no keys.
        """
        f = Fields(obj, path)
        return cls(
            compat_id=CompatId(f.hex32("compat_id")),
            scope_id=ScopeId(f.hex16("scope_id")),
            block_keys=read_block_keys(f, nonempty=True),
            ttl_ms=f.integer("ttl_ms", minimum=1),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "compat_id": self.compat_id.hex(),
            "scope_id": self.scope_id.hex(),
            "block_keys": hex_list(self.block_keys),
            "ttl_ms": self.ttl_ms,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRenewal:
    """The body of PUT leases/{id} (§6.6): ``{"ttl_ms"}`` with ``ttl_ms`` ≥ 1."""

    ttl_ms: int

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a renewal.

        Raises:
            RecordError: ``ttl_ms`` missing or not a positive uint64.
        """
        return cls(ttl_ms=Fields(obj, path).integer("ttl_ms", minimum=1))

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"ttl_ms": self.ttl_ms}


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseGrant:
    """A holder's answer to POST or PUT leases (§6.6): ``{"lease", "ttl_ms", "block_keys"?}``.

    ``lease`` is the identifier used in ``leases/{id}`` (URL-unreserved characters, 1-128);
    ``ttl_ms`` is the granted TTL; ``block_keys`` is optional (``None`` when absent).
    """

    lease: str
    ttl_ms: int
    block_keys: tuple[BlockKey, ...] | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a lease grant.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        return cls(
            lease=read_name(f.raw("lease"), f.at("lease")),
            ttl_ms=f.integer("ttl_ms"),
            block_keys=read_block_keys(f) if f.has("block_keys") else None,
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {"lease": self.lease, "ttl_ms": self.ttl_ms}
        if self.block_keys is not None:
            out["block_keys"] = hex_list(self.block_keys)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceRequest:
    """The body of POST place (DESIGN §3): ``{"scope_id", "compat_id", "block_keys",
    "prompt_tokens", "session"?, "request_ref"?}``.

    ``block_keys`` may be empty (a prompt shorter than one block); ``prompt_tokens`` is at
    least the number of keys, since every keyed block holds one or more tokens.
    """

    scope_id: ScopeId
    compat_id: CompatId
    block_keys: tuple[BlockKey, ...]
    prompt_tokens: int
    session: uuid.UUID | None = None
    request_ref: str | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a placement request.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        keys = read_block_keys(f)
        tokens = f.integer("prompt_tokens")
        if tokens < len(keys):
            raise RecordError("fewer tokens than block keys", path=f.at("prompt_tokens"))
        session = f.raw("session", optional=True)
        return cls(
            scope_id=ScopeId(f.hex16("scope_id")),
            compat_id=CompatId(f.hex32("compat_id")),
            block_keys=keys,
            prompt_tokens=tokens,
            session=None if session is None else read_uuid(session, f.at("session")),
            request_ref=read_opaque(f, "request_ref"),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {
            "scope_id": self.scope_id.hex(),
            "compat_id": self.compat_id.hex(),
            "block_keys": hex_list(self.block_keys),
            "prompt_tokens": self.prompt_tokens,
        }
        if self.session is not None:
            out["session"] = str(self.session)
        if self.request_ref is not None:
            out["request_ref"] = self.request_ref
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaceResponse:
    """The answer to POST place (DESIGN §3): ``{"instance", "matched", "cost", "directive"?}``.

    The JSON member is ``cost`` as in DESIGN §3's table; its value is the §6.4 cost in
    microseconds, hence ``cost_us`` here. ``directive`` names the prefetch directive the PC
    issued, if any.
    """

    instance: str
    matched: int
    cost_us: float
    directive: uuid.UUID | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a placement answer.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        directive = f.raw("directive", optional=True)
        return cls(
            instance=read_uri(f.raw("instance"), f.at("instance"), HTTP_SCHEMES),
            matched=f.integer("matched", maximum=UINT32_MAX),
            cost_us=f.number("cost"),
            directive=None if directive is None else read_uuid(directive, f.at("directive")),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {
            "instance": self.instance,
            "matched": self.matched,
            "cost": number_json(self.cost_us),
        }
        if self.directive is not None:
            out["directive"] = str(self.directive)
        return out
