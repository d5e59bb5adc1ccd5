"""The model configuration of a Llama-family checkpoint (``config.json``) and its §4.1 view.

Reads the members a Llama decoder needs from the usual Hugging Face ``config.json`` (unknown
members ignored) and renders the positional encoding as the descriptor's ``positional`` string
(spec §4.1, registry syntax ``rope;factor=…;scaling=…;theta=…``). Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp.errors import BadRequest, RecordError
from kvsp.fields import Fields

CONFIG_FILE = "config.json"
ROPE_SCALINGS = ("linear", "llama3")
"""The ``rope_scaling`` types the reference engine implements."""


class CheckpointError(BadRequest):
    """A checkpoint folder that cannot be loaded: bad ``config.json``, missing or misshapen
    tensors, unreadable files. The message names the file; ``path`` names the key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """A ``rope_scaling`` entry: ``linear`` (factor) or ``llama3`` (Llama 3.1 frequency bands)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What the reference engine reads from ``config.json`` (Llama family)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    name: str | None = None
    """``_name_or_path`` when present: the default ``model`` string of the descriptor."""

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def positional(self) -> str:
        """The §4.1 ``positional`` member: ``rope;theta=…`` plus ``factor``/``scaling`` if any.

        The llama3 band parameters (low/high frequency factors, original context) have no
        registered key; they are the model's own and travel with its ``config.json``.
        """
        params = {"theta": format_number(self.rope_theta)}
        if self.rope_scaling is not None:
            params["factor"] = format_number(self.rope_scaling.factor)
            params["scaling"] = self.rope_scaling.kind
        return "rope;" + ";".join(f"{k}={params[k]}" for k in sorted(params))

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` members, in the Hugging Face spelling."""
        obj: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.name is not None:
            obj["_name_or_path"] = self.name
        if (s := self.rope_scaling) is not None:
            obj["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
            if s.kind == "llama3":
                obj["rope_scaling"].update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings,
                )
        return obj


def format_number(value: float) -> str:
    """A number in the registry syntax: integral values without a fraction, else shortest repr."""
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def read_json_file(path: Path) -> Any:
    """Read one JSON file of a checkpoint.

    Raises:
        CheckpointError: the file cannot be read or is not JSON; the message names the file.
    """
    try:
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from exc
    except ValueError as exc:
        raise CheckpointError(f"{path}: not JSON: {exc}") from exc


def read_config(folder: str | Path) -> ModelConfig:
    """Read and check ``config.json`` in a checkpoint folder.

    Raises:
        CheckpointError: the file is missing or not JSON, a member is missing or has the wrong
            type, or the shapes disagree; the message names the file, ``path`` the key.
    """
    path = Path(folder) / CONFIG_FILE
    obj = read_json_file(path)
    try:
        return parse_config(obj)
    except RecordError as exc:
        raise CheckpointError(f"{path}: {exc.detail}", path=exc.path) from None


def parse_config(obj: object) -> ModelConfig:
    """Build a :class:`ModelConfig` from parsed ``config.json``; unknown members are ignored.

    Raises:
        RecordError: a member is missing, of the wrong type or inconsistent; ``path`` names it.
    """
    f = Fields(obj)
    hidden = f.integer("hidden_size", minimum=1)
    heads = f.integer("num_attention_heads", minimum=1)
    kv_heads = f.integer("num_key_value_heads", minimum=1, optional=True) or heads
    head_dim = f.integer("head_dim", minimum=1, optional=True, nullable=True)
    if head_dim is None:
        if hidden % heads:
            raise RecordError(
                f"absent, and hidden_size {hidden} is not a multiple of {heads} heads",
                path=f.at("head_dim"),
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise RecordError(
            f"{heads} attention heads are not a multiple of {kv_heads} KV heads",
            path=f.at("num_key_value_heads"),
        )
    if head_dim % 2:
        raise RecordError(f"RoPE needs an even head_dim, got {head_dim}", path=f.at("head_dim"))
    name = f.string("_name_or_path", optional=True, nullable=True)
    return ModelConfig(
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size", minimum=1),
        num_hidden_layers=f.integer("num_hidden_layers", minimum=1),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive(f, "rms_norm_eps", 1e-6),
        rope_theta=_positive(f, "rope_theta", 10000.0),
        rope_scaling=_rope_scaling(f),
        vocab_size=f.integer("vocab_size", minimum=1),
        tie_word_embeddings=_bool(f, "tie_word_embeddings", False),
        max_position_embeddings=f.integer("max_position_embeddings", minimum=1, optional=True)
        or 2048,
        name=name or None,
    )


def _positive(f: Fields, key: str, default: float) -> float:
    value = f.number(key, optional=True, nullable=True)
    if value is None:
        return default
    if value <= 0:
        raise RecordError("must be a positive number", path=f.at(key))
    return float(value)


def _bool(f: Fields, key: str, default: bool) -> bool:
    value = f.boolean(key, optional=True)
    return default if value is None else bool(value)


def _rope_scaling(f: Fields) -> RopeScaling | None:
    s = f.nested("rope_scaling", optional=True, nullable=True)
    if s is None:
        return None
    kind = s.string("rope_type", optional=True) or s.string("type", optional=True)
    if kind is None:
        raise RecordError("required member is missing", path=s.at("rope_type"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        known = ", ".join(ROPE_SCALINGS)
        raise RecordError(f"unsupported rope scaling {kind!r} ({known})", path=s.at("rope_type"))
    factor = s.number("factor", minimum=0.0)
    if factor <= 0 or not math.isfinite(factor):
        raise RecordError("must be a positive number", path=s.at("factor"))
    if kind == "linear":
        return RopeScaling(kind=kind, factor=factor)
    low = s.number("low_freq_factor", minimum=0.0)
    high = s.number("high_freq_factor", minimum=0.0)
    if not 0 < low < high:
        raise RecordError("needs 0 < low_freq_factor < high_freq_factor", path=s.path)
    return RopeScaling(
        kind=kind,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=s.integer("original_max_position_embeddings", minimum=1),
    )


def weight_files(folder: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint, ascending by file name (§4.1 order).

    Raises:
        CheckpointError: there are none.
    """
    files = sorted(Path(folder).glob("*.safetensors"), key=lambda p: p.name.encode())
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files")
    return files
