"""Hugging Face checkpoints for the transformers engine: what is supported, and the
Compatibility Descriptor of one (spec §4.1).

The descriptor is computed from the real files of the folder:

* ``model_digest``: SHA-256 over the ``*.safetensors`` files concatenated in ascending byte
  order of their file names (§4.1; the same function as the reference engine). Only these
  files are loaded (``use_safetensors``), so the digest covers every weight the model runs.
  ``config.json`` is not part of it: what of it shapes the KV is in the other members.
* ``tokenizer_digest``: SHA-256 over ``tokenizer.json`` followed by ``tokenizer_config.json``
  (when present): the vocabulary and the rules that turn text into ids (BOS, specials).
* ``layers``, ``kv_heads``, ``head_dim``: ``num_hidden_layers``, ``num_key_value_heads``
  (else ``num_attention_heads``) and ``head_dim`` when the config states it, else
  ``hidden_size / num_attention_heads``.
* ``positional``: ``rope;theta=…`` from the config's RoPE parameters, plus ``factor`` and
  ``scaling`` for ``linear`` and ``llama3`` scaling (the llama3 frequency bands have no
  registered key: they count through the config digest in ``model``); ``kv_dtype`` and
  ``block_tokens`` as given.
* ``model``: ``<name>#config=sha-256:<hex>``: the name is the one given, else
  ``_name_or_path`` of ``config.json``, else its ``model_type`` (never the folder's name, so
  the same files give the same identity anywhere); the digest is SHA-256 of the RFC 8785 (JCS)
  form of ``config.json`` without the members that do not change what is computed
  (:data:`CONFIG_METADATA`). Every other member (norm epsilon, activation, RoPE details such
  as the llama3 bands, …) is part of the identity, because §4.1 wants "every parameter that
  affects the stored tensors" in it and ``model_digest`` covers only the weights.

:func:`check_supported` refuses, naming the feature, every model whose KV this descriptor
would describe wrongly: sliding-window (at any width) or chunked attention, layer types other
than full attention, encoder-decoder and nested (multimodal) configs, position schemes other
than RoPE, RoPE variants with no registered parameters (dynamic NTK, YaRN, LongRoPE, partial
rotary), and quantized weights. Needs ``transformers`` (its config classes), not torch.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import rfc8785

from kvsp.compat import CompatibilityDescriptor, file_digest, model_digest_of
from kvsp.engine.config import CheckpointError, format_number, weight_files

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONFIG_METADATA = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "use_cache", "dtype", "torch_dtype"}
)
"""``config.json`` members left out of the config digest: provenance, the library version, and
the stored weights' dtype (the engine computes in float32; the weights are hashed anyway)."""
DESCRIBED_ROPE = frozenset({"default", "linear", "llama3"})
"""RoPE types whose parameters the §4.1 ``positional`` member carries (theta, factor)."""


class UnsupportedModel(CheckpointError):
    """A checkpoint whose KV the engine would compute or describe wrongly; the message names
    the feature."""


def load_config(folder: str | Path) -> Any:
    """The checkpoint's ``transformers`` config, from local files only.

    Raises:
        CheckpointError: no readable ``config.json``, or a model type transformers lacks.
    """
    from transformers import AutoConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=False
            )
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: cannot read {CONFIG_FILE}: {exc}") from exc


def check_supported(config: Any) -> None:
    """Refuse a model this engine would run or describe wrongly.

    Raises:
        UnsupportedModel: the message names the feature.
    """
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{model_type}: encoder-decoder models are not supported")
    if config.get_text_config(decoder=True) is not config:
        raise UnsupportedModel(f"{model_type}: nested (multimodal) configs are not supported")
    if getattr(config, "quantization_config", None) is not None:
        raise UnsupportedModel(f"{model_type}: quantized weights are not supported")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModel(f"{model_type}: chunked attention is not supported")
    _check_layer_types(config, model_type)
    _check_sliding_window(config, model_type)
    _rope_parameters(config)


def _check_layer_types(config: Any, model_type: str) -> None:
    for kind in getattr(config, "layer_types", None) or ():
        if kind not in {"full_attention", "sliding_attention"}:
            raise UnsupportedModel(f"{model_type}: layer type {kind!r} is not supported")


def _check_sliding_window(config: Any, model_type: str) -> None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return
    types = getattr(config, "layer_types", None)
    if types is not None:
        used = "sliding_attention" in types
    else:
        used = getattr(config, "use_sliding_window", True) is not False
    if used:
        # even a window longer than the context: the cache would keep only the window
        raise UnsupportedModel(
            f"{model_type}: sliding window attention ({window} tokens) is not supported"
        )


def _rope_parameters(config: Any) -> dict[str, Any]:
    model_type = getattr(config, "model_type", "?")
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" not in params and "full_attention" in params:
        params = params["full_attention"]  # per layer type; only full attention is allowed
    if not isinstance(params, dict) or params.get("rope_theta") is None:
        raise UnsupportedModel(f"{model_type}: a position scheme other than RoPE is not supported")
    kind = params.get("rope_type", "default")
    if kind not in DESCRIBED_ROPE:
        raise UnsupportedModel(f"{model_type}: rope_type {kind!r} is not supported")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"{model_type}: partial rotary embedding is not supported")
    return dict(params)


def positional_of(config: Any) -> str:
    """The §4.1 ``positional`` member of a supported config.

    Raises:
        UnsupportedModel: not RoPE, or a RoPE variant without registered parameters.
    """
    params = _rope_parameters(config)
    members = {"theta": format_number(float(params["rope_theta"]))}
    if params.get("rope_type", "default") != "default":
        members["factor"] = format_number(float(params["factor"]))
        members["scaling"] = str(params["rope_type"])
    return "rope;" + ";".join(f"{k}={members[k]}" for k in sorted(members))


def geometry_of_config(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a config.

    Raises:
        UnsupportedModel: a member is missing or not a positive integer.
    """
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    out = (getattr(config, "num_hidden_layers", None), kv_heads, head_dim)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in out):
        raise UnsupportedModel(f"{config.model_type}: per-layer or missing KV dimensions {out}")
    return out  # type: ignore[return-value]


def tokenizer_files(folder: str | Path) -> list[Path]:
    """``tokenizer.json`` and, when present, ``tokenizer_config.json``.

    Raises:
        CheckpointError: no ``tokenizer.json``.
    """
    files = [Path(folder) / name for name in TOKENIZER_FILES]
    if not files[0].is_file():
        raise CheckpointError(f"{folder}: no {TOKENIZER_FILES[0]}")
    return [p for p in files if p.is_file()]


def _read_config_json(folder: str | Path) -> dict[str, Any]:
    try:
        raw = json.loads((Path(folder) / CONFIG_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: cannot read {CONFIG_FILE}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{folder}: {CONFIG_FILE} is not a JSON object")
    return raw


def config_digest(raw: dict[str, Any]) -> bytes:
    """SHA-256 of the JCS (RFC 8785) form of ``config.json`` less :data:`CONFIG_METADATA`.

    Raises:
        CheckpointError: a value JCS cannot represent (NaN, an integer beyond 2^53).
    """
    kept = {k: v for k, v in raw.items() if k not in CONFIG_METADATA}
    try:
        return hashlib.sha256(rfc8785.dumps(kept)).digest()
    except (rfc8785.CanonicalizationError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{CONFIG_FILE} has no canonical JSON form: {exc}") from exc


def model_name(folder: str | Path, model: str | None = None) -> str:
    """The descriptor's ``model``: ``<name>#config=sha-256:<hex of config_digest>``.

    Raises:
        CheckpointError: an unreadable ``config.json``.
    """
    raw = _read_config_json(folder)
    name = model or raw.get("_name_or_path") or raw.get("model_type")
    base = name if isinstance(name, str) and name else "model"
    return f"{base}#config=sha-256:{config_digest(raw).hex()}"


def describe_checkpoint(
    folder: str | Path,
    *,
    block_tokens: int = 16,
    kv_dtype: str = "fp32",
    model: str | None = None,
    config: Any = None,
) -> CompatibilityDescriptor:
    """The Compatibility Descriptor (§4.1) of a supported checkpoint, digests from its files.

    Raises:
        CheckpointError: an unreadable config, no weight or tokenizer files.
        UnsupportedModel: a model the engine refuses (the message names the feature).
        DescriptorError: an unreadable file or an invalid member.
    """
    config = config if config is not None else load_config(folder)
    check_supported(config)
    layers, kv_heads, head_dim = geometry_of_config(config)
    return CompatibilityDescriptor(
        model=model_name(folder, model),
        model_digest=model_digest_of(weight_files(folder)),
        tokenizer_digest=file_digest(tokenizer_files(folder)),
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        positional=positional_of(config),
        block_tokens=block_tokens,
    )
