"""Tiny random Hugging Face checkpoints for the transformers engine's tests (spec §4.1 inputs).

``write_checkpoint(family, folder)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` through the
libraries' own ``save_pretrained``: float32, random weights from ``torch.manual_seed(seed)``,
so the same call writes the same files. The tokenizer is a byte-level BPE without merges
(256 byte tokens plus ``<s>``, ``</s>``, ``<pad>``), built in code with ``tokenizers``.

Needs torch, transformers and tokenizers (the ``transformers`` extra); import it after
``pytest.importorskip``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "olmo")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
VOCAB = 256 + len(SPECIAL_TOKENS)
BOS, EOS, PAD = 256, 257, 258

# hidden 64, 4 query heads, 2 KV heads (GQA), 2 layers: a forward pass takes milliseconds
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    # wider than the 0.02 default so greedy choices are not near-ties
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    # no sliding window within reach of any test prompt: None disables it
    "mistral": {"sliding_window": None},
    # head_dim (24) != hidden / heads (16); Gemma ties its embeddings
    "gemma": {"head_dim": 24, "tie_word_embeddings": True},
    "olmo": {},
}
_CONFIG_CLASS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "gemma": "GemmaConfig",
    "olmo": "OlmoConfig",
}


def make_config(family: str, **overrides: Any) -> Any:
    """The ``transformers`` config of a tiny ``family`` model, ``overrides`` applied last.

    Raises:
        ValueError: an unknown family.
    """
    if family not in _CONFIG_CLASS:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    import transformers

    cls = getattr(transformers, _CONFIG_CLASS[family])
    kwargs = {**_COMMON, **_FAMILY[family], **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cls(**kwargs)
    config.dtype = "float32"
    return config


def write_tokenizer(folder: Path) -> None:
    """Write the byte-level ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    for i, name in enumerate(SPECIAL_TOKENS):
        vocab[name] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    code = ord(ch)
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def write_checkpoint(family: str, folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random ``family`` checkpoint into ``folder`` (created) and return it.

    ``overrides`` go to the config (e.g. ``rope_theta=5e5``, ``num_hidden_layers=3``).

    Raises:
        ValueError: an unknown family.
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = make_config(family, **overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation="eager"
        )
        model = model.to(torch.float32)
        model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return folder
