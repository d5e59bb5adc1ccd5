"""A real holder publishing at a real Index Service (``kvsp serve index`` and ``kvsp serve
holder`` as processes on 127.0.0.1): publish, retrieve by layer range, evict with withdrawal,
never evict a leased block nor let leases pin the whole tier, withdraw on shutdown (§6.1, §6.6,
§6.7)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvsp.container import decode_container
from kvsp.records import LookupRequest, LookupResponse
from kvsp.services.index.client import IndexClient
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.tiny_holder import COMPAT, DESCRIPTOR, SCOPE, SIZE, container, key

SERVICE_TOKEN = "service-token-0123456789abcdefghijklmn"
CLIENT_TOKEN = "client-token-0123456789abcdefghijklmno"
CLIENT = {"authorization": f"Bearer {CLIENT_TOKEN}"}


@dataclass
class Services:
    index: RunningService
    holder: RunningService
    http: httpx.Client

    def block_url(self, n: int) -> str:
        return f"{self.holder.base_url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key(n).hex()}"

    def put(self, n: int) -> httpx.Response:
        headers = CLIENT | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        return self.http.put(self.block_url(n), content=container(n), headers=headers)

    def lease(self, *ns: int) -> httpx.Response:
        body = {
            "compat_id": COMPAT.hex(),
            "scope_id": SCOPE.hex(),
            "block_keys": [key(n).hex() for n in ns],
            "ttl_ms": 60_000,
        }
        return self.http.post(f"{self.holder.base_url}leases", json=body, headers=CLIENT)

    def lookup(self, n: int) -> LookupResponse:
        request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(key(n),))

        async def ask() -> LookupResponse:
            async with IndexClient(self.index.base_url, CLIENT_TOKEN) as client:
                return await client.lookup(request)

        return asyncio.run(ask())


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    principals = tmp_path / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("service", SERVICE_TOKEN, ["admin"], None),
            principal_entry("client", CLIENT_TOKEN, ["client", "instance"], [SCOPE]),
        ],
    )
    token_file = tmp_path / "holder.token"
    token_file.write_text(SERVICE_TOKEN + "\n")
    kvsp = [sys.executable, "-m", "kvsp", "serve"]
    common = ["--listen", "127.0.0.1:0", "--principals", str(principals)]
    folders = [tmp_path / name for name in ("index", "holder")]
    for folder in folders:
        folder.mkdir()
    index = start_process(
        [*kvsp, "index", *common, "--state", str(folders[0] / "state")], workdir=folders[0]
    )
    try:
        holder_argv = [
            *kvsp,
            "holder",
            *common,
            "--state",
            str(folders[1] / "state"),
            "--index",
            index.base_url,
            "--index-token-file",
            str(token_file),
            "--tier",
            f"host={2 * SIZE}",
            "--lease-max-octets",
            str(SIZE),
        ]
        holder = start_process(holder_argv, workdir=folders[1])
        try:
            with httpx.Client(timeout=10) as http:
                yield Services(index, holder, http)
        finally:
            holder.stop()
    finally:
        index.stop()


def test_publish_retrieve_evict_and_withdraw(services: Services) -> None:
    descriptor_url = f"{services.holder.base_url}descriptors/{COMPAT.hex()}"
    created = services.http.put(descriptor_url, json=DESCRIPTOR.to_json(), headers=CLIENT)
    assert created.status_code == 201, created.text
    assert services.put(1).status_code == 201

    found = services.lookup(1)
    assert found.matched == 1 and found.replicas is not None
    (record,) = found.replicas[0]
    assert record.holder == services.holder.base_url
    assert record.layer_digests == tuple(decode_container(container(1)).layer_digests())

    got = services.http.get(services.block_url(1) + "?layers=1-2", headers=CLIENT)
    expected = decode_container(container(1)).select(1, 2).encode()
    assert got.status_code == 200 and got.content == expected
    sha = base64.b64encode(hashlib.sha256(expected).digest()).decode()
    assert got.headers["repr-digest"] == f"sha-256=:{sha}:"

    # The host tier holds two blocks: leasing 1 makes 2 the only victim for block 3.
    assert services.put(2).status_code == 201
    assert services.lease(1).status_code == 201
    assert services.put(3).status_code == 201
    assert services.lookup(2).matched == 0  # withdrawn when evicted
    assert services.http.get(services.block_url(2), headers=CLIENT).status_code == 404
    assert services.lookup(1).matched == 1 and services.lookup(3).matched == 1

    # Leases stop at half the capacity: 3 cannot be leased too, so a store still finds room.
    refused = services.lease(3)
    assert refused.status_code == 429
    assert refused.json()["type"] == "urn:ietf:params:kvsp:problem:kvsp-lease-quota"
    assert services.put(4).status_code == 201  # evicts 3
    assert services.lookup(3).matched == 0
    assert services.lookup(1).matched == 1 and services.lookup(4).matched == 1
    assert services.http.get(services.block_url(1), headers=CLIENT).content == container(1)

    # A clean shutdown withdraws every record.
    assert services.holder.stop() == 0
    assert services.lookup(1).matched == 0 and services.lookup(4).matched == 0
