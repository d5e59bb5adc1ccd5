"""Rotary position embedding with the descriptor's parameters (spec §4.1 ``positional``).

``rope;theta=θ`` rotates dimension pair i of a head (the "rotate half" pairing of Llama
checkpoints: i and i + head_dim/2) by ``position × θ^(-2i/head_dim)``. ``scaling=linear``
divides every frequency by ``factor``; ``scaling=llama3`` divides only the low frequencies and
interpolates a middle band (Llama 3.1), with the band parameters from the model's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvsp.engine.config import ModelConfig, RopeScaling
from kvsp.errors import BadRequest
from kvsp.registries import parse_positional


@dataclass(frozen=True, slots=True)
class Rope:
    """RoPE for one head size: θ and an optional scaling."""

    head_dim: int
    theta: float
    scaling: RopeScaling | None = None

    @classmethod
    def from_config(cls, config: ModelConfig) -> Rope:
        """The RoPE of a checkpoint's ``config.json``."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling)

    @classmethod
    def from_positional(
        cls, positional: str, head_dim: int, bands: RopeScaling | None = None
    ) -> Rope:
        """The RoPE a descriptor's ``positional`` member names (§4.1); llama3 band parameters
        (which have no registered key) come from ``bands`` or take the Llama 3.1 defaults.

        Raises:
            DescriptorError: the string is not in the registered syntax.
            BadRequest: not ``rope``, or a scaling the engine does not implement.
        """
        name, params = parse_positional(positional, "$.positional")
        if name != "rope":
            raise BadRequest(f"the reference engine implements rope, not {name!r}")
        theta = float(params.get("theta", "10000"))
        kind = params.get("scaling")
        if kind is None:
            return cls(head_dim, theta)
        if kind not in ("linear", "llama3"):
            raise BadRequest(f"rope scaling {kind!r} is not implemented", path="$.positional")
        factor = float(params.get("factor", "1"))
        if bands is not None and bands.kind == kind:
            scaling = RopeScaling(
                kind=kind,
                factor=factor,
                low_freq_factor=bands.low_freq_factor,
                high_freq_factor=bands.high_freq_factor,
                original_max_position_embeddings=bands.original_max_position_embeddings,
            )
        else:
            scaling = RopeScaling(kind=kind, factor=factor)
        return cls(head_dim, theta, scaling)

    def inverse_frequencies(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The ``head_dim/2`` angular frequencies (float32), scaling applied."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32)
        inv = 1.0 / (self.theta ** (exponents / self.head_dim))
        s = self.scaling
        if s is not None and s.kind == "linear":
            inv = inv / s.factor
        elif s is not None and s.kind == "llama3":
            inv = _llama3(inv, s)
        return inv.to(device)

    def cos_sin(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, 1, head_dim]`` for integer ``positions [n]``."""
        freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    low_wavelen = old / s.low_freq_factor
    high_wavelen = old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [n, heads, head_dim]`` by the angles in ``cos``/``sin`` (rotate-half pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
