"""Replica Records and lookup messages (spec §4.4 Replica Record, §6.1, §6.2; DESIGN.md §4, §7).

A Replica Record says where a copy of one block is, which layers sit in which tier, and how to
verify it. A record served over MOQT carries a ``moqt://`` holder and ``moqt_namespace``, the
base64url of the five Track Namespace Fields each preceded by a one-octet length (DESIGN §4;
:mod:`kvsp.moqt_mapping` reads and writes it), and may list ``moqt_carriers``, the same
holder's MOQT-over-QMux endpoints (``moqt+tls``, ``moqt+tcp``, ``moqt+unix`` URIs, fastest
first; an extension member that others ignore, §4.4).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Self

from kvsp.audience import lease_base_allowed
from kvsp.errors import RecordError
from kvsp.fields import Fields
from kvsp.ids import BlockKey, CompatId, ScopeId, format_digest
from kvsp.moqt_mapping import format_moqt_namespace, read_moqt_namespace, split_namespace_octets
from kvsp.records_common import (
    CARRIER_SCHEMES,
    HTTP_SCHEMES,
    UINT32_MAX,
    as_list,
    check_disjoint,
    hex_list,
    number_json,
    read_block_keys,
    read_hex32_list,
    read_label,
    read_opaque,
    read_optional_rate,
    read_pair,
    read_uri,
    read_uris,
    uri_scheme,
)
from kvsp.registries import Tier

_TIERS = {t.value: t for t in Tier}


@dataclass(frozen=True, slots=True, kw_only=True)
class Residency:
    """Which layers of a replica sit in one tier (§4.4): ``{"tier", "layers": [a, b],
    "read_mbit_per_s"?}`` with the inclusive range a..b."""

    tier: Tier
    first: int
    last: int
    read_mbit_per_s: float | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a residency entry.

        Raises:
            RecordError: unknown tier, bad layer range, or a rate that is not > 0.
        """
        f = Fields(obj, path)
        name = f.string("tier")
        tier = _TIERS.get(name)
        if tier is None:
            known = ", ".join(Tier)
            raise RecordError(f"unknown tier {name!r} (registered: {known})", path=f.at("tier"))
        first, last = read_pair(f.raw("layers"), f.at("layers"), half_open=False)
        rate = read_optional_rate(f, "read_mbit_per_s")
        return cls(tier=tier, first=first, last=last, read_mbit_per_s=rate)

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {"tier": str(self.tier), "layers": [self.first, self.last]}
        if self.read_mbit_per_s is not None:
            out["read_mbit_per_s"] = number_json(self.read_mbit_per_s)
        return out


def _read_residency(f: Fields, layer_count: int | None) -> tuple[Residency, ...] | None:
    values = f.array("residency", optional=True)
    if values is None:
        return None
    if not values:
        raise RecordError("must not be empty (omit the member instead)", path=f.at("residency"))
    entries = tuple(Residency.from_json(v, p) for v, p in f.items("residency"))
    paths = [f"{f.at('residency')}[{i}].layers" for i in range(len(entries))]
    # §4.4: layer ranges are inclusive and MUST NOT overlap.
    check_disjoint((r.first, r.last + 1, p) for r, p in zip(entries, paths, strict=True))
    if layer_count is not None:
        for r, p in zip(entries, paths, strict=True):
            if r.last >= layer_count:
                raise RecordError(f"layer {r.last} beyond the {layer_count} layer digests", path=p)
    return entries


MAX_CARRIERS = 8


def _read_carriers(value: object, path: str) -> tuple[str, ...]:
    """``moqt_carriers``: 1..8 distinct ``moqt+tls``/``moqt+tcp``/``moqt+unix`` URIs."""
    uris = read_uris(value, path, nonempty=True, unique=True, schemes=CARRIER_SCHEMES)
    if len(uris) > MAX_CARRIERS:
        raise RecordError(f"at most {MAX_CARRIERS} carriers", path=path)
    return uris


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaRecord:
    """A Replica Record (§4.4): one holder's copy of one block.

    JSON members as in §4.4; ``layer_digests`` are bare hex32, ``digest`` is
    ``"sha-256:<hex32>"``. ``layer_digests`` and ``residency`` are optional but never empty;
    ``moqt_namespace`` is required when ``holder`` is a ``moqt`` URI. ``lease_base`` is our
    extension member (DESIGN §4): the HTTP base where leases on a relay-held replica are taken,
    on the holder's origin (its host, for a ``moqt`` holder).
    ``moqt_carriers``, another extension member, lists the holder's MOQT-over-QMux endpoints
    (fastest first); a client uses one only where it names the holder's own host
    (:mod:`kvsp.transfer.moqt_carriers`).
    ``site`` and ``zone``, extension members too, label where the holder runs
    (:data:`~kvsp.records_common.LABEL_PATTERN`; absent when ``None``): placement prefers
    holders in an instance's own site and assumes a link only to those (:mod:`kvsp.placement`).
    ``moqt_namespace`` holds the namespace octets (fields with their length octets); see
    :func:`~kvsp.moqt_mapping.split_namespace_octets`. ``codec`` is any uint16; whether it is
    registered matters to whoever decodes the block, not to the index.
    """

    block_key: BlockKey
    compat_id: CompatId
    scope_id: ScopeId
    holder: str
    codec: int
    size: int
    digest: bytes
    layer_digests: tuple[bytes, ...] | None
    residency: tuple[Residency, ...] | None
    ttl_ms: int
    moqt_namespace: bytes | None = None
    lease_base: str | None = None
    moqt_carriers: tuple[str, ...] | None = None
    site: str | None = None
    zone: str | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a Replica Record.

        Raises:
            RecordError: a bad or missing member, named by its JSON path.
        """
        f = Fields(obj, path)
        holder = read_uri(f.raw("holder"), f.at("holder"))
        layers = f.array("layer_digests", optional=True)
        layer_digests = None
        if layers is not None:
            layer_digests = read_hex32_list(layers, f.at("layer_digests"), nonempty=True)
        namespace = f.raw("moqt_namespace", optional=True)
        if namespace is None and uri_scheme(holder) == "moqt":
            # §4.4: a replica served over MOQT has a moqt holder *and* a moqt_namespace.
            raise RecordError("required when holder is a moqt URI", path=f.at("moqt_namespace"))
        raw_lease_base = f.raw("lease_base", optional=True)
        lease_base = None
        if raw_lease_base is not None:
            lease_base = read_uri(raw_lease_base, f.at("lease_base"), HTTP_SCHEMES)
            # Clients send credentials to lease_base: only to an origin the holder URI names.
            if not lease_base_allowed(holder, lease_base):
                raise RecordError("not on the holder's origin", path=f.at("lease_base"))
        carriers = f.raw("moqt_carriers", optional=True)
        if carriers is not None and uri_scheme(holder) != "moqt":
            raise RecordError("only a moqt holder offers carriers", path=f.at("moqt_carriers"))
        return cls(
            block_key=BlockKey(f.hex32("block_key")),
            compat_id=CompatId(f.hex32("compat_id")),
            scope_id=ScopeId(f.hex16("scope_id")),
            holder=holder,
            codec=f.integer("codec", maximum=0xFFFF),
            size=f.integer("size"),
            digest=f.digest("digest"),
            layer_digests=layer_digests,
            residency=_read_residency(f, None if layer_digests is None else len(layer_digests)),
            ttl_ms=f.integer("ttl_ms"),
            moqt_namespace=None
            if namespace is None
            else read_moqt_namespace(namespace, f.at("moqt_namespace")),
            lease_base=lease_base,
            moqt_carriers=None
            if carriers is None
            else _read_carriers(carriers, f.at("moqt_carriers")),
            site=read_label(f, "site"),
            zone=read_label(f, "zone"),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON (optional members only when present)."""
        out: dict[str, Any] = {
            "block_key": self.block_key.hex(),
            "compat_id": self.compat_id.hex(),
            "scope_id": self.scope_id.hex(),
            "holder": self.holder,
            "codec": self.codec,
            "size": self.size,
            "digest": format_digest(self.digest),
        }
        if self.layer_digests is not None:
            out["layer_digests"] = hex_list(self.layer_digests)
        if self.residency is not None:
            out["residency"] = [r.to_json() for r in self.residency]
        out["ttl_ms"] = self.ttl_ms
        if self.moqt_namespace is not None:
            out["moqt_namespace"] = format_moqt_namespace(self.moqt_namespace)
        if self.lease_base is not None:
            out["lease_base"] = self.lease_base
        if self.moqt_carriers is not None:
            out["moqt_carriers"] = list(self.moqt_carriers)
        if self.site is not None:
            out["site"] = self.site
        if self.zone is not None:
            out["zone"] = self.zone
        return out

    @property
    def namespace_fields(self) -> tuple[bytes, ...] | None:
        """The five Track Namespace Fields of ``moqt_namespace``, or ``None`` without one.

        Raises:
            RecordError: the stored octets are not five length-prefixed fields.
        """
        if self.moqt_namespace is None:
            return None
        return split_namespace_octets(self.moqt_namespace, "$.moqt_namespace")

    def verify_layer_digests(self) -> bool:
        """Whether ``digest`` is the SHA-256 of the concatenated layer digests (§4.3); ``False``
        when the record lists none."""
        if self.layer_digests is None:
            return False
        return hashlib.sha256(b"".join(self.layer_digests)).digest() == self.digest


MAX_TARGETS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupRequest:
    """A lookup (§6.2): ``{"scope_id", "compat_id", "block_keys", "targets"?, "compact"?}``.

    ``block_keys`` are in prefix order (at most 1,000,000). ``targets`` may be absent (``None``)
    or an array of instance URIs. ``compact`` is our extension member (DESIGN §7): when true the
    answer carries ``matched`` and estimates only; it is written only when true.
    """

    scope_id: ScopeId
    compat_id: CompatId
    block_keys: tuple[BlockKey, ...]
    targets: tuple[str, ...] | None = None
    compact: bool = False

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a lookup request.

        Raises:
            RecordError: a bad or missing member, too many keys or targets, duplicate targets.
        """
        f = Fields(obj, path)
        targets = f.array("targets", optional=True)
        if targets is not None and len(targets) > MAX_TARGETS:
            raise RecordError(f"at most {MAX_TARGETS} targets allowed", path=f.at("targets"))
        return cls(
            scope_id=ScopeId(f.hex16("scope_id")),
            compat_id=CompatId(f.hex32("compat_id")),
            block_keys=read_block_keys(f),
            targets=None
            if targets is None
            else read_uris(targets, f.at("targets"), unique=True, schemes=HTTP_SCHEMES),
            compact=bool(f.boolean("compact", optional=True)),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        out: dict[str, Any] = {
            "scope_id": self.scope_id.hex(),
            "compat_id": self.compat_id.hex(),
            "block_keys": hex_list(self.block_keys),
        }
        if self.targets is not None:
            out["targets"] = list(self.targets)
        if self.compact:
            out["compact"] = True
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetEstimate:
    """The §6.4 estimates for one lookup target: ``fetch_us`` and ``recompute_us``."""

    target: str
    fetch_us: float
    recompute_us: float

    @classmethod
    def from_json(cls, obj: object, path: str = "$", *, target: str) -> Self:
        """Read ``{"fetch_us", "recompute_us"}`` for ``target`` (the member name it sat under).

        Raises:
            RecordError: a missing, negative or non-finite estimate.
        """
        f = Fields(obj, path)
        return cls(
            target=target, fetch_us=f.number("fetch_us"), recompute_us=f.number("recompute_us")
        )

    def to_json(self) -> dict[str, Any]:
        """Render the estimate object (without the target, which is its member name)."""
        return {
            "fetch_us": number_json(self.fetch_us),
            "recompute_us": number_json(self.recompute_us),
        }


def _read_estimates(f: Fields) -> tuple[TargetEstimate, ...] | None:
    value = f.raw("estimates", optional=True)
    if value is None:
        return None
    table = Fields(value, f.at("estimates"))
    estimates = []
    for target, entry in table.obj.items():
        where = f"{table.path}[{target!r}]"
        uri = read_uri(target, where, HTTP_SCHEMES)
        estimates.append(TargetEstimate.from_json(entry, where, target=uri))
    return tuple(estimates)


def _read_replicas(f: Fields, matched: int) -> tuple[tuple[ReplicaRecord, ...], ...] | None:
    values = f.array("replicas", optional=True)
    if values is None:
        return None
    if len(values) != matched:
        raise RecordError(
            f"expected {matched} entries (one per matched key)", path=f.at("replicas")
        )
    per_key = []
    for item, where in f.items("replicas"):
        records = as_list(item, where)
        if not records:
            raise RecordError("a matched key has at least one replica", path=where)
        per_key.append(
            tuple(ReplicaRecord.from_json(r, f"{where}[{j}]") for j, r in enumerate(records))
        )
    return tuple(per_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResponse:
    """A lookup answer (§6.2).

    JSON: ``{"matched": n, "replicas": [[record, ...], ...], "estimates": {target:
    {"fetch_us", "recompute_us"}, ...}, "hint": "..."}``. ``replicas`` holds one non-empty array
    per matched key, in key order; it is absent (``None``) in a compact answer (DESIGN §7).
    ``estimates`` is an object keyed by target URI, absent when no target could be estimated.
    ``hint`` is our extension member: a diagnostic such as a compat mismatch.
    """

    matched: int
    replicas: tuple[tuple[ReplicaRecord, ...], ...] | None
    estimates: tuple[TargetEstimate, ...] | None = None
    hint: str | None = None

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a lookup answer.

        Raises:
            RecordError: a bad member, or ``replicas`` not one non-empty array per matched key.
        """
        f = Fields(obj, path)
        matched = f.integer("matched", maximum=UINT32_MAX)
        return cls(
            matched=matched,
            replicas=_read_replicas(f, matched),
            estimates=_read_estimates(f),
            hint=read_opaque(f, "hint"),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON.

        Raises:
            RecordError: two estimates for one target (they are keyed by target).
        """
        out: dict[str, Any] = {"matched": self.matched}
        if self.replicas is not None:
            out["replicas"] = [[r.to_json() for r in records] for records in self.replicas]
        if self.estimates is not None:
            table = {e.target: e.to_json() for e in self.estimates}
            if len(table) != len(self.estimates):
                raise RecordError("two estimates for one target", path="$.estimates")
            out["estimates"] = table
        if self.hint is not None:
            out["hint"] = self.hint
        return out

    def check_answers(self, request: LookupRequest) -> None:
        """Check that this answer fits ``request``: at most as many matches as keys, and each
        record names its key, the request's compat_id and scope_id.

        Raises:
            RecordError: the answer does not belong to the request.
        """
        if self.matched > len(request.block_keys):
            raise RecordError("more matches than keys asked for", path="$.matched")
        for i, records in enumerate(self.replicas or ()):
            for j, r in enumerate(records):
                expected = (request.block_keys[i], request.compat_id, request.scope_id)
                if (r.block_key, r.compat_id, r.scope_id) != expected:
                    raise RecordError(
                        "record is not for the key asked", path=f"$.replicas[{i}][{j}]"
                    )
