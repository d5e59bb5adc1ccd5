"""RoPE with the descriptor's positional parameters matches the direct formula (spec §4.1)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference engine needs the torch extra")
pytest.importorskip("safetensors", reason="the reference engine needs the engine extra")

from kvsp.engine.checkpoint import init_model  # noqa: E402
from kvsp.engine.config import RopeScaling  # noqa: E402
from kvsp.engine.engine import Engine  # noqa: E402
from kvsp.engine.rope import Rope, apply_rope  # noqa: E402
from kvsp.errors import BadRequest, DescriptorError  # noqa: E402

torch.set_num_threads(1)
HEAD_DIM = 16


def _direct(x: np.ndarray, position: int, theta: float) -> np.ndarray:
    """Pair (i, i + d/2) rotated by position · θ^(-2i/d), in float64."""
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for i in range(half):
        angle = position * theta ** (-2.0 * i / x.shape[-1])
        c, s = math.cos(angle), math.sin(angle)
        out[..., i] = x[..., i] * c - x[..., i + half] * s
        out[..., i + half] = x[..., i + half] * c + x[..., i] * s
    return out


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 1234.5])
def test_rope_from_descriptor_matches_the_formula(tmp_path: Path, theta: float) -> None:
    folder = init_model(
        tmp_path, seed=1, layers=1, hidden=64, heads=4, kv_heads=2, rope_theta=theta
    )
    engine = Engine(folder, num_pages=2, block_tokens=4)
    rope = Rope.from_positional(engine.descriptor.positional, HEAD_DIM)
    assert rope.theta == theta and rope == engine.model.rope
    rng = np.random.default_rng(0)
    positions = [0, 1, 7, 100, 255]
    x = rng.standard_normal((len(positions), 3, HEAD_DIM))
    cos, sin = rope.cos_sin(torch.tensor(positions), rope.inverse_frequencies(), torch.float32)
    ours = apply_rope(torch.tensor(x, dtype=torch.float32), cos, sin).double().numpy()
    expected = np.stack([_direct(x[i], p, theta) for i, p in enumerate(positions)])
    # float32 angles: |error| ≤ position · 2^-23 rad per pair, so about 3e-5 at 255
    assert np.max(np.abs(ours - expected)) < 1e-4
    assert np.max(np.abs(ours[:3] - expected[:3])) < 2e-6


def _llama3_direct(theta: float, s: RopeScaling) -> list[float]:
    out = []
    for i in range(HEAD_DIM // 2):
        freq = theta ** (-2.0 * i / HEAD_DIM)
        wavelen = 2 * math.pi / freq
        low = s.original_max_position_embeddings / s.low_freq_factor
        high = s.original_max_position_embeddings / s.high_freq_factor
        if wavelen < high:
            out.append(freq)
        elif wavelen > low:
            out.append(freq / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


def test_llama3_and_linear_scaling() -> None:
    bands = RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    rope = Rope.from_positional("rope;factor=8;scaling=llama3;theta=500000", HEAD_DIM, bands)
    assert rope.scaling == bands
    got = rope.inverse_frequencies().double().numpy()
    expected = np.array(_llama3_direct(500000.0, bands))
    assert np.allclose(got, expected, rtol=1e-6, atol=0)
    plain = Rope(HEAD_DIM, 500000.0).inverse_frequencies().double().numpy()
    assert got[0] == plain[0] and got[-1] < plain[-1]  # high band untouched, low band scaled
    linear = Rope.from_positional("rope;factor=2;scaling=linear;theta=10000", HEAD_DIM)
    base = Rope(HEAD_DIM, 10000.0).inverse_frequencies()
    assert torch.equal(linear.inverse_frequencies(), base / 2)
    default = Rope.from_positional("rope;factor=8;scaling=llama3;theta=500000", HEAD_DIM)
    assert default.scaling is not None and default.scaling.original_max_position_embeddings == 8192


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("alibi", BadRequest),
        ("rope;scaling=yarn", BadRequest),
        ("rope;theta=abc", DescriptorError),
        ("rope;theta=1;factor=2", DescriptorError),
    ],
)
def test_unsupported_positional(text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        Rope.from_positional(text, HEAD_DIM)
