"""KV blocks over MOQT through :class:`~interop.lossy_proxy.LossyProxy` (a lossy network).

Two topologies, all in one event loop over real UDP on 127.0.0.1:

* ``client-relay``: publisher → relay, and the verifying client reaches the relay through the
  proxy (the client's MOQT session is the lossy one);
* ``relay-relay``: publisher → origin relay; the edge relay's upstream session to the origin goes
  through the proxy (FETCH forwarded upstream on a miss), and the client talks to the edge
  directly.

Blocks are 2 MiB (32 layers of 64 KiB, one object per layer); :func:`check_block` verifies every
layer of what the client handed out against digests computed here, independently of the
client's own checks. Used by the loss tests and by ``bench/bench_loss.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from interop.lossy_proxy import Impairment as Impairment  # re-exported
from interop.lossy_proxy import LossyProxy as LossyProxy  # re-exported
from kvsp.container import Geometry, encode_container, replica_digest
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import encode_moqt_namespace, kv_namespace
from kvsp.records import ReplicaRecord
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import MemoryBlocks, MoqtBlockPublisher, StoredBlock
from kvsp.transfer.moqt_transfer import parse_moqt_uri
from kvsp.transfer.verify import VerifiedBlock
from moqt.asyncio import connect
from moqt.backend import get_backend
from relay.relay import Relay, RelayConfig
from relay.upstream import UpstreamConfig

GEOMETRY = Geometry(layers=32, kv_heads=8, head_dim=128, element_size=2)
TOKENS = 16  # 32 KiB sections: 64 KiB objects, a 2 MiB block
SECTION = GEOMETRY.section_length(TOKENS)
COMPAT = CompatId(hashlib.sha256(b"reliability-compat").digest())
SCOPE = ScopeId(b"\x5e" * 16)
Kind = Literal["client-relay", "relay-relay"]
KINDS: tuple[Kind, ...] = ("client-relay", "relay-relay")


@dataclass(frozen=True, slots=True)
class TestBlock:
    """A block, its container octets and its layer digests (computed here)."""

    key: BlockKey
    container: bytes
    digests: tuple[bytes, ...]

    @property
    def payload(self) -> int:
        """Octets of layer data (what goodput counts)."""
        return GEOMETRY.layers * 2 * SECTION

    def record(self, holder: str) -> ReplicaRecord:
        """The Replica Record a relay at ``holder`` would publish for it (§4.4)."""
        return ReplicaRecord.from_json(
            {
                "block_key": self.key.hex(),
                "compat_id": COMPAT.hex(),
                "scope_id": SCOPE.hex(),
                "holder": holder,
                "codec": 1,
                "size": len(self.container),
                "digest": "sha-256:" + replica_digest(self.digests).hex(),
                "layer_digests": [d.hex() for d in self.digests],
                "ttl_ms": 60_000,
                "moqt_namespace": encode_moqt_namespace(kv_namespace(COMPAT, SCOPE, self.key)),
            }
        )


def make_block(seed: int) -> TestBlock:
    """A 2 MiB block whose every layer differs, deterministic in ``seed``."""
    layers = []
    for i in range(GEOMETRY.layers):
        k = hashlib.sha256(b"K%d/%d" % (seed, i)).digest() * (SECTION // 32)
        v = hashlib.sha256(b"V%d/%d" % (seed, i)).digest() * (SECTION // 32)
        layers.append((k, v))
    container = encode_container(layers, first_layer=0, token_count=TOKENS, geometry=GEOMETRY)
    digests = tuple(hashlib.sha256(k + v).digest() for k, v in layers)
    key = BlockKey(hashlib.sha256(b"reliability-key/%d" % seed).digest())
    return TestBlock(key, container, digests)


def check_block(got: VerifiedBlock, block: TestBlock) -> None:
    """Every layer handed out is the block's, checked here by its own digest.

    Raises:
        AssertionError: a layer differs, is missing, or the block was not checked against the
            record by the client.
    """
    assert got.producer_verified
    assert [layer.index for layer in got.layers] == list(range(GEOMETRY.layers))
    for layer in got.layers:
        digest = hashlib.sha256(bytes(layer.k) + bytes(layer.v)).digest()
        assert digest == block.digests[layer.index], f"layer {layer.index} differs"
    assert got.encode() == block.container


@dataclass
class Topology:
    """A running topology: where the client fetches from, the proxy, the client."""

    kind: Kind
    holder: str
    proxy: LossyProxy
    client: MoqtBlockClient
    blocks: MemoryBlocks

    def add(self, block: TestBlock) -> None:
        """Have the publisher serve ``block``."""
        self.blocks.add(
            StoredBlock.of(
                COMPAT, SCOPE, block.key, block.container, geometry=GEOMETRY, ttl_ms=60_000
            )
        )

    async def fetch(self, block: TestBlock) -> VerifiedBlock:
        """The verified block, fetched once (no retry: QUIC's loss recovery does the work)."""
        return await self.client.get_block(
            block.record(self.holder), geometry=GEOMETRY, block_tokens=TOKENS
        )


@contextlib.asynccontextmanager
async def topology(
    kind: Kind,
    impairment: Impairment,
    certs: tuple[Path, Path],
    blocks: Sequence[TestBlock] = (),
    *,
    timeout: float = 20.0,
) -> AsyncIterator[Topology]:
    """Start ``kind`` with ``impairment`` on its lossy hop; the publisher serves ``blocks``."""
    cert, key = certs
    served = MemoryBlocks()
    async with contextlib.AsyncExitStack() as stack:
        origin = Relay(RelayConfig(certificate=cert, private_key=key))
        await origin.start()
        stack.push_async_callback(origin.close)
        at = parse_moqt_uri(origin.url)
        proxy = LossyProxy((at.host, at.port), impairment)
        await stack.enter_async_context(proxy)
        proxied = f"moqt://127.0.0.1:{proxy.address[1]}/"
        if kind == "client-relay":
            holder = proxied
        else:
            upstream = UpstreamConfig(url=proxied, cafile=cert, connect_timeout=timeout)
            edge = Relay(RelayConfig(certificate=cert, private_key=key, upstream=upstream))
            await edge.start()
            stack.push_async_callback(edge.close)
            holder = edge.url
        await publish_blocks(stack, origin.url, served)
        client = MoqtBlockClient(cafile=str(cert), server_name="localhost", timeout=timeout)
        await stack.enter_async_context(client)
        running = Topology(kind, holder, proxy, client, served)
        for block in blocks:
            running.add(block)
        yield running


async def publish_blocks(stack: contextlib.AsyncExitStack, url: str, blocks: MemoryBlocks) -> None:
    """A publisher session to the relay at ``url`` (closed with ``stack``) that announces the
    scope and serves ``blocks``."""
    address = parse_moqt_uri(url)
    configuration = get_backend().configuration(is_client=True, verify=False)
    connection = await stack.enter_async_context(
        connect(address.host, address.port, configuration=configuration)
    )
    publisher = MoqtBlockPublisher(connection, blocks)
    serving = asyncio.ensure_future(publisher.serve())
    stack.callback(serving.cancel)
    await publisher.announce(COMPAT, SCOPE)
