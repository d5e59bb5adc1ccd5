"""``kvsp model``: write a small seeded Llama checkpoint and print its Compatibility
Descriptor (spec §4.1; DESIGN.md §5), for ``kvsp serve instance --engine reference --model``.

``kvsp model init DIR`` writes ``config.json``, the safetensors weights and ``tokenizer.json``
(deterministic from the seed) and ``descriptor.json``, the descriptor of those files (for
``kvsp compat-id``, ``kvsp generate --descriptor`` and ``--descriptor`` of the services);
``kvsp model descriptor DIR`` prints the descriptor computed from those files as JSON. torch
is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DESCRIPTOR_FILE = "descriptor.json"
"""What ``kvsp model init`` names the checkpoint's Compatibility Descriptor in its folder."""


def _cmd_init(args: argparse.Namespace) -> int:
    from kvsp.engine.checkpoint import descriptor_for, init_model

    folder = init_model(
        args.folder,
        seed=args.seed,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_positions=args.max_positions,
        tie_embeddings=args.tie_embeddings,
        weights_dtype=args.weights_dtype,
    )
    descriptor = descriptor_for(folder, block_tokens=args.block_tokens, kv_dtype=args.kv_dtype)
    path = Path(folder) / DESCRIPTOR_FILE
    path.write_text(json.dumps(descriptor.to_json(), indent=2, sort_keys=True) + "\n")
    print(folder)
    return 0


def _cmd_descriptor(args: argparse.Namespace) -> int:
    from kvsp.engine.checkpoint import descriptor_for

    descriptor = descriptor_for(args.folder, block_tokens=args.block_tokens, kv_dtype=args.kv_dtype)
    print(json.dumps(descriptor.to_json(), indent=2, sort_keys=True))
    return 0


def configure_model_parser(sub: Any) -> None:
    """Add ``kvsp model init`` and ``kvsp model descriptor`` to the ``kvsp`` subcommands."""
    model = sub.add_parser("model", help="reference-engine checkpoints (needs the engine extra)")
    msub = model.add_subparsers(metavar="ACTION", required=True)
    p = msub.add_parser("init", help="write a small seeded Llama checkpoint into DIR")
    p.add_argument("folder", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=259, help="259: the byte-level tokenizer's")
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--weights-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument(
        "--block-tokens", type=int, default=16, metavar="B", help="descriptor.json's block_tokens"
    )
    p.add_argument("--kv-dtype", default="fp32", metavar="T", help="descriptor.json's kv_dtype")
    p.set_defaults(handler=_cmd_init)
    p = msub.add_parser("descriptor", help="print the Compatibility Descriptor of DIR (§4.1)")
    p.add_argument("folder", metavar="DIR")
    p.add_argument("--block-tokens", type=int, default=16, metavar="B")
    p.add_argument("--kv-dtype", default="fp32", metavar="T")
    p.set_defaults(handler=_cmd_descriptor)
