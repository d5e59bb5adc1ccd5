"""The simulator's side of the real Index Service (spec §6.1 publish and withdraw, §6.2 lookup):
an :class:`~kvsp.index.IndexService` over a :class:`~kvsp.stores.memory.MemoryStore`, a caller
with every right, and the descriptor of the simulated model.

The Index Service's methods are ``async`` because stores may be remote; the in-process store
never suspends, so :func:`run_sync` drives each call to completion in place, without an event
loop per call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import SimError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import IndexService, ReplicaPath, holder_id_of
from kvsp.keys import scope_id
from kvsp.records import LookupRequest, ReplicaRecord, Residency
from kvsp.sim.config import ClusterConfig
from kvsp.stores.memory import MemoryStore

T = TypeVar("T")

RECORD_TTL_MS = 7 * 24 * 3_600_000
"""Replica TTL: longer than any trace, so records leave the index only by withdrawal."""
SCOPE_KEY = b"kvsp-sim scope key: 32+ octets, fixed for replay"
CODEC_RAW = 1
KV_DTYPES = {1: "fp8_e4m3", 2: "bf16", 4: "fp32"}
"""The element type the descriptor names for each ``dtype_bytes``."""


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that completes without suspending (every in-process store call).

    Raises:
        SimError: the coroutine suspended (a store that does real I/O).
    """
    try:
        coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coro.close()
    raise SimError("the replica store suspended; the simulator needs an in-process store")


def sim_descriptor(config: ClusterConfig) -> CompatibilityDescriptor:
    """The Compatibility Descriptor of the simulated model (its geometry from ``config``)."""
    return CompatibilityDescriptor(
        model="kvsp-sim-llama-2-70b",
        model_digest=hashlib.sha256(b"kvsp-sim weights").digest(),
        tokenizer_digest=hashlib.sha256(b"kvsp-sim tokenizer").digest(),
        layers=config.layers,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        kv_dtype=KV_DTYPES[config.dtype_bytes],
        positional="rope;theta=10000",
        block_tokens=config.block_tokens,
    )


class SimCaller:
    """The simulator's principal for the Index Service: every right (it speaks for all)."""

    name = "kvsp-sim"

    def may_use_scope(self, scope_id: bytes) -> bool:
        """Always."""
        return True

    def may_publish_for(self, holder: str) -> bool:
        """Always."""
        return True

    def may_publish_for_id(self, holder_id: bytes) -> bool:
        """Always."""
        return True

    def may_report_for(self, instance: str) -> bool:
        """Always."""
        return True


class _Descriptors:
    def __init__(self, descriptor: CompatibilityDescriptor, cid: bytes) -> None:
        self._descriptor = descriptor
        self._cid = cid

    def get(self, compat: bytes, /) -> CompatibilityDescriptor | None:
        return self._descriptor if compat == self._cid else None


class ClusterIndex:
    """The real :class:`~kvsp.index.IndexService` over a :class:`MemoryStore`, as the cluster's
    holders and the KVSP policies use it; counts publications and withdrawals."""

    def __init__(self, config: ClusterConfig) -> None:
        descriptor = sim_descriptor(config)
        self.compat_id = CompatId(compat_id(descriptor))
        self.scope_id: ScopeId = scope_id(SCOPE_KEY)
        self.service = IndexService(
            MemoryStore(),
            max_ttl_ms=RECORD_TTL_MS,
            descriptors=_Descriptors(descriptor, self.compat_id),
        )
        self.caller = SimCaller()
        self.block_bytes = config.block_bytes
        self.published = 0
        self.withdrawn = 0

    def record(
        self, holder: str, key: BlockKey, residency: tuple[Residency, ...] | None
    ) -> ReplicaRecord:
        """A Replica Record for ``key`` at ``holder`` (no layer digests: whole-block replicas)."""
        return ReplicaRecord(
            block_key=key,
            compat_id=self.compat_id,
            scope_id=self.scope_id,
            holder=holder,
            codec=CODEC_RAW,
            size=self.block_bytes,
            digest=hashlib.sha256(key).digest(),
            layer_digests=None,
            residency=residency,
            ttl_ms=RECORD_TTL_MS,
        )

    def publish(
        self,
        holder: str,
        keys: Sequence[BlockKey],
        now_ms: int,
        residency: tuple[Residency, ...] | None,
    ) -> None:
        """Publish ``holder``'s replicas of ``keys`` in one batch (§6.1).

        Raises:
            SimError: the index refused a record.
        """
        records = [self.record(holder, key, residency) for key in keys]
        for outcome in run_sync(self.service.publish_batch(self.caller, records, now_ms)):
            if outcome.error is not None:
                raise SimError(f"publish refused: {outcome.error}")
        self.published += len(records)

    def withdraw(self, holder: str, key: BlockKey) -> None:
        """Withdraw ``holder``'s replica of ``key`` (§6.1)."""
        path = ReplicaPath(
            compat_id=self.compat_id,
            scope_id=self.scope_id,
            block_key=key,
            holder_id=holder_id_of(holder),
        )
        if run_sync(self.service.withdraw(self.caller, path)):
            self.withdrawn += 1

    def find(self, keys: Sequence[BlockKey], now_ms: int) -> list[list[ReplicaRecord]]:
        """The replicas of the leading matched ``keys`` (§6.2), one list per matched key."""
        request = LookupRequest(
            scope_id=self.scope_id, compat_id=self.compat_id, block_keys=tuple(keys)
        )
        result = run_sync(self.service.find(self.caller, request, now_ms))
        return [[record for record, _ in found] for found in result.matches]
