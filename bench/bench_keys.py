"""Benchmark the §4.2 Block Key chain and the §4.1 Compatibility ID.

Run by hand: ``.venv/bin/python bench/bench_keys.py --reps 7``. A 131,072-token prompt with
B = 16 (8,192 blocks) is keyed by (a) ``kvsp.keys.block_keys`` from a numpy array, (a') the
same from a Python list, (b) a straightforward ``hmac.digest`` loop over the same messages,
and (c) vLLM-style ``sha256(pickle.dumps((parent, tuple(block), None)))``. Variants run
round-robin so that drift of the shared machine hits them alike; medians, min and max are
printed with the ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import pickle
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvsp.compat import CompatibilityDescriptor, compat_id, compute_compat_id
from kvsp.keys import block_keys

TOKENS = 131_072
B = 16


def naive_hmac(scope_key: bytes, compat: bytes, tokens: list[int]) -> list[bytes]:
    """(b) §4.2 as written: build each message, one ``hmac.digest`` per block."""
    keys = []
    previous = bytes(32)
    fmt = struct.Struct(f">{B}I")
    for i in range(0, len(tokens) - len(tokens) % B, B):
        message = b"KVSP-BLOCK-1\x00" + compat + previous + fmt.pack(*tokens[i : i + B])
        previous = hmac.digest(scope_key, message, "sha256")
        keys.append(previous)
    return keys


def vllm_style(tokens: list[int]) -> list[bytes]:
    """(c) vLLM's prefix-cache block hash: SHA-256 over a pickled (parent, block, extra) tuple."""
    keys = []
    parent: bytes | None = None
    for i in range(0, len(tokens) - len(tokens) % B, B):
        blob = pickle.dumps((parent, tuple(tokens[i : i + B]), None), pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(blob).digest()
        keys.append(parent)
    return keys


def measure(variants: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Run every variant once per round, ``reps`` rounds; return the seconds of each run."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def report_chain(reps: int) -> None:
    rng = np.random.default_rng(2026)
    array = rng.integers(0, 128_256, TOKENS, dtype=np.int64)
    tokens = array.tolist()
    scope_key, compat = os.urandom(32), os.urandom(32)
    ours = block_keys(scope_key, compat, array, B)
    if ours != naive_hmac(scope_key, compat, tokens) or ours != block_keys(
        scope_key, compat, tokens, B
    ):
        raise SystemExit("block_keys disagrees with the straightforward HMAC chain")
    variants: dict[str, Callable[[], Any]] = {
        "(a)  block_keys, numpy int64": lambda: block_keys(scope_key, compat, array, B),
        "(a') block_keys, Python list": lambda: block_keys(scope_key, compat, tokens, B),
        "(b)  hmac.digest loop (list)": lambda: naive_hmac(scope_key, compat, tokens),
        "(c)  vLLM sha256(pickle) (list)": lambda: vllm_style(tokens),
    }
    times = measure(variants, reps)
    print(f"Block-key chain: {TOKENS} tokens, B = {B} ({TOKENS // B} blocks), {reps} reps")
    print(f"  {'variant':34s} {'median Mtok/s':>13s} {'min':>7s} {'max':>7s} {'ms/prompt':>10s}")
    rate: dict[str, float] = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rate[name] = TOKENS / median / 1e6
        fast, slow = TOKENS / min(samples) / 1e6, TOKENS / max(samples) / 1e6
        print(f"  {name:34s} {rate[name]:13.2f} {slow:7.2f} {fast:7.2f} {median * 1e3:10.2f}")
    a, a_list, b, c = rate.values()
    print(f"  ratios: (a)/(b) = {a / b:.2f}x   (a)/(c) = {a / c:.2f}x   (target >= 1.30x)")
    print(f"          (a')/(b) = {a_list / b:.2f}x  (a')/(c) = {a_list / c:.2f}x")


def report_compat(reps: int) -> None:
    obj: dict[str, Any] = {
        "model": "Llama-3-8B-Instruct",
        "model_digest": "sha-256:" + "a1" * 32,
        "tokenizer_digest": "sha-256:" + "b2" * 32,
        "adapters": ["sha-256:" + "c3" * 32],
        "layers": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "kv_dtype": "bf16",
        "positional": "rope;factor=8;scaling=llama3;theta=500000",
        "block_tokens": 16,
        "layout": "kvsp-layout-1",
    }
    record = CompatibilityDescriptor.from_json(obj)
    n = 20_000
    variants: dict[str, Callable[[], Any]] = {
        "compat_id(descriptor), cached": lambda: [compat_id(record) for _ in range(n)],
        "compute_compat_id, uncached": lambda: [compute_compat_id(record) for _ in range(n)],
        "compat_id(dict): validate + cached": lambda: [compat_id(obj) for _ in range(n)],
    }
    times = measure(variants, reps)
    print(f"Compatibility ID: {n} calls per rep, {reps} reps")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:36s} {n / median / 1e3:9.1f} k/s  ({median / n * 1e6:.2f} us/call)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    report_chain(args.reps)
    print()
    report_compat(args.reps)


if __name__ == "__main__":
    main()
