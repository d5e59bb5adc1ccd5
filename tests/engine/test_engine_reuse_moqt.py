"""Reuse over MOQT through the relay is exact (DESIGN.md §4–6;
spec §4.3, §6.5, §6.7).

In process: engine A's blocks are pushed into a real relay (:class:`RelayLink`, real UDP) and
the publisher leaves; engine B FETCHes them from the relay's cache with
:class:`MoqtBlockClient` straight into its KV pages (:class:`DeviceSink`, each layer made ready
once verified against the relay's Replica Record) while its prefill already runs. Tolerance:
none. The logits equal B's full recompute bit for bit, the greedy tokens are the same, and the
loaded KV bytes equal those B computes itself.

As processes: ``kvsp serve control``, ``kvsp serve relay --index`` and two ``kvsp serve
instance --engine reference --relay``. A serves a prompt (its blocks go into the relay) and is
killed; B is directed to prefetch the first blocks from the relay (``moqt://`` source, lease on
the relay's HTTP face) and serves a prompt starting with them: loaded 4 blocks, the same greedy
tokens as a fresh engine's full recompute, and the blocks B keeps (its holder face) are
bit-identical to what a fresh engine computes for that prefix.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.compat import compat_id  # noqa: E402
from kvsp.container import Geometry  # noqa: E402
from kvsp.engine.checkpoint import descriptor_for, init_model  # noqa: E402
from kvsp.engine.engine import Engine  # noqa: E402
from kvsp.engine.sampler import Sampler  # noqa: E402
from kvsp.engine.sink import DeviceSink  # noqa: E402
from kvsp.ids import BlockKey, ScopeId  # noqa: E402
from kvsp.keys import block_keys, scope_id  # noqa: E402
from kvsp.records import ReplicaRecord  # noqa: E402
from kvsp.transfer.moqt_client import MoqtBlockClient  # noqa: E402
from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock  # noqa: E402
from kvsp.transfer.relay_link import RelayLink, RelayLinkConfig  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402
from moqt.certs import make_self_signed  # noqa: E402
from relay.kv import replica_record  # noqa: E402
from relay.relay import Relay, RelayConfig  # noqa: E402
from tests.support.polling import eventually, until  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.slow  # control plane, relay and two reference-engine instances
B = 8
PROMPT = [(7 * i + 3) % 256 for i in range(45)]  # 5 complete blocks and 5 tail tokens
LOADED = 3
SCOPE = ScopeId(b"\x5e" * 16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("reuse-moqt"), seed=11, layers=3, hidden=64, heads=4, kv_heads=2
    )


def _engine(model_dir: Path) -> Engine:
    return Engine(model_dir, num_pages=32, block_tokens=B)


async def _relay_records(
    engine: Engine, cert: Path, key: Path, blocks: list[StoredBlock]
) -> tuple[Relay, list[ReplicaRecord]]:
    """A relay holding ``blocks`` (pushed over a link that is then closed) and its records."""
    relay = Relay(RelayConfig(certificate=cert, private_key=key))
    await relay.start()
    source = MemoryBlocks()
    for block in blocks:
        source.add(block)
    link = RelayLink(RelayLinkConfig(url=relay.url, cafile=str(cert), retry_s=0.05), source)
    link.start()
    for block in blocks:
        link.push(block.compat, block.scope, block.key)
    await asyncio.wait_for(link.idle(), 20)
    await link.close()  # the publisher has gone: what follows comes from the relay's cache
    records = []
    for block in blocks:
        track = (block.namespace, block.track_name)
        replica = await until(lambda t=track: relay.holder.replica(t), 10)  # type: ignore[misc]
        record = replica_record(replica, holder=relay.url, lease_base=None, ttl_ms=60_000)
        records.append(record)
    return relay, records


def _sinks(engine: Engine, count: int) -> tuple[list[int], list[DeviceSink]]:
    """Fresh pages and their sinks: every layer pending from now on (before prefill starts)."""
    pages = engine.cache.allocate(count)
    return pages, [DeviceSink(engine.cache, page) for page in pages]


async def _load(
    client: MoqtBlockClient,
    geometry: Geometry,
    records: list[ReplicaRecord],
    sinks: list[DeviceSink],
) -> None:
    """FETCH each block from the relay into its page, committing each verified layer."""
    for record, sink in zip(records, sinks, strict=True):
        stream = client.stream_block(record, geometry=geometry, block_tokens=B, sink=sink)
        try:
            async for layer in stream:
                sink.commit(layer.index)
        except BaseException as exc:
            sink.abort(str(exc))
            raise


def test_blocks_through_the_relay_give_bit_exact_logits(model_dir: Path, tmp_path: Path) -> None:
    a, b = _engine(model_dir), _engine(model_dir)
    compat = compat_id(b.descriptor)
    keys = [BlockKey(bytes([i]) * 32) for i in range(LOADED)]
    exported = a.export_prompt_blocks(PROMPT)[:LOADED]
    geometry = Geometry.from_descriptor(a.descriptor)
    blocks = [
        StoredBlock.of(compat, SCOPE, key, x.container, geometry=geometry)
        for key, x in zip(keys, exported, strict=True)
    ]
    full_seq = b.new_sequence()
    full = b.prefill(full_seq, PROMPT, all_logits=True)
    reference = list(b.generate(PROMPT, 8, Sampler()))
    cert, key = make_self_signed("localhost", tmp_path)

    async def scenario() -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        relay, records = await _relay_records(b, cert, key, blocks)
        try:
            async with MoqtBlockClient(cafile=str(cert), timeout=20) as client:
                seq = b.new_sequence()
                pages, sinks = _sinks(b, LOADED)
                loading = asyncio.ensure_future(_load(client, geometry, records, sinks))
                # prefill starts now: layer l of the new tokens waits for layer l of the pages
                part = await asyncio.to_thread(
                    b.prefill, seq, PROMPT, loaded_prefix_pages=pages, all_logits=True
                )
                await loading
                again, sinks = _sinks(b, LOADED)
                await _load(client, geometry, records, sinks)
                tokens = await asyncio.to_thread(
                    lambda: list(b.generate(PROMPT, 8, Sampler(), loaded_prefix_pages=again))
                )
                return part, pages, seq.pages[:LOADED], tokens
        finally:
            await relay.close()

    part, pages, used, tokens = asyncio.run(scenario())
    assert used == pages  # the loaded pages were used, not recomputed
    assert part.shape[0] == len(PROMPT) - LOADED * B
    assert torch.equal(part, full[LOADED * B :])  # bit-exact: tolerance 0
    assert tokens == reference and len(set(tokens)) > 1
    for i, page in enumerate(pages):  # the loaded KV bytes are what B computes itself
        assert torch.equal(b.cache.kv[page], b.cache.kv[full_seq.pages[i]])
        assert b.block_container(full_seq, i) == exported[i].container


# --- the same through real processes ------------------------------------------------------------

TOKEN = "engine-moqt-test-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SCOPE_KEY = bytes(range(80, 112))
# A vocabulary above the agent's warm-up ids (< 65521), untied so greedy output varies.
MODEL = {"seed": 11, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 65_536}


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 7_919 + i * 4_099) % 65_536 for i in range(length)]


class Cluster:
    """Control plane, relay and instances A and B, with what the test needs to talk to them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.model = init_model(folder / "model", **MODEL)  # type: ignore[arg-type]
        self.compat = compat_id(descriptor_for(self.model, block_tokens=B))
        self.started: list[RunningService] = []
        self.http = httpx.Client(timeout=60, headers=AUTH)
        principals = folder / "principals.toml"
        write_principals(principals, [principal_entry("admin", TOKEN, ["admin"], None)])
        self.principals = principals
        (folder / "token").write_text(TOKEN + "\n")
        (folder / "scope.key").write_text(SCOPE_KEY.hex())

    def start(self, name: str, *argv: str) -> RunningService:
        work = self.folder / name
        work.mkdir()
        command = [sys.executable, "-m", "kvsp", "serve", *argv, "--listen", "127.0.0.1:0"]
        command += ["--principals", str(self.principals), "--state", str(work / "state")]
        service = start_process(command, workdir=work, ready_timeout=90)
        self.started.append(service)
        return service

    def instance(self, name: str, control: str, relay: str, cert: Path) -> RunningService:
        return self.start(
            name,
            *("instance", "--control", control, "--token-file", str(self.folder / "token")),
            *("--engine", "reference", "--model", str(self.model), "--block-tokens", str(B)),
            *("--kv-capacity-blocks", "128", "--scope-key-file", str(self.folder / "scope.key")),
            *("--relay", relay, "--relay-cafile", str(cert)),
        )

    def close(self) -> None:
        for service in reversed(self.started):
            service.stop()
        self.http.close()

    def generate(self, instance: RunningService, prompt: list[int], n: int) -> tuple[int, list]:
        answer = self.http.post(
            f"{instance.base_url}generate", json={"prompt": prompt, "max_tokens": n}
        )
        assert answer.status_code == 200, answer.text
        tokens = [json.loads(line)["token"] for line in answer.text.splitlines()]
        return int(answer.headers["kvsp-loaded-blocks"]), tokens

    def holders(self, control: str, keys: list[BlockKey]) -> list[set[str]]:
        body = {
            "scope_id": scope_id(SCOPE_KEY).hex(),
            "compat_id": self.compat.hex(),
            "block_keys": [k.hex() for k in keys],
        }
        answer = self.http.post(f"{control}lookup", json=body).json()
        return [{r["holder"] for r in rs} for rs in answer["replicas"]]

    def prefetch(self, instance: RunningService, keys: list[BlockKey], source: str) -> Any:
        directive = {
            "directive": str(uuid.uuid4()),
            "scope_id": scope_id(SCOPE_KEY).hex(),
            "compat_id": self.compat.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [source]} for k in keys],
            "layer_order": "ascending",
            "deadline_ms": 30_000,
            "lease_ms": 10_000,
        }
        answer = self.http.post(f"{instance.base_url}prefetch", json=directive)
        assert answer.status_code == 202, answer.text
        location = answer.headers["location"]

        def finished() -> Any:
            status = self.http.get(location).json()
            return status if status["state"] != "pending" else None

        return eventually(finished, 60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    made = Cluster(tmp_path_factory.mktemp("engine-moqt-cluster"))
    try:
        yield made
    finally:
        made.close()


def test_instance_b_reuses_blocks_of_a_through_the_relay(cluster: Cluster) -> None:
    control = cluster.start(
        "control", "control", "--directive-token-file", str(cluster.folder / "token")
    )
    token_file = str(cluster.folder / "token")
    relay = cluster.start("relay", "relay", "--index", control.base_url, "--token-file", token_file)
    faces = json.loads(relay.base_url)
    cert = cluster.folder / "relay" / "state" / "relay-tls" / "cert.pem"
    with ThreadPoolExecutor(2) as starting:  # both load torch: start them side by side
        started = [
            starting.submit(cluster.instance, name, control.base_url, faces["moqt"], cert)
            for name in ("a", "b")
        ]
        a, b = (future.result() for future in started)

    first = prompt_of(1, 5 * B + 3)
    loaded, tokens_a = cluster.generate(a, first, 6)
    engine = Engine(cluster.model, num_pages=64, block_tokens=B)
    assert loaded == 0 and tokens_a == list(engine.generate(first, 6, Sampler()))
    keys = block_keys(SCOPE_KEY, cluster.compat, first, B)[:4]
    eventually(
        lambda: (
            True
            if all(faces["moqt"] in h for h in cluster.holders(control.base_url, keys))
            else None
        )
    )
    a.proc.kill()  # A is gone: the relay's cache is the only MOQT source
    a.proc.wait(10)

    status = cluster.prefetch(b, keys, faces["moqt"])
    assert status["state"] == "complete", status
    assert status["loaded"] == [k.hex() for k in keys]
    second = first[: 4 * B] + prompt_of(2, 2 * B + 5)  # shares A's first four blocks
    loaded, tokens_b = cluster.generate(b, second, 8)
    assert loaded == 4
    assert tokens_b == list(engine.generate(second, 8, Sampler()))  # greedy, full recompute
    assert len(set(tokens_b)) > 1

    # the KV bytes B loaded are bit-identical to what an engine computes for that prefix
    own = engine.export_prompt_blocks(second)
    for i, key in enumerate(keys):
        url = f"{b.base_url}blocks/{cluster.compat.hex()}/{scope_id(SCOPE_KEY).hex()}/{key.hex()}"
        answer = cluster.http.get(url)
        assert answer.status_code == 200, answer.text
        assert answer.content == own[i].container
