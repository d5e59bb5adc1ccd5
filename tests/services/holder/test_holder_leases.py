"""Leases never starve other principals (§6.6): a real holder (``kvsp serve holder``) whose
clients lease everything they can still stores another principal's block, and the per-client
quota defaults to a share of the holder's capacity."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvsp.errors import LeaseQuota as LeaseQuotaExceeded
from kvsp.leases import LeaseQuota, LeaseTable, capacity_quota
from kvsp.registries import Tier
from kvsp.services.holder import Holder, HolderConfig
from kvsp.services.holder.app import configure_parser, holder_config
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.cliargs import add_common_arguments
from kvsp.web.clock import ManualClock
from kvsp.web.testing import RunningService, start_process
from relay.holder import HolderConfig as RelayHolderConfig
from relay.holder import RelayHolder
from tests.support.tiny_holder import COMPAT, DESCRIPTOR, SCOPE, SIZE, container, key

ADMIN_TOKEN = "admin-token-0123456789abcdefghijklmnop"
GREEDY = [f"greedy{i}-token-0123456789abcdefghijklmn" for i in range(3)]
OTHER_TOKEN = "other-token-0123456789abcdefghijklmnop"
LEASE_QUOTA = "urn:ietf:params:kvsp:problem:kvsp-lease-quota"


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[RunningService]:
    principals = tmp_path / "principals.toml"
    entries = [principal_entry("admin", ADMIN_TOKEN, ["admin"], None)]
    for i, token in enumerate(GREEDY):
        entries.append(principal_entry(f"greedy{i}", token, ["client", "instance"], [SCOPE]))
    entries.append(principal_entry("other", OTHER_TOKEN, ["client", "instance"], [SCOPE]))
    write_principals(principals, entries)
    argv = [
        sys.executable,
        "-m",
        "kvsp",
        "serve",
        "holder",
        "--listen",
        "127.0.0.1:0",
        "--principals",
        str(principals),
        "--state",
        str(tmp_path / "state"),
        "--tier",
        f"host={4 * SIZE}",  # no --lease-max-octets: the default quota
    ]
    service = start_process(argv, workdir=tmp_path)
    try:
        yield service
    finally:
        service.stop()


def test_clients_leasing_all_they_can_leave_room_for_another_principals_put(
    holder: RunningService,
) -> None:
    base = holder.base_url
    with httpx.Client(timeout=10) as http:

        def put(n: int, token: str) -> httpx.Response:
            url = f"{base}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key(n).hex()}"
            headers = auth(token) | {"if-none-match": "*", "content-type": "application/kvsp-block"}
            return http.put(url, content=container(n), headers=headers)

        def lease(n: int, token: str) -> httpx.Response:
            body = {
                "compat_id": COMPAT.hex(),
                "scope_id": SCOPE.hex(),
                "block_keys": [key(n).hex()],
                "ttl_ms": 60_000,
            }
            return http.post(f"{base}leases", json=body, headers=auth(token))

        created = http.put(
            f"{base}descriptors/{COMPAT.hex()}",
            json=DESCRIPTOR.to_json(),
            headers=auth(ADMIN_TOKEN),
        )
        assert created.status_code == 201, created.text
        for n in range(1, 5):  # the host tier is full
            assert put(n, GREEDY[0]).status_code == 201

        leased: list[int] = []
        for token in GREEDY:  # every greedy client tries to lease every block
            for n in range(1, 5):
                response = lease(n, token)
                if response.status_code == 201:
                    leased.append(n)
                else:
                    assert response.status_code == 429, response.text
                    assert response.json()["type"] == LEASE_QUOTA
        for n in (5, 6):  # another principal still stores, evicting unleased blocks
            stored = put(n, OTHER_TOKEN)
            assert stored.status_code == 201, stored.text
        assert leased  # leases are granted, up to half the capacity in all
        assert len(leased) * SIZE <= 2 * SIZE
        for n in leased:  # and the leased blocks stay (§6.6)
            url = f"{base}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key(n).hex()}"
            assert http.get(url, headers=auth(OTHER_TOKEN)).status_code == 200


def parse(state: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser, 8471)
    configure_parser(parser)
    return parser.parse_args(["--state", str(state), *argv])


def holder_of(config: HolderConfig) -> Holder:
    return Holder(config, index=None, descriptors=DescriptorRegistry(), clock=ManualClock(0))


def test_the_default_quota_is_a_quarter_of_the_capacity_and_all_leases_half(
    tmp_path: Path,
) -> None:
    config = holder_config(parse(tmp_path, "--tier", "host=8MiB", "--tier", "disk=24MiB"))
    quota = holder_of(config).leases.quota
    assert quota.max_octets_per_client == 8 << 20  # a quarter of 32 MiB
    assert quota.max_octets_total == 16 << 20  # half of it, for all clients together
    assert holder_of(HolderConfig()).leases.quota.max_octets_per_client == 1 << 28  # 1 GiB / 4


def test_a_configured_quota_is_still_bounded_by_half_the_capacity(tmp_path: Path) -> None:
    config = holder_config(parse(tmp_path, "--tier", "host=1MiB", "--lease-max-octets", "1GiB"))
    quota = holder_of(config).leases.quota
    assert quota.max_octets_total == 512 << 10
    assert quota.max_octets_per_client == 512 << 10
    explicit = HolderConfig(
        tiers={Tier.HOST: 100},
        lease_quota=LeaseQuota(
            max_octets_per_client=10, max_ttl_ms=5, max_leases_per_client=2, max_octets_total=20
        ),
    )
    assert holder_of(explicit).leases.quota.max_octets_total == 20  # lower than half: kept


def test_the_holder_wide_bound_counts_every_client() -> None:
    table = LeaseTable(capacity_quota(100, max_ttl_ms=1_000, max_leases_per_client=8))
    table.grant("a", {b"k1": 25}, ttl_ms=100, now_ms=0)
    table.grant("b", {b"k2": 25}, ttl_ms=100, now_ms=0)
    assert table.total_octets(0) == 50
    with pytest.raises(LeaseQuotaExceeded, match="all clients together"):
        table.grant("c", {b"k3": 1}, ttl_ms=100, now_ms=0)
    table.expire(100)
    assert table.total_octets(100) == 0
    table.grant("c", {b"k3": 25}, ttl_ms=100, now_ms=100)  # room again once leases end


def test_a_relay_given_its_cache_budget_bounds_leases_the_same_way() -> None:
    quota = LeaseQuota(max_octets_per_client=1 << 30, max_ttl_ms=1_000, max_leases_per_client=8)
    config = RelayHolderConfig(lease_quota=quota, capacity=1 << 30)
    bounded = RelayHolder(config, ManualClock(0)).leases.quota
    assert bounded.max_octets_total == 1 << 29 and bounded.max_octets_per_client == 1 << 29
