"""The Index Service logic (kvsp.index, spec §6.1-6.3): publishing rules, prefix lookup, no leak
across scopes, the compat mismatch hint, §6.4 estimates for targets, status epochs."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import pytest

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import BadRequest, Forbidden, KVSPError, PayloadTooLarge, StaleEpoch
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import IndexService, LookupResult, ReplicaPath, holder_id_of
from kvsp.placement import estimate_targets
from kvsp.records import (
    InstanceStatusRecord,
    Link,
    LookupRequest,
    ReplicaRecord,
    Residency,
)
from kvsp.registries import InstanceState, Tier
from kvsp.stores.memory import MemoryStore

T = TypeVar("T")
DESCRIPTOR = CompatibilityDescriptor(
    model="m",
    model_digest=b"\xa1" * 32,
    tokenizer_digest=b"\xb2" * 32,
    layers=4,
    kv_heads=2,
    head_dim=8,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=16,
)
COMPAT = compat_id(DESCRIPTOR)
DRIFTED = compat_id(replace(DESCRIPTOR, block_tokens=32))
SCOPE_A = ScopeId(b"\x0a" * 16)
SCOPE_B = ScopeId(b"\x0b" * 16)
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
II7 = "https://ii7.example/kvsp/"
II9 = "https://ii9.example/kvsp/"
NOW = 1_000_000


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@dataclass
class Caller:
    """A test caller: the scopes it may use, the holders/instances it may speak for."""

    name: str = "tester"
    scopes: set[bytes] = field(default_factory=lambda: {SCOPE_A})
    holders: set[str] = field(default_factory=lambda: {H1, H2, II9})
    instances: set[str] = field(default_factory=lambda: {II7, II9})

    def may_use_scope(self, scope_id: bytes) -> bool:
        return scope_id in self.scopes

    def may_publish_for(self, holder: str) -> bool:
        return holder in self.holders

    def may_publish_for_id(self, holder_id: bytes) -> bool:
        return any(holder_id_of(h) == holder_id for h in self.holders)

    def may_report_for(self, instance: str) -> bool:
        return instance in self.instances


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"key%d" % i).digest())


def record(
    i: int, holder: str = H1, *, compat: bytes = COMPAT, scope: bytes = SCOPE_A, ttl: int = 60_000
) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(compat),
        scope_id=ScopeId(scope),
        holder=holder,
        codec=1,
        size=4096,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=(
            Residency(tier=Tier.DEVICE, first=0, last=1),
            Residency(tier=Tier.HOST, first=2, last=3, read_mbit_per_s=800.0),
        ),
        ttl_ms=ttl,
    )


def path_of(r: ReplicaRecord) -> ReplicaPath:
    return ReplicaPath(
        compat_id=r.compat_id,
        scope_id=r.scope_id,
        block_key=r.block_key,
        holder_id=holder_id_of(r.holder),
    )


def status(instance: str = II7, epoch: int = 1, **changes: Any) -> InstanceStatusRecord:
    base = InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=2,
        queued=1,
        batch_size=16,
        kv_utilization=0.5,
        prefill_tokens_per_s=8000.0,
        decode_tokens_per_s=500.0,
        links=(
            Link(holder=H1, mbit_per_s=10_000.0, rtt_us=20.0),
            Link(holder=H2, mbit_per_s=2_000.0, rtt_us=50.0),
        ),
        requested_state=None,
        ttl_ms=3000,
    )
    return replace(base, **changes)


def lookup_request(*indices: int, compat: bytes = COMPAT, scope: bytes = SCOPE_A, **kw: Any):
    return LookupRequest(
        scope_id=ScopeId(scope),
        compat_id=CompatId(compat),
        block_keys=tuple(key(i) for i in indices),
        **kw,
    )


@pytest.fixture
def service() -> IndexService:
    return IndexService(MemoryStore(), max_ttl_ms=600_000, descriptors={COMPAT: DESCRIPTOR})


def publish(service: IndexService, *records: ReplicaRecord, now: int = NOW) -> list[int]:
    caller = Caller()
    return [run(service.publish(caller, path_of(r), r, now)) for r in records]


# --- §6.1 publish ------------------------------------------------------------------------------


def test_publish_grants_the_ttl_capped_at_the_maximum(service: IndexService) -> None:
    assert publish(service, record(0, ttl=5000), record(1, ttl=10**9)) == [5000, 600_000]
    answer = run(service.lookup(Caller(), lookup_request(0, 1), NOW + 1000))
    assert answer.replicas is not None
    assert [rs[0].ttl_ms for rs in answer.replicas] == [4000, 599_000]


def test_publish_is_an_idempotent_refresh(service: IndexService) -> None:
    publish(service, record(0, ttl=1000))
    publish(service, record(0, ttl=1000), now=NOW + 900)
    assert run(service.store.count()) == 1
    answer = run(service.lookup(Caller(), lookup_request(0), NOW + 1500))
    assert answer.matched == 1


@pytest.mark.parametrize(
    ("segment", "member"),
    [
        ("compat_id", "$.compat_id"),
        ("scope_id", "$.scope_id"),
        ("block_key", "$.block_key"),
        ("holder_id", "$.holder"),
    ],
)
def test_publish_rejects_a_body_that_disagrees_with_the_path(
    service: IndexService, segment: str, member: str
) -> None:
    r = record(0)
    wrong = {
        "compat_id": DRIFTED,
        "scope_id": SCOPE_B,
        "block_key": key(9),
        "holder_id": holder_id_of(H2),
    }[segment]
    path = replace(path_of(r), **{segment: wrong})
    with pytest.raises(BadRequest) as caught:
        run(service.publish(Caller(), path, r, NOW))
    assert caught.value.path == member
    assert run(service.store.count()) == 0


def test_publish_for_another_holder_or_scope_is_forbidden(service: IndexService) -> None:
    forged = record(0, holder="https://evil.example/kvsp/")
    with pytest.raises(Forbidden, match="may not publish for holder"):
        run(service.publish(Caller(), path_of(forged), forged, NOW))
    other_scope = record(0, scope=SCOPE_B)
    with pytest.raises(Forbidden, match="not authorized for this scope"):
        run(service.publish(Caller(), path_of(other_scope), other_scope, NOW))
    assert run(service.store.count()) == 0


def test_publish_rejects_a_zero_ttl(service: IndexService) -> None:
    r = record(0, ttl=0)
    with pytest.raises(BadRequest) as caught:
        run(service.publish(Caller(), path_of(r), r, NOW))
    assert caught.value.path == "$.ttl_ms"


def test_publish_batch_gives_one_outcome_per_item(service: IndexService) -> None:
    good = record(0)
    bad_json = {**record(1).to_json(), "block_key": "ABC"}
    forged = record(2, holder="https://evil.example/kvsp/").to_json()
    outcomes = run(
        service.publish_batch(Caller(), [good, bad_json, forged, record(3, ttl=10**9)], NOW)
    )
    assert [o.ttl_ms for o in outcomes] == [60_000, None, None, 600_000]
    assert isinstance(outcomes[1].error, BadRequest)
    assert outcomes[1].error.path == "$.records[1].block_key"
    assert isinstance(outcomes[2].error, Forbidden)
    assert outcomes[0].to_json() == {"ok": True, "ttl_ms": 60_000}
    problem = outcomes[2].to_json()
    assert problem["ok"] is False
    assert problem["problem"]["type"] == "urn:ietf:params:kvsp:problem:kvsp-forbidden"
    assert run(service.store.count()) == 2


def test_withdraw_needs_scope_and_holder_and_says_whether_there_was_one(
    service: IndexService,
) -> None:
    r = record(0)
    publish(service, r)
    with pytest.raises(Forbidden):
        run(service.withdraw(Caller(holders={H2}), path_of(r)))
    with pytest.raises(Forbidden):
        run(service.withdraw(Caller(scopes={SCOPE_B}), path_of(r)))
    assert run(service.withdraw(Caller(), path_of(r)))
    assert not run(service.withdraw(Caller(), path_of(r)))
    assert run(service.lookup(Caller(), lookup_request(0), NOW)).matched == 0


# --- §6.2 lookup -------------------------------------------------------------------------------


def test_lookup_stops_at_the_first_key_without_a_live_replica(service: IndexService) -> None:
    publish(service, record(0), record(1, H1), record(1, H2), record(3))
    answer = run(service.lookup(Caller(), lookup_request(0, 1, 2, 3), NOW))
    assert answer.matched == 2
    assert answer.replicas is not None
    assert [[r.holder for r in rs] for rs in answer.replicas] == [[H1], [H1, H2]]
    answer.check_answers(lookup_request(0, 1, 2, 3))
    assert answer.hint is None


def test_expired_records_are_never_returned(service: IndexService) -> None:
    publish(service, record(0, ttl=1000), record(1, ttl=5000))
    assert run(service.lookup(Caller(), lookup_request(0, 1), NOW + 999)).matched == 2
    assert run(service.lookup(Caller(), lookup_request(0, 1), NOW + 1000)).matched == 0
    assert run(service.lookup(Caller(), lookup_request(1), NOW + 1000)).matched == 1
    assert run(service.sweep(NOW + 1000, 100)) == 1


def test_compact_answers_carry_no_records(service: IndexService) -> None:
    publish(service, record(0), record(1))
    answer = run(service.lookup(Caller(), lookup_request(0, 1, compact=True), NOW))
    assert answer.matched == 2
    assert answer.replicas is None
    assert answer.to_json() == {"matched": 2}


def test_an_unauthorized_scope_answers_exactly_like_an_empty_one(service: IndexService) -> None:
    publish(service, record(0, scope=SCOPE_A), record(0, compat=DRIFTED, scope=SCOPE_A))
    run(service.put_status(Caller(), holder_id_of(II7), status(), NOW))
    outsider = Caller(scopes={SCOPE_B})
    for kw in ({}, {"compact": True}, {"targets": (II7,)}):
        denied = run(service.lookup(outsider, lookup_request(0, **kw), NOW))
        empty = run(service.lookup(Caller(), lookup_request(0, scope=SCOPE_B, **kw), NOW))
        assert denied == empty
        assert denied.matched == 0 and denied.hint is None


def test_hint_when_the_first_key_has_replicas_under_another_compat_id(
    service: IndexService,
) -> None:
    publish(service, record(0, compat=DRIFTED))
    answer = run(service.lookup(Caller(), lookup_request(0, 1), NOW))
    assert answer.matched == 0
    assert answer.hint is not None
    assert f"under compat_id {COMPAT.hex()}" in answer.hint
    assert f"replicas under compat_id {DRIFTED.hex()}" in answer.hint
    assert "block_tokens" in answer.hint


def test_weaker_hint_when_the_scope_holds_only_other_compat_ids(service: IndexService) -> None:
    publish(service, record(5, compat=DRIFTED))
    answer = run(service.lookup(Caller(), lookup_request(0), NOW))
    assert answer.hint is not None
    assert "only under compat_id " + DRIFTED.hex() in answer.hint
    # Once the scope holds anything under the asked compat id, a miss is just a miss.
    publish(service, record(6))
    assert run(service.lookup(Caller(), lookup_request(0), NOW)).hint is None


def test_no_hint_from_expired_records_or_for_hits(service: IndexService) -> None:
    publish(service, record(0, compat=DRIFTED, ttl=10))
    assert run(service.lookup(Caller(), lookup_request(0), NOW + 10)).hint is None
    publish(service, record(0), record(1, compat=DRIFTED))
    assert run(service.lookup(Caller(), lookup_request(0, 1), NOW)).hint is None


def test_hint_lists_a_bounded_number_of_compat_ids(service: IndexService) -> None:
    for n in range(6):
        publish(service, record(0, compat=bytes([n]) * 32))
    hint = run(service.lookup(Caller(), lookup_request(0), NOW)).hint
    assert hint is not None and "(+3 more)" in hint and len(hint) <= 1024


def test_too_many_keys_are_refused() -> None:
    service = IndexService(MemoryStore(), max_ttl_ms=1000, descriptors={}, max_lookup_keys=3)
    with pytest.raises(PayloadTooLarge):
        run(service.lookup(Caller(), lookup_request(0, 1, 2, 3), NOW))


def test_an_empty_lookup_matches_nothing(service: IndexService) -> None:
    publish(service, record(0, compat=DRIFTED))
    answer = run(service.lookup(Caller(), lookup_request(), NOW))
    assert answer.to_json() == {"matched": 0, "replicas": []}


def test_rendering_without_records_equals_the_response(service: IndexService) -> None:
    publish(service, record(0), record(0, H2), record(1))
    run(service.put_status(Caller(), holder_id_of(II7), status(), NOW))
    request = lookup_request(0, 1, targets=(II7,))
    result = run(service.find(Caller(), request, NOW))
    assert isinstance(result, LookupResult)
    assert result.to_json(NOW + 7) == result.to_response(NOW + 7).to_json()


# --- §6.4 estimates ----------------------------------------------------------------------------


def test_estimates_match_placement(service: IndexService) -> None:
    publish(service, record(0, H1), record(0, H2), record(1, H2), record(2, II9))
    st7 = status(II7)
    st9 = status(II9, prefill_tokens_per_s=2000.0)
    for s in (st7, st9):
        run(service.put_status(Caller(), holder_id_of(s.instance), s, NOW))
    request = lookup_request(0, 1, 2, targets=(II9, II7, "https://unknown.example/"))
    answer = run(service.lookup(Caller(), request, NOW))
    found = run(service.store.lookup(COMPAT, SCOPE_A, request.block_keys, NOW))
    expected = estimate_targets(
        [[r for r, _ in f] for f in found], [st9, st7], block_tokens=16, layers=4
    )
    assert answer.estimates is not None
    assert [(e.target, e.fetch_us, e.recompute_us) for e in answer.estimates] == [
        (t, e.fetch_us, e.recompute_us) for t, e in expected.items()
    ]
    assert answer.estimates[1].recompute_us == pytest.approx(1e6 * 48 / 8000)


def test_no_estimates_without_descriptor_status_or_finite_values(service: IndexService) -> None:
    publish(service, record(0))
    unknown = IndexService(service.store, max_ttl_ms=1000, descriptors={})
    run(service.put_status(Caller(), holder_id_of(II7), status(), NOW))
    request = lookup_request(0, targets=(II7,))
    assert run(unknown.lookup(Caller(), request, NOW)).estimates is None
    assert run(service.lookup(Caller(), request, NOW + 3000)).estimates is None  # status expired
    stalled = status(epoch=2, prefill_tokens_per_s=0.0, links=())
    run(service.put_status(Caller(), holder_id_of(II7), stalled, NOW))
    assert run(service.lookup(Caller(), request, NOW)).estimates is None  # inf left out
    assert math.isinf(estimate_targets([[record(0)]], [stalled], block_tokens=16)[II7].recompute_us)


# --- §6.3 status -------------------------------------------------------------------------------


def test_status_epochs_and_permissions(service: IndexService) -> None:
    answer = run(service.put_status(Caller(), holder_id_of(II7), status(epoch=3), NOW))
    assert answer.state is InstanceState.ACTIVE
    with pytest.raises(StaleEpoch):
        run(service.put_status(Caller(), holder_id_of(II7), status(epoch=2), NOW))
    with pytest.raises(BadRequest) as caught:
        run(service.put_status(Caller(), holder_id_of(II9), status(epoch=4), NOW))
    assert caught.value.path == "$.instance"
    with pytest.raises(Forbidden):
        run(service.put_status(Caller(instances=set()), holder_id_of(II7), status(epoch=4), NOW))


def test_errors_are_kvsp_errors(service: IndexService) -> None:
    with pytest.raises(KVSPError):
        run(service.lookup(Caller(), lookup_request(*range(70_000)), NOW))
