"""A Llama-family decoder over the paged KV cache (DESIGN.md §6).

RMSNorm, RoPE (:mod:`kvsp.engine.rope`), grouped-query attention and a SwiGLU MLP, in the
tensor names and orientation of Hugging Face Llama checkpoints (``y = x @ W.T``). One forward
pass takes n new tokens of one sequence starting at position ``start``: their K and V go into
the sequence's pages first, then attention reads K and V of all ``start + n`` tokens back from
the pages, so a prefix whose pages were loaded from elsewhere is consumed exactly like one
computed here. Before reading layer l it calls ``wait(l)``, which lets loading of layer l of a
prefix overlap the computation of the layers before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvsp.engine.config import ModelConfig
from kvsp.engine.kvcache import PagedKVCache
from kvsp.engine.rope import Rope, apply_rope

ATTEND_SCORES = 1 << 26
"""Attention scores (floats) computed at once: 256 MiB; longer prompts go in query slices."""

LAYER_TENSORS = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
}
"""Short name → Hugging Face name (after ``model.layers.N.``) of each per-layer tensor."""


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's tensors."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


@dataclass(frozen=True, slots=True)
class Weights:
    """All tensors of a Llama-family model; ``lm_head`` is ``embed`` when tied."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name → shape, for every tensor the model needs."""
    c = config
    hd, h, kvh = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    per_layer: dict[str, tuple[int, ...]] = {
        "q": (h * hd, c.hidden_size),
        "k": (kvh * hd, c.hidden_size),
        "v": (kvh * hd, c.hidden_size),
        "o": (c.hidden_size, h * hd),
        "gate": (c.intermediate_size, c.hidden_size),
        "up": (c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "input_norm": (c.hidden_size,),
        "post_norm": (c.hidden_size,),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    shapes["model.embed_tokens.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        for short, name in LAYER_TENSORS.items():
            shapes[f"model.layers.{i}.{name}"] = per_layer[short]
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as Llama does."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class LlamaModel:
    """The decoder: weights, RoPE tables and the forward pass over paged KV."""

    def __init__(self, config: ModelConfig, weights: Weights, rope: Rope | None = None) -> None:
        self.config = config
        self.weights = weights
        self.rope = rope or Rope.from_config(config)
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.inv_freq = self.rope.inverse_frequencies(self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        *,
        start: int,
        pages: torch.Tensor,
        cache: PagedKVCache,
        wait: Callable[[int], None] | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits for ``tokens [n]`` at positions ``start ..``; K and V go into ``pages``.

        ``pages`` is the sequence's page table covering ``start + n`` tokens; pages that
        hold positions before ``start`` must already hold their K and V (or be loading,
        with ``wait`` guarding each layer). Returns ``[n, vocab]`` logits, or ``[1, vocab]``
        for the last token unless ``all_logits``.
        """
        c, w = self.config, self.weights
        n = int(tokens.shape[0])
        total = start + n
        block = cache.block_tokens
        positions = torch.arange(start, total, device=self.device)
        cos, sin = self.rope.cos_sin(positions, self.inv_freq, self.dtype)
        page_of = pages[positions // block]
        slots = positions % block
        used = pages[: -(-total // block)]
        causal = positions if n > 1 else None  # query i sees keys up to position start + i
        h = F.embedding(tokens, w.embed)
        for index, layer in enumerate(w.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            q = F.linear(x, layer.q).view(n, c.num_attention_heads, c.head_dim)
            k = F.linear(x, layer.k).view(n, c.num_key_value_heads, c.head_dim)
            v = F.linear(x, layer.v).view(n, c.num_key_value_heads, c.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(index, page_of, slots, k, v)
            if wait is not None:
                wait(index)
            keys_l, values_l = cache.gather(index, used, total, self.dtype)
            h = h + F.linear(self._attend(q, keys_l, values_l, causal), layer.o)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            h = h + F.linear(F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up), layer.down)
        h = rms_norm(h if all_logits else h[-1:], w.norm, c.rms_norm_eps)
        return F.linear(h, w.lm_head)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Grouped-query attention: query head j reads KV head j // group_size; with
        ``positions`` (one per query) query i sees the keys up to ``positions[i]``.

        The scores of all queries against all keys take ``heads * n * total`` floats (17 GiB
        for a 32k-token prompt with 4 heads), so beyond :data:`ATTEND_SCORES` they are
        computed for slices of the queries in turn. Each query's row is the same sum either
        way; the BLAS may block it differently (about 1e-6 on logits of magnitude 4).
        """
        n, heads = q.shape[0], self.config.num_attention_heads
        total = k.shape[0]
        rows = max(1, ATTEND_SCORES // (heads * total))
        if n <= rows:
            return self._attend_rows(q, k, v, positions)
        return torch.cat(
            [
                self._attend_rows(
                    q[a : a + rows], k, v, None if positions is None else positions[a : a + rows]
                )
                for a in range(0, n, rows)
            ]
        )

    def _attend_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        c = self.config
        n, kvh, group, hd = q.shape[0], c.num_key_value_heads, c.group_size, c.head_dim
        qg = q.view(n, kvh, group, hd).permute(1, 2, 0, 3)  # [kvh, group, n, hd]
        kt = k.permute(1, 2, 0)[:, None]  # [kvh, 1, hd, total]
        scores = torch.matmul(qg, kt) * (hd**-0.5)
        if positions is not None:
            keys = torch.arange(k.shape[0], device=k.device)
            scores = scores.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v.permute(1, 0, 2)[:, None])  # [kvh, group, n, hd]
        return out.permute(2, 0, 1, 3).reshape(n, kvh * group * hd)
