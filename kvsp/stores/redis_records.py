"""The compact form of Replica Records in the Redis store, and the key values that hold them
(spec §4.4 Replica Record; :mod:`kvsp.stores.redis`).

A record is kept without its block key, compat id and scope id (the key names carry them):
``version (1) ‖ codec (2) ‖ size (8) ‖ ttl_ms (8) ‖ digest (32) ‖ flags (1) ‖ holder``, then,
as the flags say, the layer digests, the residency section, ``moqt_namespace``,
``lease_base``, ``moqt_carriers`` (newline-joined), ``site`` and ``zone``; strings and
sections are preceded by a 4-octet length, integers are big-endian.
It is less than half the record's JSON and decodes faster (``bench/bench_index.py`` prints
both). A *key value* is the largest expiry of its entries (15 ASCII digits), then per holder
``holder id (16) ‖ expiry (15 digits) ‖ length (10 digits) ‖ compact record``.
"""

from __future__ import annotations

import functools
import math
import struct
from collections import OrderedDict

from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import StoredReplica
from kvsp.records import ReplicaRecord, Residency
from kvsp.registries import Tier

EXPIRY_DIGITS = 15
"""Expiry times in key values: ms since the epoch, zero-padded (good until year 33658)."""
_ENTRY_HEAD = 16 + EXPIRY_DIGITS + 10

_RECORD = struct.Struct("!BHQQ32sBI")  # version, codec, size, ttl_ms, digest, flags, holder len
_COUNT = struct.Struct("!I")  # counts and lengths: no record a body limit admits comes near
_RESIDENCY = struct.Struct("!IId")  # first, last, read_mbit_per_s (NaN: absent)
_VERSION = 1
_LAYERS, _RESIDENCIES, _NAMESPACE, _LEASE, _CARRIERS, _SITE, _ZONE = 1, 2, 4, 8, 16, 32, 64
_TIERS = {t.value.encode(): t for t in Tier}


def _rate(value: float | None) -> float:
    return math.nan if value is None else value


def _text(value: str) -> bytes:
    raw = value.encode()
    return _COUNT.pack(len(raw)) + raw


def encode_record(record: ReplicaRecord) -> bytes:
    """The compact form of ``record`` without its key, compat and scope ids (the store's key
    names carry them).

    Raises:
        ValueError: a member beyond the form's limits (2**32 - 1 layers or octets).
    """
    flags = (
        (record.layer_digests is not None) * _LAYERS
        | (record.residency is not None) * _RESIDENCIES
        | (record.moqt_namespace is not None) * _NAMESPACE
        | (record.lease_base is not None) * _LEASE
        | (record.moqt_carriers is not None) * _CARRIERS
        | (record.site is not None) * _SITE
        | (record.zone is not None) * _ZONE
    )
    holder = record.holder.encode()
    head = (_VERSION, record.codec, record.size, record.ttl_ms, record.digest, flags, len(holder))
    parts = [_RECORD.pack(*head), holder]
    if record.layer_digests is not None:
        parts += [_COUNT.pack(len(record.layer_digests)), *record.layer_digests]
    if record.residency is not None:
        section = b"".join(
            _text(r.tier.value)
            + _RESIDENCY.pack(
                r.first, r.last, math.nan if r.read_mbit_per_s is None else r.read_mbit_per_s
            )
            for r in record.residency
        )
        parts += [_COUNT.pack(len(section)), section]
    if record.moqt_namespace is not None:
        parts += [_COUNT.pack(len(record.moqt_namespace)), record.moqt_namespace]
    if record.lease_base is not None:
        parts.append(_text(record.lease_base))
    if record.moqt_carriers is not None:
        parts.append(_text("\n".join(record.moqt_carriers)))  # URIs hold no newline
    for label in (record.site, record.zone):
        if label is not None:
            parts.append(_text(label))
    try:
        return b"".join(parts)
    except struct.error as exc:
        raise ValueError(f"record beyond the compact form's limits: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _holder_text(raw: bytes) -> str:
    return raw.decode()


@functools.lru_cache(maxsize=4096)
def _residencies(section: bytes) -> tuple[Residency, ...]:
    """The residency entries of a section; cached, since a holder's records mostly share a
    few layouts (and building the objects is most of a record's decoding time)."""
    out = []
    pos = 0
    while pos < len(section):
        (length,) = _COUNT.unpack_from(section, pos)
        tier = _TIERS[section[pos + 4 : pos + 4 + length]]
        first, last, rate = _RESIDENCY.unpack_from(section, pos + 4 + length)
        pos += 4 + length + _RESIDENCY.size
        rate_or_none = None if math.isnan(rate) else rate
        out.append(Residency(tier=tier, first=first, last=last, read_mbit_per_s=rate_or_none))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _digests(count: int) -> struct.Struct:
    """How ``count`` layer digests are unpacked: one C call for all of them."""
    return struct.Struct("32s" * count)


def decode_record(
    data: bytes, pos: int, block_key: bytes, compat: bytes, scope: bytes
) -> ReplicaRecord:
    """Read the compact form at ``data[pos:]`` back into the record it was made from.

    Raises:
        ValueError: not the compact form (an unknown version or truncated octets).
    """
    try:
        version, codec, size, ttl_ms, digest, flags, length = _RECORD.unpack_from(data, pos)
        if version != _VERSION:
            raise ValueError(f"unknown compact record version {version}")
        pos += _RECORD.size
        holder = _holder_text(data[pos : pos + length])
        pos += length
        layers = None
        if flags & _LAYERS:
            (count,) = _COUNT.unpack_from(data, pos)
            pos += 4
            layers = _digests(count).unpack_from(data, pos)
            pos += 32 * count
        residency = None
        if flags & _RESIDENCIES:
            (length,) = _COUNT.unpack_from(data, pos)
            residency = _residencies(data[pos + 4 : pos + 4 + length])
            pos += 4 + length
        namespace = lease_base = None
        if flags & _NAMESPACE:
            (length,) = _COUNT.unpack_from(data, pos)
            namespace = data[pos + 4 : pos + 4 + length]
            pos += 4 + length
        if flags & _LEASE:
            (length,) = _COUNT.unpack_from(data, pos)
            lease_base = data[pos + 4 : pos + 4 + length].decode()
            pos += 4 + length
        carriers = None
        if flags & _CARRIERS:
            (length,) = _COUNT.unpack_from(data, pos)
            carriers = tuple(data[pos + 4 : pos + 4 + length].decode().split("\n"))
            pos += 4 + length
        labels: list[str | None] = []
        for flag in (_SITE, _ZONE):
            label = None
            if flags & flag:
                (length,) = _COUNT.unpack_from(data, pos)
                label = _holder_text(data[pos + 4 : pos + 4 + length])
                pos += 4 + length
            labels.append(label)
    except (struct.error, KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"truncated or malformed compact record: {exc}") from None
    return ReplicaRecord(
        block_key=BlockKey(block_key),
        compat_id=CompatId(compat),
        scope_id=ScopeId(scope),
        holder=holder,
        codec=codec,
        size=size,
        digest=digest,
        layer_digests=layers,
        residency=residency,
        ttl_ms=ttl_ms,
        moqt_namespace=namespace,
        lease_base=lease_base,
        moqt_carriers=carriers,
        site=labels[0],
        zone=labels[1],
    )


class RecordCache:
    """Records decoded from key values, by ``(compat, scope, key, compact octets)``, so that a
    hot prefix (a shared system prompt) is decoded once rather than on every lookup. Holds at
    most ``size`` records; the least recently used go first. Stale entries cannot be returned:
    a changed record has other octets."""

    __slots__ = ("_records", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._records: OrderedDict[tuple[bytes, bytes, bytes, bytes], ReplicaRecord]
        self._records = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def decode(
        self, value: bytes, start: int, stop: int, block_key: bytes, compat: bytes, scope: bytes
    ) -> ReplicaRecord:
        """The record whose compact form is ``value[start:stop]``.

        Raises:
            ValueError: not the compact form.
        """
        if self.size <= 0:
            return decode_record(value, start, block_key, compat, scope)
        records = self._records
        key = (compat, scope, block_key, value[start:stop])
        record = records.get(key)
        if record is not None:
            records.move_to_end(key)  # the most recently used
            return record
        record = records[key] = decode_record(value, start, block_key, compat, scope)
        if len(records) > self.size:
            records.popitem(last=False)
        return record


def live_entries(
    value: bytes, now_ms: int, block_key: bytes, compat: bytes, scope: bytes, cache: RecordCache
) -> list[StoredReplica]:
    """The unexpired records of a key value, decoded (through ``cache``), with their expiry
    times.

    Raises:
        ValueError: a malformed key value.
    """
    out = []
    pos, end = EXPIRY_DIGITS, len(value)
    while pos < end:
        expires = int(value[pos + 16 : pos + 16 + EXPIRY_DIGITS])
        stop = pos + _ENTRY_HEAD + int(value[pos + 16 + EXPIRY_DIGITS : pos + _ENTRY_HEAD])
        if expires > now_ms:
            record = cache.decode(value, pos + _ENTRY_HEAD, stop, block_key, compat, scope)
            out.append((record, expires))
        pos = stop
    return out
