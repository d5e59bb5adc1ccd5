"""The simulated cluster's parameters: a frozen dataclass with documented defaults, read from a
JSON or TOML parameter file (see the package docstring for what each number stands for).

A parameter file holds any subset of the fields of :class:`ClusterConfig` as top-level members;
the others keep their defaults. Unknown members are refused (a typo would otherwise silently
leave a default in place).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp.errors import BadRequest

TRACE_BLOCK_TOKENS = 512
"""The Mooncake traces name one hash id per 512-token block."""


class ConfigError(BadRequest):
    """A cluster parameter file or value that cannot be used."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """Everything the simulator needs to know about the cluster (defaults: see the package
    docstring, "The documented cluster")."""

    instances: int = 7
    # model geometry (LLaMA-2-70B: 80 layers, GQA with 8 KV heads of 128, bf16)
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    block_tokens: int = TRACE_BLOCK_TOKENS
    # prefill time model: overhead + per token + per (new token, attended token) pair
    prefill_overhead_us: float = 20_000.0
    prefill_us_per_token: float = 125.0
    prefill_us_per_pair: float = 0.00234
    reference_tokens: int = 8192
    layerwise_overlap: bool = True
    # per-instance KV pool and network
    cache_blocks: int = 4096
    nic_mbit_per_s: float = 800_000.0
    rtt_us: float = 20.0
    # optional shared holder tier ("store"); 0 blocks = none
    store_blocks: int = 0
    store_nic_mbit_per_s: float = 400_000.0
    store_read_mbit_per_s: float | None = None
    store_rtt_us: float = 30.0

    def __post_init__(self) -> None:
        """Raises: ConfigError: a count below its minimum or a non-positive rate."""
        positive = ("instances", "layers", "kv_heads", "head_dim", "dtype_bytes")
        for name in (*positive, "block_tokens", "cache_blocks", "reference_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("nic_mbit_per_s", "store_nic_mbit_per_s", "prefill_us_per_token"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be positive and finite")
        nonneg = ("prefill_overhead_us", "prefill_us_per_pair", "rtt_us", "store_rtt_us")
        for name in (*nonneg, "store_blocks"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} must be finite and >= 0")
        if self.dtype_bytes not in (1, 2, 4):
            raise ConfigError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.store_read_mbit_per_s is not None and not self.store_read_mbit_per_s > 0:
            raise ConfigError("store_read_mbit_per_s must be positive when given")

    @property
    def block_bytes(self) -> int:
        """Octets of one block: K and V, every layer, ``block_tokens`` tokens."""
        per_token = 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
        return per_token * self.block_tokens

    def prefill_us(self, new_tokens: int, cached_tokens: int) -> float:
        """Time to prefill ``new_tokens`` after a resident prefix of ``cached_tokens``: overhead
        + linear work per new token + attention over ``new * cached + new**2 / 2`` pairs."""
        if new_tokens <= 0:
            return self.prefill_overhead_us
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2
        return (
            self.prefill_overhead_us
            + self.prefill_us_per_token * new_tokens
            + self.prefill_us_per_pair * pairs
        )

    @property
    def prefill_tokens_per_s(self) -> float:
        """The rate an instance reports (§4.4): ``reference_tokens`` over their prefill time."""
        return 1e6 * self.reference_tokens / self.prefill_us(self.reference_tokens, 0)

    def with_overrides(self, **values: Any) -> ClusterConfig:
        """A copy with the given fields replaced (``None`` values are skipped).

        Raises:
            ConfigError: an unknown field or a bad value.
        """
        given = {k: v for k, v in values.items() if v is not None}
        unknown = sorted(set(given) - _FIELDS)
        if unknown:
            raise ConfigError(f"unknown cluster parameter(s): {', '.join(unknown)}")
        try:
            return dataclasses.replace(self, **given)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None


_FIELDS = {f.name for f in dataclasses.fields(ClusterConfig)}


def load_config(path: str | Path) -> ClusterConfig:
    """Read a parameter file (``.toml`` as TOML, anything else as JSON) over the defaults.

    Raises:
        ConfigError: unreadable, malformed, not an object, an unknown member or a bad value.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        data: object = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: malformed: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected an object of cluster parameters")
    return ClusterConfig().with_overrides(**data)
