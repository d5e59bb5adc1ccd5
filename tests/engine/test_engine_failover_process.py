"""§6.8 failover on the torch reference engine among real processes: ``kvsp serve control``, a
``kvsp serve holder`` keeping session replicas and three ``kvsp serve instance --engine
reference`` over one seeded checkpoint (``kvsp model init``'s kind). The instance serving a
generation is SIGKILLed mid-stream; the resumed instance loads the prompt's and the generated
blocks the killed one stored at the holder, replays the rest by decode steps and samples on at
``output_offset``: the caller's tokens equal an uninterrupted in-process run, for greedy and
seeded top-p sampling.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.compat import compat_id  # noqa: E402
from kvsp.engine.api import GREEDY, Sampling  # noqa: E402
from kvsp.engine.checkpoint import descriptor_for, init_model  # noqa: E402
from kvsp.engine.reference import TorchEngine  # noqa: E402
from kvsp.keys import scope_id  # noqa: E402
from kvsp.services.frontend import FrontEnd, FrontendConfig  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from tests.support import cluster as cluster_kit  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

B = 8
SCOPE_KEY = bytes(range(150, 182))
SCOPE = scope_id(SCOPE_KEY)
MODEL = {"seed": 13, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 4_096}
TOKENS = 320
"""Enough that the kill lands while the instance is still generating (~1 ms a token)."""
KILL_AT = 24
TOP_P = Sampling(method="top-p", params={"p": 0.9}, seed=5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("torch-failover")
    model = init_model(folder / "model", **MODEL)  # type: ignore[arg-type]
    descriptor = descriptor_for(model, block_tokens=B)
    write_principals(
        folder / "principals",
        [
            principal_entry("admin", cluster_kit.ADMIN_TOKEN, ["admin"], None),
            principal_entry("client", cluster_kit.CLIENT_TOKEN, ["client"], [SCOPE]),
        ],
    )
    (folder / "admin.token").write_text(cluster_kit.ADMIN_TOKEN + "\n")
    (folder / "descriptor.json").write_text(json.dumps(descriptor.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    c = cluster_kit.Cluster(folder, httpx.Client(timeout=60))
    token = str(folder / "admin.token")
    described = ("--descriptor", str(folder / "descriptor.json"))
    instance = [
        *("--control", "", "--token-file", token, "--engine", "reference"),
        *("--model", str(model), "--block-tokens", str(B), "--kv-capacity-blocks", "256"),
        *("--scope-key-file", str(folder / "scope.key"), "--status-ttl-ms", "600"),
    ]
    try:
        c._serve("control", "control", *described, "--directive-token-file", token)
        c._serve("holder", "holder", "--index", c.control, "--index-token-file", token, *described)
        instance[1] = c.control
        with ThreadPoolExecutor(3) as pool:
            starts = [
                pool.submit(c._serve, name, "instance", *instance, "--replica-holder", c.holder)
                for name in ("a", "b", "c")
            ]
            for start in starts:
                start.result()
        c.model = model
        yield c
    finally:
        c.stop()
        c.http.close()


def reference(model: Path, prompt: list[int], sampling: Sampling) -> list[int]:
    async def run() -> list[int]:
        engine = TorchEngine(model, num_pages=64, block_tokens=B)
        try:
            seq = await engine.prefill(prompt, [])
            return [t async for t in seq.tokens(TOKENS, sampling)]
        finally:
            await engine.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("sampling", [GREEDY, TOP_P], ids=["greedy", "top-p"])
def test_a_killed_reference_instance_is_resumed_token_for_token(
    cluster: Any, sampling: Sampling
) -> None:
    prompt = [(97 * i + 13 * len(sampling.method)) % 4_000 for i in range(3 * B + 3)]
    expected = reference(cluster.model, prompt, sampling)
    assert len(set(expected)) > 10  # a varied output, not a fixed point that hides errors
    killed: list[str] = []

    async def generate() -> list[Any]:
        delivered = []
        config = FrontendConfig(stall_s=0.3, poll_s=0.03, poll_max_s=0.2, reattach_s=60)
        async with FrontEnd(
            cluster.control,
            cluster_kit.CLIENT_TOKEN,
            scope_id=SCOPE,
            compat_id=compat_id(descriptor_for(cluster.model, block_tokens=B)),
            block_tokens=B,
            scope_key=SCOPE_KEY,
            config=config,
        ) as fe:
            sampler = {"method": sampling.method, "params": dict(sampling.params)}
            sampler["seed"] = sampling.seed
            async for token in fe.generate(prompt, TOKENS, sampler):
                delivered.append(token)
                if token.index == KILL_AT and not killed and fe.current is not None:
                    killed.append(cluster.name_of(fe.current))
                    cluster.kill(killed[0])
        return delivered

    delivered = asyncio.run(generate())
    assert [t.index for t in delivered] == list(range(TOKENS))
    assert [t.token for t in delivered] == expected
    assert delivered[-1].epoch >= 2  # the kill landed mid-generation and the session moved
    assert {t.instance for t in delivered if t.epoch >= 2} & {cluster.url(killed[0])} == set()
