"""§6.6 leases: quotas, expiry on an injected clock, ownership, reference counts."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterator

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsp import errors
from kvsp.leases import Lease, LeaseQuota, LeaseTable
from tests.support import REPO

K1, K2, K3 = (bytes([i]) * 32 for i in range(1, 4))
QUOTA = LeaseQuota(max_octets_per_client=1000, max_ttl_ms=10_000, max_leases_per_client=3)


def counter() -> Iterator[str]:
    return (f"lease-{i}" for i in itertools.count())


@pytest.fixture
def table() -> LeaseTable:
    ids = counter()
    return LeaseTable(QUOTA, new_id=lambda: next(ids))


def test_grant_and_expiry_at_exactly_expires_ms(table: LeaseTable) -> None:
    lease = table.grant("c", {K1: 100, K2: 200}, ttl_ms=500, now_ms=1000)
    assert lease == Lease(
        id="lease-0", client="c", keys=frozenset({K1, K2}), octets=300, expires_ms=1500
    )
    assert table.is_leased(K1, 1499)
    assert table.leased_keys(1499) == {K1, K2}
    assert table.octets_of("c", 1499) == 300
    assert not table.is_leased(K1, 1500)  # the end is exclusive
    assert table.octets_of("c", 1500) == 0
    assert table.expire(1500) == [lease]
    assert table.expire(1500) == []
    assert len(table) == 0


def test_ttl_quota(table: LeaseTable) -> None:
    table.grant("c", {K1: 1}, ttl_ms=10_000, now_ms=0)
    with pytest.raises(errors.LeaseQuota) as info:
        table.grant("c", {K1: 1}, ttl_ms=10_001, now_ms=0)
    assert info.value.status == 429
    assert info.value.problem == "kvsp-lease-quota"
    for bad in (0, -5):
        with pytest.raises(errors.BadRequest):
            table.grant("c", {K1: 1}, ttl_ms=bad, now_ms=0)


def test_octet_quota_counts_only_unexpired_leases(table: LeaseTable) -> None:
    table.grant("c", {K1: 600}, ttl_ms=100, now_ms=0)
    with pytest.raises(errors.LeaseQuota):
        table.grant("c", {K2: 401}, ttl_ms=100, now_ms=50)
    table.grant("c", {K2: 400}, ttl_ms=100, now_ms=50)  # exactly at the quota
    table.grant("other", {K2: 1000}, ttl_ms=100, now_ms=50)  # quotas are per client
    table.grant("c", {K3: 600}, ttl_ms=100, now_ms=100)  # the first one has expired
    with pytest.raises(errors.LeaseQuota):
        table.grant("x", {K1: 1001}, ttl_ms=1, now_ms=100)


def test_lease_count_quota(table: LeaseTable) -> None:
    for _ in range(3):
        table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)
    with pytest.raises(errors.LeaseQuota):
        table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)


def test_renew_moves_the_end(table: LeaseTable) -> None:
    lease = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)
    renewed = table.renew(lease.id, "c", ttl_ms=300, now_ms=90)
    assert renewed.expires_ms == 390
    assert table.is_leased(K1, 389)
    assert table.expire(389) == []  # the old deadline (100) is stale
    assert table.expire(390) == [renewed]
    other = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=400)
    with pytest.raises(errors.LeaseQuota):
        table.renew(other.id, "c", ttl_ms=10_001, now_ms=400)
    assert table.get(other.id, "c", now_ms=400) == other  # a refused renewal changes nothing


def test_renew_or_release_after_expiry_is_not_found(table: LeaseTable) -> None:
    lease = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)
    with pytest.raises(errors.NotFound):
        table.renew(lease.id, "c", ttl_ms=100, now_ms=100)
    with pytest.raises(errors.NotFound):
        table.release(lease.id, "c", now_ms=100)
    with pytest.raises(errors.NotFound):
        table.renew("never", "c", ttl_ms=100, now_ms=100)


def test_another_clients_lease_is_not_found(table: LeaseTable) -> None:
    lease = table.grant("owner", {K1: 1}, ttl_ms=100, now_ms=0)
    calls: list[Callable[[], Lease]] = [
        lambda: table.renew(lease.id, "thief", ttl_ms=50, now_ms=1),
        lambda: table.release(lease.id, "thief", now_ms=1),
        lambda: table.get(lease.id, "thief", now_ms=1),
    ]
    for call in calls:
        with pytest.raises(errors.NotFound) as info:
            call()
        assert str(info.value) == "no such lease"  # the same words as for a missing lease
    assert table.get(lease.id, "owner", now_ms=1) == lease


def test_overlapping_leases_keep_keys_until_the_last_goes(table: LeaseTable) -> None:
    a = table.grant("c", {K1: 10, K2: 10}, ttl_ms=100, now_ms=0)
    b = table.grant("d", {K2: 10, K3: 10}, ttl_ms=200, now_ms=0)
    c = table.grant("c", {K2: 10}, ttl_ms=300, now_ms=0)
    assert table.leased_keys(0) == {K1, K2, K3}
    assert table.release(a.id, "c", now_ms=10) == a
    assert table.leased_keys(10) == {K2, K3}
    assert table.leased_keys(200) == {K2}
    assert table.expire(200) == [b]
    table.release(c.id, "c", now_ms=250)
    assert table.leased_keys(250) == set()
    assert table.leases_of("c", 250) == []


def test_time_never_runs_backward(table: LeaseTable) -> None:
    lease = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=1000)
    assert not table.is_leased(K1, 1100)
    assert not table.is_leased(K1, 1050)  # once expired, always expired
    assert table.expire(0) == [lease]
    later = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)  # "now" is 1100
    assert later.expires_ms == 1200


def test_bad_grants(table: LeaseTable) -> None:
    with pytest.raises(errors.BadRequest):
        table.grant("c", {}, ttl_ms=100, now_ms=0)
    with pytest.raises(errors.BadRequest):
        table.grant("c", {K1: -1}, ttl_ms=100, now_ms=0)


def test_repeated_id_is_refused() -> None:
    table = LeaseTable(QUOTA, new_id=lambda: "same")
    table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)
    with pytest.raises(RuntimeError):
        table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)


def test_default_ids_are_random_hex() -> None:
    table = LeaseTable(QUOTA)
    a = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)
    b = table.grant("c", {K1: 1}, ttl_ms=100, now_ms=0)
    assert a.id != b.id
    assert len(a.id) == 32
    int(a.id, 16)


@pytest.mark.parametrize("field", ["max_octets_per_client", "max_ttl_ms", "max_leases_per_client"])
def test_quota_config_is_checked(field: str) -> None:
    values = {"max_octets_per_client": 1, "max_ttl_ms": 1, "max_leases_per_client": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        LeaseQuota(**values)


def test_module_is_sans_io() -> None:
    source = REPO / "kvsp" / "leases.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"asyncio", "starlette", "httpx", "aiohttp", "time", "socket"})


class LeaseModel(RuleBasedStateMachine):
    """The table against a brute-force model: a list of (id, client, keys, octets, end)."""

    def __init__(self) -> None:
        super().__init__()
        ids = counter()
        self.quota = LeaseQuota(max_octets_per_client=50, max_ttl_ms=40, max_leases_per_client=4)
        self.table = LeaseTable(self.quota, new_id=lambda: next(ids))
        self.now = 0
        self.model: dict[str, Lease] = {}
        self.expired_seen: set[str] = set()

    def live(self) -> list[Lease]:
        return [x for x in self.model.values() if self.now < x.expires_ms]

    @rule(
        client=st.sampled_from(["a", "b"]),
        sizes=st.dictionaries(st.sampled_from([K1, K2, K3]), st.integers(0, 30), max_size=3),
        ttl=st.integers(-1, 45),
    )
    def grant(self, client: str, sizes: dict[bytes, int], ttl: int) -> None:
        mine = [x for x in self.live() if x.client == client]
        octets = sum(sizes.values())
        if ttl <= 0 or not sizes:
            expected: type[Exception] | None = errors.BadRequest
        elif ttl > 40 or sum(x.octets for x in mine) + octets > 50 or len(mine) >= 4:
            expected = errors.LeaseQuota
        else:
            expected = None
        if expected is not None:
            with pytest.raises(expected):
                self.table.grant(client, sizes, ttl, self.now)
            return
        lease = self.table.grant(client, sizes, ttl, self.now)
        assert lease.expires_ms == self.now + ttl
        self.model[lease.id] = lease

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), client=st.sampled_from(["a", "b"]), ttl=st.integers(1, 45))
    def renew(self, data: st.DataObject, client: str, ttl: int) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.model)))
        old = self.model[lease_id]
        if old.client != client or self.now >= old.expires_ms:
            with pytest.raises(errors.NotFound):
                self.table.renew(lease_id, client, ttl, self.now)
        elif ttl > 40:
            with pytest.raises(errors.LeaseQuota):
                self.table.renew(lease_id, client, ttl, self.now)
        else:
            renewed = self.table.renew(lease_id, client, ttl, self.now)
            assert renewed.expires_ms == self.now + ttl
            self.model[lease_id] = renewed

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), client=st.sampled_from(["a", "b"]))
    def release(self, data: st.DataObject, client: str) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.model)))
        old = self.model[lease_id]
        if old.client != client or self.now >= old.expires_ms:
            with pytest.raises(errors.NotFound):
                self.table.release(lease_id, client, self.now)
        else:
            assert self.table.release(lease_id, client, self.now) == old
            del self.model[lease_id]

    @rule(ms=st.integers(0, 30))
    def advance(self, ms: int) -> None:
        self.now += ms

    @rule()
    def expire(self) -> None:
        gone = self.table.expire(self.now)
        expected = {i for i, x in self.model.items() if self.now >= x.expires_ms}
        assert {x.id for x in gone} == expected - self.expired_seen
        self.expired_seen |= expected
        for lease_id in expected:
            del self.model[lease_id]

    @invariant()
    def agrees_with_model(self) -> None:
        live = self.live()
        for key in (K1, K2, K3):
            assert self.table.is_leased(key, self.now) == any(key in x.keys for x in live)
        assert self.table.leased_keys(self.now) == {k for x in live for k in x.keys}
        for client in ("a", "b"):
            mine = [x for x in live if x.client == client]
            assert self.table.octets_of(client, self.now) == sum(x.octets for x in mine)
            assert {x.id for x in self.table.leases_of(client, self.now)} == {x.id for x in mine}
        assert len(self.table) == len(live)


TestLeaseModel = LeaseModel.TestCase
