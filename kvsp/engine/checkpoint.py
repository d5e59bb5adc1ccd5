"""Llama-family checkpoints on disk: load any, write a small seeded one, describe it (§4.1).

A checkpoint folder holds ``config.json``, one or more ``*.safetensors`` files with the
Hugging Face tensor names (sharded files allowed, with or without
``model.safetensors.index.json``) and the tokenizer definition ``tokenizer.json``. The §4.1
``model_digest`` is computed over the ``*.safetensors`` files in ascending byte order of their
names and ``tokenizer_digest`` over ``tokenizer.json``, so both are real file digests.

:func:`init_model` writes float32 weights by default: on CPU that keeps the engine exact
against other float32 implementations; ``weights_dtype="bf16"`` halves the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvsp.compat import CompatibilityDescriptor, descriptor_from_files
from kvsp.engine.config import (
    CONFIG_FILE,
    CheckpointError,
    ModelConfig,
    RopeScaling,
    read_config,
    weight_files,
)
from kvsp.engine.model import LAYER_TENSORS, LayerWeights, Weights, expected_shapes
from kvsp.engine.tokenizer import TOKENIZER_FILE, ByteTokenizer

INDEX_FILE = "model.safetensors.index.json"
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tensor_index(files: list[Path]) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for bad files
            raise CheckpointError(f"{path}: not a safetensors file: {exc}") from exc
        for name in names:
            if name in index:
                raise CheckpointError(
                    f"{path}: tensor {name} is also in {index[name].name}", path=name
                )
            index[name] = path
    return index


def load_tensors(
    folder: str | Path, config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, by Hugging Face name, checked against the config.

    Raises:
        CheckpointError: a tensor is missing or has the wrong shape (file and name given).
    """
    files = weight_files(folder)
    index = _tensor_index(files)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        path = index.get(name)
        if path is None:
            where = ", ".join(p.name for p in files)
            raise CheckpointError(f"{folder}: tensor {name} is missing from {where}", path=name)
        with safe_open(str(path), framework="pt") as f:
            tensor = f.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json needs {shape}",
                path=name,
            )
        out[name] = tensor.to(device=device, dtype=dtype)
    return out


def load_weights(
    folder: str | Path, config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype
) -> Weights:
    """The model's :class:`Weights` from a checkpoint folder.

    Raises:
        CheckpointError: a tensor is missing or misshapen, or a file is unreadable.
    """
    t = load_tensors(folder, config, device=device, dtype=dtype)
    layers = tuple(
        LayerWeights(
            **{short: t[f"model.layers.{i}.{name}"] for short, name in LAYER_TENSORS.items()}
        )
        for i in range(config.num_hidden_layers)
    )
    embed = t["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else t["lm_head.weight"]
    return Weights(embed=embed, layers=layers, norm=t["model.norm.weight"], lm_head=lm_head)


def descriptor_for(
    folder: str | Path,
    *,
    block_tokens: int = 16,
    kv_dtype: str = "fp32",
    model: str | None = None,
) -> CompatibilityDescriptor:
    """The Compatibility Descriptor (§4.1) of a checkpoint, digests computed from its files.

    ``model`` defaults to ``_name_or_path`` in ``config.json``, else the folder's name.

    Raises:
        CheckpointError: bad ``config.json`` or no weight files.
        DescriptorError: an unreadable file or an invalid member.
    """
    config = read_config(folder)
    return descriptor_from_files(
        model=model or config.name or Path(folder).resolve().name,
        weight_files=weight_files(folder),
        tokenizer_file=Path(folder) / TOKENIZER_FILE,
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        kv_dtype=kv_dtype,
        positional=config.positional(),
        block_tokens=block_tokens,
    )


def init_model(
    folder: str | Path,
    *,
    seed: int,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 259,
    rope_theta: float = 10000.0,
    rope_scaling: RopeScaling | None = None,
    tie_embeddings: bool = False,
    rms_norm_eps: float = 1e-5,
    max_positions: int = 4096,
    shards: int = 1,
    weights_dtype: str = "fp32",
    name: str | None = None,
) -> Path:
    """Write a small seeded Llama checkpoint (config, safetensors, tokenizer) into ``folder``.

    Weights come from numpy's PCG64 generator seeded with ``seed``, so the files (and the
    ``model_digest``) are the same on every machine. Returns the folder.

    Raises:
        CheckpointError: inconsistent sizes (the message names the ``config.json`` key).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = ModelConfig(
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        vocab_size=vocab,
        tie_word_embeddings=tie_embeddings,
        max_position_embeddings=max_positions,
        name=name or f"kvsp-tiny-llama-s{seed}-l{layers}-h{hidden}",
    )
    config_bytes = json.dumps(config.to_json(), indent=2, sort_keys=True).encode() + b"\n"
    (folder / CONFIG_FILE).write_bytes(config_bytes)
    read_config(folder)  # the file we wrote must read back; raises CheckpointError if not
    tensors = _seeded_tensors(config, seed, WEIGHT_DTYPES[weights_dtype])
    _save_shards(folder, tensors, shards)
    ByteTokenizer().save(folder)
    return folder


def _seeded_tensors(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:  # norm gains around 1, so they matter without dominating
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            values = rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = torch.from_numpy(values.astype(np.float32)).to(dtype)
    return out


def _save_shards(folder: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = list(tensors)
    shards = min(shards, len(names))
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
