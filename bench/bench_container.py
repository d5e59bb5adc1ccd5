"""Benchmark KVB1 encoding, decoding and verification (spec §4.3, §6.7) against SHA-256.

Run: ``.venv/bin/python bench/bench_container.py [--reps N]``. The cases run round-robin, each
figure is the median over the repetitions, and each ratio is the median of the per-round ratios
against the hashlib floor of the same round. The block is 16 tokens × 32 layers × 8 kv_heads ×
128 head_dim × bf16 (64 KiB a layer, 2 MiB in all) unless the options say otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable

from kvsp.container import (
    Geometry,
    decode_container,
    encode_container,
    encode_container_parts,
    layer_digest,
    replica_digest,
    verify_container,
)
from kvsp.container_reader import ContainerReader


class PageSink:
    """Preallocated per-layer pages, the shape of a device cache's staging buffer."""

    def __init__(self, layers: int, section: int) -> None:
        self.pages = [(bytearray(section), bytearray(section)) for _ in range(layers)]

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        k, v = self.pages[index]
        return memoryview(k), memoryview(v)


def measure(cases: list[Callable[[], object]], reps: int) -> list[list[float]]:
    """Seconds per rep for each case, run round-robin so that drift hits all cases alike."""
    for fn in cases:
        fn()  # warm up
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(reps):
        for fn, out in zip(cases, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="repetitions per figure")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64 * 1024, help="reader chunk size")
    args = parser.parse_args()

    geometry = Geometry(args.layers, args.kv_heads, args.head_dim, 2)
    section = geometry.section_length(args.tokens)
    pairs = [(os.urandom(section), os.urandom(section)) for _ in range(args.layers)]
    data = encode_container(pairs, first_layer=0, token_count=args.tokens, geometry=geometry)
    digests = [layer_digest(k, v) for k, v in pairs]
    digest = replica_digest(digests)
    container_digest = hashlib.sha256(data).digest()
    chunks = [data[i : i + args.chunk] for i in range(0, len(data), args.chunk)]  # as received

    def floor() -> None:
        hashlib.sha256(data).digest()

    def encode_and_digest() -> None:
        encode_container(pairs, first_layer=0, token_count=args.tokens, geometry=geometry)
        replica_digest([layer_digest(k, v) for k, v in pairs])

    def encode_parts_and_digest() -> None:
        encode_container_parts(pairs, first_layer=0, token_count=args.tokens, geometry=geometry)
        replica_digest([layer_digest(k, v) for k, v in pairs])

    def decode_and_verify() -> None:
        verify_container(decode_container(data, geometry), digests, digest)

    def reader(sink: PageSink | None = None) -> Callable[[], None]:
        def run() -> None:
            r = ContainerReader(
                geometry, layer_digests=digests, digest=digest, sink=sink, hash_container=False
            )
            for chunk in chunks:
                r.feed(chunk)
            r.close()

        return run

    def reader_two_pass() -> None:
        r = ContainerReader(geometry, layer_digests=digests, digest=digest)
        for chunk in chunks:
            r.feed(chunk)
        r.close()
        if r.container_digest() != container_digest:
            raise SystemExit("container digest differs")

    cases: list[tuple[str, Callable[[], object]]] = [
        ("hashlib.sha256 floor (1 pass)", floor),
        ("encode (joined bytes) + layer/replica digests", encode_and_digest),
        ("encode parts (vectored, no copy) + digests", encode_parts_and_digest),
        ("decode + verify (layers + replica)", decode_and_verify),
        (f"reader {args.chunk // 1024} KiB chunks + verify", reader()),
        ("reader + verify, into a sink", reader(PageSink(args.layers, section))),
        ("reader + verify + container digest (2 passes)", reader_two_pass),
    ]
    print(
        f"block: {args.tokens} tokens x {args.layers} layers x {args.kv_heads} kv_heads x "
        f"{args.head_dim} head_dim x bf16 = {len(data)} octets with header; "
        f"{args.reps} reps, medians"
    )
    times = measure([fn for _, fn in cases], args.reps)
    print(f"{'path':<48} {'GB/s':>7} {'x floor':>8}")
    for (name, _), own in zip(cases, times, strict=True):
        rate = len(data) / statistics.median(own) / 1e9
        ratio = statistics.median(f / t for f, t in zip(times[0], own, strict=True))
        print(f"{name:<48} {rate:7.3f} {ratio:8.3f}")
    print("(a 2-pass path can reach at most 0.5x the 1-pass floor)")

    tracemalloc.start()
    decode_and_verify()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"tracemalloc peak during decode + verify: {peak} octets = "
        f"{100 * peak / len(data):.2f}% of the container (target < 5%)"
    )


if __name__ == "__main__":
    main()
