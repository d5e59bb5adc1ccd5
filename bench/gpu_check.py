"""Device check of the KV sink, the reference engine and the transformers engine (DESIGN.md
§5–6), for a lent GPU.

Run: ``.venv/bin/python bench/gpu_check.py [--blocks 64] [--device auto]`` (≤ 2 minutes;
runs on the CPU too). Prints one JSON object:

* ``tiny_model``: a small seeded Llama on the device; blocks exported by engine A and loaded
  through ContainerReader + DeviceSink into engine B give the same logits as B's own
  recompute (``exact``: bit-identical) and the same greedy tokens;
* ``transformers``: per family of ``--hf-families`` (default llama and gemma, whose head_dim
  is not hidden/heads), a tiny random checkpoint (``tests/support/hf_models.py``) in the
  transformers engine's core on the device: blocks exported by core A, verified and loaded
  into core B's ``DynamicCache`` (``kv_device``), give B's recompute logits (``exact``), the
  same greedy tokens, and B's own blocks are A's octets; ``skipped`` without the extra;
* ``sink``: N synthetic blocks (default 64 × 32 layers × 8 kv_heads × 128 dims × bf16 × 16
  tokens = 2 MiB each, independent of the tiny model) fed in 256 KiB chunks through the
  reader and the sink into the paged cache: GB/s with layer-digest verification and without,
  next to the SHA-256 floor of this host, and whether the loaded pages equal the source;
* ``overlap``: one compute kernel per layer that reads the loaded layer, run after the whole
  prefix loaded (sequential) and while it loads, layer l waiting only for layer l.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsp.container import decode_container, encode_container
from kvsp.engine.blocks import page_container
from kvsp.engine.checkpoint import init_model
from kvsp.engine.engine import Engine
from kvsp.engine.kvcache import PagedKVCache
from kvsp.engine.sampler import Sampler
from kvsp.engine.sink import PrefixLoad, Staging, load_block

CHUNK = 256 * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_model_check(device: torch.device) -> dict[str, Any]:
    """Reuse through the sink on the device gives the recompute's logits and tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_model(Path(tmp), seed=7, layers=4, hidden=128, heads=8, kv_heads=2)
        a = Engine(folder, device=device, num_pages=32, block_tokens=16)
        b = Engine(folder, device=device, num_pages=32, block_tokens=16)
        prompt = [(13 * i + 1) % 256 for i in range(100)]
        blocks = a.export_prompt_blocks(prompt)
        seq = b.new_sequence()
        full = b.prefill(seq, prompt)
        same_bytes = all(b.block_container(seq, x.index) == x.container for x in blocks)
        b.free(seq)
        load = b.load_prefix([[x.container] for x in blocks], [x.layer_digests for x in blocks])
        seq = b.new_sequence()
        part = b.prefill(seq, prompt, loaded_prefix_pages=load.pages)
        b.free(seq)
        greedy = list(b.generate(prompt, 16, Sampler()))
        load = b.load_prefix([[x.container] for x in blocks], [x.layer_digests for x in blocks])
        reused = list(b.generate(prompt, 16, Sampler(), loaded_prefix_pages=load.pages))
        b.close()
        return {
            "blocks": len(blocks),
            "exact": bool(torch.equal(full, part)),
            "max_abs_diff": float((full - part).abs().max()),
            "greedy_equal": greedy == reused,
            "loaded_bytes_equal_recomputed": same_bytes,
            "prefill_tokens_per_s": round(b.stats().prefill_tokens_per_s, 1),
            "decode_tokens_per_s": round(b.stats().decode_tokens_per_s, 1),
        }


def _greedy(core: Any, prompt: list[int], n: int, pages: list[int] | None) -> list[int]:
    """``n`` greedy tokens of ``prompt`` on an engine core, its first blocks from ``pages``."""
    seq = core.new_sequence()
    try:
        tokens = [int(core.prefill(seq, prompt, loaded_prefix_pages=pages).argmax())]
        while len(tokens) < n:
            tokens.append(int(core.decode(seq, tokens[-1]).argmax()))
        return tokens
    finally:
        core.free(seq)


def transformers_check(device: torch.device, families: list[str]) -> dict[str, Any]:
    """The transformers engine on the device, per family of tiny random checkpoint: blocks
    exported by core A and loaded into core B's cache (a transformers ``DynamicCache`` on the
    device) give the logits of B's own recompute (``exact``) and the same greedy tokens, and
    B's own blocks are the octets A exported."""
    root = str(Path(__file__).resolve().parents[1])  # tests.support, when run as a script
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        from transformers.utils import logging as hf_logging

        from kvsp.engine.transformers_engine import HFCore
        from tests.support.hf_models import write_checkpoint
    except ModuleNotFoundError as exc:  # the transformers extra is optional
        return {"skipped": f"{exc.name} is not installed: pip install 'kvsp[transformers]'"}
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out: dict[str, Any] = {}
    prompt = [(13 * i + 1) % 256 for i in range(100)]
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            folder = write_checkpoint(family, Path(tmp) / family, seed=7)
            a = HFCore(folder, device=str(device), num_pages=32, block_tokens=16)
            b = HFCore(folder, device=str(device), num_pages=32, block_tokens=16)
            seq = a.new_sequence()
            a.prefill(seq, prompt)
            blocks = [a.block_container(seq, i) for i in range(len(prompt) // 16)]
            a.free(seq)
            digests = [decode_container(c).layer_digests() for c in blocks]
            seq = b.new_sequence()
            full = b.prefill(seq, prompt)
            same_bytes = all(b.block_container(seq, i) == c for i, c in enumerate(blocks))
            b.free(seq)
            load = b.load_prefix(blocks, digests)
            seq = b.new_sequence()
            part = b.prefill(seq, prompt, loaded_prefix_pages=load.pages)
            kv_device = str(seq.cache.layers[0].keys.device)
            b.free(seq)
            greedy = _greedy(b, prompt, 16, None)
            reused = _greedy(b, prompt, 16, b.load_prefix(blocks, digests).pages)
            out[family] = {
                "blocks": len(blocks),
                "loaded": len(load.pages),
                "kv_device": kv_device,
                "exact": bool(torch.equal(full, part)),
                "max_abs_diff": float((full - part).abs().max()),
                "greedy_equal": greedy == reused,
                "loaded_bytes_equal_recomputed": same_bytes,
                "prefill_tokens_per_s": round(b.stats().prefill_tokens_per_s, 1),
                "decode_tokens_per_s": round(b.stats().decode_tokens_per_s, 1),
            }
    return out


def make_blocks(args: argparse.Namespace, cache: PagedKVCache) -> list[tuple[bytes, list[bytes]]]:
    """Random containers of the synthetic geometry with their layer digests."""
    rng = np.random.default_rng(1)
    section = cache.section_length
    out = []
    for _ in range(args.blocks):
        raw = rng.integers(0, 256, size=args.layers * 2 * section, dtype=np.uint8).tobytes()
        view = memoryview(raw)
        layers = [
            (view[2 * i * section :][:section], view[(2 * i + 1) * section :][:section])
            for i in range(args.layers)
        ]
        container = encode_container(layers, first_layer=0, token_count=cache.block_tokens)
        out.append((container, decode_container(container).layer_digests()))
    return out


def chunks(data: bytes) -> Iterator[memoryview]:
    """The container as a transport would deliver it."""
    view = memoryview(data)
    for i in range(0, len(view), CHUNK):
        yield view[i : i + CHUNK]


def sink_rate(
    cache: PagedKVCache, blocks: list[tuple[bytes, list[bytes]]], verify: bool, reps: int
) -> float:
    """Median GB/s of container octets through reader + sink into the pages."""
    staging = Staging(cache) if cache.device.type != "cpu" else None
    total = sum(len(c) for c, _ in blocks)
    rates = []
    for _ in range(reps):
        began = time.perf_counter()
        for page, (container, digests) in enumerate(blocks):
            cache.begin_load(page)
            expected = digests if verify else None
            load_block(cache, page, chunks(container), layer_digests=expected, staging=staging)
        _sync(cache.device)
        rates.append(total / (time.perf_counter() - began) / 1e9)
    return statistics.median(rates)


def sha256_floor(blocks: list[tuple[bytes, list[bytes]]]) -> float:
    """GB/s of plain SHA-256 over the same octets (the verification floor)."""
    began = time.perf_counter()
    for container, _ in blocks:
        hashlib.sha256(container).digest()
    return sum(len(c) for c, _ in blocks) / (time.perf_counter() - began) / 1e9


def _kernel(
    cache: PagedKVCache, pages: torch.Tensor, work: torch.Tensor, repeat: int
) -> Callable[[int], torch.Tensor]:
    def run(layer: int) -> torch.Tensor:
        acc = cache.kv[pages, layer].float().sum()
        for _ in range(repeat):
            acc = acc + (work @ work).sum()
        return acc

    return run


def _median_time(run: Callable[[], None], device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        began = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def overlap(
    cache: PagedKVCache, blocks: list[tuple[bytes, list[bytes]]], prefix: int, reps: int
) -> dict[str, float]:
    """A per-layer kernel after a full load (sequential) and during it (overlapped)."""
    device, layers = cache.device, cache.layers
    pages = list(range(prefix))
    sources = [b[0] for b in blocks[:prefix]]
    digests = [b[1] for b in blocks[:prefix]]
    pages_t = torch.tensor(pages, device=device)

    def load() -> PrefixLoad:
        return PrefixLoad(cache, pages, [chunks(s) for s in sources], digests).start()

    load_s = _median_time(lambda: load().join(), device, reps)
    size = 1024 if device.type == "cuda" else 256
    work = torch.randn(size, size, device=device)
    one = _kernel(cache, pages_t, work, 1)
    per_repeat = _median_time(lambda: [one(x) for x in range(layers)], device, reps) / layers
    repeat = max(1, round(load_s / layers / per_repeat))  # compute ≈ load, layer by layer
    kernel = _kernel(cache, pages_t, work, repeat)

    def sequential() -> None:
        load().join()
        for layer in range(layers):
            kernel(layer)

    def overlapped() -> None:
        running = load()
        for layer in range(layers):
            cache.wait_layer(pages, layer, 60.0)
            kernel(layer)
        running.join()

    compute_s = _median_time(lambda: [kernel(x) for x in range(layers)], device, reps)
    sequential_s = _median_time(sequential, device, reps)
    overlapped_s = _median_time(overlapped, device, reps)
    return {
        "prefix_blocks": prefix,
        "kernel_repeats_per_layer": repeat,
        "load_s": round(load_s, 4),
        "compute_s": round(compute_s, 4),
        "sequential_s": round(sequential_s, 4),
        "overlapped_s": round(overlapped_s, 4),
        "speedup": round(sequential_s / overlapped_s, 3),
        "ideal_speedup": round(sequential_s / max(load_s, compute_s), 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the checks and print the JSON summary; exit 1 when a check fails."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefix", type=int, default=16, help="blocks in the overlap test")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument(
        "--hf-families",
        default="llama,gemma",
        help="transformers engine check on these tiny checkpoints ('' to skip)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (CPU default: 1)")
    args = p.parse_args(argv)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    if args.threads or device.type == "cpu":
        # on CPU the loader thread needs a core of its own to overlap with compute
        torch.set_num_threads(args.threads or 1)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if not args.skip_model:
        report["tiny_model"] = tiny_model_check(device)
    if args.hf_families:
        report["transformers"] = transformers_check(device, args.hf_families.split(","))
    cache = PagedKVCache(
        num_pages=args.blocks,
        layers=args.layers,
        block_tokens=args.block_tokens,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        kv_dtype=args.kv_dtype,
        device=device,
    )
    blocks = make_blocks(args, cache)
    report["sink"] = {
        "blocks": args.blocks,
        "block_bytes": len(blocks[0][0]),
        "geometry": [args.layers, args.kv_heads, args.head_dim, args.kv_dtype, args.block_tokens],
        "gbps_verified": round(sink_rate(cache, blocks, True, args.reps), 3),
        "gbps_unverified": round(sink_rate(cache, blocks, False, args.reps), 3),
        "sha256_floor_gbps": round(sha256_floor(blocks), 3),
        "pages_equal_source": all(page_container(cache, i) == c for i, (c, _) in enumerate(blocks)),
    }
    report["overlap"] = overlap(cache, blocks, min(args.prefix, args.blocks), args.reps)
    report["elapsed_s"] = round(time.perf_counter() - started, 2)
    model = report.get("tiny_model", {"exact": True, "greedy_equal": True})
    hf = [x for x in report.get("transformers", {}).values() if isinstance(x, dict)]
    report["ok"] = bool(
        report["sink"]["pages_equal_source"]
        and model["exact"]
        and model["greedy_equal"]
        and all(x["exact"] and x["greedy_equal"] and x["loaded_bytes_equal_recomputed"] for x in hf)
        and all(x["loaded"] == x["blocks"] for x in hf)
    )
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
