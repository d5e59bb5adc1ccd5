"""KVSP blocks through the relay over MOQT-over-QMux carriers, every part a real process on
127.0.0.1 (DESIGN.md §4 Carriers; spec §4.4, §6.7; draft-ietf-quic-qmux-01).

``kvsp serve control``, ``kvsp serve relay`` listening on QUIC, QMux over TLS (default), QMux
over plain TCP on loopback and QMux over a Unix socket, and ``kvsp serve instance`` publishing
its computed blocks to the relay over the Unix socket (``--relay moqt+unix://...``). The relay's
Replica Records name its QUIC URI as holder and list the three carriers in ``moqt_carriers``
(fastest first). A reader then fetches a block through the relay, layer by layer into a sink and
verified against the record: over the Unix socket (the relay is on this host), over TLS or
plain TCP when the record offers only that, and over QUIC when the carriers it offers all fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.container import Geometry, decode_container
from kvsp.engine.toy import toy_descriptor
from kvsp.ids import ScopeId
from kvsp.keys import block_keys, scope_id
from kvsp.records import LookupRequest, ReplicaRecord
from kvsp.services.index.client import IndexClient
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService
from tests.support.polling import eventually
from tests.support.services import Services

pytest.importorskip("moqt.qmux_asyncio")
pytestmark = pytest.mark.timeout(150)
ADMIN = "qmux-admin-token-0123456789abcdef012"
READER = "qmux-reader-token-0123456789abcdef01"
SCOPE_KEY = bytes(range(60, 100))
SCOPE = ScopeId(scope_id(SCOPE_KEY))
DESCRIPTOR = toy_descriptor(layers=6, block_tokens=16)
COMPAT = compat_id(DESCRIPTOR)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
PROMPT = [(17 * i + 3) % 50_000 for i in range(2 * 16 + 1)]  # two complete blocks


class Sink:
    """Caller memory for layers (a stand-in for device pages): one buffer per K and V."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[bytearray, bytearray]] = {}

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        k, v = bytearray(k_len), bytearray(v_len)
        self.buffers[index] = (k, v)
        return memoryview(k), memoryview(v)


async def lookup(control: str, keys: list[bytes]) -> list[tuple[ReplicaRecord, ...]]:
    request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=tuple(keys))
    async with IndexClient(control, READER) as index:
        answer = await index.lookup(request)
    return list(answer.replicas or ())


def relay_records(control: str, keys: list[bytes], relay_url: str) -> list[ReplicaRecord] | None:
    found = asyncio.run(lookup(control, keys))
    mine = [[r for r in records if r.holder == relay_url] for records in found]
    if len(mine) != len(keys) or not all(mine):
        return None
    return [records[0] for records in mine]


def test_blocks_reach_a_reader_through_the_relay_over_every_qmux_carrier(tmp_path: Path) -> None:
    principals = tmp_path / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("admin", ADMIN, ["admin"], None),
            principal_entry("reader", READER, ["client"], [SCOPE]),
        ],
    )
    (tmp_path / "admin.token").write_text(ADMIN)
    (tmp_path / "scope.key").write_text(SCOPE_KEY.hex())
    (tmp_path / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    socket_path = tmp_path / "relay.sock"
    services = Services(tmp_path, principals)
    start = services.start

    try:
        control = start("control", "control")
        relay = start(
            "relay",
            *("relay", "--index", control.base_url),
            *("--token-file", str(tmp_path / "admin.token")),
            *("--qmux-unix", str(socket_path), "--qmux-tcp-listen", "127.0.0.1:0"),
        )
        faces = json.loads(relay.base_url)
        carriers = faces["carriers"]
        assert [c.split(":", 1)[0] for c in carriers] == ["moqt+unix", "moqt+tcp", "moqt+tls"]
        assert carriers[0] == f"moqt+unix://localhost{socket_path.resolve()}"
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600  # the access boundary
        cert = tmp_path / "relay" / "state" / "relay-tls" / "cert.pem"
        instance = start(
            "instance",
            *("instance", "--control", control.base_url),
            *("--token-file", str(tmp_path / "admin.token")),
            *("--descriptor", str(tmp_path / "descriptor.json")),
            *("--scope-key-file", str(tmp_path / "scope.key")),
            *("--relay", carriers[0], "--relay-cafile", str(cert)),
        )
        asyncio.run(scenario(control, instance, faces, cert))
    finally:
        services.stop_all()


async def scenario(
    control: RunningService, instance: RunningService, faces: dict[str, object], cert: Path
) -> None:
    keys = block_keys(SCOPE_KEY, COMPAT, PROMPT, DESCRIPTOR.block_tokens)
    auth = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(timeout=30, headers=auth) as http:
        answer = await http.post(
            f"{instance.base_url}generate", json={"prompt": PROMPT, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
    originals = []
    async with BlockClient(ADMIN) as blocks:
        for records in await lookup(control.base_url, keys):
            own = [r for r in records if r.holder == instance.base_url]
            block = await blocks.get_block(instance.base_url, own[0], geometry=GEOMETRY)
            originals.append(decode_container(block.encode()))
    relay_url = str(faces["moqt"])
    # the instance published over the Unix socket; the relay's records list its carriers
    found = await asyncio.to_thread(
        eventually, lambda: relay_records(control.base_url, keys, relay_url)
    )
    carriers = tuple(str(c) for c in faces["carriers"])  # type: ignore[attr-defined]
    assert all(record.moqt_carriers == carriers for record in found)
    record, original = found[1], originals[1]

    async def fetch(rec: ReplicaRecord) -> tuple[str, Sink]:
        sink = Sink()
        async with MoqtBlockClient(cafile=str(cert), auth_token=READER, timeout=15) as client:
            stream = client.stream_block(rec, geometry=GEOMETRY, sink=sink)
            assert [layer.index async for layer in stream] == list(range(DESCRIPTOR.layers))
            await stream.block()
            used = [str(address) for address in client.sessions()]
        return used[0], sink

    def check(sink: Sink) -> None:
        for index, (k, v) in sorted(sink.buffers.items()):
            want = original.layers[index]
            assert bytes(k) == bytes(want.k) and bytes(v) == bytes(want.v)
            assert hashlib.sha256(k + v).digest() == record.layer_digests[index]  # type: ignore[index]
        assert sorted(sink.buffers) == list(range(DESCRIPTOR.layers))

    used, sink = await fetch(record)  # the relay is on this host: its Unix socket
    assert used.startswith("unix:"), used
    check(sink)
    for carrier, kind in ((carriers[2], "tls:"), (carriers[1], "tcp:")):
        only = dataclasses.replace(record, moqt_carriers=(carrier,))
        used, sink = await fetch(only)
        assert used.startswith(kind), used
        check(sink)
    dead = dataclasses.replace(record, moqt_carriers=("moqt+tls://127.0.0.1:1/",))
    used, sink = await fetch(dead)  # the carrier refuses: QUIC, the holder URI, serves
    assert used.startswith("quic:"), used
    check(sink)
