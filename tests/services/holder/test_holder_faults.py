"""Storage faults at a real holder (``kvsp serve holder`` with a disk tier, publishing at a real
``kvsp serve index``): a block file that is missing, empty, truncated or corrupt is a miss
(404, never 500 or 400), its record is withdrawn at the IS at once, its files are deleted, and
the fault is counted in ``kvsp_block_faults_total`` (§6.1, §6.6, §6.7). Over MOQT, the same
fault ends the FETCH as a missing track and retires the block."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, decode_container, encode_container
from kvsp.errors import KVSPError, NotFound
from kvsp.moqt_mapping import encode_moqt_namespace, kv_namespace
from kvsp.records import LookupRequest, LookupResponse, ReplicaRecord
from kvsp.registries import Tier
from kvsp.services.holder import Holder, HolderConfig
from kvsp.services.index.client import IndexClient
from kvsp.stores.blocks import BlockRef
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import serve_blocks
from kvsp.transfer.relay_link import HolderBlocks
from kvsp.web.auth import Principal, principal_entry, write_principals
from kvsp.web.clock import SystemClock
from kvsp.web.testing import RunningService, start_process
from moqt.backend import get_backend
from moqt.certs import make_self_signed
from tests.support.polling import eventually, until
from tests.support.tiny_holder import COMPAT, DESCRIPTOR, GEOMETRY, SCOPE, SIZE, container, key

SERVICE_TOKEN = "service-token-0123456789abcdefghijklmn"
CLIENT_TOKEN = "client-token-0123456789abcdefghijklmno"
METRICS_TOKEN = "metrics-token-0123456789abcdefghijklmn"
CLIENT = {"authorization": f"Bearer {CLIENT_TOKEN}"}
SERVICE = {"authorization": f"Bearer {SERVICE_TOKEN}"}
METRICS = {"authorization": f"Bearer {METRICS_TOKEN}"}
NOT_FOUND = "urn:ietf:params:kvsp:problem:kvsp-not-found"


def remove(path: Path) -> None:
    path.unlink()


def empty(path: Path) -> None:
    path.write_bytes(b"")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: SIZE // 2])


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[SIZE // 2] ^= 0xFF  # same length, another digest
    path.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "missing": remove,
    "empty": empty,
    "truncated": truncate,
    "corrupt": corrupt,
}


def block_file(blocks: Path, n: int, suffix: str = ".kvb") -> Path:
    return blocks / COMPAT.hex() / SCOPE.hex() / f"{key(n).hex()}{suffix}"


@dataclass
class Cluster:
    index: RunningService
    holder: RunningService
    blocks: Path
    http: httpx.Client

    def block_url(self, n: int) -> str:
        return f"{self.holder.base_url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key(n).hex()}"

    def put(self, n: int) -> httpx.Response:
        headers = CLIENT | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        return self.http.put(self.block_url(n), content=container(n), headers=headers)

    def lookup(self, n: int) -> LookupResponse:
        request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(key(n),))

        async def ask() -> LookupResponse:
            async with IndexClient(self.index.base_url, CLIENT_TOKEN) as client:
                return await client.lookup(request)

        return asyncio.run(ask())

    def metric(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The samples of ``name`` by their sorted labels."""
        response = self.http.get(f"{self.holder.base_url}metrics", headers=METRICS)
        assert response.status_code == 200, response.text
        return {
            tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
            if sample.name == name
        }

    def faults(self, kind: str) -> float:
        return self.metric("kvsp_block_faults_total").get(
            (("kind", kind), ("service", "holder")), 0.0
        )

    def server_errors(self) -> list[tuple[tuple[str, str], ...]]:
        samples = self.metric("kvsp_http_requests_total")
        return [labels for labels, value in samples.items() if dict(labels)["status"][0] == "5"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("faults")
    principals = tmp / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("service", SERVICE_TOKEN, ["admin"], None),
            principal_entry("client", CLIENT_TOKEN, ["client", "instance"], [SCOPE]),
            principal_entry("scraper", METRICS_TOKEN, ["metrics"], []),
        ],
    )
    token_file = tmp / "holder.token"
    token_file.write_text(SERVICE_TOKEN + "\n")
    kvsp = [sys.executable, "-m", "kvsp", "serve"]
    common = ["--listen", "127.0.0.1:0", "--principals", str(principals)]
    folders = [tmp / name for name in ("index", "holder")]
    for folder in folders:
        folder.mkdir()
    index = start_process(
        [*kvsp, "index", *common, "--state", str(folders[0] / "state")], workdir=folders[0]
    )
    try:
        state = folders[1] / "state"
        holder_argv = [
            *kvsp,
            "holder",
            *common,
            "--state",
            str(state),
            "--index",
            index.base_url,
            "--index-token-file",
            str(token_file),
            "--tier",
            f"disk={64 * SIZE}",
        ]
        holder = start_process(holder_argv, workdir=folders[1])
        try:
            with httpx.Client(timeout=10) as http:
                url = f"{holder.base_url}descriptors/{COMPAT.hex()}"
                created = http.put(url, json=DESCRIPTOR.to_json(), headers=SERVICE)
                assert created.status_code == 201, created.text
                yield Cluster(index, holder, state / "blocks", http)
        finally:
            holder.stop()
    finally:
        index.stop()


CASES = [(kind, read) for kind in DAMAGE for read in ("whole", "layers")]


@pytest.mark.parametrize(("kind", "read"), CASES)
def test_a_faulty_block_file_is_a_miss_and_is_withdrawn(
    cluster: Cluster, kind: str, read: str
) -> None:
    n = 1 + CASES.index((kind, read))
    assert cluster.put(n).status_code == 201
    assert cluster.lookup(n).matched == 1
    data, sidecar = block_file(cluster.blocks, n), block_file(cluster.blocks, n, ".json")
    assert data.exists() and sidecar.exists()
    before = cluster.faults(kind)

    DAMAGE[kind](data)
    query = "" if read == "whole" else "?layers=1-2"
    got = cluster.http.get(cluster.block_url(n) + query, headers=CLIENT)

    assert got.status_code == 404, got.text
    assert got.headers["content-type"] == "application/problem+json"
    assert got.json()["type"] == NOT_FOUND
    eventually(lambda: cluster.lookup(n).matched == 0, what="the record withdrawn at the IS")
    assert not data.exists() and not sidecar.exists()
    assert cluster.faults(kind) == before + 1
    again = cluster.http.get(cluster.block_url(n), headers=CLIENT)
    assert again.status_code == 404 and cluster.faults(kind) == before + 1  # gone, not re-read
    assert cluster.server_errors() == []


def test_sound_blocks_are_served_and_verified_on_each_read(cluster: Cluster) -> None:
    n = 40
    assert cluster.put(n).status_code == 201
    whole = cluster.http.get(cluster.block_url(n), headers=CLIENT)
    assert whole.status_code == 200 and whole.content == container(n)
    part = cluster.http.get(cluster.block_url(n) + "?layers=1-2", headers=CLIENT)
    assert part.content == decode_container(container(n)).select(1, 2).encode()
    assert cluster.lookup(n).matched == 1
    assert sum(cluster.metric("kvsp_block_faults_total").values()) == sum(
        cluster.faults(kind) for kind in DAMAGE
    )


# -- over MOQT: the publishing path of an instance's holder face reads the same files ------------


class RecordingIndex:
    """An IS stand-in that keeps what is published and withdrawn (the MOQT test runs in one
    process; the HTTP tests above use a real IS)."""

    def __init__(self) -> None:
        self.records: dict[BlockRef, ReplicaRecord] = {}
        self.withdrawn: list[BlockRef] = []

    @property
    def name(self) -> str:
        return "recording"

    def may_use_scope(self, scope_id: bytes) -> bool:
        return True

    async def publish(self, record: ReplicaRecord, /) -> int:
        self.records[BlockRef(record.compat_id, record.scope_id, record.block_key)] = record
        return record.ttl_ms

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[int | KVSPError]:
        return [await self.publish(record) for record in records]

    async def withdraw(self, compat_id: bytes, scope_id: bytes, key: bytes, holder: str, /) -> bool:
        ref = BlockRef(compat_id, scope_id, key)  # type: ignore[arg-type]
        self.withdrawn.append(ref)
        return self.records.pop(ref, None) is not None


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_faulty_block_file_ends_a_moqt_fetch_as_missing(tmp_path: Path, kind: str) -> None:
    cert, private_key = make_self_signed("localhost", tmp_path / "certs")

    async def scenario() -> None:
        registry = DescriptorRegistry()
        registry.add(DESCRIPTOR)
        config = HolderConfig(
            public_url="http://holder.test/",
            tiers={Tier.DISK: 8 * SIZE},
            state_dir=tmp_path / "state",
            fsync=False,
        )
        index = RecordingIndex()
        holder = Holder(config, index=index, descriptors=registry, clock=SystemClock())
        await holder.start()
        owner = Principal(name="client", roles=frozenset({"instance"}), scopes=frozenset({SCOPE}))
        stored = await holder.put_block(owner, COMPAT, SCOPE, key(1), container(1))
        ref = stored.meta.ref
        assert ref in index.records
        quic = get_backend("aioquic")
        configuration = quic.configuration(
            is_client=False, certificate=str(cert), private_key=str(private_key)
        )
        server = await serve_blocks(
            "127.0.0.1", 0, configuration=configuration, blocks=HolderBlocks(holder.store)
        )
        try:
            body = holder.record_of(stored).to_json()
            body["holder"] = f"moqt://127.0.0.1:{server.address[1]}"
            body["moqt_namespace"] = encode_moqt_namespace(kv_namespace(COMPAT, SCOPE, key(1)))
            record = ReplicaRecord.from_json(body)
            DAMAGE[kind](block_file(tmp_path / "state" / "blocks", 1))
            async with MoqtBlockClient(cafile=str(cert), backend="aioquic", timeout=10) as client:
                with pytest.raises(NotFound):
                    await client.get_block(record, geometry=GEOMETRY)
            await until(lambda: ref not in holder.store, what="the faulty block retired")
            assert index.withdrawn == [ref] and ref not in index.records
            assert holder.faults[kind] == 1
            assert not block_file(tmp_path / "state" / "blocks", 1, ".json").exists()
        finally:
            server.close()
            await holder.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


BIG = CompatibilityDescriptor(
    model="big",
    model_digest=b"\x01" * 32,
    tokenizer_digest=b"\x02" * 32,
    layers=4,
    kv_heads=8,
    head_dim=128,
    kv_dtype="fp16",
    positional="rope",
    block_tokens=256,
)


def test_a_fault_found_in_a_worker_thread_is_retired_before_the_miss_is_answered(
    tmp_path: Path,
) -> None:
    geometry = Geometry.from_descriptor(BIG)
    section = geometry.section_length(256)
    layers = [(bytes([i]) * section, bytes([i + 1]) * section) for i in range(4)]
    data = encode_container(layers, first_layer=0, token_count=256, geometry=geometry)
    assert len(data) >= 1 << 20  # read and hashed off the event loop

    async def scenario() -> None:
        registry = DescriptorRegistry()
        registry.add(BIG)
        config = HolderConfig(
            public_url="http://holder.test/",
            tiers={Tier.DISK: 4 * len(data)},
            state_dir=tmp_path,
            fsync=False,
        )
        index = RecordingIndex()
        holder = Holder(config, index=index, descriptors=registry, clock=SystemClock())
        await holder.start()
        try:
            owner = Principal(name="x", roles=frozenset({"instance"}), scopes=frozenset({SCOPE}))
            compat = compat_id(BIG)
            stored = await holder.put_block(owner, compat, SCOPE, key(1), data)
            path = tmp_path / "blocks" / compat.hex() / SCOPE.hex() / f"{key(1).hex()}.kvb"
            raw = bytearray(path.read_bytes())
            raw[-5] ^= 1
            path.write_bytes(bytes(raw))
            with pytest.raises(NotFound):
                await holder.get_block(owner, compat, SCOPE, key(1), (1, 2), None)
            ref = stored.meta.ref  # already retired when the miss is answered
            assert index.withdrawn == [ref] and ref not in holder.store and not path.exists()
            assert holder.faults["corrupt"] == 1
        finally:
            await holder.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
