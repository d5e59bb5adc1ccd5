"""The transformers engine over tiny Hugging Face checkpoints of several families (spec §4.1,
§4.3, §6.5, §6.7, §6.8; DESIGN.md §5–6).

For each family: the Compatibility Descriptor comes from the files (same files, same id; a
changed weight file, tokenizer or rope theta, another id); blocks computed by one engine and
loaded into another give the same greedy tokens as a full recompute, with logits and KV bytes
bit-identical on one machine (prefill runs in block-aligned chunks either way), and within
1e-4 of one plain transformers forward over the whole prompt; a corrupted layer is caught by
its digest and the block recomputed; a resumed session continues the uninterrupted run's
tokens. Models whose KV the descriptor would describe wrongly are refused at start-up, naming
the feature.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
import warnings
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

torch = pytest.importorskip("torch", reason="the transformers engine needs the torch extra")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip(
        "transformers", reason="the transformers engine needs the transformers extra"
    )

from kvsp.compat import compat_id  # noqa: E402
from kvsp.container import Geometry, decode_container  # noqa: E402
from kvsp.engine.api import GREEDY, Sampling  # noqa: E402
from kvsp.engine.hf_checkpoint import (  # noqa: E402
    UnsupportedModel,
    check_supported,
    describe_checkpoint,
)
from kvsp.engine.transformers_engine import HFCore, HFEngine  # noqa: E402
from kvsp.errors import BadRequest, DigestMismatch, Incompatible, LayersUnavailable  # noqa: E402
from kvsp.records import Sampler, SessionCheckpoint  # noqa: E402
from kvsp.services.instance.app import configure_parser, make_engine  # noqa: E402
from kvsp.sessions import plan_resume  # noqa: E402
from tests.support.hf_models import FAMILIES, make_config, write_checkpoint  # noqa: E402

torch.set_num_threads(1)
T = TypeVar("T")
B = 8
PROMPT = [(37 * i + 11) % 250 for i in range(3 * B + 3)]  # 3 complete blocks and 3 tail tokens
LOADED = 2
COUNT = 12
RESUMED = 20
TOP_P = Sampling(method="top-p", params={"p": 0.9}, seed=7)
TOLERANCE = 1e-4
"""Max |Δlogit| between the engine's block-aligned chunks and one transformers forward."""


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: write_checkpoint(family, root / family / "model") for family in FAMILIES}


def engine(folder: Path) -> HFEngine:
    return HFEngine(folder, num_pages=32, block_tokens=B)


# -- the descriptor (§4.1) --------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_descriptor_is_stable_and_follows_the_files(family: str, tmp_path: Path) -> None:
    base = describe_checkpoint(write_checkpoint(family, tmp_path / "a" / "m"), block_tokens=B)
    # the same files in a folder of another name, elsewhere: the same identity
    again = describe_checkpoint(write_checkpoint(family, tmp_path / "b" / "x"), block_tokens=B)
    assert again == base and compat_id(again) == compat_id(base)
    config = make_config(family)
    assert (base.layers, base.kv_heads) == (config.num_hidden_layers, config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert base.head_dim == head_dim and base.positional == "rope;theta=10000"

    weights = describe_checkpoint(
        write_checkpoint(family, tmp_path / "c" / "m", seed=1), block_tokens=B
    )
    assert weights.model_digest != base.model_digest

    theta = describe_checkpoint(
        write_checkpoint(family, tmp_path / "d" / "m", rope_theta=5e5), block_tokens=B
    )
    assert theta.positional == "rope;theta=500000" and theta.model_digest == base.model_digest

    tok = write_checkpoint(family, tmp_path / "e" / "m")
    text = (tok / "tokenizer.json").read_text()
    (tok / "tokenizer.json").write_text(text.replace('"<pad>"', '"<unk>"'))
    tokenizer = describe_checkpoint(tok, block_tokens=B)
    cfg = write_checkpoint(family, tmp_path / "f" / "m")
    obj = json.loads((cfg / "tokenizer_config.json").read_text())
    (cfg / "tokenizer_config.json").write_text(json.dumps({**obj, "add_bos_token": True}))
    tokenizer_config = describe_checkpoint(cfg, block_tokens=B)
    assert tokenizer.tokenizer_digest != base.tokenizer_digest
    assert tokenizer_config.tokenizer_digest not in {
        base.tokenizer_digest,
        tokenizer.tokenizer_digest,
    }

    # a config.json member outside the geometry and positional members (what §4.1 calls
    # "every parameter that affects the stored tensors") goes into `model`
    eps = describe_checkpoint(
        write_checkpoint(family, tmp_path / "g" / "m", rms_norm_eps=1e-2), block_tokens=B
    )
    assert eps.model != base.model and eps.model_digest == base.model_digest
    assert base.model.startswith(f"{config.model_type}#config=sha-256:")

    described = (base, weights, theta, tokenizer, tokenizer_config, eps)
    ids = {compat_id(d) for d in described}
    assert len(ids) == len(described)
    assert compat_id(describe_checkpoint(tmp_path / "a" / "m", block_tokens=2 * B)) not in ids


# -- reuse of loaded blocks (§4.3, §6.5) --------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_blocks_give_the_recomputed_tokens_bit_for_bit(
    family: str, checkpoints: dict[str, Path]
) -> None:
    folder = checkpoints[family]

    async def scenario() -> None:
        a, b = engine(folder), engine(folder)
        try:
            assert a.descriptor == b.descriptor
            seq_a = await a.prefill(PROMPT, [])
            tokens_a = [t async for t in seq_a.tokens(COUNT)]
            computed = [x.container for x in seq_a.computed]
            assert [x.index for x in seq_a.computed] == [0, 1, 2]

            geometry = Geometry.from_descriptor(b.descriptor)
            loaded = [decode_container(c, geometry) for c in computed[:LOADED]]
            seq_b = await b.prefill(PROMPT, loaded)
            assert seq_b.loaded_blocks == LOADED
            # the blocks B computes after the loaded ones are A's, octet for octet
            assert [x.index for x in seq_b.computed] == [LOADED]
            assert seq_b.computed[0].container == computed[LOADED]
            assert [await seq_b.block(i) for i in range(3)] == computed
            assert [t async for t in seq_b.tokens(COUNT)] == tokens_a

            full = await b.prefill(PROMPT, [])
            assert [x.container for x in full.computed] == computed
            assert [t async for t in full.tokens(COUNT)] == tokens_a
            for seq in (seq_a, seq_b, full):
                await seq.release()
            assert b.stats().kv_utilization == 0
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_with_a_loaded_prefix_equal_the_recompute(
    family: str, checkpoints: dict[str, Path]
) -> None:
    folder = checkpoints[family]
    a, b = (
        HFCore(folder, num_pages=16, block_tokens=B),
        HFCore(folder, num_pages=16, block_tokens=B),
    )
    seq_a = a.new_sequence()
    full = a.prefill(seq_a, PROMPT)
    blocks = [a.block_container(seq_a, i) for i in range(3)]
    with pytest.raises(LayersUnavailable):
        a.block_container(seq_a, 3)  # 3 tail tokens: not a complete block

    seq_b = b.new_sequence()
    pages = [b.import_block(x) for x in blocks[:LOADED]]
    part = b.prefill(seq_b, PROMPT, loaded_prefix_pages=pages)
    assert torch.equal(part, full)  # bit-exact, not merely close
    assert seq_b.pages[:LOADED] == pages

    # every block loaded: the last one is recomputed for the last token's logits
    seq_c = b.new_sequence()
    every = [b.import_block(x) for x in blocks]
    assert torch.equal(
        b.prefill(seq_c, PROMPT[: 3 * B], loaded_prefix_pages=every), _logits(a, PROMPT[: 3 * B])
    )
    assert b.block_container(seq_c, 2) == blocks[2]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", dtype=torch.float32
        ).eval()
    with torch.no_grad():
        reference = plain(torch.tensor([PROMPT])).logits[0, -1]
    assert float((reference - full).abs().max()) < TOLERANCE
    for core, seq in ((a, seq_a), (b, seq_b), (b, seq_c)):
        core.free(seq)
    assert b.cache.used_pages == 0


def _logits(core: HFCore, tokens: list[int]) -> Any:
    seq = core.new_sequence()
    try:
        return core.prefill(seq, tokens)
    finally:
        core.free(seq)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_corrupted_layer_is_caught_and_its_block_recomputed(
    family: str, checkpoints: dict[str, Path]
) -> None:
    folder = checkpoints[family]
    a, b = (
        HFCore(folder, num_pages=16, block_tokens=B),
        HFCore(folder, num_pages=16, block_tokens=B),
    )
    seq_a = a.new_sequence()
    full = a.prefill(seq_a, PROMPT)
    blocks = [a.block_container(seq_a, i) for i in range(3)]
    digests = [decode_container(x, a.geometry).layer_digests() for x in blocks]

    bad = bytearray(blocks[1])
    layer1 = decode_container(blocks[1], a.geometry).layers[1]
    offset = len(bad) - 2 * layer1.k.nbytes  # the last layer (1) starts here: flip its K
    bad[offset + 5] ^= 0x40
    load = b.load_prefix([blocks[0], bytes(bad), blocks[2]], digests)
    assert isinstance(load.error, DigestMismatch) and "layer 1" in load.error.detail
    assert len(load.pages) == 1  # block 1 and every block after it are left to the prefill

    seq_b = b.new_sequence()
    assert torch.equal(b.prefill(seq_b, PROMPT, loaded_prefix_pages=load.pages), full)
    assert [b.block_container(seq_b, i) for i in range(3)] == blocks
    b.free(seq_b)
    assert b.cache.used_pages == 0


def test_a_block_of_another_geometry_is_refused(checkpoints: dict[str, Path]) -> None:
    other = HFCore(checkpoints["gemma"], num_pages=4, block_tokens=B)  # head_dim 24, not 16
    block = _block(other)

    async def scenario() -> None:
        e = engine(checkpoints["llama"])
        try:
            with pytest.raises(Incompatible):
                await e.prefill(PROMPT, [decode_container(block)])
            with pytest.raises(BadRequest):
                await e.prefill([300], [])  # outside the 259 ids
        finally:
            await e.aclose()

    run(scenario())


def _block(core: HFCore) -> bytes:
    seq = core.new_sequence()
    core.prefill(seq, PROMPT[:B])
    try:
        return core.block_container(seq, 0)
    finally:
        core.free(seq)


# -- refused models --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "overrides", "feature"),
    [
        ("mistral", {"sliding_window": 8}, "sliding window"),
        ("mistral", {"sliding_window": 4096}, "sliding window"),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            "sliding window",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type 'dynamic'",
        ),
        ("llama", {"partial_rotary_factor": 0.5}, "partial rotary"),
        ("qwen2", {"layer_types": ["full_attention", "linear_attention"]}, "'linear_attention'"),
    ],
    ids=[
        "mistral-window",
        "mistral-wide-window",
        "qwen2-window",
        "dynamic-rope",
        "partial-rotary",
        "linear-attention",
    ],
)
def test_a_model_the_descriptor_cannot_describe_is_refused_at_start_up(
    family: str, overrides: dict[str, Any], feature: str, tmp_path: Path
) -> None:
    folder = write_checkpoint(family, tmp_path / "m", **overrides)
    with pytest.raises(UnsupportedModel, match=feature):
        HFEngine(folder, block_tokens=B)
    with pytest.raises(UnsupportedModel, match=feature):
        make_engine(_args(folder))


def test_a_window_the_config_does_not_use_is_accepted(tmp_path: Path) -> None:
    folder = write_checkpoint("qwen2", tmp_path / "m", sliding_window=8, use_sliding_window=False)
    assert HFCore(folder, num_pages=4, block_tokens=B).descriptor.layers == 2


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (lambda: transformers.T5Config(), "encoder-decoder"),
        (lambda: transformers.GPT2Config(), "other than RoPE"),
    ],
    ids=["t5", "gpt2"],
)
def test_configs_without_a_describable_cache_are_refused(config: Any, feature: str) -> None:
    with pytest.raises(UnsupportedModel, match=feature):
        check_supported(config())


# -- the command line -----------------------------------------------------------------------


def _args(folder: Path | None, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    model = ["--model", str(folder)] if folder is not None else []
    base = ["--control", "http://127.0.0.1:1", "--token-file", "t", "--engine", "transformers"]
    return parser.parse_args([*base, *model, "--block-tokens", str(B), *extra])


def test_serve_instance_engine_transformers(checkpoints: dict[str, Path]) -> None:
    made = make_engine(_args(checkpoints["qwen3"]))
    try:
        assert isinstance(made, HFEngine)
        assert made.descriptor == describe_checkpoint(checkpoints["qwen3"], block_tokens=B)
    finally:
        run(made.aclose())
    with pytest.raises(BadRequest, match="--model"):
        make_engine(_args(None))
    with pytest.raises(BadRequest, match="fp32"):
        make_engine(_args(checkpoints["qwen3"], "--kv-dtype", "bf16"))


def test_a_missing_extra_is_named(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(BadRequest, match=r"kvsp\[transformers\]"):
        make_engine(_args(checkpoints["qwen3"]))


# -- resume (§6.8) ----------------------------------------------------------------------------


async def uninterrupted(folder: Path, sampling: Sampling) -> tuple[list[int], list[bytes]]:
    """The tokens of a run from scratch and the containers of its complete blocks."""
    e = engine(folder)
    try:
        seq = await e.prefill(PROMPT, [])
        tokens = [t async for t in seq.tokens(RESUMED, sampling)]
        complete = (len(PROMPT) + RESUMED - 1) // B
        blocks = [await seq.block(i) for i in range(complete)]
        with pytest.raises(LayersUnavailable):
            await seq.block(complete)  # the last token's KV is not computed yet
        await seq.release()
        return tokens, blocks
    finally:
        await e.aclose()


def checkpoint_at(tokens: list[int], offset: int) -> SessionCheckpoint:
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
        max_tokens=RESUMED,
    )


RESUME_CASES = [
    pytest.param(family, sampling, offset, load, id=f"{family}-{name}-{where}-{how}")
    for family in FAMILIES
    for name, sampling in (("greedy", GREEDY), ("top-p", TOP_P))
    for where, offset in (("boundary", 6), ("inside", 13))
    for how, load in (("loaded", True), ("recomputed", False))
    if family in {"llama", "gemma"} or (name == "greedy") == (offset == 6) == load
]


@pytest.mark.parametrize(("family", "sampling", "offset", "load_generated"), RESUME_CASES)
def test_resumed_tokens_equal_the_uninterrupted_run(
    family: str,
    sampling: Sampling,
    offset: int,
    load_generated: bool,
    checkpoints: dict[str, Path],
) -> None:
    folder = checkpoints[family]

    async def scenario() -> None:
        expected, blocks = await uninterrupted(folder, sampling)
        plan = plan_resume(checkpoint_at(expected, offset), B)
        generated = plan.loadable if load_generated else 0
        prefill, replay = plan.split(generated)
        resumed = engine(folder)
        try:
            geometry = Geometry.from_descriptor(resumed.descriptor)
            loaded = [decode_container(x, geometry) for x in blocks[: 3 + generated]]
            seq = await resumed.resume(loaded, prefill, replay)
            assert seq.loaded_blocks == 3 + generated
            rest = [t async for t in seq.tokens(RESUMED - offset, sampling, step=offset)]
            assert rest == expected[offset:]
            # the blocks it completes are the original run's, bit for bit
            assert await seq.block(3 + generated) == blocks[3 + generated]
            await seq.release()
        finally:
            await resumed.aclose()

    run(scenario())


def test_resume_needs_something_to_compute(checkpoints: dict[str, Path]) -> None:
    async def scenario() -> None:
        e = engine(checkpoints["llama"])
        try:
            with pytest.raises(BadRequest):
                await e.resume([], [], [])
            with pytest.raises(BadRequest):
                await e.resume([], [], [1_000_000])  # outside the vocabulary
        finally:
            await e.aclose()

    run(scenario())
