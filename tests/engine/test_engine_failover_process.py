"""§6.8 failover among real processes, for each engine: ``kvsp serve control``, a ``kvsp serve
holder`` keeping session replicas and three ``kvsp serve instance`` over one checkpoint, either
``--engine reference`` (a seeded ``kvsp model init`` checkpoint) or ``--engine transformers``
(tiny random Hugging Face checkpoints of two families, :mod:`tests.support.hf_models`). The
instance serving a generation is SIGKILLed mid-stream; the resumed instance loads the prompt's
and the generated blocks the killed one stored at the holder, replays the rest by decode steps
and samples on at ``output_offset``: the caller's tokens equal an uninterrupted in-process run
of the same engine over the same folder, for greedy and seeded top-p sampling.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.engine.api import GREEDY, InferenceEngine, Sampling  # noqa: E402
from kvsp.engine.checkpoint import descriptor_for, init_model  # noqa: E402
from kvsp.engine.reference import TorchEngine  # noqa: E402
from kvsp.keys import scope_id  # noqa: E402
from kvsp.services.frontend import FrontEnd, FrontendConfig  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from tests.support import cluster as cluster_kit  # noqa: E402

torch.set_num_threads(1)  # the in-process runs; the instances keep their own defaults
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

B = 8
SCOPE_KEY = bytes(range(150, 182))
SCOPE = scope_id(SCOPE_KEY)
MODEL = {"seed": 13, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 4_096}
TOKENS = 320
"""Enough that the kill lands while the instance is still generating (~1 ms a token on the
reference engine, a few on transformers); prompt and output stay within the Hugging Face
checkpoints' 512 positions."""
KILL_AT = 24
TOP_P = Sampling(method="top-p", params={"p": 0.9}, seed=5)
HF_FAMILIES = ("llama", "gemma")
"""Gemma adds a head_dim other than hidden / heads and tied embeddings to llama's layout."""


@dataclass(frozen=True)
class Checkpoint:
    """One engine's model folder, its descriptor and how to run it in process."""

    engine: str
    model: Path
    descriptor: CompatibilityDescriptor
    prompt_vocab: int
    """Prompt token ids stay below this (the HF checkpoints' byte tokens)."""

    def open(self) -> InferenceEngine:
        """A fresh in-process engine over the same folder."""
        if self.engine == "reference":
            return TorchEngine(self.model, num_pages=64, block_tokens=B)
        from kvsp.engine.transformers_engine import HFEngine

        return HFEngine(self.model, num_pages=64, block_tokens=B)


@dataclass(frozen=True)
class Failover:
    """The running processes of one engine case and the checkpoint they serve."""

    cluster: cluster_kit.Cluster
    checkpoint: Checkpoint


def checkpoint(case: str, folder: Path) -> Checkpoint:
    """Write the checkpoint of ``case`` ("reference" or an HF family) under ``folder``."""
    if case == "reference":
        model = init_model(folder / "model", **MODEL)  # type: ignore[arg-type]
        return Checkpoint("reference", model, descriptor_for(model, block_tokens=B), 4_000)
    pytest.importorskip("tokenizers", reason="the transformers engine needs its extra")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("transformers", reason="the transformers engine needs its extra")
    from kvsp.engine.hf_checkpoint import describe_checkpoint
    from tests.support.hf_models import write_checkpoint

    model = write_checkpoint(case, folder / "model", seed=13)
    return Checkpoint("transformers", model, describe_checkpoint(model, block_tokens=B), 256)


@pytest.fixture(scope="module", params=["reference", *HF_FAMILIES])
def failover(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Failover]:
    folder = tmp_path_factory.mktemp(f"failover-{request.param}")
    ckpt = checkpoint(request.param, folder)
    write_principals(
        folder / "principals",
        [
            principal_entry("admin", cluster_kit.ADMIN_TOKEN, ["admin"], None),
            principal_entry("client", cluster_kit.CLIENT_TOKEN, ["client"], [SCOPE]),
        ],
    )
    (folder / "admin.token").write_text(cluster_kit.ADMIN_TOKEN + "\n")
    (folder / "descriptor.json").write_text(json.dumps(ckpt.descriptor.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    c = cluster_kit.Cluster(folder, httpx.Client(timeout=60))
    token = str(folder / "admin.token")
    described = ("--descriptor", str(folder / "descriptor.json"))
    instance = [
        *("--control", "", "--token-file", token, "--engine", ckpt.engine),
        *("--model", str(ckpt.model), "--block-tokens", str(B), "--kv-capacity-blocks", "256"),
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
        yield Failover(c, ckpt)
    finally:
        c.stop()
        c.http.close()


def uninterrupted(ckpt: Checkpoint, prompt: list[int], sampling: Sampling) -> list[int]:
    """The tokens of one uninterrupted in-process run of ``ckpt``'s engine."""

    async def run() -> list[int]:
        engine = ckpt.open()
        try:
            seq = await engine.prefill(prompt, [])
            return [t async for t in seq.tokens(TOKENS, sampling)]
        finally:
            await engine.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("sampling", [GREEDY, TOP_P], ids=["greedy", "top-p"])
def test_a_killed_instance_is_resumed_token_for_token(
    failover: Failover, sampling: Sampling
) -> None:
    cluster, ckpt = failover.cluster, failover.checkpoint
    prompt = [(97 * i + 13 * len(sampling.method)) % ckpt.prompt_vocab for i in range(3 * B + 3)]
    expected = uninterrupted(ckpt, prompt, sampling)
    assert len(set(expected)) > 10  # a varied output, not a fixed point that hides errors
    killed: list[str] = []

    async def generate() -> list[Any]:
        delivered = []
        config = FrontendConfig(stall_s=0.3, poll_s=0.03, poll_max_s=0.2, reattach_s=60)
        async with FrontEnd(
            cluster.control,
            cluster_kit.CLIENT_TOKEN,
            scope_id=SCOPE,
            compat_id=compat_id(ckpt.descriptor),
            block_tokens=B,
            scope_key=SCOPE_KEY,
            config=config,
        ) as fe:
            sampler: dict[str, Any] = {"method": sampling.method, "params": dict(sampling.params)}
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
