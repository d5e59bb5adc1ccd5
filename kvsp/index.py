"""The Index Service logic (spec §6.1 publishing and withdrawing, §6.2 lookup, §6.3 status epochs
as the IS keeps them, §6.4 estimates for lookup targets; DESIGN.md §3, §7 compact answers).

Sans-I/O: :class:`IndexService` works over a :class:`ReplicaStore` (the protocol is defined
here, :mod:`kvsp.stores` implements it), takes ``now_ms`` as an argument and asks a
:class:`Caller` what the authenticated party may do, so the rules of who may do what stay in
one place (the service shell's auth module). Methods are ``async`` only because stores may be
remote.

Records are checked before they are kept (:func:`check_record`): ``digest`` must be the
replica digest of ``layer_digests`` (§4.3) when the record lists them; when the IS knows the
compat id's descriptor, the layers they and ``residency`` name must be the descriptor's layers;
a record for an unknown compat id is kept as before, with its layer list bounded by what a
container may hold; ``size`` lies between the header of the listed layers and the largest
container anyone transfers. Each holder may keep at most ``max_records_per_holder``
records (507 ``kvsp-insufficient-storage`` beyond it; refreshes always pass), so that one
holder cannot fill the IS. Status epochs are bounded by the IS's clock as at the PC
(:mod:`kvsp.lifecycle`).

Authorization never leaks: a lookup in a scope the caller may not use is answered exactly like a
miss in a scope holding nothing (§6.2 "MUST NOT return replicas of a scope for which the client
is not authorized").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import DEFAULT_LIMITS, header_size, replica_digest
from kvsp.errors import (
    BadRequest,
    DigestMismatch,
    Forbidden,
    Incompatible,
    InsufficientStorage,
    KVSPError,
    PayloadTooLarge,
    StaleEpoch,
)
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id
from kvsp.lifecycle import DEFAULT_MAX_EPOCH_SKEW_MS, check_epoch_bound
from kvsp.placement import estimate_targets
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    StateAnswer,
    TargetEstimate,
)

DEFAULT_MAX_LOOKUP_KEYS = 65_536
"""Keys per lookup: a 1M-token prompt at B=16. The request is ~4.4 MB of JSON; a full answer
grows by ~2.7 KB per replica of 32 layers, which is why compact answers exist (DESIGN §7)."""
DEFAULT_MAX_RECORDS_PER_HOLDER = 500_000
"""Records one holder may keep at the IS: 1 TB of 2 MiB blocks, ~800 MiB of IS memory at
32 layers a record."""
HINT_IDS = 3
"""Compat ids a hint lists before "(+N more)", keeping it under the 1,024-character limit."""
_DESCRIPTOR_ADVICE = "check the model, tokenizer, adapters, kv_dtype and block_tokens"


StoredReplica = tuple[ReplicaRecord, int]
"""A stored record with its absolute expiry time in milliseconds."""


@functools.lru_cache(maxsize=65536)
def holder_id_of(uri: str) -> bytes:
    """The 16 octets that name a holder URI in paths and in the store (``uri_id``, DESIGN §3);
    cached, since a few holders publish most records."""
    return bytes.fromhex(uri_id(uri))


class ReplicaStore(Protocol):
    """Replica records with expiry, and the latest instance status records (§6.1–6.3): what
    the IS keeps, in memory or in Redis (:mod:`kvsp.stores`).

    Narrow on purpose, so that a Redis store answers each call in one round trip: a lookup
    is one call for the whole prompt, not one per key. Identifiers are raw octets; a replica
    is stored under ``(compat_id, scope_id, block_key, holder_id)`` where ``holder_id`` is
    :func:`holder_id_of` its holder, because a withdrawal names the holder only by that id.
    Expiry is absolute milliseconds on the caller's clock: a record is live while
    ``now_ms < expires_ms``.
    """

    async def put(self, record: ReplicaRecord, expires_ms: int) -> None:
        """Store or refresh ``record`` (its holder's entry for its key) until ``expires_ms``."""
        ...

    async def put_many(
        self, items: Sequence[StoredReplica], *, max_per_holder: int | None = None
    ) -> list[bool]:
        """Store or refresh several records at once (one round trip); per item, whether it
        was stored. With ``max_per_holder``, a record that would be a holder's record beyond
        that many is not stored (a refresh of a kept record always is)."""
        ...

    async def delete(self, compat_id: bytes, scope_id: bytes, key: bytes, holder_id: bytes) -> bool:
        """Remove one holder's record for a key; whether there was one."""
        ...

    async def delete_holder(self, holder_id: bytes, *, published_before: int | None = None) -> int:
        """Remove every record of the holder ``holder_id``, or only those last published or
        refreshed (``expires_ms - ttl_ms``) before ``published_before``; how many went."""
        ...

    async def lookup(
        self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], now_ms: int
    ) -> list[list[StoredReplica]]:
        """The live records of the leading ``keys``, one non-empty list per key, stopping at
        the first key without a live record (§6.2: keys are chained)."""
        ...

    async def compats_with_key(self, scope_id: bytes, key: bytes, now_ms: int) -> set[bytes]:
        """The Compatibility IDs under which ``key`` has a live record in ``scope_id``."""
        ...

    async def compats_in_scope(self, scope_id: bytes, now_ms: int) -> set[bytes]:
        """The Compatibility IDs with at least one live record in ``scope_id``."""
        ...

    async def sweep(self, now_ms: int, max_items: int) -> int:
        """Remove expired records, examining at most ``max_items`` expiry entries; returns how
        many records were removed. Bounded, so a caller can interleave it with requests."""
        ...

    async def count(self) -> int:
        """How many replica records are stored (expired ones not yet swept included)."""
        ...

    async def put_status(
        self, record: InstanceStatusRecord, expires_ms: int, *, poisoned_above: int | None = None
    ) -> bool:
        """Store an instance's status until ``expires_ms``; ``False`` (and nothing stored) when
        its epoch is lower than the highest seen for that instance (§6.3), unless that highest
        epoch is above ``poisoned_above`` (:mod:`kvsp.lifecycle`: a poisoned epoch)."""
        ...

    async def statuses(self, instances: Sequence[str], now_ms: int) -> list[InstanceStatusRecord]:
        """The live status records of those of ``instances`` that have one, in that order."""
        ...


HolderCensus = tuple[str, int, int]
"""One holder's share of the live records: its URI, how many records, their total ``size``."""


@runtime_checkable
class ReplicaCensus(Protocol):
    """A store that can count its live records per holder, for operators (``GET replicas``
    at the IS, ``kvsp status``). Optional: the IS offers the route only over a store that
    has it."""

    async def holders(self, now_ms: int) -> list[HolderCensus]:
        """Every holder with a live record: ``(holder, records, octets)``, by holder URI."""
        ...


class ReplicaIndex(Protocol):
    """The Index Service as a publisher sees it (§6.1): what a holder needs of it.
    :class:`~kvsp.services.index.client.IndexClient` provides it over HTTP."""

    async def publish(self, record: ReplicaRecord, /) -> int:
        """Publish or refresh a record (§6.1); returns the granted TTL in ms."""
        ...

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[int | KVSPError]:
        """Publish or refresh several records; per record, the granted TTL or its error."""
        ...

    async def withdraw(
        self, compat: CompatId, scope: ScopeId, key: BlockKey, holder: str, /
    ) -> bool:
        """Withdraw a record (§6.1); whether one was there."""
        ...


class Caller(Protocol):
    """What the IS asks about the authenticated party of a request."""

    @property
    def name(self) -> str:
        """A name for error messages."""
        ...

    def may_use_scope(self, scope_id: bytes) -> bool:
        """Whether it may read and write replicas of ``scope_id`` (§6.1, §6.2)."""
        ...

    def may_publish_for(self, holder: str) -> bool:
        """Whether it may publish records naming ``holder`` (§6.1)."""
        ...

    def may_publish_for_id(self, holder_id: bytes) -> bool:
        """Whether it may publish for the holder whose ``uri_id`` is ``holder_id``."""
        ...

    def may_report_for(self, instance: str) -> bool:
        """Whether it may report the status of ``instance`` (§6.3)."""
        ...


@runtime_checkable
class HolderAuthority(Protocol):
    """A caller that may withdraw the records of holders other than its own: the PC, which
    declares instances failed (§6.3), and admin. Optional on a :class:`Caller`."""

    def may_withdraw_any_holder(self) -> bool:
        """Whether it may withdraw every record of any holder."""
        ...


class DescriptorSource(Protocol):
    """Where the IS finds the descriptor of a compat id (geometry for §6.4 estimates)."""

    def get(self, compat_id: bytes, /) -> CompatibilityDescriptor | None:
        """The descriptor of ``compat_id``, if known."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaPath:
    """The identifiers of ``replicas/{compat}/{scope}/{key}/{holder_id}`` (DESIGN §3)."""

    compat_id: CompatId
    scope_id: ScopeId
    block_key: BlockKey
    holder_id: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchOutcome:
    """The result for one record of a batch publish: the granted TTL or the error."""

    ttl_ms: int | None = None
    error: KVSPError | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"ok": true, "ttl_ms": n}`` or ``{"ok": false, "problem": {RFC 9457 object}}``."""
        if self.error is not None:
            return {"ok": False, "problem": self.error.to_problem()}
        return {"ok": True, "ttl_ms": self.ttl_ms}


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    """A lookup's findings before rendering: the live records with their expiry times."""

    matches: list[list[StoredReplica]]
    estimates: tuple[TargetEstimate, ...] | None
    hint: str | None
    compact: bool

    @property
    def matched(self) -> int:
        """How many leading keys have a live replica."""
        return len(self.matches)

    def to_response(self, now_ms: int) -> LookupResponse:
        """The §6.2 answer, each record's ``ttl_ms`` set to its remaining TTL at ``now_ms``."""
        replicas = None
        if not self.compact:
            replicas = tuple(
                tuple(dataclasses.replace(r, ttl_ms=expires - now_ms) for r, expires in found)
                for found in self.matches
            )
        return LookupResponse(
            matched=self.matched, replicas=replicas, estimates=self.estimates, hint=self.hint
        )

    def to_json(self, now_ms: int) -> dict[str, Any]:
        """``to_response(now_ms).to_json()``, without building the intermediate records."""
        out: dict[str, Any] = {"matched": self.matched}
        if not self.compact:
            out["replicas"] = [[_record_json(r, e - now_ms) for r, e in f] for f in self.matches]
        if self.estimates is not None:
            out["estimates"] = {e.target: e.to_json() for e in self.estimates}
        if self.hint is not None:
            out["hint"] = self.hint
        return out


def _record_json(record: ReplicaRecord, ttl_ms: int) -> dict[str, Any]:
    out = record.to_json()
    out["ttl_ms"] = ttl_ms
    return out


def _id_list(ids: set[bytes]) -> str:
    shown = sorted(ids)[:HINT_IDS]
    text = ", ".join(i.hex() for i in shown)
    return text + (f" (+{len(ids) - len(shown)} more)" if len(ids) > len(shown) else "")


def check_record(
    record: ReplicaRecord, descriptor: CompatibilityDescriptor | None, path: str = "$"
) -> None:
    """Check a record against itself and, when known, its compat id's descriptor (§4.3, §4.4);
    ``path`` is the record's JSON path, for the errors.

    Raises:
        DigestMismatch: ``digest`` is not the replica digest of ``layer_digests``.
        Incompatible: the layers do not fit the descriptor.
        PayloadTooLarge: more layer digests than a container may hold (unknown compat id).
        BadRequest: a ``size`` no container of the record's layers can have.
    """
    digests = record.layer_digests
    if digests is not None:
        limit = DEFAULT_LIMITS.max_layer_count if descriptor is None else descriptor.layers
        if descriptor is None and len(digests) > limit:
            raise PayloadTooLarge(
                f"at most {limit} layer digests, got {len(digests)}", path=f"{path}.layer_digests"
            )
        if descriptor is not None and len(digests) != limit:
            raise Incompatible(
                f"{len(digests)} layer digests, but the descriptor of this compat_id has "
                f"{limit} layers",
                path=f"{path}.layer_digests",
            )
        # §4.3: the replica digest is the SHA-256 of the concatenated layer digests.
        if replica_digest(digests) != record.digest:
            raise DigestMismatch("is not the SHA-256 of the layer digests", path=f"{path}.digest")
    _check_size(record, path)
    for i, r in enumerate(record.residency or ()):
        if descriptor is not None and r.last >= descriptor.layers:
            raise Incompatible(
                f"layer {r.last} beyond the descriptor's {descriptor.layers} layers",
                path=f"{path}.residency[{i}].layers",
            )


def _check_size(record: ReplicaRecord, path: str) -> None:
    """A container is at most :data:`~kvsp.container.DEFAULT_LIMITS` ``max_total_bytes`` (what
    holders and clients transfer) and at least the header of the layers listed."""
    most = DEFAULT_LIMITS.max_total_bytes
    least = 0 if record.layer_digests is None else header_size(len(record.layer_digests))
    if not least <= record.size <= most:
        raise BadRequest(
            f"{record.size} octets: a container of these layers has {least}..{most}",
            path=f"{path}.size",
        )


def check_path(path: ReplicaPath, record: ReplicaRecord) -> None:
    """Require that the body of a PUT names the resource it is put to (§6.1, DESIGN §3).

    Raises:
        BadRequest: a member differs from its path segment; ``path`` names the member.
    """
    pairs = (
        ("compat_id", "compat", path.compat_id.hex(), record.compat_id.hex()),
        ("scope_id", "scope", path.scope_id.hex(), record.scope_id.hex()),
        ("block_key", "key", path.block_key.hex(), record.block_key.hex()),
        ("holder", "holder_id", path.holder_id.hex(), holder_id_of(record.holder).hex()),
    )
    for member, segment, in_path, in_body in pairs:
        if in_path != in_body:
            what = "uri_id(holder)" if member == "holder" else member
            raise BadRequest(
                f"{what} is {in_body} in the body but {in_path} in the path ({{{segment}}})",
                path=f"$.{member}",
            )


class IndexService:
    """Replica records with TTLs, prefix lookup, status for estimates (§6.1–6.4).

    ``max_ttl_ms`` caps every granted TTL (§6.1); ``descriptors`` supplies the geometry the
    §6.4 estimates and the record checks need; ``max_lookup_keys`` bounds one lookup;
    ``max_records_per_holder`` bounds the records of one holder (``None``: no bound);
    ``max_epoch_skew_ms`` bounds status epochs (:mod:`kvsp.lifecycle`).
    """

    def __init__(
        self,
        store: ReplicaStore,
        *,
        max_ttl_ms: int,
        descriptors: DescriptorSource,
        max_lookup_keys: int = DEFAULT_MAX_LOOKUP_KEYS,
        max_records_per_holder: int | None = DEFAULT_MAX_RECORDS_PER_HOLDER,
        max_epoch_skew_ms: int = DEFAULT_MAX_EPOCH_SKEW_MS,
    ) -> None:
        if max_ttl_ms < 1 or max_lookup_keys < 1:
            raise ValueError("max_ttl_ms and max_lookup_keys must be positive")
        if max_records_per_holder is not None and max_records_per_holder < 1:
            raise ValueError("max_records_per_holder must be positive")
        self.store = store
        self.max_ttl_ms = max_ttl_ms
        self.descriptors = descriptors
        self.max_lookup_keys = max_lookup_keys
        self.max_records_per_holder = max_records_per_holder
        self.max_epoch_skew_ms = max_epoch_skew_ms

    # --- §6.1 publish and withdraw -------------------------------------------------------------

    def _admit(
        self, caller: Caller, record: ReplicaRecord, now_ms: int, path: str = "$"
    ) -> StoredReplica:
        if record.ttl_ms < 1:
            raise BadRequest("must be at least 1", path="$.ttl_ms")
        # §6.1: the client MUST be authorized for the record's scope ...
        if not caller.may_use_scope(record.scope_id):
            raise Forbidden(f"principal {caller.name!r} is not authorized for this scope")
        # ... and MUST be the holder named in the record or authorized to publish for it.
        if not caller.may_publish_for(record.holder):
            raise Forbidden(
                f"principal {caller.name!r} may not publish for holder {record.holder[:200]!r}"
            )
        check_record(record, self.descriptors.get(record.compat_id), path)
        granted = min(record.ttl_ms, self.max_ttl_ms)  # §6.1: capped at the configured maximum
        if granted != record.ttl_ms:
            record = dataclasses.replace(record, ttl_ms=granted)
        return record, now_ms + granted

    async def publish(
        self, caller: Caller, path: ReplicaPath, record: ReplicaRecord, now_ms: int
    ) -> int:
        """Publish or refresh a Replica Record put to ``path``; returns the granted TTL.

        Raises:
            BadRequest: the body disagrees with the path, or ``ttl_ms`` is 0.
            Forbidden: the caller may not use the scope or publish for the holder.
            DigestMismatch, Incompatible, PayloadTooLarge: see :func:`check_record`.
            InsufficientStorage: a new record beyond the holder's record quota.
        """
        check_path(path, record)
        stored = self._admit(caller, record, now_ms)
        if not (await self._put([stored]))[0]:
            raise self._over_quota(record)
        return stored[0].ttl_ms

    async def _put(self, items: Sequence[StoredReplica]) -> list[bool]:
        return await self.store.put_many(items, max_per_holder=self.max_records_per_holder)

    def _over_quota(self, record: ReplicaRecord) -> InsufficientStorage:
        return InsufficientStorage(
            f"holder {record.holder[:200]!r} keeps {self.max_records_per_holder} records at "
            "this IS, its quota; withdraw some (or let them expire) before publishing more"
        )

    async def publish_batch(
        self, caller: Caller, items: Sequence[ReplicaRecord | object], now_ms: int
    ) -> list[BatchOutcome]:
        """Publish several records under the rules of :meth:`publish`, one outcome per item.

        Items are records or their JSON values (read with the path ``$.records[i]``); a bad
        item fails alone.
        """
        outcomes: list[BatchOutcome] = []
        accepted: list[tuple[int, StoredReplica]] = []
        for i, item in enumerate(items):
            try:
                record = (
                    item
                    if isinstance(item, ReplicaRecord)
                    else ReplicaRecord.from_json(item, f"$.records[{i}]")
                )
                stored = self._admit(caller, record, now_ms, f"$.records[{i}]")
            except KVSPError as exc:
                outcomes.append(BatchOutcome(error=exc))
                continue
            accepted.append((i, stored))
            outcomes.append(BatchOutcome(ttl_ms=stored[0].ttl_ms))
        kept = await self._put([stored for _, stored in accepted])
        for (i, (record, _)), ok in zip(accepted, kept, strict=True):
            if not ok:
                outcomes[i] = BatchOutcome(error=self._over_quota(record))
        return outcomes

    async def withdraw(self, caller: Caller, path: ReplicaPath) -> bool:
        """Withdraw one holder's record (§6.1); whether there was one.

        Raises:
            Forbidden: the caller may not use the scope or publish for the holder.
        """
        if not caller.may_use_scope(path.scope_id):
            raise Forbidden(f"principal {caller.name!r} is not authorized for this scope")
        if not caller.may_publish_for_id(path.holder_id):
            raise Forbidden(f"principal {caller.name!r} may not withdraw for this holder")
        return await self.store.delete(
            path.compat_id, path.scope_id, path.block_key, path.holder_id
        )

    async def withdraw_holder(
        self, caller: Caller, holder_id: bytes, *, published_before: int | None = None
    ) -> int:
        """Withdraw every record of the holder named by ``holder_id`` (§6.1, for a holder
        that failed or ended, §6.3), or only those last published before ``published_before``
        (ms, the IS's clock: a restarted holder keeps what its new incarnation published);
        returns how many went.

        Raises:
            Forbidden: the caller may not withdraw for that holder: only the holder itself
                (as for publishing), the PC (which declares instances failed) and admin may.
        """
        authority = isinstance(caller, HolderAuthority) and caller.may_withdraw_any_holder()
        if not (authority or caller.may_publish_for_id(holder_id)):
            raise Forbidden(f"principal {caller.name!r} may not withdraw for this holder")
        return await self.store.delete_holder(holder_id, published_before=published_before)

    async def sweep(self, now_ms: int, max_items: int) -> int:
        """Remove expired records, bounded by ``max_items``; returns how many went."""
        return await self.store.sweep(now_ms, max_items)

    # --- §6.2 lookup ---------------------------------------------------------------------------

    async def lookup(self, caller: Caller, request: LookupRequest, now_ms: int) -> LookupResponse:
        """Answer a lookup (§6.2) with records carrying their remaining TTL.

        Raises:
            PayloadTooLarge: more than ``max_lookup_keys`` keys.
        """
        return (await self.find(caller, request, now_ms)).to_response(now_ms)

    async def find(self, caller: Caller, request: LookupRequest, now_ms: int) -> LookupResult:
        """The findings of a lookup, for callers that render them themselves.

        Raises:
            PayloadTooLarge: more than ``max_lookup_keys`` keys.
        """
        keys = request.block_keys
        if len(keys) > self.max_lookup_keys:
            raise PayloadTooLarge(
                f"at most {self.max_lookup_keys} keys per lookup, got {len(keys)}",
                path="$.block_keys",
            )
        visible = caller.may_use_scope(request.scope_id)
        matches: list[list[StoredReplica]] = []
        if visible and keys:
            # §6.2: the store stops at the first key without an unexpired replica.
            matches = await self.store.lookup(request.compat_id, request.scope_id, keys, now_ms)
        hint = None
        if visible and keys and not matches:
            hint = await self._hint(request, now_ms)
        return LookupResult(
            matches=matches,
            estimates=await self._estimates(request, matches, now_ms),
            hint=hint,
            compact=request.compact,
        )

    async def _hint(self, request: LookupRequest, now_ms: int) -> str | None:
        """Say when the miss looks like descriptor drift rather than an empty cache."""
        asked = request.compat_id
        others = await self.store.compats_with_key(request.scope_id, request.block_keys[0], now_ms)
        others.discard(asked)
        if others:
            return (
                f"no replica of block_keys[0] under compat_id {asked.hex()}; that key has "
                f"replicas under compat_id {_id_list(others)}: {_DESCRIPTOR_ADVICE} of your "
                "descriptor"
            )
        in_scope = await self.store.compats_in_scope(request.scope_id, now_ms)
        if in_scope and asked not in in_scope:
            return (
                f"no replica under compat_id {asked.hex()} in this scope, which holds replicas "
                f"only under compat_id {_id_list(in_scope)}: if they should match, "
                f"{_DESCRIPTOR_ADVICE} of your descriptor"
            )
        return None

    async def _estimates(
        self, request: LookupRequest, matches: list[list[StoredReplica]], now_ms: int
    ) -> tuple[TargetEstimate, ...] | None:
        """§6.2/§6.4 ``fetch_us``/``recompute_us`` per target with status and a known
        descriptor; targets whose estimate is infinite are left out."""
        if not request.targets:
            return None
        descriptor = self.descriptors.get(request.compat_id)
        if descriptor is None:
            return None
        statuses = await self.store.statuses(request.targets, now_ms)
        if not statuses:
            return None
        table = estimate_targets(
            [[record for record, _ in found] for found in matches],
            statuses,
            block_tokens=descriptor.block_tokens,
            layers=descriptor.layers,
        )
        estimates = tuple(
            TargetEstimate(target=target, fetch_us=e.fetch_us, recompute_us=e.recompute_us)
            for target, e in table.items()
            if math.isfinite(e.fetch_us) and math.isfinite(e.recompute_us)
        )
        return estimates or None

    # --- §6.3 status ---------------------------------------------------------------------------

    async def put_status(
        self, caller: Caller, instance_id: bytes, record: InstanceStatusRecord, now_ms: int
    ) -> StateAnswer:
        """Keep an instance's status for estimates until its ``ttl_ms`` runs out (§6.3).

        The IS is not the lifecycle authority: it answers with the state the instance reported.

        Raises:
            BadRequest: ``uri_id(record.instance)`` is not ``instance_id``, or the epoch is more
                than ``max_epoch_skew_ms`` ahead of ``now_ms``.
            Forbidden: the caller may not report for that instance.
            StaleEpoch: the epoch is lower than one already seen for the instance (and that
                one is not poisoned, :mod:`kvsp.lifecycle`).
        """
        actual = holder_id_of(record.instance)
        if actual != instance_id:
            raise BadRequest(
                f"uri_id(instance) is {actual.hex()} in the body but {instance_id.hex()} in "
                "the path ({instance_id})",
                path="$.instance",
            )
        if not caller.may_report_for(record.instance):
            raise Forbidden(f"principal {caller.name!r} may not report for this instance")
        if not await self.keep_status(record, now_ms):
            # §6.3: records with an epoch lower than the highest seen are discarded.
            raise StaleEpoch(f"epoch {record.epoch} is lower than one already seen")
        return StateAnswer(state=record.state)

    async def keep_status(self, record: InstanceStatusRecord, now_ms: int) -> bool:
        """Store a status record for estimates until its ``ttl_ms`` runs out, replacing a
        poisoned epoch; ``False`` when a higher epoch is kept (§6.3). No authorization: for
        callers that checked it (the PC forwarding records it accepted).

        Raises:
            BadRequest: the epoch is more than ``max_epoch_skew_ms`` ahead of ``now_ms``.
        """
        check_epoch_bound(record.epoch, now_ms, self.max_epoch_skew_ms)
        expires_ms = now_ms + record.ttl_ms
        bound = now_ms + self.max_epoch_skew_ms
        return await self.store.put_status(record, expires_ms, poisoned_above=bound)
