"""Fast, in-process checks of the bugs the crash tests found (``test_crashes.py`` finds them
with real processes; these pin each fix down without timing):

* a disk-tier block whose data file is gone while its sidecar is left is reported dropped on
  restart, so the holder withdraws the record it may have published before the crash;
* httpcore's ``AttributeError`` when a peer dies right after accepting a connection leaves a
  KVSP client as a :class:`~kvsp.errors.TransportError`, not a crash (the holder
  answered 500 to a PUT when the Index Service died mid-publish);
* the MOQT block client drops a pooled session that stopped answering, so that a holder
  restarted at the same address (which no longer knows the old QUIC connection) is reached at
  the next request, not after QUIC's 60 s idle timeout.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from pathlib import Path

import httpx
import pytest

from kvsp.container import Geometry, encode_container
from kvsp.errors import TransportError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import LookupRequest
from kvsp.registries import Tier
from kvsp.services.index.client import IndexClient
from kvsp.stores.blocks import BlockRef, BlockStore, StoreConfig, describe_block
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock, serve_blocks
from moqt.asyncio import MOQTServer
from moqt.backend import get_backend
from moqt.certs import make_self_signed
from tests.support import loss as loss_kit

GEOMETRY = Geometry(layers=2, kv_heads=1, head_dim=8, element_size=2)
COMPAT = CompatId(hashlib.sha256(b"crash-fixes").digest())
SCOPE = ScopeId(b"\x0c" * 16)


def store(root: Path) -> BlockStore:
    config = StoreConfig(budgets={Tier.DISK: 1 << 20}, disk_root=root, fsync=False)
    return BlockStore(config, is_leased=lambda ref: False)


def admit(blocks: BlockStore, n: int) -> BlockRef:
    section = GEOMETRY.section_length(4)
    layers = [(bytes([n, i]) * (section // 2), bytes([i, n]) * (section // 2)) for i in range(2)]
    data = memoryview(encode_container(layers, first_layer=0, token_count=4, geometry=GEOMETRY))
    ref = BlockRef(COMPAT, SCOPE, BlockKey(bytes([n]) * 32))
    blocks.admit(describe_block(ref, data, GEOMETRY), data, Tier.DISK)
    return ref


def test_a_disk_block_whose_data_file_is_lost_is_reported_dropped(tmp_path: Path) -> None:
    before = store(tmp_path)
    kept, lost = admit(before, 1), admit(before, 2)
    data = tmp_path / COMPAT.hex() / SCOPE.hex() / f"{lost.key.hex()}.kvb"
    data.unlink()  # the sidecar stays behind
    after = store(tmp_path)
    dropped = after.open()
    assert [(d.ref, d.reason) for d in dropped] == [(lost, "no data file")]
    assert [b.meta.ref for b in after] == [kept]
    assert not data.with_suffix(".json").exists()


def test_a_peer_dying_after_accept_is_a_transport_error() -> None:
    def dies(request: httpx.Request) -> httpx.Response:
        socket = None  # what anyio finds once the connection was torn down
        return socket.getpeername()  # type: ignore[attr-defined, no-any-return]

    async def scenario() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(dies))
        request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(BlockKey(b"k" * 32),))
        async with http, IndexClient("http://127.0.0.1:9/", "token", client=http) as index:
            with pytest.raises(TransportError, match="connection lost"):
                await index.lookup(request)

    asyncio.run(scenario())


def test_a_moqt_holder_restarted_at_its_address_is_reached_again(tmp_path: Path) -> None:
    cert, key = make_self_signed("localhost", tmp_path)
    block = loss_kit.make_block(31)
    served = MemoryBlocks()
    served.add(StoredBlock.of(loss_kit.COMPAT, loss_kit.SCOPE, block.key, block.container))
    server_tls = get_backend().configuration(
        is_client=False, certificate=str(cert), private_key=str(key)
    )

    async def holder() -> tuple[MOQTServer, tuple[str, int]]:
        server = await serve_blocks("127.0.0.1", 0, configuration=server_tls, blocks=served)
        return server, server.address

    async def scenario() -> None:
        first, address = await holder()
        # The client reaches the holder through a plain proxy: closing the proxy first makes
        # the holder vanish without a word, as a SIGKILLed process does.
        proxy = loss_kit.LossyProxy(address)
        await proxy.start()
        record = block.record(f"moqt://127.0.0.1:{proxy.address[1]}/")
        async with MoqtBlockClient(cafile=str(cert), server_name="localhost", timeout=1.0) as c:
            fetch = functools.partial(
                c.get_block, record, geometry=loss_kit.GEOMETRY, block_tokens=loss_kit.TOKENS
            )
            loss_kit.check_block(await fetch(), block)
            listen = proxy.address
            await proxy.close()
            first.close()
            second, address = await holder()  # "restarted" at the same address
            async with loss_kit.LossyProxy(address, listen=listen):
                with pytest.raises(TransportError):  # the old session: nobody answers it
                    await fetch()
                loss_kit.check_block(await fetch(), block)
            second.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
