"""The torch reference engine behind real instance processes (DESIGN.md §5–6; spec §6.5,
§6.7): ``kvsp serve control``, a standalone ``kvsp serve holder`` and two ``kvsp serve
instance --engine reference`` on one tiny seeded model.

Instance A computes a prompt and publishes its blocks; instance B prefetches the first of
them from A's holder face and then serves a prompt starting with them: the greedy tokens equal
a full recompute. Blocks offered through a proxy that flips one octet of each block body fail
verification, are not used, and are recomputed: the tokens still equal.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.compat import compat_id  # noqa: E402
from kvsp.engine.checkpoint import descriptor_for, init_model  # noqa: E402
from kvsp.engine.engine import Engine  # noqa: E402
from kvsp.engine.sampler import Sampler  # noqa: E402
from kvsp.keys import block_keys, scope_id  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402
from tests.support.polling import eventually  # noqa: E402

pytestmark = pytest.mark.slow  # control plane, holder and two reference-engine instances
B = 8
SCOPE_KEY = bytes(range(40, 72))
SCOPE = scope_id(SCOPE_KEY)
TOKEN = "engine-instance-test-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# A vocabulary above the agent's warm-up ids (< 65521), untied so greedy output varies.
MODEL = {"seed": 11, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 65_536}


class CorruptingProxy:
    """A TCP proxy, on its own thread, flipping one octet near the end of every response body
    of at least ``min_body`` octets (block bodies; lease answers pass untouched)."""

    def __init__(self, min_body: int = 1024) -> None:
        self.min_body = min_body
        self.upstream: tuple[str, int] | None = None
        self.flipped = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.server = server
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.upstream is None:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        try:
            await asyncio.gather(
                self._forward(reader, up_writer), self._responses(up_reader, writer)
            )
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            up_writer.close()

    @staticmethod
    async def _forward(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        dst.close()

    async def _responses(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            head = await src.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = bytearray(await src.readexactly(length))
            if length >= self.min_body:
                body[length - 100] ^= 0x40
                self.flipped += 1
            dst.write(head + body)
            await dst.drain()

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@dataclass
class Cluster:
    model: Path
    control: RunningService
    holder: RunningService
    a: RunningService
    b: RunningService
    proxy: CorruptingProxy
    http: httpx.Client

    def generate(
        self, instance: RunningService, prompt: list[int], n: int
    ) -> tuple[int, list[int]]:
        answer = self.http.post(
            f"{instance.base_url}generate", json={"prompt": prompt, "max_tokens": n}, headers=AUTH
        )
        assert answer.status_code == 200, answer.text
        tokens = [json.loads(line)["token"] for line in answer.text.splitlines()]
        return int(answer.headers["kvsp-loaded-blocks"]), tokens

    def prefetch(self, instance: RunningService, keys: list[bytes], source: str) -> dict[str, Any]:
        directive = {
            "directive": str(uuid.uuid4()),
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [source]} for k in keys],
            "layer_order": "ascending",
            "deadline_ms": 20_000,
            "lease_ms": 10_000,
        }
        answer = self.http.post(f"{instance.base_url}prefetch", json=directive, headers=AUTH)
        assert answer.status_code == 202, answer.text
        location = answer.headers["location"]

        def finished() -> dict[str, Any] | None:
            status: dict[str, Any] = self.http.get(location, headers=AUTH).json()
            return status if status["state"] != "pending" else None

        return eventually(finished)

    def matched(self, keys: list[bytes], holder: str) -> int | None:
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [k.hex() for k in keys],
        }
        answer = self.http.post(f"{self.control.base_url}lookup", json=body, headers=AUTH).json()
        held = [any(r["holder"] == holder for r in rs) for rs in answer["replicas"]]
        return len(held) if all(held) and len(held) == len(keys) else None


COMPAT = b""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    global COMPAT
    folder = tmp_path_factory.mktemp("engine-cluster")
    model = init_model(folder / "model", **MODEL)  # type: ignore[arg-type]
    descriptor = descriptor_for(model, block_tokens=B)
    COMPAT = compat_id(descriptor)
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("admin", TOKEN, ["admin"], None)])
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    descriptor_file = folder / "descriptor.json"
    descriptor_file.write_text(json.dumps(descriptor.to_json()))
    scope_key = folder / "scope.key"
    scope_key.write_text(SCOPE_KEY.hex())
    kvsp = [sys.executable, "-m", "kvsp", "serve"]
    started: list[RunningService] = []
    proxy = CorruptingProxy()

    def start(name: str, kind: str, *argv: str) -> RunningService:
        work = folder / name
        work.mkdir()
        common = ["--listen", "127.0.0.1:0", "--principals", str(principals)]
        service = start_process(
            [*kvsp, kind, *common, "--state", str(work / "state"), *argv],
            workdir=work,
            ready_timeout=60,
        )
        started.append(service)
        return service

    instance = [
        "--control",
        "",
        "--token-file",
        str(token),
        "--engine",
        "reference",
        "--model",
        str(model),
        "--block-tokens",
        str(B),
        "--kv-capacity-blocks",
        "256",
        "--scope-key-file",
        str(scope_key),
    ]
    try:
        control = start("control", "control", "--directive-token-file", str(token))
        instance[1] = control.base_url
        holder = start(
            "holder",
            "holder",
            "--index",
            control.base_url,
            "--index-token-file",
            str(token),
            "--descriptor",
            str(descriptor_file),
            "--public-url",
            proxy.url,  # its records name the proxy, so instances fetch through it
        )
        host, port = holder.base_url.removeprefix("http://").rstrip("/").split(":")
        proxy.upstream = (host, int(port))
        a = start("a", "instance", *instance)
        b = start("b", "instance", *instance)
        with httpx.Client(timeout=60) as http:
            yield Cluster(model, control, holder, a, b, proxy, http)
    finally:
        for service in reversed(started):
            service.stop()
        proxy.close()


def recompute(model: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of a fresh engine computing ``prompt`` from scratch."""
    engine = Engine(model, num_pages=64, block_tokens=B)
    return list(engine.generate(prompt, n, Sampler()))


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 7_919 + i * 4_099) % 65_536 for i in range(length)]


def test_prefetched_blocks_from_another_instance_give_the_recomputed_tokens(
    cluster: Cluster,
) -> None:
    first = prompt_of(1, 5 * B + 3)
    loaded, tokens_a = cluster.generate(cluster.a, first, 6)
    assert loaded == 0 and tokens_a == recompute(cluster.model, first, 6)
    keys = block_keys(SCOPE_KEY, COMPAT, first, B)[:4]
    eventually(lambda: cluster.matched(keys, cluster.a.base_url))

    status = cluster.prefetch(cluster.b, keys, cluster.a.base_url)
    assert status["state"] == "complete", status
    second = first[: 4 * B] + prompt_of(2, 2 * B + 5)  # shares A's first four blocks
    loaded, tokens_b = cluster.generate(cluster.b, second, 8)
    assert loaded == 4
    assert tokens_b == recompute(cluster.model, second, 8)
    assert len(set(tokens_b)) > 1  # a varied output, not a fixed point that hides errors
    status = cluster.http.get(f"{cluster.b.base_url}status", headers=AUTH).json()
    assert status["prefill_tokens_per_s"] > 0 and status["decode_tokens_per_s"] > 0
    assert 0 <= status["kv_utilization"] <= 1  # pages in use; the sequences are released


def test_a_corrupted_source_is_not_used_and_the_blocks_are_recomputed(cluster: Cluster) -> None:
    prompt = prompt_of(3, 3 * B + 2)
    engine = Engine(cluster.model, num_pages=64, block_tokens=B)
    blocks = engine.export_prompt_blocks(prompt)
    keys = block_keys(SCOPE_KEY, COMPAT, prompt, B)
    for key, block in zip(keys, blocks, strict=True):
        url = f"{cluster.holder.base_url}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key.hex()}"
        headers = AUTH | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        put = cluster.http.put(url, content=block.container, headers=headers)
        assert put.status_code == 201, put.text
    eventually(lambda: cluster.matched(keys, cluster.proxy.url))

    status = cluster.prefetch(cluster.b, keys, cluster.proxy.url)
    assert status["state"] != "complete" and status["loaded"] == [], status
    assert cluster.proxy.flipped >= 1
    loaded, tokens = cluster.generate(cluster.b, prompt, 6)
    assert loaded == 0
    assert tokens == recompute(cluster.model, prompt, 6)
