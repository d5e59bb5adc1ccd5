"""The relay as a KVSP holder against a real ``kvsp serve index`` process: Replica Records with a
moqt:// holder, withdrawal before eviction, leases on its HTTP face; and ``relay.app`` as a
process (ready file, healthz, records withdrawn on SIGTERM)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.container import header_size
from kvsp.ids import BlockKey, ScopeId
from kvsp.moqt_mapping import decode_moqt_namespace
from kvsp.records import LookupRequest, ReplicaRecord
from kvsp.registries import Tier
from kvsp.services.index.client import IndexClient
from kvsp.web.auth import Principals, principal_entry, write_principals
from kvsp.web.clock import SystemClock
from kvsp.web.testing import RunningService, start_process
from moqt.certs import make_self_signed
from relay.holder import HolderConfig, RelayHolder
from relay.relay import Relay
from relay.web import HttpFace, create_app
from tests.support.polling import until
from tests.support.relay_kit import (
    COMPAT,
    SCOPE_A,
    Block,
    Certs,
    block_track,
    client,
    fetch_all,
    make_block,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(90)
PRINCIPALS = {
    # name: (roles, scopes)
    "relay": (["admin"], None),
    "pub": (["instance"], [SCOPE_A]),
    "reader": (["client"], [SCOPE_A]),
}
TRACK_CHARGE = 4 * (1024 + 64)  # a 4-layer block of 1 KiB layers in the relay's budget


def token(name: str) -> str:
    return f"holder-token-{name}-0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


@pytest.fixture(scope="module")
def principals_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("principals") / "principals.toml"
    entries = [principal_entry(n, token(n), r, s) for n, (r, s) in PRINCIPALS.items()]
    write_principals(path, entries)
    return path


@pytest.fixture(scope="module")
def index(
    tmp_path_factory: pytest.TempPathFactory, principals_file: Path
) -> Iterator[RunningService]:
    folder = tmp_path_factory.mktemp("index")
    argv = [
        sys.executable,
        *("-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0"),
        *("--state", str(folder / "state"), "--principals", str(principals_file)),
    ]
    with start_process(argv, workdir=folder) as running:
        yield running


async def lookup(index: RunningService, block: Block) -> tuple[ReplicaRecord, ...]:
    request = LookupRequest(
        scope_id=ScopeId(block.scope), compat_id=COMPAT, block_keys=(BlockKey(block.key),)
    )
    async with IndexClient(index.base_url, token("reader")) as reader:
        answer = await reader.lookup(request)
    return () if answer.matched == 0 or answer.replicas is None else answer.replicas[0]


class RecordingIndex:
    """The IS client, noting for each withdrawal whether the track was still cached."""

    def __init__(self, inner: IndexClient) -> None:
        self.inner = inner
        self.relay: Relay | None = None
        self.withdrawn: list[tuple[bytes, bool]] = []

    async def publish(self, record: ReplicaRecord, /) -> int:
        return await self.inner.publish(record)

    async def withdraw(self, compat: bytes, scope: bytes, key: bytes, holder: str, /) -> bool:
        cached = self.relay is not None and any(
            k[0][4] == key.hex().encode()
            for k in self.relay.cache.keys()  # noqa: SIM118 - a list copy
        )
        self.withdrawn.append((key, cached))
        return await self.inner.withdraw(compat, scope, key, holder)


def test_records_eviction_and_leases(
    certs: Certs, principals_file: Path, index: RunningService
) -> None:
    blocks = [make_block(40 + i) for i in range(4)]
    tracks = {k: v for b in blocks for k, v in block_track(b).items()}
    principals = Principals.load(principals_file)

    async def scenario() -> None:
        async with IndexClient(index.base_url, token("relay")) as inner:
            recorder = RecordingIndex(inner)
            clock = SystemClock()
            holder = RelayHolder(HolderConfig(record_ttl_ms=30_000), clock, recorder)
            face = HttpFace(create_app(holder, principals, clock), "127.0.0.1", 0)
            holder.lease_base = face.url
            await face.start()
            config = relay_config(certs, principals=principals, cache_bytes=2 * TRACK_CHARGE + 100)
            try:
                async with running_relay(config, holder=holder) as relay:
                    recorder.relay = relay
                    await steps(relay, face.url, recorder)
            finally:
                await face.stop()

    async def steps(relay: Relay, face_url: str, recorder: RecordingIndex) -> None:
        first, second, third, fourth = blocks
        async with (
            publishing(relay.url, certs, tracks, [first.namespace[:4]], token=token("pub")),
            client(relay.url, certs, token=token("reader")) as reader,
        ):
            await fetch_all(reader, first.track, 4)
            records = await until(lambda: lookup(index, first), what="the first block's record")
            check_record(records, first, relay.url, face_url)

            await fetch_all(reader, second.track, 4)
            await fetch_all(reader, third.track, 4)  # over budget: the LRU block goes
            await until(lambda: _missing(lookup(index, first)), what="the first block withdrawn")
            assert first.track not in relay.cache
            assert recorder.withdrawn == [(first.key, True)]  # withdrawn while still cached
            await until(lambda: lookup(index, third), what="the third block's record")

            headers = {"authorization": f"Bearer {token('reader')}"}
            body = {
                "compat_id": COMPAT.hex(),
                "scope_id": SCOPE_A.hex(),
                "block_keys": [second.key.hex()],
                "ttl_ms": 20_000,
            }
            async with httpx.AsyncClient(base_url=face_url, headers=headers) as http:
                granted = await http.post("leases", json=body)
                assert granted.status_code == 201, granted.text
                lease = granted.json()["lease"]
                missing = await http.post("leases", json={**body, "block_keys": [first.key.hex()]})
                assert missing.status_code == 404
                await fetch_all(reader, fourth.track, 4)  # over budget: the leased LRU stays
                await until(lambda: third.track not in relay.cache)
                assert second.track in relay.cache and third.track not in relay.cache
                assert await lookup(index, second)
                renewed = await http.put(f"leases/{lease}", json={"ttl_ms": 10_000})
                assert renewed.status_code == 200 and renewed.json()["lease"] == lease
                assert (await http.delete(f"leases/{lease}")).status_code == 204
                assert (await http.get("healthz")).json() == {"status": "ok"}

    run(scenario(), timeout=60)


async def _missing(found: Any) -> bool:
    return not await found


def check_record(records: tuple[ReplicaRecord, ...], block: Block, url: str, face: str) -> None:
    assert len(records) == 1
    record = records[0]
    assert record.holder == url and url.startswith("moqt://127.0.0.1:")
    assert record.moqt_namespace is not None
    fields = decode_moqt_namespace(record.to_json()["moqt_namespace"])
    assert fields == block.namespace
    assert record.digest.hex().encode() == block.name
    assert record.layer_digests == block.digests
    assert record.size == header_size(4) + sum(len(layer) for layer in block.layers)
    assert record.codec == 1
    assert [(r.tier, r.first, r.last) for r in record.residency or ()] == [(Tier.HOST, 0, 3)]
    assert record.lease_base == face
    assert 0 < record.ttl_ms <= 30_000
    assert record.verify_layer_digests()


def test_the_relay_process(
    certs: Certs, principals_file: Path, index: RunningService, tmp_path: Path
) -> None:
    block = make_block(50)
    token_file = tmp_path / "relay.token"
    token_file.write_text(token("relay") + "\n")
    argv = [
        sys.executable,
        *("-m", "relay.app", "--listen", "127.0.0.1:0", "--state", str(tmp_path / "state")),
        *("--principals", str(principals_file), "--index", index.base_url),
        *("--token-file", str(token_file), "--record-ttl-ms", "30000"),
    ]
    service = start_process(argv, workdir=tmp_path)
    try:
        ready = json.loads(service.base_url)
        assert set(ready) == {"moqt", "http", "carriers"}
        assert ready["moqt"].startswith("moqt://127.0.0.1:")
        [tls] = ready["carriers"]  # QMux over TLS is on by default, on the --listen host
        assert tls.startswith("moqt+tls://127.0.0.1:")
        assert ready["http"].startswith("http://127.0.0.1:")
        assert httpx.get(ready["http"] + "healthz").json() == {"status": "ok"}
        pinned = (tmp_path / "state" / "relay-tls" / "cert.pem", certs[1])

        async def scenario() -> None:
            async with (
                publishing(
                    ready["moqt"], pinned, block_track(block), [block.namespace], token=token("pub")
                ),
                client(ready["moqt"], pinned, token=token("reader")) as reader,
            ):
                objects = await fetch_all(reader, block.track, 4)
                assert [bytes(o.payload) for o in objects] == list(block.layers)
            records = await until(lambda: lookup(index, block), what="the block's record")
            check_record(records, block, ready["moqt"], ready["http"])

        run(scenario())
    finally:
        status = service.stop()
    assert status == 0, service.output()
    assert run(lookup(index, block)) == ()
