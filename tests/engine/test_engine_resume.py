"""Resuming a session on the torch reference engine (spec §6.8 steps 1-4; DESIGN.md §6).

A second engine over the same seeded checkpoint takes the prompt's blocks as containers (their
tokens unknown), computes the prompt tail as a prefill, replays the delivered output tokens by
decode steps, and restarts the sampler at ``output_offset``: its tokens equal the uninterrupted
run's, for greedy and seeded top-p sampling, with the generated blocks loaded or recomputed,
and at a block boundary or inside a block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.container import Geometry, decode_container  # noqa: E402
from kvsp.engine.api import GREEDY, Sampling  # noqa: E402
from kvsp.engine.checkpoint import init_model  # noqa: E402
from kvsp.engine.reference import TorchEngine  # noqa: E402
from kvsp.errors import BadRequest, LayersUnavailable  # noqa: E402
from kvsp.records import Sampler, SessionCheckpoint  # noqa: E402
from kvsp.sessions import plan_resume  # noqa: E402

T = TypeVar("T")
B = 8
PROMPT = [(37 * i + 11) % 250 for i in range(3 * B + 3)]
COUNT = 20
TOP_P = Sampling(method="top-p", params={"p": 0.9}, seed=7)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("resume-model")
    yield init_model(folder / "model", seed=5, layers=2, hidden=64, heads=4, kv_heads=2)


def engine(model: Path) -> TorchEngine:
    return TorchEngine(model, num_pages=64, block_tokens=B)


async def uninterrupted(model: Path, sampling: Sampling) -> tuple[list[int], list[bytes]]:
    """The tokens of a run from scratch and the containers of its complete blocks."""
    e = engine(model)
    try:
        seq = await e.prefill(PROMPT, [])
        tokens = [t async for t in seq.tokens(COUNT, sampling)]
        complete = (len(PROMPT) + COUNT - 1) // B
        blocks = [await seq.block(i) for i in range(complete)]
        with pytest.raises(LayersUnavailable):
            await seq.block(complete)  # the last token's KV is not computed yet
        await seq.release()
        return tokens, blocks
    finally:
        await e.aclose()


def checkpoint_at(tokens: list[int], offset: int) -> SessionCheckpoint:
    import uuid

    return SessionCheckpoint(
        session=uuid.uuid4(),
        epoch=1,
        compat_id=bytes(32),  # type: ignore[arg-type]
        scope_id=bytes(16),  # type: ignore[arg-type]
        prompt_blocks=tuple(bytes([i]) * 32 for i in range(3)),  # type: ignore[misc]
        prompt_tail=tuple(PROMPT[3 * B :]),
        generated=tuple(tokens[:offset]),
        output_offset=offset,
        sampler=Sampler(method="greedy", step=offset, deterministic=True),
        max_tokens=COUNT,
    )


@pytest.mark.parametrize("sampling", [GREEDY, TOP_P], ids=["greedy", "top-p"])
@pytest.mark.parametrize("offset", [6, 13], ids=["boundary", "inside"])
@pytest.mark.parametrize("load_generated", [True, False], ids=["loaded", "recomputed"])
def test_resumed_tokens_equal_the_uninterrupted_run(
    model: Path, sampling: Sampling, offset: int, load_generated: bool
) -> None:
    async def scenario() -> None:
        expected, blocks = await uninterrupted(model, sampling)
        plan = plan_resume(checkpoint_at(expected, offset), B)
        generated = plan.loadable if load_generated else 0
        prefill, replay = plan.split(generated)
        resumed = engine(model)
        try:
            geometry = Geometry.from_descriptor(resumed.descriptor)
            loaded = [decode_container(b, geometry) for b in blocks[: 3 + generated]]
            seq = await resumed.resume(loaded, prefill, replay)
            assert seq.loaded_blocks == 3 + generated
            rest = [t async for t in seq.tokens(COUNT - offset, sampling, step=offset)]
            assert rest == expected[offset:]
            # the blocks it completes are the original run's, bit for bit
            assert await seq.block(3 + generated) == blocks[3 + generated]
            await seq.release()
        finally:
            await resumed.aclose()

    run(scenario())


def test_resume_needs_something_to_compute(model: Path) -> None:
    async def scenario() -> None:
        e = engine(model)
        try:
            with pytest.raises(BadRequest):
                await e.resume([], [], [])
            with pytest.raises(BadRequest):
                await e.resume([], [], [1_000_000])  # outside the vocabulary
        finally:
            await e.aclose()

    run(scenario())
