"""KVSP end to end through the relay, every part a real process on 127.0.0.1
(DESIGN.md §1, §4; spec §4.4, §6.1, §6.2, §6.6, §6.7).

``kvsp serve control`` (IS and PC), ``kvsp serve relay --index`` (a caching relay that is a
KVSP holder) and ``kvsp serve instance --relay`` (toy engine, 10 layers). The instance computes
a prompt's blocks and publishes them: its own HTTP records at the IS, and each block as its
stored MOQT track into the relay, which caches it and publishes its own Replica Record
(``moqt://`` holder, ``moqt_namespace``, ``lease_base``). The instance is then killed
(SIGKILL: no goodbye). A reader finds the relay's replica by an IS lookup, takes a lease on the
relay's lease base, FETCHes layers 3..7 with :class:`MoqtBlockClient`, every layer verified
against ``layer_digests``; the octets equal what the instance computed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.container import Geometry, decode_container
from kvsp.engine.toy import toy_descriptor
from kvsp.errors import Forbidden
from kvsp.ids import ScopeId
from kvsp.keys import block_keys, scope_id
from kvsp.moqt_mapping import decode_moqt_namespace
from kvsp.records import LeaseRequest, LookupRequest, ReplicaRecord
from kvsp.services.index.client import IndexClient
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService
from tests.support.polling import eventually
from tests.support.services import Services

pytestmark = pytest.mark.timeout(120)
ADMIN = "e2e-admin-token-0123456789abcdef0123"
READER = "e2e-reader-token-0123456789abcdef012"
OUTSIDER = "e2e-outsider-token-0123456789abcdef0"
SCOPE_KEY = bytes(range(100, 140))
SCOPE = ScopeId(scope_id(SCOPE_KEY))
DESCRIPTOR = toy_descriptor(layers=10, block_tokens=16)
COMPAT = compat_id(DESCRIPTOR)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
PROMPT = [(31 * i + 7) % 50_000 for i in range(3 * 16 + 5)]  # three complete blocks


async def lookup(control: str, token: str, keys: list[bytes]) -> list[tuple[ReplicaRecord, ...]]:
    request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=tuple(keys))
    async with IndexClient(control, token) as index:
        answer = await index.lookup(request)
    return list(answer.replicas or ())


def relay_records(control: str, keys: list[bytes], relay_url: str) -> list[ReplicaRecord] | None:
    """The relay's record of every key, once the IS has them all."""
    found = asyncio.run(lookup(control, READER, keys))
    mine = [[r for r in records if r.holder == relay_url] for records in found]
    if len(mine) != len(keys) or not all(mine):
        return None
    return [records[0] for records in mine]


def test_a_block_published_into_the_relay_outlives_its_publisher(tmp_path: Path) -> None:
    principals = tmp_path / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("admin", ADMIN, ["admin"], None),
            principal_entry("reader", READER, ["client"], [SCOPE]),
            principal_entry("outsider", OUTSIDER, ["client"], [ScopeId(b"\x01" * 16)]),
        ],
    )
    (tmp_path / "admin.token").write_text(ADMIN)
    (tmp_path / "scope.key").write_text(SCOPE_KEY.hex())
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    services = Services(tmp_path, principals)
    start = services.start

    try:
        control = start("control", "control")
        relay = start(
            "relay",
            *("relay", "--index", control.base_url),
            *("--token-file", str(tmp_path / "admin.token")),
        )
        faces = json.loads(relay.base_url)
        relay_cert = tmp_path / "relay" / "state" / "relay-tls" / "cert.pem"
        instance = start(
            "instance",
            *("instance", "--control", control.base_url),
            *("--token-file", str(tmp_path / "admin.token")),
            *("--descriptor", str(tmp_path / "descriptor.json")),
            *("--scope-key-file", str(tmp_path / "scope.key")),
            *("--relay", faces["moqt"], "--relay-cafile", str(relay_cert)),
        )
        asyncio.run(scenario(control, instance, faces, relay_cert))
    finally:
        services.stop_all()


async def scenario(
    control: RunningService, instance: RunningService, faces: dict[str, str], cert: Path
) -> None:
    keys = block_keys(SCOPE_KEY, COMPAT, PROMPT, DESCRIPTOR.block_tokens)
    assert len(keys) == 3
    auth = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(timeout=30, headers=auth) as http:
        answer = await http.post(
            f"{instance.base_url}generate", json={"prompt": PROMPT, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["kvsp-computed-blocks"] == "3"
    # what the instance computed, as its own holder face serves it (verified)
    originals = []
    async with BlockClient(ADMIN) as blocks:
        for records in await lookup(control.base_url, ADMIN, keys):
            own = [r for r in records if r.holder == instance.base_url]
            assert own, records
            block = await blocks.get_block(instance.base_url, own[0], geometry=GEOMETRY)
            originals.append((own[0], decode_container(block.encode())))
    found = await asyncio.to_thread(
        eventually, lambda: relay_records(control.base_url, keys, faces["moqt"])
    )
    instance.proc.kill()  # the publisher is gone without a word
    instance.proc.wait(10)

    for record, (own, original) in zip(found, originals, strict=True):
        # the relay's own record of the same bytes, a moqt:// holder with a lease base
        assert record.digest == own.digest and record.layer_digests == own.layer_digests
        assert record.lease_base == faces["http"]
        fields = decode_moqt_namespace(record.to_json()["moqt_namespace"])
        assert fields == (
            b"kvsp",
            b"1",
            COMPAT.hex().encode(),
            SCOPE.hex().encode(),
            record.block_key.hex().encode(),
        )
        assert original.layer_count == DESCRIPTOR.layers == 10

    record, (_, original) = found[1], originals[1]
    request = LeaseRequest(
        compat_id=COMPAT, scope_id=SCOPE, block_keys=(record.block_key,), ttl_ms=20_000
    )
    async with (
        BlockClient(READER) as http_face,
        MoqtBlockClient(cafile=str(cert), auth_token=READER, timeout=15) as moqt,
    ):
        assert record.lease_base is not None
        grant = await http_face.acquire_lease(record.lease_base, request)
        stream = moqt.stream_block(record, layers=(3, 7), geometry=GEOMETRY)
        streamed = [layer.index async for layer in stream]
        block = await stream.block()
        assert streamed == [3, 4, 5, 6, 7]  # handed out one by one, each once verified
        assert (block.first_layer, block.layer_count) == (3, 5)
        for layer in block.layers:
            assert layer.index in range(3, 8)
            want = original.layers[layer.index]
            assert bytes(layer.k) == bytes(want.k) and bytes(layer.v) == bytes(want.v)
            digest = hashlib.sha256(bytes(layer.k) + bytes(layer.v)).digest()
            assert digest == record.layer_digests[layer.index]
        await http_face.release_lease(record.lease_base, grant.lease)

    # a principal without the scope gets nothing from the relay, cached or not
    async with MoqtBlockClient(cafile=str(cert), auth_token=OUTSIDER, timeout=15) as outsider:
        with pytest.raises(Forbidden):
            await outsider.get_block(record, layers=(3, 7), geometry=GEOMETRY)
